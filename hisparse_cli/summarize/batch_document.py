"""One document of a batch, wherever it runs: read it, find and read its reference, summarize
it with a Job, and turn the outcome into the fields of its results line.

    task = DocumentTask(index, total, given, path, record, identify_seconds)
    fields = run_document(job, task.path, references=..., password=..., progress=None)
    fields["status"]  # "ok" (+ the summarize JSON, "warnings") | "error" (+ "error")
    fields["seconds"] # this document's own time (reading + summarizing)

The local batch (batch_runner.LocalRunner) calls `run_document` in the driver process; a Ray
worker (cluster/worker.BatchWorker) calls the very same function in its own process, and the
driver writes what it returns. Isolation is the same in both: the document's own failure
(a HisparseError or any other exception) becomes an error record and the batch goes on;
a model that cannot be loaded is not the document's failure and is raised (it ends the
batch with its own exit code). A reference that cannot be read does not fail its document:
the record is ok, without ROUGE, and says why in `warnings`.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from pathlib import Path

from hisparse_cli.summarize.batch import StdinInput
from hisparse_cli.errors import EXIT_INTERNAL, HisparseError, InputError


@dataclass(frozen=True)
class DocumentTask:
    """A document the batch still has to summarize. `record` holds its first fields (input,
    given, sha256, settings_id: written in that order); `index` is its 1-based position
    among `total` inputs. `path` is the stdin document itself (its bytes) for input `-`."""

    index: int
    total: int
    given: str
    path: Path | StdinInput
    record: dict
    identify_seconds: float = 0.0


def error_record(exc: BaseException) -> dict:
    """{type, message, hint, exit_code} of a document's failure (out-of-memory errors as
    ResourceError, anything unexpected as an internal error, exit 1)."""
    from hisparse_cli.planner.vram import oom_error as as_resource_error

    err = exc if isinstance(exc, HisparseError) else as_resource_error(exc)
    if err is not None:
        return {"type": type(err).__name__, "message": err.message, "hint": err.hint,
                "exit_code": err.exit_code}
    return {"type": type(exc).__name__, "message": f"internal error: {exc}", "hint": None,
            "exit_code": EXIT_INTERNAL}


def error_from_record(error: dict) -> HisparseError:
    """The exception an error record describes (a worker's fatal error, raised again in the
    driver with its own message, hint and exit code)."""
    from hisparse_cli import errors

    cls = getattr(errors, str(error.get("type")), None)
    if isinstance(cls, type) and issubclass(cls, HisparseError):
        return cls(error.get("message") or "", hint=error.get("hint"))
    exc = HisparseError(error.get("message") or "internal error", hint=error.get("hint"))
    exc.exit_code = int(error.get("exit_code") or EXIT_INTERNAL)
    return exc


def run_document(job, path: Path | StdinInput, *, references: Path | None = None,
                 password: str | None = None, progress=None,
                 include_secrets: bool = False) -> dict:
    """Summarize the document at `path` (or the stdin document) with `job` → its
    results-line fields (module docstring). The model is loaded first, outside the
    document's isolation. `include_secrets`: a folder's secrets are read too."""
    job.engine()  # loaded once; a model that cannot load ends the batch (its exit code)
    started = time.perf_counter()
    try:
        fields = {"status": "ok", **_summarize(job, path, started, references, password,
                                               progress, include_secrets)}
    except HisparseError as exc:
        fields = {"status": "error", "error": error_record(exc)}
    except Exception as exc:  # noqa: BLE001 - record it, go on with the next document
        fields = {"status": "error", "error": error_record(exc)}
        release_cuda_memory()
    fields["seconds"] = time.perf_counter() - started
    return fields


def _summarize(job, path: Path | StdinInput, started: float, references: Path | None,
               password: str | None, progress, include_secrets: bool = False) -> dict:
    from contextlib import nullcontext

    from hisparse_cli.summarize.batch import find_reference
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


def release_cuda_memory() -> None:
    """Give cached CUDA memory back after a failed document (no-op without torch/CUDA)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


__all__ = ["DocumentTask", "run_document", "error_record", "error_from_record",
           "release_cuda_memory"]
