"""Progress reporting for slow model steps (download, extraction, conversion).

Library functions take `progress=`, which may be:
    None                      silent (the default; library code prints nothing)
    a rich.console.Console    a spinner on a terminal, one line per step otherwise
                              (pass `Console(stderr=True)`: stdout carries only results)
    a callable(str) -> None   called with a one-line message at the start of each step
`Reporter` turns any of these into one `step(message)` context manager, and `iterate` into
a progress bar on a terminal console, else (a log: stderr not a terminal, or a callable) a
line at most every `console.LOG_EVERY_S` seconds with the count, rate and ETA; silent with
None (`-q`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from rich.console import Console

ProgressLike = Union["Console", Callable[[str], None], None]


class Reporter:
    """Uniform front for the three kinds of `progress=` argument."""

    def __init__(self, progress: ProgressLike = None) -> None:
        self._progress = progress

    def _is_console(self) -> bool:
        return hasattr(self._progress, "status") and hasattr(self._progress, "is_terminal")

    def note(self, message: str) -> None:
        """Report a one-off message (no duration)."""
        if self._progress is None:
            return
        if self._is_console():
            self._progress.print(f"[dim]hisparse:[/] {message}", highlight=False)
        else:
            self._progress(message)

    @contextmanager
    def step(self, message: str) -> Iterator[None]:
        """Show `message` while the body runs (spinner on a terminal console)."""
        if self._progress is None:
            yield
        elif self._is_console() and self._progress.is_terminal:
            with self._progress.status(message):
                yield
        else:
            self.note(message)
            yield

    def iterate(self, items: Iterable, what: str, total: int | None = None) -> Iterator:
        """Yield `items`, showing the progress of `what` (module docstring)."""
        if total is None:
            try:
                total = len(items)  # type: ignore[arg-type]
            except TypeError:
                total = None
        if self._progress is None:
            yield from items
            return
        if self._is_console() and self._progress.is_terminal:
            from rich.progress import track

            yield from track(items, description=what, total=total, console=self._progress,
                             transient=True)
            return
        from hisparse_cli.console import LOG_EVERY_S, eta_text

        started = last = time.perf_counter()
        self.note(f"{what}: 0/{total:,}" if total else f"{what}")
        done = 0
        for item in items:
            yield item
            done += 1
            now = time.perf_counter()
            if now - last >= LOG_EVERY_S and (total is None or done < total):
                last = now
                rate = done / (now - started)
                eta = f", {eta_text((total - done) / rate)}" if total and rate > 0 else ""
                self.note(f"{what}: {done:,}/{total:,} ({rate:,.1f}/s{eta})" if total
                          else f"{what}: {done:,} ({rate:,.1f}/s)")
