"""The worker side of a Ray batch: one process that loads the model once and summarizes the
documents the driver hands it, one at a time.

`BatchWorker` is a plain class; cluster/runner.py makes it a Ray actor (`ray.remote`) with
`num_cpus` = threads per worker, `num_gpus` = GPUs per worker and two concurrent calls (so
the driver can ask `progress()` while `run()` works). Nothing here imports Ray at module
import time, and nothing here writes the results file: `run` returns the document's record
fields (batch_document.run_document, the same function the local batch calls) plus
`worker` (which process, node and GPU ran it, and the attempt), and the driver writes them.

Placement, shared with the Ray Data entry point (cluster/ray_data.py):
  * `drop_shadowing_paths()`: Ray puts the driver's working directory on every worker's
    sys.path; a `kernels`-shadowing folder there (a hisparse checkout's root) is removed.
  * `place_worker()`: a worker with GPUs assigned by Ray uses the first of them as its CUDA
    device (`torch.cuda.set_device`; Ray normally narrows CUDA_VISIBLE_DEVICES to the
    assigned ones, where the index is 0; without that, the assigned id itself). A worker with
    none hides every GPU (CUDA_VISIBLE_DEVICES="") before CUDA starts, so it never lands on
    a GPU Ray gave to another worker; a GPU profile then runs on the CPU with its warning.
  * `set_worker_threads(n)`: torch's intra-op threads for this process.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path


def drop_shadowing_paths() -> list[str]:
    """Remove from sys.path the driver's folders that Ray adds to every worker's path (its
    working directory, its script's folder) when they would shadow the `kernels`
    distribution transformers imports: a `kernels` folder or module there (a hisparse
    checkout's top-level kernels/, installed as hisparse_cli.kernels, or a user's own)
    would be imported in its place. hisparse itself is imported from its installation.
    Entries inside the Python installation are kept. Returns the entries removed."""
    install = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}

    def shadows(entry: str) -> bool:
        folder = Path(entry or ".").resolve()
        if any(folder == root or root in folder.parents for root in install):
            return False
        return (folder / "kernels").is_dir() or (folder / "kernels.py").is_file()

    dropped = [p for p in sys.path if shadows(p)]
    sys.path[:] = [p for p in sys.path if p not in dropped]
    return dropped


def set_worker_threads(threads: int | None) -> None:
    """This process's CPU threads for torch (None: torch's default). The one place a worker
    sets its threads; the CPU thread policy (issue 37) is to take this over."""
    if threads is None:
        return
    import torch

    torch.set_num_threads(int(threads))


def assigned_gpus() -> list[str]:
    """The GPU ids Ray assigned to this worker ([] outside Ray or without GPUs)."""
    try:
        import ray

        if not ray.is_initialized():
            return []
        return [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]
    except Exception:  # noqa: BLE001 - not in a Ray worker: no assignment
        return []


def place_worker(gpus: list[str] | None = None) -> dict:
    """Use the first assigned GPU as this process's CUDA device, or hide every GPU when none
    is assigned (module docstring). Returns {"gpus": ids, "cuda_device": index or None}."""
    gpus = assigned_gpus() if gpus is None else gpus
    if not gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before CUDA starts in this process
        return {"gpus": [], "cuda_device": None}
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
               if v.strip()]
    index = visible.index(gpus[0]) if gpus[0] in visible else int(gpus[0])
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(index)
    return {"gpus": gpus, "cuda_device": index}


class WorkerProgress:
    """The pipeline's progress callback inside a worker: keeps the latest (step, phase, done,
    total) of the running document for the driver's `progress()` calls (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: dict | None = None

    def begin(self, index: int, total: int, given: str) -> "WorkerProgress":
        with self._lock:
            self._state = {"index": index, "total": total, "given": given, "step": "reading",
                           "phase": "", "done": 0, "of": 0}
        return self

    def end(self) -> None:
        with self._lock:
            self._state = None

    def __enter__(self) -> "WorkerProgress":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def __call__(self, step: str, phase: str, done: int, total: int) -> None:
        with self._lock:
            if self._state is not None:
                self._state.update(step=step, phase=phase, done=done, of=total)

    def snapshot(self) -> dict | None:
        with self._lock:
            return dict(self._state) if self._state is not None else None


class BatchWorker:
    """One batch worker (a Ray actor): `load()` once, then `run(task, attempt)` per document."""

    def __init__(self, spec, *, worker_id: int, threads: int | None = None,
                 references: str | None = None, password: str | None = None,
                 include_secrets: bool = False) -> None:
        drop_shadowing_paths()  # before anything imports transformers here
        self.worker_id, self.threads = worker_id, threads
        self.references = Path(references) if references else None
        self.password, self.include_secrets = password, include_secrets
        self.warnings: list[str] = []
        self.job = spec.build(warn=self.warnings.append)
        self.place: dict = {"gpus": [], "cuda_device": None}
        self.progress_state = WorkerProgress()

    def info(self) -> dict:
        return {"id": self.worker_id, "host": socket.gethostname(), "pid": os.getpid(),
                "gpus": self.place["gpus"], "threads": self.threads}

    def load(self) -> dict:
        """Place the process, set its threads, load the model → {"worker", "warnings",
        "seconds"} or {"fatal": error record} when the model cannot load."""
        from hisparse_cli.summarize.batch_document import error_record

        started = time.perf_counter()
        try:
            self.place = place_worker()
            set_worker_threads(self.threads)
            self.job.engine()
        except Exception as exc:  # noqa: BLE001 - the driver ends the batch with its code
            return {"fatal": error_record(exc), "worker": self.info()}
        return {"worker": self.info(), "warnings": list(self.warnings),
                "seconds": time.perf_counter() - started}

    def run(self, task, attempt: int = 1) -> dict:
        """Summarize one document → its record fields, with `worker` (batch_document)."""
        from hisparse_cli.summarize.batch_document import error_record, run_document

        progress = self.progress_state.begin(task.index, task.total, task.given)
        started_at = time.time()
        try:
            fields = run_document(self.job, task.path, references=self.references,
                                  password=self.password, progress=progress,
                                  include_secrets=self.include_secrets)
        except Exception as exc:  # noqa: BLE001 - only the model load gets here
            return {"fatal": error_record(exc), "worker": self.info()}
        finally:
            self.progress_state.end()
        fields["worker"] = {**self.info(), "attempt": attempt, "started_at": started_at,
                            "finished_at": time.time()}
        return fields

    def progress(self) -> dict | None:
        return self.progress_state.snapshot()

    def release(self) -> None:
        release = getattr(self.job, "release", None)
        if release is not None:
            release()


__all__ = ["BatchWorker", "WorkerProgress", "place_worker", "assigned_gpus",
           "set_worker_threads", "drop_shadowing_paths"]
