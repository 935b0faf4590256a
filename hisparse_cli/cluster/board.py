"""Progress of a batch spread over several workers, on stderr: one line for the batch (inputs
settled of all, documents running) and one per worker (loading, idle, or its document with
the generation step and phase and the tokens done). Live only on a terminal and without
--quiet; elsewhere it shows nothing (each finished document still gets its own line from
the reporter). Lines printed while it is live must go through the same Console (`console`),
which Rich then prints above the display."""

from __future__ import annotations

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from hisparse_cli.summarize.batch import printable


class WorkerBoard:
    def __init__(self, *, quiet: bool = False, console=None) -> None:
        from hisparse_cli.console import stderr_console

        self.console = console or stderr_console()
        self.live = self.console.is_terminal and not quiet
        self._progress: Progress | None = None
        self._batch = None
        self._rows: dict[int, object] = {}

    def start(self, workers: int) -> None:
        if not self.live or self._progress is not None:
            return
        self._progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                  TextColumn("{task.fields[count]}"), TimeElapsedColumn(),
                                  console=self.console, transient=True)
        self._progress.start()
        self._batch = self._progress.add_task(f"batch: starting {workers} worker(s)",
                                              total=None, count="")

    def update(self, states: dict[int, dict | str], *, settled: int, total: int) -> None:
        """`states`: worker id → its `progress()` snapshot, or "loading" / "idle";
        `settled`: inputs done with (written or skipped) of `total`."""
        if self._progress is None:
            return
        running = sum(1 for s in states.values() if isinstance(s, dict))
        self._progress.update(self._batch, completed=settled, total=total or None,
                              count=f"{settled}/{total} inputs done",
                              description=f"batch: {running} running on {len(states)} "
                                          "worker(s)")
        for worker_id, state in states.items():
            row = self._rows.get(worker_id)
            if row is None:
                row = self._rows[worker_id] = self._progress.add_task(
                    f"  worker {worker_id}", total=None, count="")
            if not isinstance(state, dict):
                text = "loading the model" if state == "loading" else "idle"
                self._progress.update(row, description=f"  worker {worker_id}: {text}",
                                      completed=0, count="")
                continue
            given = printable(str(state["given"]))
            step = f" · {state['step']}" + (f" · {state['phase']}" if state["phase"] else "")
            self._progress.update(row, description=(f"  worker {worker_id}: [{state['index']}/"
                                                    f"{state['total']}] {given}{step}"),
                                  completed=state["done"], total=state["of"] or None,
                                  count=f"{state['done']:,}/{state['of']:,} tokens"
                                  if state["of"] else "")

    def forget(self, worker_id: int) -> None:
        """A worker that is gone (its replacement gets a row of its own)."""
        row = self._rows.pop(worker_id, None)
        if row is not None and self._progress is not None:
            self._progress.remove_task(row)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


__all__ = ["WorkerBoard"]
