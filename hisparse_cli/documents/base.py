"""The `Document` every ingester produces: text plus where each part came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

DocumentKind = Literal["pdf", "text", "repository"]


@dataclass(frozen=True)
class Section:
    """A located piece of the document: a PDF page or a repository file.

    label:  human reference, e.g. "page 3" or "src/app.py"
    start:  character offset of the section's text inside Document.text
    end:    character offset one past its end
    """

    label: str
    start: int
    end: int


@dataclass(frozen=True)
class Document:
    """Ingested document.

    text:      the full text fed to the model (with page markers / file headers)
    kind:      how it was read ("pdf", "text", "repository")
    source:    the path the user gave
    sections:  pages or files, in order, with offsets into `text` (map-reduce keeps them)
    skipped:   for repositories/PDFs: (item, reason) pairs of what was left out
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
