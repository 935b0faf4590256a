"""A document piped in on stdin (`cat notes.txt | hisparse summarize -`).

The bytes are read once, bounded by the largest format limit, and go to the reader their
content names (formats.document_format without a file name: `%PDF` → PDF, a .docx zip →
.docx, `<!doctype html` / `<html` → HTML, else text), so `cat report.pdf | hisparse
summarize -` works too. The document's source is "<stdin>"; its title is the one given
(`--title`), else a text's first Markdown `# ` heading or a PDF's/.docx's/page's own title,
else none. A terminal on stdin (nothing piped) and empty input are InputErrors.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import BinaryIO

from hisparse_cli.documents.base import Document
from hisparse_cli.documents.formats import (byte_limit, document_format, document_from_bytes,
                                            too_large)
from hisparse_cli.errors import InputError

STDIN_ARG = "-"
STDIN_SOURCE = "<stdin>"


def read_stdin(limits, stream: BinaryIO | None = None) -> bytes:
    """stdin's bytes (at most the largest format limit + 1: the reader refuses more)."""
    stream = stream if stream is not None else sys.stdin.buffer
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        raise InputError("`-` reads the document from stdin, but stdin is a terminal",
                         hint="pipe a document in: `cat notes.txt | hisparse summarize -`")
    most = max(byte_limit(fmt, limits) for fmt in ("pdf", "docx", "html", "text"))
    try:
        data = stream.read(most + 1)
    except OSError as exc:
        raise InputError(f"cannot read stdin: {exc.strerror or exc}",
                         hint="pipe a document into hisparse") from None
    if not data:
        raise InputError("stdin is empty", hint="pipe a document in: "
                                                "`cat notes.txt | hisparse summarize -`")
    return data


def stdin_document(data: bytes, limits, *, password: str | None = None,
                   title: str | None = None) -> Document:
    """The Document of bytes read from stdin (module docstring)."""
    fmt = document_format("", data[:1024], whole=data)
    limit = byte_limit(fmt, limits)
    if len(data) > limit:
        raise too_large(STDIN_SOURCE, len(data), fmt, limit)
    doc = document_from_bytes(data, fmt, source=STDIN_SOURCE, limits=limits, password=password)
    if title is None:
        from hisparse_cli.documents.text import markdown_title

        own = markdown_title(doc.text) if doc.kind == "text" else doc.title
        title = "" if own == STDIN_SOURCE else own
    sections = doc.sections
    if doc.kind == "text":
        sections = tuple(replace(s, label="stdin") for s in sections)
    return replace(doc, title=title, sections=sections)


__all__ = ["STDIN_ARG", "STDIN_SOURCE", "read_stdin", "stdin_document"]
