"""Ingestion entry point: any path (or stdin) → `Document`, plus the limits and the genre guess.

`load_document(path)` dispatches on what the path is:
  * "-" (the string)                             → stdin (stdin.py: text, or a PDF/.docx/
                                                   HTML piped in, recognised by content)
  * a directory                                  → folder.py: a code repository (repo.py)
                                                   or a document collection (collection.py)
  * a file                                       → by name, then content (formats.py):
      *.pdf, or `%PDF` content under a name that does not say text → PDF reader (pdf.py)
      *.docx, or a zip holding word/document.xml                   → .docx reader (docx.py)
      *.html / *.htm, or content starting `<!doctype html`/`<html`  → HTML reader (webpage.py)
      anything else → text reader (text.py; Markdown is text; a notes.txt that starts with
      "%PDF" is text)
and fills `Document.genre` with `guess_genre` (genre.py), which picks the prompt family (a
collection's genre is "collection"). Every failure is an `InputError` (exit code 3) with a hint; bad
limits are a `ConfigError`.
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

    max_pages:          PDFs with more pages are refused before any page is parsed
    max_pdf_bytes:      PDFs larger than this are refused before pypdf reads them
    pdf_timeout_s:      wall-clock budget for reading a PDF: interrupts pypdf where a timer
                        signal can be used (main thread), else checked before every page
    max_docx_bytes:     .docx files larger than this are refused before they are read
    max_unzipped_bytes: a .docx whose archive entries declare more bytes uncompressed is
                        refused before anything is inflated (zip bombs)
    max_zip_entries:    a .docx with more archive entries is refused
    max_html_bytes:     HTML pages larger than this are refused before they are parsed
    max_file_bytes:     repository files larger than this are skipped (reported)
    max_total_chars:    a single document with more characters is refused; a repository or
                        collection stops adding files at this total (the rest is reported)
    max_files:          a repository or collection stops adding files after this many
    """

    max_pages: int = 2000
    max_pdf_bytes: int = 256 * 1024 * 1024
    pdf_timeout_s: float = 120.0
    max_docx_bytes: int = 256 * 1024 * 1024
    max_unzipped_bytes: int = 512 * 1024 * 1024
    max_zip_entries: int = 10_000
    max_html_bytes: int = 20 * 1024 * 1024
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


def _load_file(path: Path, limits: IngestLimits, password: str | None) -> Document:
    from hisparse_cli.documents.formats import document_format, document_from_bytes, read_limited
    from hisparse_cli.documents.pdf import load_pdf
    from hisparse_cli.documents.text import load_text

    try:
        with path.open("rb") as handle:
            head = handle.read(1024)
            fmt = document_format(path.name, head, whole=path if head.startswith(b"PK") else None)
            if fmt in ("docx", "html"):
                handle.seek(0)
                data = read_limited(handle, str(path), fmt, limits)
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}",
                         hint="check the path and its permissions") from None
    if fmt == "pdf":
        return load_pdf(path, password=password, max_pages=limits.max_pages,
                        timeout_s=limits.pdf_timeout_s, max_chars=limits.max_total_chars,
                        max_bytes=limits.max_pdf_bytes)
    if fmt == "text":
        return load_text(path, max_chars=limits.max_total_chars)
    return document_from_bytes(data, fmt, source=str(path), limits=limits, password=password)


def load_document(path: str | Path, *, password: str | None = None,
                  limits: IngestLimits | None = None, include_secrets: bool = False,
                  title: str | None = None, stdin=None) -> Document:
    """Read stdin ("-"), a PDF, a .docx, an HTML page, a text file or a folder into a
    `Document` (genre filled in). `include_secrets`: a folder's secrets are read too
    (secret_files.py). `title`: replaces the document's own title. `stdin`: the binary
    stream "-" reads (default sys.stdin.buffer). A file named "-" is `Path("-")` or "./-"."""
    from hisparse_cli.documents.folder import load_folder
    from hisparse_cli.documents.stdin import STDIN_ARG, read_stdin, stdin_document

    limits = limits or IngestLimits()
    if isinstance(path, str) and path == STDIN_ARG:
        document = stdin_document(read_stdin(limits, stdin), limits, password=password,
                                  title=title)
        return _with_genre(document)
    path = Path(path).expanduser()
    if not path.exists():
        raise InputError(f"{path}: no such file or directory",
                         hint="check the path (a PDF, a .docx, an HTML page, a text file, a "
                              "folder, or - for stdin)")
    if path.is_dir():
        document = load_folder(path, limits, password=password, include_secrets=include_secrets)
    elif not path.is_file():
        raise InputError(f"{path} is not a regular file or directory",
                         hint="give a PDF, a .docx, an HTML page, a text file or a directory")
    else:
        document = _load_file(path, limits, password)
    if title is not None:
        document = replace(document, title=title)
    return _with_genre(document)


def _with_genre(document: Document) -> Document:
    return replace(document, genre=guess_genre(document.text, document.kind))


__all__ = ["load_document", "IngestLimits", "guess_genre", "GENRES", "Document", "Section"]
