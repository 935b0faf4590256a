"""`hisparse batch --ray`: the documents of a batch summarized by Ray actors, the results file
written by the driver alone (summarize/batch_runner.run_batch, the same loop as the local batch).

`RayRunner` is a summarize/batch_runner.DocumentRunner. On the first document that needs work it
connects to Ray (cluster/connect.py: a private local cluster or a joined one), resolves the
model here for a local cluster (each node resolves its own otherwise), and starts the
workers (cluster/worker.BatchWorker actors), which load the model in parallel. It holds at most
one document per live worker, hands each document to an idle worker and returns documents
as they finish, in any order.

Failures:
  * a document's own failure comes back as its error record (the worker goes on);
  * a worker that cannot load the model ends the batch with the model's error and exit code,
    like the local batch; one that dies while loading ends it too (WorkerError);
  * a worker that dies while summarizing (killed, crashed, out of memory, its node lost) is
    replaced by a new one, and its document is tried once more on another worker; if that
    worker dies as well, the document is recorded as an error (WorkerError, or ResourceError
    when Ray says the process ran out of memory) and the batch goes on;
  * Ctrl-C (or any error in the driver) stops at once: `close()` kills the actors, shuts a
    private cluster down, and the documents in flight are not written (rerun with --resume).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from hisparse_cli.summarize.batch_document import DocumentTask, error_from_record, error_record
from hisparse_cli.errors import ResourceError, WorkerError
from hisparse_cli.cluster.connect import RayOptions

POLL_SECONDS = 0.25  # the driver's wait between progress updates
ATTEMPTS = 2  # a document whose worker dies is tried once more on another worker


@dataclass
class _Worker:
    id: int
    handle: object
    load_ref: object | None = None  # while loading
    task: DocumentTask | None = None  # while running
    run_ref: object | None = None
    attempt: int = 0


class RayRunner:
    def __init__(self, job, options: RayOptions, *, references: Path | None = None,
                 password: str | None = None, include_secrets: bool = False,
                 quiet: bool = False, warn=None, note=None, console=None) -> None:
        self.job, self.options = job, options
        # resolved here: a worker's working directory is not this one's
        self.references = Path(references).expanduser().resolve() if references else None
        self.password, self.include_secrets = password, include_secrets
        self.warn = warn or (lambda message: None)
        self.note = note or (lambda message: None)
        self.quiet, self.console = quiet, console
        self._settled = (0, 0)  # (highest input index handed over, of how many inputs)
        self.plan = None
        self._ray = None
        self._actor_class = None
        self._owned = False
        self._spec = None
        self._workers: dict[int, _Worker] = {}
        self._next_id = 1
        self._queue: deque[tuple[DocumentTask, int]] = deque()  # (task, attempt)
        self._warned: set[str] = set()
        self._board = None
        self._last_poll = 0.0
        self._restore_stdout = lambda: None

    # --- start --------------------------------------------------------------------------
    def _start(self) -> None:
        from hisparse_cli.cluster.board import WorkerBoard
        from hisparse_cli.cluster.connect import (cluster_resources, connect, keep_stdout_clean,
                                              plan_shortfall, require_ray, worker_plan)

        self._ray = require_ray()
        self._restore_stdout = keep_stdout_clean(quiet=self.quiet)
        self._owned = connect(self.options.address, quiet=self.quiet)
        local = self.options.address == "local"
        resources = cluster_resources()
        self.plan = worker_plan(self.options, self.job.profile, resources, private=local)
        shortfall = None if local else plan_shortfall(self.plan, resources)
        if shortfall:
            self.warn(shortfall)
        resolve = getattr(self.job, "resolve", None)  # one resolve (and pull) here, not per worker
        self._spec = self.job.spec(resolve() if local and resolve is not None else None)
        plan = self.plan
        self.note(f"Ray: {plan.workers} worker(s), {plan.threads} thread(s)"
                  + (f" and {plan.gpus:g} GPU(s)" if plan.gpus else "") + " each, on "
                  + (f"a local cluster ({resources['cpus']:g} CPUs, {resources['gpus']:g} GPUs)"
                     if local else f"{resources['nodes']} node(s)"))
        self._board = WorkerBoard(quiet=self.quiet, console=self.console)
        for _ in range(plan.workers):
            self._add_worker()
        self._board.start(plan.workers)

    def _add_worker(self) -> None:
        if self._actor_class is None:
            from hisparse_cli.cluster.worker import BatchWorker

            self._actor_class = self._ray.remote(BatchWorker)
        actor = self._actor_class.options(
            num_cpus=self.plan.threads, num_gpus=self.plan.gpus, max_concurrency=2,
            max_restarts=0)
        worker_id, self._next_id = self._next_id, self._next_id + 1
        handle = actor.remote(self._spec, worker_id=worker_id, threads=self.plan.threads,
                              references=str(self.references) if self.references else None,
                              password=self.password, include_secrets=self.include_secrets)
        self._workers[worker_id] = _Worker(worker_id, handle, load_ref=handle.load.remote())

    # --- DocumentRunner -------------------------------------------------------------------
    def has_room(self) -> bool:
        return self._ray is None or self.pending() < len(self._workers)

    def submit(self, task: DocumentTask) -> None:
        if self._ray is None:
            self._start()
        self._queue.append((task, 1))
        self._settled = (task.index, task.total)
        self._dispatch()

    def pending(self) -> int:
        return len(self._queue) + sum(1 for w in self._workers.values() if w.task is not None)

    def next_finished(self) -> tuple[DocumentTask, dict]:
        while True:
            self._dispatch()
            owners = {r: w for w in self._workers.values()
                      for r in (w.load_ref, w.run_ref) if r is not None}
            assert owners, "next_finished with nothing submitted"
            ready, _ = self._ray.wait(list(owners), num_returns=1, timeout=POLL_SECONDS)
            if not ready:
                self._poll_progress()
                continue
            worker = owners[ready[0]]
            if ready[0] == worker.load_ref:
                self._loaded(worker)
                continue
            finished = self._finished(worker)
            if finished is not None:
                return finished

    def close(self) -> None:
        if self._board is not None:
            self._board.stop()
        if self._ray is None:
            return
        for worker in self._workers.values():
            try:
                self._ray.kill(worker.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._workers.clear()
        if self._owned:
            self._ray.shutdown()
        self._restore_stdout()

    # --- internals --------------------------------------------------------------------------
    def _dispatch(self) -> None:
        for worker in self._workers.values():
            if not self._queue:
                return
            if worker.load_ref is None and worker.task is None:
                task, attempt = self._queue.popleft()
                worker.task, worker.attempt = task, attempt
                worker.run_ref = worker.handle.run.remote(task, attempt)

    def _loaded(self, worker: _Worker) -> None:
        ref, worker.load_ref = worker.load_ref, None
        try:
            loaded = self._ray.get(ref)
        except self._ray.exceptions.RayActorError as exc:
            raise WorkerError(f"Ray worker {worker.id} died while loading the model: "
                              f"{_first_line(exc)}") from None
        if "fatal" in loaded:
            raise error_from_record(loaded["fatal"])
        for message in loaded.get("warnings") or ():
            if message not in self._warned:
                self._warned.add(message)
                self.warn(f"worker {worker.id}: {message}")

    def _finished(self, worker: _Worker) -> tuple[DocumentTask, dict] | None:
        ref, task, attempt = worker.run_ref, worker.task, worker.attempt
        worker.run_ref, worker.task = None, None
        exceptions = self._ray.exceptions
        died = tuple(getattr(exceptions, name) for name in (
            "RayActorError", "OutOfMemoryError", "WorkerCrashedError", "NodeDiedError")
            if hasattr(exceptions, name))
        try:
            fields = self._ray.get(ref)
        except died as exc:  # the worker process is gone
            self._replace(worker)
            if attempt < ATTEMPTS:
                self.warn(f"worker {worker.id} died while summarizing {task.given} "
                          f"({_first_line(exc)}); trying it on another worker")
                self._queue.appendleft((task, attempt + 1))
                return None
            return task, {"status": "error", "error": _death_record(exc, attempts=attempt),
                          "seconds": 0.0}
        except exceptions.RayTaskError as exc:  # raised in the worker outside run_document
            return task, {"status": "error", "error": error_record(getattr(exc, "cause", None) or exc),
                          "seconds": 0.0}
        if "fatal" in fields:
            raise error_from_record(fields["fatal"])
        return task, fields

    def _replace(self, worker: _Worker) -> None:
        try:  # normally gone already; never leave a half-dead one holding resources
            self._ray.kill(worker.handle, no_restart=True)
        except Exception:  # noqa: BLE001
            pass
        del self._workers[worker.id]
        self._board.forget(worker.id)
        self._add_worker()

    def _poll_progress(self) -> None:
        if self._board is None or not self._board.live:
            return
        now = time.monotonic()
        if now - self._last_poll < 2 * POLL_SECONDS:
            return
        self._last_poll = now
        busy = {w.id: w.handle.progress.remote() for w in self._workers.values() if w.task}
        states: dict[int, dict | str] = {
            w.id: "loading" if w.load_ref is not None else "idle" for w in self._workers.values()}
        for worker_id, ref in busy.items():
            task = self._workers[worker_id].task
            states[worker_id] = {"index": task.index, "total": task.total, "given": task.given,
                                 "step": "starting", "phase": "", "done": 0, "of": 0}
            try:  # the worker's own view, once its run has begun
                states[worker_id] = self._ray.get(ref, timeout=POLL_SECONDS) or states[worker_id]
            except Exception:  # noqa: BLE001 - a dying worker: shown as it was until replaced
                pass
        index, total = self._settled
        self._board.update(states, settled=index - self.pending(), total=total)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _death_record(exc: BaseException, *, attempts: int) -> dict:
    """A WorkerError record, or a ResourceError one when Ray's memory monitor killed the
    worker (a kernel OOM kill looks like any other SIGKILL: a WorkerError)."""
    import ray

    why = _first_line(exc)
    oom = (isinstance(exc, getattr(ray.exceptions, "OutOfMemoryError", ()))
           or "running low on memory" in str(exc))
    cls = ResourceError if oom else WorkerError
    err = cls(f"the Ray worker summarizing it died {attempts} times (last: {why})",
              hint=None if not oom else "the worker ran out of memory; give workers more "
                   "memory (fewer per node) or use a smaller profile")
    return error_record(err)


__all__ = ["RayRunner", "ATTEMPTS"]
