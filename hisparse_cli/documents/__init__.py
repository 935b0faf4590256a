"""Ingestion entry point: any path → `Document`, plus the limits (the genre guess: genre.py).

`load_document(path)` dispatches on what the path is:
  * a directory                                  → repository reader (repo.py)
  * a file named *.pdf, or one without a known text suffix whose content starts with
    `%PDF` (a PDF saved as report.dat)           → PDF reader (pdf.py)
  * any other file                               → text reader (text.py; Markdown is text;
    a notes.txt that starts with "%PDF" is text)
and fills `Document.genre` with `guess_genre` (genre.py), which picks the prompt family.
Every failure is an `InputError` (exit code 3) with a hint; bad limits are a `ConfigError`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path

from hisparse_cli.documents.base import Document, Section
from hisparse_cli.documents.genre import GENRES, guess_genre
from hisparse_cli.errors import ConfigError, InputError



@dataclass(frozen=True)
class IngestLimits:
    """Guards against huge or hostile inputs.

    max_pages:        PDFs with more pages are refused before any page is parsed
    max_pdf_bytes:    PDFs larger than this are refused before pypdf reads them
    pdf_timeout_s:    wall-clock budget for reading a PDF: interrupts pypdf where a timer
                      signal can be used (main thread), else checked before every page
    max_file_bytes:   repository files larger than this are skipped (reported)
    max_total_chars:  a text/PDF document with more characters is refused; a repository
                      stops adding files at this total (the rest is reported as skipped)
    max_files:        a repository stops adding files after this many
    """

    max_pages: int = 2000
    max_pdf_bytes: int = 256 * 1024 * 1024
    pdf_timeout_s: float = 120.0
    max_file_bytes: int = 1_000_000
    max_total_chars: int = 5_000_000
    max_files: int = 5000

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            ok_type = (int, float) if f.name == "pdf_timeout_s" else (int,)
            if isinstance(value, bool) or not isinstance(value, ok_type) or not value > 0:
                raise ConfigError(f"{f.name} must be a positive number, got {value!r}",
                                  hint=f"set {f.name} to a value greater than 0")


def _is_pdf(path: Path) -> bool:
    from hisparse_cli.documents.repo import TEXT_SUFFIXES

    suffix = path.suffix.lower()
    if suffix == ".pdf":
        return True
    if suffix in TEXT_SUFFIXES:  # the name says text: never sniffed as a PDF
        return False
    try:
        with path.open("rb") as handle:
            return handle.read(1024).lstrip(b"\xef\xbb\xbf\r\n\t ").startswith(b"%PDF")
    except OSError:
        return False  # the text reader reports the real problem


def load_document(path: str | Path, *, password: str | None = None,
                  limits: IngestLimits | None = None) -> Document:
    """Read a PDF, a text file or a source directory into a `Document` (genre filled in)."""
    from hisparse_cli.documents.pdf import load_pdf
    from hisparse_cli.documents.repo import load_repository
    from hisparse_cli.documents.text import load_text

    limits = limits or IngestLimits()
    path = Path(path).expanduser()
    if not path.exists():
        raise InputError(f"{path}: no such file or directory",
                         hint="check the path (a PDF, a text file or a directory)")
    if path.is_dir():
        document = load_repository(path, max_file_bytes=limits.max_file_bytes,
                                   max_total_chars=limits.max_total_chars,
                                   max_files=limits.max_files)
    elif not path.is_file():
        raise InputError(f"{path} is not a regular file or directory",
                         hint="give a PDF, a text file or a directory")
    elif _is_pdf(path):
        document = load_pdf(path, password=password, max_pages=limits.max_pages,
                            timeout_s=limits.pdf_timeout_s,
                            max_chars=limits.max_total_chars, max_bytes=limits.max_pdf_bytes)
    else:
        document = load_text(path, max_chars=limits.max_total_chars)
    return replace(document, genre=guess_genre(document.text, document.kind))


__all__ = ["load_document", "IngestLimits", "guess_genre", "GENRES", "Document", "Section"]
