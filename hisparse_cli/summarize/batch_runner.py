"""The batch loop: every input → one results line (ok or error), then the batch summary.

`run_batch` is the one driver of every batch, local or on Ray: it walks the inputs in order,
identifies each document (resolved path + content sha256), skips what the results file
already holds (`--resume`; failed ones are redone with `retry_failed`), hands the rest to a
`DocumentRunner` and alone appends each finished document as one line (ResultsFile: one
fsync'd write, never a partial line). Every record carries the job's `settings_id` (model,
profile, sparse and summary settings); `other_settings` finds finished records made with
different ones. `batch_summary` counts the latest record of each input and gives mean ROUGE
with 95% bootstrap intervals (lo/hi None below two scored documents: one value has no
interval).

Runners (the protocol below) only execute documents (batch_document.run_document):
  * `LocalRunner`             one at a time in this process (the engine loaded once, on the
                              first document that needs it);
  * `cluster.runner.RayRunner` on Ray actors, one document per worker at a time.
A runner holds at most as many documents as it has room for; the loop waits for one to
finish before it identifies the next input, so the local batch writes its lines in input
order and a Ray batch in the order its documents finish. A model that cannot load, or Ctrl-C,
leaves the loop at once: lines already written stay, nothing partial is written, and
`close()` releases the runner (the engine's kept state; Ray's actors and private cluster).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from hisparse_cli.summarize.batch import (ResultsFile, StdinInput, content_sha256, printable,
                                          record_key)
from hisparse_cli.summarize.batch_document import DocumentTask, error_record, run_document
from hisparse_cli.errors import InputError
from hisparse_cli.scoring import ROUGE_TYPES, bootstrap_ci

Report = Callable[[str, int, int, str, dict | None], None]  # (event, i, n, given, record)


@dataclass
class BatchOutcome:
    processed: int = 0
    skipped: int = 0
    skipped_failed: int = 0  # of `skipped`: failed earlier (not redone without retry_failed)
    keys: list[tuple[str, str]] = field(default_factory=list)


class DocumentRunner(Protocol):
    """Executes documents for `run_batch`; never writes the results file."""

    def has_room(self) -> bool:
        """Whether another document may be submitted now."""

    def submit(self, task: DocumentTask) -> None: ...

    def pending(self) -> int:
        """Documents submitted and not yet returned by `next_finished`."""

    def next_finished(self) -> tuple[DocumentTask, dict]:
        """Wait for a document to finish → (task, its record fields incl. "seconds")."""

    def close(self) -> None: ...


class LocalRunner:
    """Runs each document in this process when the loop asks for it (one at a time)."""

    def __init__(self, job, *, references: Path | None = None, password: str | None = None,
                 progress_factory=None, include_secrets: bool = False) -> None:
        self.job, self.references, self.password = job, references, password
        self.include_secrets = include_secrets
        self.progress_factory = progress_factory
        self._task: DocumentTask | None = None

    def has_room(self) -> bool:
        return self._task is None

    def submit(self, task: DocumentTask) -> None:
        self._task = task

    def pending(self) -> int:
        return int(self._task is not None)

    def next_finished(self) -> tuple[DocumentTask, dict]:
        task, self._task = self._task, None
        assert task is not None, "next_finished with nothing submitted"
        progress = self.progress_factory(task.index, task.total) if self.progress_factory \
            else None
        return task, run_document(self.job, task.path, references=self.references,
                                  password=self.password, progress=progress,
                                  include_secrets=self.include_secrets)

    def close(self) -> None:  # the engine's kept KV storage and decode graph (decode_state.py)
        release = getattr(self.job, "release", None)
        if release is not None:
            release()


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
              report: Report | None = None, include_secrets: bool = False,
              runner: DocumentRunner | None = None) -> BatchOutcome:
    """Summarize `items` ((as given, resolved path or the stdin document)) with `job`,
    appending to `results` (already opened). Documents whose (path, sha256) is in `results`
    are skipped (failed ones are redone with `retry_failed`). `include_secrets`: a folder's
    secrets are read (and fingerprinted) too. `runner` executes the documents (default: a
    LocalRunner of `job`); it is closed before this returns or raises."""
    report = report or (lambda *args: None)
    if runner is None:
        runner = LocalRunner(job, references=references, password=password,
                             progress_factory=progress_factory,
                             include_secrets=include_secrets)
    done = results.latest()
    outcome = BatchOutcome()
    total = len(items)
    settings_id = getattr(job, "settings_id", None)

    def write(task: DocumentTask, fields: dict) -> None:
        seconds = fields.pop("seconds", 0.0)
        record = {**task.record, **fields, "seconds": task.identify_seconds + seconds}
        record = results.append(record)  # as written (printable)
        outcome.processed += 1
        report("done", task.index, total, task.given, record)

    try:
        for index, (given, path) in enumerate(items, 1):
            while not runner.has_room():
                write(*runner.next_finished())
            # printable: the form the file holds, so the key matches again on --resume
            record: dict = {"input": printable(str(path)), "given": printable(given),
                            "sha256": None}
            if settings_id is not None:
                record["settings_id"] = settings_id()
            started = time.perf_counter()
            error = None
            try:
                record["sha256"] = _identify(path, include_secrets)
            except Exception as exc:  # noqa: BLE001 - one unreadable input never ends the batch
                error = error_record(exc)
            task = DocumentTask(index, total, given, path, record, time.perf_counter() - started)
            outcome.keys.append(record_key(record))
            previous = done.get(record_key(record))
            if previous is not None and (previous.get("status") == "ok" or not retry_failed):
                outcome.skipped += 1
                if previous.get("status") != "ok":
                    outcome.skipped_failed += 1
                report("skip", index, total, given, previous)
            elif error is not None:
                write(task, {"status": "error", "error": error})
            else:
                report("start", index, total, given, None)
                runner.submit(task)
        while runner.pending():
            write(*runner.next_finished())
    finally:
        runner.close()
    return outcome


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
           "BatchOutcome", "DocumentRunner", "LocalRunner", "error_record"]
