"""The `Document` every ingester produces: text plus where each part came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

DocumentKind = Literal["pdf", "text", "docx", "html", "repository", "collection"]


@dataclass(frozen=True)
class Section:
    """A located piece of the document: a PDF page, a repository file, a collection's member
    document, a heading's part of a .docx/.html document.

    label:  human reference, e.g. "page 3", "src/app.py" or "2. Payment"
    start:  character offset of the section's text inside Document.text
    end:    character offset one past its end
    bytes:  for a file read whole (a repository file, a collection member): its size on
            disk; None for parts of one file
    """

    label: str
    start: int
    end: int
    bytes: int | None = None


@dataclass(frozen=True)
class Document:
    """Ingested document.

    text:      the full text fed to the model (with page markers / file headers)
    kind:      how it was read ("pdf", "text", "docx", "html", "repository", "collection")
    source:    the path the user gave
    sections:  pages, files, member documents or headed parts, in order, with offsets into
               `text` (map-reduce keeps them)
    skipped:   (item, reason) pairs of what was left out (files, pages, secrets)
    title:     a best-effort title (file or folder name, PDF metadata title)
    genre:     one of documents.genre.GENRES (prompt and length choice)
    """

    text: str
    kind: DocumentKind
    source: str
    sections: tuple[Section, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()
    title: str = ""
    genre: str = "generic"
    meta: dict = field(default_factory=dict)
