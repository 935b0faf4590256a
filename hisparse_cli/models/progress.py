"""Progress reporting for slow model steps (download, extraction, conversion).

Library functions take `progress=`, which may be:
    None                      silent (the default; library code prints nothing)
    a rich.console.Console    a spinner on a terminal, one line per step otherwise
                              (pass `Console(stderr=True)`: stdout carries only results)
    a callable(str) -> None   called with a one-line message at the start of each step
`Reporter` turns any of these into one `step(message)` context manager.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
