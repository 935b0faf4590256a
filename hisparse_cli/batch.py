"""Batch summarization: inputs → one JSON line per document, resumable after a crash.

Inputs (`expand_inputs`):
  * a file                  one document;
  * a folder                its document files (DOCUMENT_SUFFIXES, not hidden, not `*.ref.*`);
                            only the folder itself unless `recursive`. To summarize a folder
                            *as a code repository*, name it in a list file instead;
  * `@list.txt`             one path per line (blank lines and `#` comments skipped; relative
                            paths are relative to the current directory); a folder named
                            there is one document (a repository).
References (`find_reference`): `<stem>.ref.txt`, `<stem>.txt`, `<stem>.md` in the references
folder, then `<stem>.ref.txt` beside the input (a repository folder `x/` → `x.ref.txt`).

Results file (`ResultsFile`): each finished document is appended as one line, written with a
single write + flush + fsync; the file is never rewritten. A line cut short by a kill has no
final newline or is not JSON: `--resume` truncates it away (everything before it is intact).
A document is identified by its resolved path plus the sha256 of its content (for a folder:
of every file's relative path and bytes), so an edited document is summarized again.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from hisparse_cli.errors import ConfigError, InputError

DOCUMENT_SUFFIXES = frozenset({".pdf", ".txt", ".md", ".markdown", ".rst", ".text", ".tex",
                               ".org", ".adoc", ".html", ".htm"})
REFERENCE_NAMES = ("{stem}.ref.txt", "{stem}.txt", "{stem}.md")


@dataclass(frozen=True)
class BatchItem:
    path: Path  # resolved
    given: str  # as the user wrote it (for messages)
    reference: Path | None = None


def _is_document_file(path: Path) -> bool:
    name = path.name
    return (path.is_file() and not name.startswith(".") and ".ref." not in name
            and path.suffix.lower() in DOCUMENT_SUFFIXES)


def _folder_files(folder: Path, recursive: bool) -> list[Path]:
    if not recursive:
        return sorted((p for p in folder.iterdir() if _is_document_file(p)), key=lambda p: p.name)
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [Path(root) / f for f in sorted(files) if _is_document_file(Path(root) / f)]
    return found


def _read_list(spec: str) -> list[str]:
    list_path = Path(spec[1:]).expanduser()
    try:
        lines = list_path.read_text(encoding="utf-8-sig").splitlines()
    except OSError as exc:
        raise InputError(f"cannot read input list {list_path}: {exc.strerror or exc}",
                         hint="give @FILE with one document path per line") from None
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def expand_inputs(args: list[str], *, recursive: bool = False) -> list[tuple[str, Path]]:
    """(as given, path) for every document, in order, each resolved path once. Missing paths
    are kept (they become failed records)."""
    out: list[tuple[str, Path]] = []
    for arg in args:
        if arg.startswith("@"):
            out += [(line, Path(line).expanduser()) for line in _read_list(arg)]
            continue
        path = Path(arg).expanduser()
        if path.is_dir():
            out += [(str(p), p) for p in _folder_files(path, recursive)]
        else:
            out.append((arg, path))
    seen: set[Path] = set()
    unique = []
    for given, path in out:
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            unique.append((given, key))
    return unique


def find_reference(path: Path, references: Path | None = None) -> Path | None:
    """The reference summary of `path`, or None (rules in the module docstring)."""
    stem = path.name if path.is_dir() else path.stem
    candidates = [references / n.format(stem=stem) for n in REFERENCE_NAMES] if references else []
    candidates.append(path.parent / f"{stem}.ref.txt")
    for candidate in candidates:
        if candidate.is_file() and candidate.resolve() != path.resolve():
            return candidate
    return None


def content_sha256(path: Path) -> str:
    """sha256 of a file's bytes, or of a folder's (relative path, bytes) pairs (no .git,
    symlinks not followed)."""
    digest = hashlib.sha256()
    if path.is_dir():
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d != ".git")
            for name in sorted(files):
                file = Path(root) / name
                if file.is_symlink() or not file.is_file():
                    continue
                digest.update(file.relative_to(path).as_posix().encode() + b"\0")
                digest.update(hashlib.sha256(file.read_bytes()).digest())
        return digest.hexdigest()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def record_key(record: dict) -> tuple[str, str]:
    return record.get("input", ""), record.get("sha256") or ""


class ResultsFile:
    """Append-only JSONL results (module docstring). `records` holds what is in the file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path).expanduser()
        self.records: list[dict] = []
        self.torn_bytes = 0

    def scan(self) -> int:
        """Read complete records; return the byte length of the intact prefix."""
        self.records, good = [], 0
        data = self.path.read_bytes() if self.path.exists() else b""
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break
            try:
                record = json.loads(line)
            except ValueError:
                break
            if not isinstance(record, dict):
                break
            self.records.append(record)
            good += len(line)
        self.torn_bytes = len(data) - good
        return good

    def open(self, *, resume: bool) -> None:
        """Prepare for appending: refuse to mix runs without --resume; cut a torn tail."""
        if self.path.is_dir():
            raise ConfigError(f"--out {self.path} is a folder", hint="give a .jsonl file path")
        if not self.path.parent.is_dir():
            raise InputError(f"cannot write {self.path}: folder {self.path.parent} does not "
                             "exist", hint="create it or choose another --out path")
        good = self.scan()
        if not resume and self.path.exists() and self.path.stat().st_size > 0:
            raise ConfigError(f"results file {self.path} already exists",
                              hint="add --resume to continue it, or choose another --out")
        if self.torn_bytes:
            with open(self.path, "r+b") as handle:
                handle.truncate(good)
                handle.flush()
                os.fsync(handle.fileno())

    def append(self, record: dict) -> None:
        data = (json.dumps(record, ensure_ascii=False, default=str) + "\n").encode("utf-8")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        self.records.append(record)

    def latest(self) -> dict[tuple[str, str], dict]:
        """The last record of every (input, sha256)."""
        return {record_key(r): r for r in self.records}


__all__ = ["BatchItem", "ResultsFile", "expand_inputs", "find_reference", "content_sha256",
           "record_key", "DOCUMENT_SUFFIXES"]
