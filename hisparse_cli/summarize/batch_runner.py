"""The batch loop: every input → one results line (ok or error), then the batch summary.

`run_batch` loads the engine once (through `Job`, on the first document that needs it: a
model that cannot load stops the batch with its own exit code), records a failing document
with its error type, message, hint and exit code and goes on, and lets Ctrl-C through after
the last finished line (nothing partial is ever written). A reference that cannot be read
does not fail its document: the record is ok, without ROUGE, and says why in `warnings`.
Every record carries the job's `settings_id` (model, profile, sparse and summary settings);
`other_settings` finds finished records made with different ones. `batch_summary` counts the
latest record of each input and gives mean ROUGE with 95% bootstrap intervals (lo/hi None
below two scored documents: one value has no interval).
"""

from __future__ import annotations

import hashlib
import io
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hisparse_cli.summarize.batch import (ResultsFile, StdinInput, content_sha256, find_reference,
                                printable, record_key)
from hisparse_cli.errors import EXIT_INTERNAL, HisparseError, InputError
from hisparse_cli.scoring import ROUGE_TYPES, bootstrap_ci

Report = Callable[[str, int, int, str, dict | None], None]  # (event, i, n, given, record)


@dataclass
class BatchOutcome:
    processed: int = 0
    skipped: int = 0
    skipped_failed: int = 0  # of `skipped`: failed earlier (not redone without retry_failed)
    keys: list[tuple[str, str]] = field(default_factory=list)


def error_record(exc: BaseException) -> dict:
    from hisparse_cli.planner.vram import oom_error as as_resource_error

    err = exc if isinstance(exc, HisparseError) else as_resource_error(exc)
    if err is not None:
        return {"type": type(err).__name__, "message": err.message, "hint": err.hint,
                "exit_code": err.exit_code}
    return {"type": type(exc).__name__, "message": f"internal error: {exc}", "hint": None,
            "exit_code": EXIT_INTERNAL}


def _identify(path: Path | StdinInput, include_secrets: bool = False) -> str:
    if isinstance(path, StdinInput):
        return hashlib.sha256(path.data).hexdigest()
    if not path.exists():
        raise InputError(f"{path}: no such file or directory", hint="check the input path")
    try:
        return content_sha256(path, include_secrets=include_secrets)
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None


def run_batch(items: list[tuple[str, Path | StdinInput]], job, results: ResultsFile, *,
              references: Path | None = None, password: str | None = None,
              retry_failed: bool = False, progress_factory=None,
              report: Report | None = None, include_secrets: bool = False) -> BatchOutcome:
    """Summarize `items` ((as given, resolved path or the stdin document)) with `job`,
    appending to `results` (already opened). Documents whose (path, sha256) is in `results`
    are skipped (failed ones are redone with `retry_failed`). `include_secrets`: a folder's
    secrets are read (and fingerprinted) too."""
    report = report or (lambda *args: None)
    done = results.latest()
    outcome = BatchOutcome()
    total = len(items)
    settings_id = getattr(job, "settings_id", None)
    try:
        for index, (given, path) in enumerate(items, 1):
            # printable: the form the file holds, so the key matches again on --resume
            record: dict = {"input": printable(str(path)), "given": printable(given),
                            "sha256": None}
            if settings_id is not None:
                record["settings_id"] = settings_id()
            started = time.perf_counter()
            try:
                record["sha256"] = _identify(path, include_secrets)
            except Exception as exc:  # noqa: BLE001 - one unreadable input never ends the batch
                record.update(status="error", error=error_record(exc))
            outcome.keys.append(record_key(record))
            previous = done.get(record_key(record))
            if previous is not None and (previous.get("status") == "ok" or not retry_failed):
                outcome.skipped += 1
                if previous.get("status") != "ok":
                    outcome.skipped_failed += 1
                report("skip", index, total, given, previous)
                continue
            if "error" not in record:
                report("start", index, total, given, None)
                job.engine()  # loaded once; a model that cannot load ends the batch (its exit code)
                try:
                    progress = progress_factory(index, total) if progress_factory else None
                    record.update(status="ok", **_summarize(job, path, started, references,
                                                            password, progress,
                                                            include_secrets))
                except HisparseError as exc:
                    record.update(status="error", error=error_record(exc))
                except Exception as exc:  # noqa: BLE001 - record it, go on with the next document
                    record.update(status="error", error=error_record(exc))
                    _release_cuda_memory()
            record["seconds"] = time.perf_counter() - started
            record = results.append(record)  # as written (printable)
            outcome.processed += 1
            report("done", index, total, given, record)
    finally:  # the engine's kept KV storage and decode graph (engine/decode_state.py)
        release = getattr(job, "release", None)
        if release is not None:
            release()
    return outcome


