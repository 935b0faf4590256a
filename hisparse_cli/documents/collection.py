"""A folder of documents (not code) → one `Document(kind="collection")`, a section per member.

`is_collection(rels)` decides on the files a view lists (folder.py): no build or project
file anywhere (pyproject.toml, package.json, Makefile, … — see repo.CONFIG_FILES and
`requirements*.txt`), and at least two thirds of the counted files are documents
(DOCUMENT_SUFFIXES: .txt .md .rst .pdf .docx .html …). Counted: every listed file except
dotfiles (.gitignore, …), lock files and binaries that are not documents (images, archives),
which neither make a folder code nor prose; a symlink counts as what it points to.

Members (hidden files aside) are read by their own readers (formats.py: PDF, .docx, HTML, text — each within its
size limit, opened with `open_checked`), in natural order of their relative paths
("ch2.md" before "ch10.md"). A member that cannot be read (encrypted, scanned, corrupt,
binary, empty) or whose text holds a secret (secret_files.py, unless `include_secrets`) is
reported in `skipped` with the reason; so are a member's own skipped pages, as
"member: page 3". Each member appears under a header `===== path =====` (PDF page markers
and .docx/.html structure kept in its text) and is one `Section` (label = its relative
path, bytes = its size). `meta["members"]` keeps each member's kind, title, span and its own
sections (pages, headings) with offsets into the collection's text.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

from hisparse_cli.documents.base import Document, Section
from hisparse_cli.documents.formats import (byte_limit, document_format, document_from_bytes,
                                            read_limited, too_large)
from hisparse_cli.documents.repo import (BINARY_SUFFIXES, CONFIG_FILES, LOCK_FILES, header_name,
                                         nothing_readable)
from hisparse_cli.documents.secret_files import secret_content
from hisparse_cli.documents.walk import Candidate, open_checked
from hisparse_cli.errors import InputError

DOCUMENT_SUFFIXES = frozenset({".txt", ".text", ".md", ".markdown", ".rst", ".org", ".adoc",
                               ".tex", ".pdf", ".docx", ".html", ".htm", ".xhtml"})
_DIGITS = re.compile(r"(\d+)")


def _is_build_file(name: str) -> bool:
    return name in CONFIG_FILES or (name.startswith("requirements") and name.endswith(".txt"))


def _is_lock(name: str) -> bool:
    return name in LOCK_FILES or name.endswith(".lock")


def is_collection(rels: list[str]) -> bool:
    """True when the listed files `rels` (a link: its target's path) are a document
    collection (module docstring)."""
    counted = 0
    documents = 0
    for rel in rels:
        path = PurePosixPath(rel)
        name, suffix = path.name, path.suffix.lower()
        if _is_build_file(name):
            return False
        if name.startswith(".") or _is_lock(name):
            continue
        if suffix in DOCUMENT_SUFFIXES:
            documents += 1
        elif suffix in BINARY_SUFFIXES:
            continue
        counted += 1
    return documents > 0 and 3 * documents >= 2 * counted


def natural_key(rel: str) -> tuple:
    """"ch2.md" before "ch10.md": digit runs compare as numbers, the rest case-insensitively."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part.casefold())
                 for part in _DIGITS.split(rel)) + ((2, 0, rel),)


def collection_files(candidates: list[Candidate], skipped: list[tuple[str, str]], limits
                     ) -> list[tuple[str, Path]]:
    """The members to read, in natural order; hidden files (a dot in front of the name or of
    a folder on the way: .gitignore, .obsidian/…), lock files, non-document binaries (a link
    is judged by its target's name too), empty files and files over their format's size
    limit go to `skipped`."""
    files = []
    for rel, file_path, target_rel in sorted(candidates, key=lambda c: natural_key(c[0])):
        reason = None
        if any(part.startswith(".") for part in rel.split("/")):
            reason = "hidden file (not a document)"
        for name in {PurePosixPath(r).name for r in (rel, target_rel) if r}:
            suffix = PurePosixPath(name).suffix.lower()
            if reason is not None:
                break
            if _is_lock(name):
                reason = "lock file"
            elif suffix in BINARY_SUFFIXES and suffix not in DOCUMENT_SUFFIXES:
                reason = "binary file"
        if reason is None:
            reason = _size_problem(rel, file_path, limits)
        if reason is None:
            files.append((rel, file_path))
        else:
            skipped.append((rel, reason))
    return files


def _size_problem(rel: str, path: Path, limits) -> str | None:
    try:
        size = path.stat().st_size
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    if size == 0:
        return "empty file"
    fmt = document_format(rel)
    limit = byte_limit(fmt, limits)
    return too_large(rel, size, fmt, limit).message if size > limit else None


def _read_member(rel: str, path: Path, limits, password: str | None) -> Document:
    with open_checked(path) as handle:
        head = handle.read(1024)
        handle.seek(0)
        fmt = document_format(rel, head)
        data = read_limited(handle, rel, fmt, limits)
    return document_from_bytes(data, fmt, source=rel, limits=limits, password=password)


def load_collection(path: Path, files: list[tuple[str, Path]], skipped: list[tuple[str, str]],
                    *, limits, password: str | None = None,
                    include_secrets: bool = False) -> Document:
    """Read the members `files` (from `collection_files`) as one document (module
    docstring); `skipped` holds what the listing left out already."""
    skipped = list(skipped)
    parts: list[str] = []
    sections: list[Section] = []
    members: list[dict] = []
    offset = 0
    cap_reason = ""
    for rel, file_path in files:
        if cap_reason:
            skipped.append((rel, cap_reason))
            continue
        try:
            member = _read_member(rel, file_path, limits, password)
        except InputError as exc:
            skipped.append((rel, exc.message))
            continue
        except OSError as exc:
            skipped.append((rel, f"unreadable: {exc.strerror or exc}"))
            continue
        secret = None if include_secrets else secret_content(member.text)
        if secret is not None:
            skipped.append((rel, secret))
            continue
        name = header_name(rel)
        head = f"===== {name} =====\n"
        block = f"{head}{member.text.rstrip()}\n\n"
        if offset + len(block) > limits.max_total_chars:
            cap_reason = f"total size cap of {limits.max_total_chars:,} characters reached"
        elif len(sections) >= limits.max_files:
            cap_reason = f"file-count cap of {limits.max_files:,} files reached"
        if cap_reason:
            skipped.append((rel, cap_reason))
            continue
        size = member.meta.get("bytes")
        sections.append(Section(label=name, start=offset, end=offset + len(block) - 1,
                                bytes=size))
        base = offset + len(head)
        members.append({"path": name, "kind": member.kind, "title": member.title,
                        "start": offset, "end": offset + len(block) - 1,
                        "sections": [{"label": s.label, "start": base + s.start,
                                      "end": base + min(s.end, len(member.text.rstrip()))}
                                     for s in member.sections]})
        skipped.extend((f"{name}: {item}", why) for item, why in member.skipped)
        parts.append(block)
        offset += len(block)
    if not sections:
        raise nothing_readable(path, skipped)
    return Document(text="".join(parts).rstrip("\n") + "\n", kind="collection",
                    source=str(path), sections=tuple(sections), skipped=tuple(skipped),
                    title=path.resolve().name, genre="collection",
                    meta={"documents": len(sections), "skipped": len(skipped),
                          "members": members})


__all__ = ["is_collection", "collection_files", "load_collection", "natural_key",
           "DOCUMENT_SUFFIXES"]
