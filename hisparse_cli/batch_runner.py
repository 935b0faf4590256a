"""The batch loop: every input → one results line (ok or error), then the batch summary.

`run_batch` loads the engine once (through `Job`, on the first document that needs it: a
model that cannot load stops the batch with its own exit code), records a failing document
with its error type, message, hint and exit code and goes on, and lets Ctrl-C through after
the last finished line (nothing partial is ever written). `batch_summary` counts the latest
record of each input and gives mean ROUGE with 95% bootstrap intervals.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hisparse_cli.batch import ResultsFile, content_sha256, find_reference, record_key
from hisparse_cli.errors import EXIT_INTERNAL, HisparseError, InputError
from hisparse_cli.scoring import ROUGE_TYPES, bootstrap_ci

Report = Callable[[str, int, int, str, dict | None], None]  # (event, i, n, given, record)


@dataclass
class BatchOutcome:
    processed: int = 0
    skipped: int = 0
    keys: list[tuple[str, str]] = field(default_factory=list)


def error_record(exc: BaseException) -> dict:
    from hisparse_cli.cli import as_resource_error

    err = exc if isinstance(exc, HisparseError) else as_resource_error(exc)
    if err is not None:
        return {"type": type(err).__name__, "message": err.message, "hint": err.hint,
                "exit_code": err.exit_code}
    return {"type": type(exc).__name__, "message": f"internal error: {exc}", "hint": None,
            "exit_code": EXIT_INTERNAL}


def _identify(path: Path) -> str:
    if not path.exists():
        raise InputError(f"{path}: no such file or directory", hint="check the input path")
    try:
        return content_sha256(path)
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None


def run_batch(items: list[tuple[str, Path]], job, results: ResultsFile, *,
              references: Path | None = None, password: str | None = None,
              retry_failed: bool = False, progress_factory=None,
              report: Report | None = None) -> BatchOutcome:
    """Summarize `items` ((as given, resolved path)) with `job`, appending to `results`
    (already opened). Documents whose (path, sha256) is in `results` are skipped (failed
    ones are redone with `retry_failed`)."""
    report = report or (lambda *args: None)
    done = results.latest()
    outcome = BatchOutcome()
    total = len(items)
    try:
        for index, (given, path) in enumerate(items, 1):
            record: dict = {"input": str(path), "given": given, "sha256": None}
            started = time.perf_counter()
            try:
                record["sha256"] = _identify(path)
            except HisparseError as exc:
                record.update(status="error", error=error_record(exc))
            outcome.keys.append(record_key(record))
            previous = done.get(record_key(record))
            if previous is not None and (previous.get("status") == "ok" or not retry_failed):
                outcome.skipped += 1
                report("skip", index, total, given, previous)
                continue
            if "error" not in record:
                report("start", index, total, given, None)
                job.engine()  # loaded once; a model that cannot load ends the batch (its exit code)
                try:
                    progress = progress_factory(index, total) if progress_factory else None
                    record.update(status="ok", **_summarize(job, path, started, references,
                                                            password, progress))
                except HisparseError as exc:
                    record.update(status="error", error=error_record(exc))
                except Exception as exc:  # noqa: BLE001 - record it, go on with the next document
                    record.update(status="error", error=error_record(exc))
                    _release_cuda_memory()
            record["seconds"] = time.perf_counter() - started
            results.append(record)
            outcome.processed += 1
            report("done", index, total, given, record)
    finally:  # the engine's kept KV storage and decode graph (engine/decode_state.py)
        release = getattr(job, "release", None)
        if release is not None:
            release()
    return outcome


def _summarize(job, path: Path, started: float, references: Path | None,
               password: str | None, progress) -> dict:
    from contextlib import nullcontext

    from hisparse_cli.documents import load_document
    from hisparse_cli.job import read_reference

    doc = load_document(path, password=password)
    ingest = time.perf_counter() - started
    ref = find_reference(path, references)
    ref_text = read_reference(ref) if ref is not None else None
    with progress if progress is not None else nullcontext():
        return job.run(doc, reference_text=ref_text, reference_path=str(ref) if ref else None,
                       ingest_seconds=ingest, progress=progress)


def _release_cuda_memory() -> None:
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def batch_summary(results: ResultsFile, keys: list[tuple[str, str]]) -> dict:
    """Counts over the latest record of each key, and mean ROUGE with 95% bootstrap CIs."""
    latest = results.latest()
    records = [latest[k] for k in dict.fromkeys(keys) if k in latest]
    ok = [r for r in records if r.get("status") == "ok"]
    failed = [r for r in records if r.get("status") != "ok"]
    rouge = {}
    scored = [r["rouge"] for r in ok if r.get("rouge")]
    for name in ROUGE_TYPES:
        values = [s[name] for s in scored if name in s]
        if values:
            mean, lo, hi = bootstrap_ci(values)
            rouge[name] = {"mean": mean, "lo": lo, "hi": hi, "n": len(values)}
    return {"documents": len(records), "ok": len(ok), "failed": len(failed),
            "failures": [{"input": r.get("input"), **(r.get("error") or {})} for r in failed],
            "rouge": rouge, "results": str(results.path)}


__all__ = ["run_batch", "batch_summary", "BatchOutcome", "error_record"]