def _summarize(job, path: Path | StdinInput, started: float, references: Path | None,
               password: str | None, progress, include_secrets: bool = False) -> dict:
    from contextlib import nullcontext

    from hisparse_cli.documents import load_document
    from hisparse_cli.summarize.job import read_reference

    if isinstance(path, StdinInput):  # the bytes read once, before the batch started
        doc = load_document("-", password=password, stdin=io.BytesIO(path.data))
    else:
        doc = load_document(path, password=password, include_secrets=include_secrets)
    ingest = time.perf_counter() - started
    ref = None if isinstance(path, StdinInput) else find_reference(path, references)
    ref = ref.resolve() if ref is not None else None  # like "input": resolved
    ref_text, warnings = None, []
    if ref is not None:
        try:
            ref_text = read_reference(ref)
        except InputError as exc:  # the summary is still worth keeping; no ROUGE for it
            warnings.append(f"no ROUGE: {exc.message}")
    with progress if progress is not None else nullcontext():
        out = job.run(doc, reference_text=ref_text, reference_path=str(ref) if ref else None,
                      ingest_seconds=ingest, progress=progress)
    out["warnings"] = warnings + list(out.get("warnings") or ())  # + the guard's (pipeline)
    return out


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
            if len(values) < 2:
                lo = hi = None
            rouge[name] = {"mean": mean, "lo": lo, "hi": hi, "n": len(values)}
    return {"documents": len(records), "ok": len(ok), "failed": len(failed),
            "failures": [{"input": r.get("input"), **(r.get("error") or {})} for r in failed],
            "warnings": [{"input": r.get("input"), "warnings": r["warnings"]}
                         for r in ok if r.get("warnings")],
            "rouge": rouge, "results": str(results.path)}


def other_settings(results: ResultsFile, settings_id: str) -> list[dict]:
    """The latest finished (ok) records made with settings other than `settings_id` (records
    written before settings_id existed are taken as matching)."""
    return [r for r in results.latest().values() if r.get("status") == "ok"
            and r.get("settings_id") not in (None, settings_id)]


# keys a result's `settings` shares with Job.settings_view (chunk_new_tokens: map-reduce
# stores the effective value there; model: the loaded model, not the one asked for)
_COMPARABLE = ("profile", "sparse", "strategy", "generation", "chunk_tokens", "instructions")


def settings_difference(record: dict, view: dict) -> list[str]:
    """Best effort, for messages: "name: stored → now" for every comparable setting in which
    `record`'s stored settings differ from `view` (Job.settings_view)."""
    out: list[str] = []

    def walk(name: str, old, new) -> None:
        if isinstance(old, dict) and isinstance(new, dict):
            for key in [k for k in new if k in old]:
                walk(f"{name}.{key}" if name else key, old[key], new[key])
        elif old != new:
            out.append(f"{name.rsplit('.', 1)[-1]}: {old} → {new}")

    stored = record.get("settings") or {}
    walk("", {k: stored[k] for k in _COMPARABLE if k in stored},
         {k: view[k] for k in _COMPARABLE if k in view})
    return out


__all__ = ["run_batch", "batch_summary", "other_settings", "settings_difference",
           "BatchOutcome", "error_record"]
