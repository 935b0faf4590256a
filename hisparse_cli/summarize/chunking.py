"""Splitting a `Document` into token-bounded chunks on its own boundaries (map-reduce input).

Pure Python: tokens are counted by a callable `count(text) -> int` (the model's tokenizer in
production, anything in tests). Rules:
  * the document is first cut into *units*: its sections (PDF pages, repository files), made
    contiguous so no character is lost; a plain-text document is one unit;
  * a unit over the budget is cut at paragraph breaks, then line breaks, then spaces, then
    anywhere (in that order of preference), each piece under the budget;
  * consecutive units are packed greedily into chunks of at most `budget` tokens;
  * every chunk carries a human reference of what it covers — "page 3", "pages 3–5",
    "page 4, lines 10–52", "src/app.py, src/db.py", "store.py, lines 1–80", "lines 1–120" —
    which the chunk prompt repeats so the final summary can cite pages and files.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Callable

from hisparse_cli.documents.base import Document

Counter = Callable[[str], int]
_PAGE = re.compile(r"^page (\d+)$")
_SEPARATORS = ("\n\n", "\n", " ")
MAX_FILES_IN_LABEL = 4


@dataclass(frozen=True)
class Unit:
    """A span of Document.text: a whole section, or part of one (`lines` set)."""

    ref: str  # the section label ("page 3", "src/app.py") or "" for plain text
    kind: str  # "page" | "file" | "text"
    start: int
    end: int
    page: int | None = None
    lines: tuple[int, int] | None = None  # 1-based, within the section (text: the document)


@dataclass(frozen=True)
class Chunk:
    label: str
    start: int
    end: int
    tokens: int  # counted on the chunk's own text

    def text(self, doc: Document) -> str:
        return doc.text[self.start:self.end]


def _unit_kind(doc: Document) -> str:
    """What one section is called in chunk labels: a PDF's or .docx's pages and an HTML page's
    headed parts are "page"s, a repository's or a collection's members "file"s."""
    return {"pdf": "page", "docx": "page", "html": "page", "repository": "file",
            "collection": "file"}.get(doc.kind, "text")


def document_units(doc: Document) -> list[Unit]:
    """Contiguous units covering all of doc.text (section i runs to section i+1's start)."""
    kind = _unit_kind(doc)
    sections = sorted(doc.sections, key=lambda s: s.start)
    if kind == "text" or not sections:
        return [Unit("", "text", 0, len(doc.text))] if doc.text else []
    units = []
    for i, sec in enumerate(sections):
        start = 0 if i == 0 else sec.start
        end = sections[i + 1].start if i + 1 < len(sections) else len(doc.text)
        if end > start:
            match = _PAGE.match(sec.label)
            units.append(Unit(sec.label, kind, start, end,
                              page=int(match.group(1)) if match else None))
    return units


class _Lines:
    """Line numbers of character offsets (bisect over newline positions)."""

    def __init__(self, text: str) -> None:
        self._newlines = [m.start() for m in re.finditer("\n", text)]

    def line(self, offset: int) -> int:
        return bisect.bisect_left(self._newlines, offset) + 1

    def span(self, start: int, end: int) -> tuple[int, int]:
        last = max(start, end - 1)
        return self.line(start), self.line(last)


def split_span(text: str, start: int, end: int, budget: int, count: Counter,
               level: int = 0) -> list[tuple[int, int]]:
    """Cut text[start:end] into consecutive spans of at most `budget` tokens each."""
    if end - start <= 1 or count(text[start:end]) <= budget:
        return [(start, end)]
    if level >= len(_SEPARATORS):  # no separator left: halve
        mid = (start + end) // 2
        return (split_span(text, start, mid, budget, count, level)
                + split_span(text, mid, end, budget, count, level))
    sep = _SEPARATORS[level]
    cuts = [start]
    pos = text.find(sep, start, end)
    while pos != -1:
        cut = pos + len(sep)
        if start < cut < end:
            cuts.append(cut)
        pos = text.find(sep, cut, end)
    cuts.append(end)
    pieces = [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
    if len(pieces) <= 1:
        return split_span(text, start, end, budget, count, level + 1)
    packed: list[tuple[int, int]] = []
    cur_start, cur_tokens = pieces[0][0], 0
    for a, b in pieces:
        n = count(text[a:b])
        if cur_tokens and cur_tokens + n > budget:
            packed.append((cur_start, a))
            cur_start, cur_tokens = a, 0
        cur_tokens += n
    packed.append((cur_start, end))
    out: list[tuple[int, int]] = []
    for a, b in packed:  # a piece may still be too long (one huge paragraph): go finer
        out.extend(split_span(text, a, b, budget, count, level + 1))
    return out


def _split_unit(doc: Document, unit: Unit, budget: int, count: Counter,
                lines: _Lines) -> list[Unit]:
    spans = split_span(doc.text, unit.start, unit.end, budget, count)
    if len(spans) == 1:
        return [unit]
    base = 0 if unit.kind == "text" else lines.line(unit.start) - 1
    parts = []
    for a, b in spans:
        first, last = lines.span(a, b)
        parts.append(Unit(unit.ref, unit.kind, a, b, page=unit.page,
                          lines=(first - base, last - base)))
    return parts


def _lines(a: int, b: int) -> str:
    return f"line {a}" if a == b else f"lines {a}–{b}"


def chunk_label(units: list[Unit]) -> str:
    """Human reference for consecutive units (see module docstring for the forms)."""
    first, last = units[0], units[-1]
    if first.kind == "text":
        lo = first.lines[0] if first.lines else 1
        hi = last.lines[1] if last.lines else None
        return _lines(lo, hi) if hi is not None else "the whole text"
    refs = list(dict.fromkeys(u.ref for u in units))
    if len(refs) == 1:
        partial = [u.lines for u in units if u.lines]
        if not partial:
            return refs[0]
        return f"{refs[0]}, {_lines(partial[0][0], partial[-1][1])}"
    if first.kind == "page" and first.page is not None and last.page is not None:
        return f"pages {first.page}–{last.page}"
    if len(refs) > MAX_FILES_IN_LABEL:
        shown = ", ".join(refs[:MAX_FILES_IN_LABEL])
        return f"{shown} and {len(refs) - MAX_FILES_IN_LABEL} more files"
    return ", ".join(refs)


def _pack(doc: Document, units: list[Unit], budget: int, count: Counter) -> list[list[Unit]]:
    groups: list[list[Unit]] = []
    current: list[Unit] = []
    used = 0
    for unit in units:
        n = count(doc.text[unit.start:unit.end])
        if current and used + n > budget:
            groups.append(current)
            current, used = [], 0
        current.append(unit)
        used += n
    if current:
        groups.append(current)
    return groups


def split_document(doc: Document, budget: int, count: Counter) -> list[Chunk]:
    """Chunks of at most `budget` tokens (counted on each chunk's text), in document order."""
    if budget < 1:
        raise ValueError(f"chunk budget must be >= 1 token, got {budget}")
    lines = _Lines(doc.text)
    units: list[Unit] = []
    for unit in document_units(doc):
        if unit.kind == "text" and unit.lines is None:
            unit = Unit("", "text", unit.start, unit.end, lines=lines.span(unit.start, unit.end))
        units.extend(_split_unit(doc, unit, budget, count, lines))
    chunks: list[Chunk] = []
    pending = _pack(doc, units, budget, count)
    while pending:
        group = pending.pop(0)
        start, end = group[0].start, group[-1].end
        n = count(doc.text[start:end])
        if n > budget and len(group) > 1:  # token counts are not exactly additive: halve
            half = len(group) // 2
            pending[:0] = [group[:half], group[half:]]
            continue
        chunks.append(Chunk(chunk_label(group), start, end, n))
    return chunks


_PAGE_SPAN = re.compile(r"^pages? (\d+)(?:–(\d+))?")
_LINE_SPAN = re.compile(r"^lines? (\d+)(?:–(\d+))?")


def _spans(labels: list[str], pattern: re.Pattern) -> list[tuple[str, str]] | None:
    found = [pattern.match(lab) for lab in labels]
    if not all(found):
        return None
    return [(m.group(1), m.group(2) or m.group(1)) for m in found]  # type: ignore[union-attr]


def merge_labels(labels: list[str]) -> str:
    """Reference for a group of chunk summaries ("pages 1–3" + "pages 4–6" → "pages 1–6")."""
    if len(labels) == 1:
        return labels[0]
    for noun, pattern in (("pages", _PAGE_SPAN), ("lines", _LINE_SPAN)):
        spans = _spans(labels, pattern)
        if spans:
            first, last = spans[0][0], spans[-1][1]
            if first == last:
                return labels[0].split(",")[0]
            return f"{noun} {first}–{last}"
    if len(labels) > 2:
        return f"{labels[0]} … {labels[-1]}"
    return "; ".join(labels)


__all__ = ["Chunk", "Unit", "document_units", "split_document", "split_span", "chunk_label",
           "merge_labels"]
