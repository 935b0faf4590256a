"""Progress of a batch spread over several workers, on stderr: one line for the batch (documents
finished, workers running) and one per worker (its document, generation step and phase, tokens
done). Live only on a terminal and without --quiet; elsewhere it shows nothing (each finished
document still gets its own line from the reporter)."""

from __future__ import annotations

from hisparse_cli.batch import printable
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class WorkerBoard:
    def __init__(self, *, quiet: bool = False) -> None:
        from hisparse_cli.console import stderr_console

        self.console = stderr_console()
        self.live = self.console.is_terminal and not quiet
        self._progress: Progress | None = None
        self._batch = None
        self._rows: dict[int, object] = {}
        self.finished = 0

    def start(self, workers: int) -> None:
        if not self.live or self._progress is not None:
            return
        self._progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                  MofNCompleteColumn(), TimeElapsedColumn(),
                                  console=self.console, transient=True)
        self._progress.start()
        self._batch = self._progress.add_task(self._batch_text(0, workers), total=None)

    def _batch_text(self, running: int, workers: int) -> str:
        return f"batch: {self.finished} finished, {running} running on {workers} worker(s)"

    def update(self, states: dict[int, dict | None], workers: int) -> None:
        """`states`: worker id → its `progress()` snapshot (None: idle or loading)."""
        if self._progress is None:
            return
        running = sum(1 for s in states.values() if s)
        self._progress.update(self._batch, description=self._batch_text(running, workers))
        for worker_id, state in states.items():
            row = self._rows.get(worker_id)
            if row is None:
                row = self._rows[worker_id] = self._progress.add_task("", total=None)
            if not state:
                self._progress.update(row, description=f"  worker {worker_id}: idle",
                                      completed=0, total=None)
                continue
            given = printable(str(state["given"]))
            step = f" · {state['step']}" + (f" · {state['phase']}" if state["phase"] else "")
            self._progress.update(row, description=(f"  worker {worker_id}: [{state['index']}/"
                                                    f"{state['total']}] {given}{step}"),
                                  completed=state["done"], total=state["of"] or None)

    def document_finished(self) -> None:
        self.finished += 1

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


__all__ = ["WorkerBoard"]
