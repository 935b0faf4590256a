"""HTML (.html/.htm) ingestion: the page's main text through trafilatura, headings kept.

trafilatura finds the main content and drops what is not (scripts, styles, navigation,
headers, footers, cookie banners, comments); the result is Markdown-like text: headings as
`#` lines, lists, tables as `| a | b |` rows. Guards: the size (`IngestLimits.max_html_bytes`,
checked before parsing, also passed to trafilatura as its own limit) and the characters of
text (`max_total_chars`). lxml parses HTML without fetching anything; nothing here reaches
the network. When trafilatura finds no main content (a page that is all navigation), the
page is refused rather than read whole.

Structure, for chunk labels: one Section per heading (label = the heading's text; the text
before the first heading is "beginning"), or one Section when the page has no headings.
Title: the page's <title> (or og:title), else the first heading, else the file name's stem.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from hisparse_cli.documents.base import Document, Section
from hisparse_cli.errors import InputError

_HEADING_LINE = re.compile(r"^(#{1,6}) +(\S.*)$")
MAX_LABEL_CHARS = 80


def looks_like_html(head: bytes) -> bool:
    """Does the start of a file without a telling name look like an HTML page?"""
    start = head[:1024].lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    return start.startswith((b"<!doctype html", b"<html")) or (
        start.startswith(b"<?xml") and b"<html" in start)


def _extract(html: bytes, max_bytes: int) -> tuple[str | None, str]:
    """(main text as Markdown or None, title) by trafilatura, its loggers silenced."""
    for name in ("trafilatura", "htmldate", "courlan", "justext", "readability"):
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)
    import trafilatura
    from trafilatura.settings import use_config

    config = use_config()
    config.set("DEFAULT", "MAX_FILE_SIZE", str(max_bytes))
    config.set("DEFAULT", "MIN_EXTRACTED_SIZE", "1")  # short pages are documents too
    text = trafilatura.extract(html, output_format="markdown", include_comments=False,
                               include_tables=True, include_links=False, include_images=False,
                               deduplicate=False, config=config)
    meta = trafilatura.extract_metadata(html)
    title = (getattr(meta, "title", None) or "").strip() if meta is not None else ""
    return text, title


def _label(heading: str) -> str:
    text = " ".join(heading.replace("*", "").split())
    return text if len(text) <= MAX_LABEL_CHARS else text[:MAX_LABEL_CHARS - 1] + "…"


def _sections(text: str) -> tuple[list[Section], str]:
    """Sections at heading lines (module docstring) and the first heading's text."""
    starts: list[tuple[int, str]] = []
    offset = 0
    for line in text.splitlines(keepends=True):
        match = _HEADING_LINE.match(line.rstrip("\n"))
        if match:
            starts.append((offset, _label(match.group(2))))
        offset += len(line)
    first = starts[0][1] if starts else ""
    if not starts or starts[0][0] > 0:
        starts.insert(0, (0, "beginning"))
    if len(starts) == 1:
        return [Section(label="", start=0, end=len(text))], first
    bounds = [s for s, _ in starts[1:]] + [len(text)]
    return [Section(label=label, start=start, end=end)
            for (start, label), end in zip(starts, bounds) if text[start:end].strip()], first


def html_document(data: bytes, *, source: str, max_chars: int, max_bytes: int) -> Document:
    """The bytes of an HTML page → Document(kind="html") (module docstring)."""
    if len(data) > max_bytes:
        raise InputError(f"{source} is {len(data):,} bytes, more than the HTML size limit of "
                         f"{max_bytes:,} bytes", hint="save the page's main text as a text file")
    try:  # bytes: trafilatura finds the encoding (BOM, <meta charset>, detection)
        text, title = _extract(data, max_bytes)
    except Exception as exc:  # noqa: BLE001 - boundary: lxml/trafilatura raise many types
        raise InputError(f"{source} is not a readable HTML page: {type(exc).__name__}: {exc}",
                         hint="save the page's main text as a text file") from None
    text = (text or "").strip()
    if not text:
        raise InputError(f"{source} has no main text (trafilatura found only navigation, "
                         "scripts or boilerplate)",
                         hint="save the part you want as a text file and summarize that")
    text += "\n"
    if len(text) > max_chars:
        raise InputError(f"{source} has more than the limit of {max_chars:,} characters of text",
                         hint="split the page into smaller parts")
    sections, first_heading = _sections(text)
    name = Path(source).name
    sections = [s if s.label else Section(name, s.start, s.end) for s in sections]
    return Document(text=text, kind="html", source=source, sections=tuple(sections),
                    title=title or first_heading or Path(source).stem,
                    meta={"bytes": len(data),
                          "structure": "headings" if len(sections) > 1 else "none"})


__all__ = ["html_document", "looks_like_html"]
