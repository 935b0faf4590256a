"""Word (.docx) ingestion through python-docx: body text with its pages or headings kept.

A .docx is a zip archive, so it is checked as one before python-docx opens it (the same
spirit as the PDF guards): the file size (`IngestLimits.max_docx_bytes`, checked before
reading), the number of archive entries and the total size they declare uncompressed
(`max_zip_entries`, `max_unzipped_bytes`: a zip bomb is refused before anything is
inflated; zipfile never inflates an entry past its declared size), then the characters of
text (`max_total_chars`). python-docx parses the XML with entity resolution off.

What is read, in document order: paragraphs (headings written as Markdown `#` lines, list
items as they are) and tables (one line per row, cells joined by " | ", a merged cell
once). Headers, footers, comments and footnotes are not read. Structure, for chunk labels:
  * pages, when the file records page breaks (explicit ones, or the ones Word writes where
    it last laid out a page): `[page N]` markers as in a PDF, one Section per page;
  * otherwise headings: one Section per heading (label = the heading's text), the text
    before the first heading labelled "beginning";
  * otherwise one Section.
"""

from __future__ import annotations

import io
import logging
import re
import zipfile
from pathlib import Path

from hisparse_cli.documents.base import Document, Section
from hisparse_cli.errors import InputError

_HEADING = re.compile(r"^(?:heading\s*(\d)|title)$", re.IGNORECASE)
MAX_LABEL_CHARS = 80


def check_docx_archive(data: bytes, *, source: str, max_entries: int,
                       max_unzipped: int) -> None:
    """InputError unless `data` is a zip holding word/document.xml whose entries stay within
    the limits (their count, and the uncompressed bytes they declare)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise InputError(f"{source} is not a readable .docx (not a zip archive: {exc})",
                         hint="re-save the document as .docx from your word processor") from None
    if len(infos) > max_entries:
        raise InputError(f"{source} has {len(infos):,} archive entries, more than the limit of "
                         f"{max_entries:,} (a zip bomb?)",
                         hint="re-save the document as .docx, or convert it to PDF")
    unzipped = sum(info.file_size for info in infos)
    if unzipped > max_unzipped:
        raise InputError(f"{source} would inflate to {unzipped:,} bytes, more than the limit of "
                         f"{max_unzipped:,} (a zip bomb?)",
                         hint="re-save the document without embedded media, or split it")
    if not any(info.filename == "word/document.xml" for info in infos):
        raise InputError(f"{source} is a zip archive but not a Word document "
                         "(no word/document.xml)", hint="give a .docx saved by a word processor")


def _quiet_docx():
    logging.getLogger("docx").setLevel(logging.ERROR)


def _cell_rows(table) -> list[str]:
    rows = []
    for row in table.rows:
        seen, cells = set(), []
        for cell in row.cells:  # a merged cell comes back once per grid column it spans
            if id(cell._tc) in seen:
                continue
            seen.add(id(cell._tc))
            cells.append(" ".join(cell.text.split()))
        if any(cells):
            rows.append(" | ".join(cells))
    return rows


def _has_page_break(paragraph) -> bool:
    return bool(paragraph.contains_page_break or paragraph._p.xpath(
        './/w:br[@w:type="page"]'))


def _blocks(document) -> list[tuple[str, str, bool]]:
    """(kind, text, page break before) for each block: kind "heading" | "text"."""
    from docx.table import Table

    blocks = []
    for item in document.iter_inner_content():
        if isinstance(item, Table):
            rows = _cell_rows(item)
            if rows:
                blocks.append(("text", "\n".join(rows), False))
            continue
        brk = _has_page_break(item)
        text = item.text.strip()
        style = item.style.name if item.style is not None else ""
        match = _HEADING.match(style.strip())
        if match and text:
            level = int(match.group(1)) if match.group(1) else 1
            blocks.append(("heading", f"{'#' * min(level, 6)} {' '.join(text.split())}", brk))
        elif text or brk:
            blocks.append(("text", text, brk))
    return blocks


def _label(heading: str) -> str:
    text = heading.lstrip("#").strip()
    return text if len(text) <= MAX_LABEL_CHARS else text[:MAX_LABEL_CHARS - 1] + "…"


def _layout(blocks: list[tuple[str, str, bool]]) -> tuple[str, list[Section]]:
    """Text and sections: by page when any page break is recorded, else by heading."""
    paged = any(brk for _, _, brk in blocks[1:])
    groups: list[tuple[str, list[str]]] = []
    page = 1
    for kind, text, brk in blocks:
        if paged and brk and groups and any(groups[-1][1]):
            page += 1
            groups.append((f"page {page}", []))
        elif not paged and kind == "heading":
            groups.append((_label(text), []))
        elif not groups:
            groups.append(("page 1" if paged else "beginning", []))
        if text:
            groups[-1][1].append(text)
    parts, sections, offset = [], [], 0
    for label, texts in groups:
        body = "\n\n".join(texts).strip()
        if not body:
            continue
        block = (f"[{label}]\n{body}\n" if paged else f"{body}\n")
        if parts:
            block = "\n" + block
        start = offset + (1 if parts else 0)
        sections.append(Section(label=label, start=start, end=offset + len(block)))
        parts.append(block)
        offset += len(block)
    return "".join(parts), sections


def docx_document(data: bytes, *, source: str, max_chars: int, max_entries: int,
                  max_unzipped: int) -> Document:
    """The bytes of a .docx → Document(kind="docx") (module docstring for what is read)."""
    check_docx_archive(data, source=source, max_entries=max_entries, max_unzipped=max_unzipped)
    _quiet_docx()
    try:
        import docx

        document = docx.Document(io.BytesIO(data))
        blocks = _blocks(document)
        core_title = (document.core_properties.title or "").strip()
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - boundary: python-docx/lxml raise many types
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() \
            else type(exc).__name__
        raise InputError(f"{source} is not a readable .docx (corrupt or truncated): {reason}",
                         hint="re-save the document as .docx and try again") from None
    text, sections = _layout(blocks)
    if not sections:
        raise InputError(f"{source} has no text", hint="check that this is the right document "
                         "(text in text boxes, headers or footers is not read)")
    if len(text) > max_chars:
        raise InputError(f"{source} has more than the limit of {max_chars:,} characters of text",
                         hint="split the document into smaller parts")
    first_heading = next((t.lstrip("#").strip() for k, t, _ in blocks if k == "heading"), "")
    pages = sum(1 for s in sections if s.label.startswith("page "))
    return Document(text=text, kind="docx", source=source, sections=tuple(sections),
                    title=core_title or first_heading or Path(source).stem,
                    meta={"bytes": len(data), "pages": pages or None,
                          "structure": "pages" if pages else
                          "headings" if len(sections) > 1 else "none"})


__all__ = ["docx_document", "check_docx_archive"]
