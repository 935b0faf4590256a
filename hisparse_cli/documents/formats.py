"""Which reader a document's bytes go to, and reading them within that reader's size limit.

`document_format(name, head)` decides, first by name, then by content:
  * `*.pdf` → "pdf", `*.docx` → "docx", `*.html` / `*.htm` / `*.xhtml` → "html";
  * any other name that says text (TEXT_SUFFIXES: `.txt`, `.md`, sources, …) → "text", so a
    notes.txt that starts with "%PDF" is text;
  * otherwise the content: `%PDF` → "pdf", a zip archive holding `word/document.xml` →
    "docx", `<!doctype html` / `<html` → "html", anything else → "text".
`read_limited(path, fmt, limits)` reads a file no larger than its format's limit (refused
before reading when the size says so); `document_from_bytes` hands bytes to the reader.
Single files, stdin and a collection's members all come through here.
"""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path
from typing import BinaryIO

from hisparse_cli.documents.base import Document
from hisparse_cli.errors import InputError

FORMATS = ("pdf", "docx", "html", "text")
DOCX_SUFFIXES = frozenset({".docx"})
HTML_SUFFIXES = frozenset({".html", ".htm", ".xhtml"})
_WHAT = {"pdf": "PDF", "docx": ".docx", "html": "HTML", "text": "text"}


def _is_docx_zip(whole: bytes | Path) -> bool:
    """Is `whole` (all bytes of a document, or the path of its file) a zip archive holding
    word/document.xml? Only the archive's directory is read."""
    try:
        if isinstance(whole, bytes):
            if not whole.startswith(b"PK\x03\x04"):
                return False
            whole = io.BytesIO(whole)
        with zipfile.ZipFile(whole) as archive:
            return "word/document.xml" in archive.namelist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError):
        return False


def document_format(name: str, head: bytes = b"", whole: bytes | Path | None = None) -> str:
    """"pdf" | "docx" | "html" | "text" for a document called `name` whose first bytes are
    `head` (`whole`: all of its bytes or its file, to recognise a .docx without its name)."""
    from hisparse_cli.documents.repo import TEXT_SUFFIXES
    from hisparse_cli.documents.webpage import looks_like_html

    suffix = Path(name).suffix.lower()
    if suffix == ".pdf":
        return "pdf"
    if suffix in DOCX_SUFFIXES:
        return "docx"
    if suffix in HTML_SUFFIXES:
        return "html"
    if suffix in TEXT_SUFFIXES:  # the name says text: never sniffed
        return "text"
    if head.lstrip(b"\xef\xbb\xbf\r\n\t ").startswith(b"%PDF"):
        return "pdf"
    if whole is not None and head.startswith(b"PK\x03\x04") and _is_docx_zip(whole):
        return "docx"
    if looks_like_html(head):
        return "html"
    return "text"


def byte_limit(fmt: str, limits) -> int:
    """The most bytes a document of format `fmt` may have (IngestLimits)."""
    return {"pdf": limits.max_pdf_bytes, "docx": limits.max_docx_bytes,
            "html": limits.max_html_bytes}.get(fmt, 4 * limits.max_total_chars + 4)


def too_large(source: str, size: int, fmt: str, limit: int) -> InputError:
    hint = {"pdf": "split the PDF into smaller parts (e.g. `qpdf --split-pages`)",
            "docx": "split the document, or save it without embedded media",
            "html": "save the page's main text as a text file"}.get(
        fmt, "split the document into parts and summarize them separately")
    return InputError(f"{source} is {size:,} bytes, more than the {_WHAT[fmt]} size limit of "
                      f"{limit:,} bytes", hint=hint)


def read_limited(handle: BinaryIO, source: str, fmt: str, limits) -> bytes:
    """All bytes of an open file, refused (InputError) when larger than the format's limit:
    before reading when its size says so, and never more than limit + 1 bytes read."""
    limit = byte_limit(fmt, limits)
    try:
        size = os.fstat(handle.fileno()).st_size
    except (OSError, ValueError, io.UnsupportedOperation):
        size = 0
    if size > limit:
        raise too_large(source, size, fmt, limit)
    data = handle.read(limit + 1)
    if len(data) > limit:
        raise too_large(source, len(data), fmt, limit)
    return data


def document_from_bytes(data: bytes, fmt: str, *, source: str, limits,
                        password: str | None = None) -> Document:
    """The reader of `fmt` on `data`; `source` names the document in messages and results."""
    if fmt == "pdf":
        from hisparse_cli.documents.pdf import pdf_document

        return pdf_document(data, source=source, password=password, max_pages=limits.max_pages,
                            timeout_s=limits.pdf_timeout_s, max_chars=limits.max_total_chars)
    if fmt == "docx":
        from hisparse_cli.documents.docx import docx_document

        return docx_document(data, source=source, max_chars=limits.max_total_chars,
                             max_entries=limits.max_zip_entries,
                             max_unzipped=limits.max_unzipped_bytes)
    if fmt == "html":
        from hisparse_cli.documents.webpage import html_document

        return html_document(data, source=source, max_chars=limits.max_total_chars,
                             max_bytes=limits.max_html_bytes)
    from hisparse_cli.documents.text import text_document

    return text_document(data, source=source, name=Path(source).name,
                         max_chars=limits.max_total_chars)


__all__ = ["FORMATS", "document_format", "byte_limit", "read_limited", "document_from_bytes",
           "too_large", "DOCX_SUFFIXES", "HTML_SUFFIXES"]
