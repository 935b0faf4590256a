"""Batch summarization: inputs → one JSON line per document, resumable after a crash.

Inputs (`expand_inputs`):
  * a file                  one document;
  * a folder                its document files (DOCUMENT_SUFFIXES, not hidden, not `*.ref.*`);
                            only the folder itself unless `recursive`. To summarize a folder
                            *as a code repository*, name it in a list file instead;
  * `@list.txt`             one path per line (blank lines and comments skipped: `#` at the
                            start of a line, or after a space or tab, starts one, so `a#1.txt`
                            is a name and `a.txt  # note` is `a.txt`; relative paths are
                            relative to the current directory; the bytes of a name are kept
                            as they are, as os.fsdecode does); a folder named there is one
                            document (a repository or a document collection);
  * `-`                     the document piped in on stdin (one document, input "-");
  * `@-`                    the list read from stdin (stdin is read once: not both).
References (`find_reference`): `<stem>.ref.txt`, `<stem>.txt`, `<stem>.md` in the references
folder, then `<stem>.ref.txt` beside the input (a repository folder `x/` → `x.ref.txt`).

Results file (`ResultsFile`): one writer at a time — `open` takes an exclusive OS lock on the
file for the whole run (results_lock.py: a second run is refused with exit 3; a killed run's
lock goes with it). Each finished document is appended as one line, written with a
single write + fsync (a write that fails half-way is cut back); the file is never rewritten.
Strings are written as `printable` text: a file-name byte that is not UTF-8 (os.fsdecode's
surrogate escape) is written as `\\xNN`, the same way every time, so a record still matches
its document on --resume. `scan` (for --resume) reads every line and changes nothing it
cannot prove is a torn write:
  * blank lines are skipped;
  * only the LAST line may be cut, and only when it is not JSON (or has no final newline)
    and looks like the start of a record (`{"input": …`) or is NUL bytes (a crash): that is
    a line a kill cut short. A complete record without its final newline gets the newline;
  * any other line that is not a record (`{"input": str, "status": "ok" | "error", …}`) —
    in the middle, or a file that is not a results file at all (a user's notes) — is an
    InputError naming the line, and the file is left as it is.
A document is identified by its resolved path plus the sha256 of its content (for a folder:
of every file the folder loader would read, by relative path and bytes; for stdin: of its
bytes), so an edited document is summarized again.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from hisparse_cli.errors import ConfigError, InputError
from hisparse_cli.summarize.results_lock import FileLock

DOCUMENT_SUFFIXES = frozenset({".pdf", ".docx", ".txt", ".md", ".markdown", ".rst", ".text",
                               ".tex", ".org", ".adoc", ".html", ".htm", ".xhtml"})
REFERENCE_NAMES = ("{stem}.ref.txt", "{stem}.txt", "{stem}.md")
RECORD_START = b'{"input": '  # how every record line starts (run_batch puts "input" first)
_LIST_COMMENT = re.compile(r"(^|\s)#.*$")


class StdinInput:
    """The document piped in on stdin (batch input `-`): its bytes, read once."""

    given = "-"

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __str__(self) -> str:
        return "-"

    def resolve(self) -> "StdinInput":
        return self


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


def _read_list(spec: str, stdin=None) -> list[str]:
    if spec == "@-":
        data = (stdin if stdin is not None else sys.stdin.buffer).read()
    else:
        list_path = Path(spec[1:]).expanduser()
        try:
            data = list_path.read_bytes()
        except OSError as exc:
            raise InputError(f"cannot read input list {list_path}: {exc.strerror or exc}",
                             hint="give @FILE with one document path per line") from None
    lines = os.fsdecode(data.removeprefix(codecs.BOM_UTF8)).splitlines()  # names as the OS has them
    names = (_LIST_COMMENT.sub("", line).strip() for line in lines)
    return [name for name in names if name]


def expand_inputs(args: list[str], *, recursive: bool = False, stdin=None
                  ) -> list[tuple[str, Path | StdinInput]]:
    """(as given, path) for every document, in order, each resolved path once. Missing paths
    are kept (they become failed records). `-` reads the document on stdin, `@-` the list
    (`stdin`: the binary stream, default sys.stdin.buffer; read at most once)."""
    from hisparse_cli.documents import IngestLimits
    from hisparse_cli.documents.stdin import read_stdin

    readers = [a for a in args if a in ("-", "@-")]
    if len(readers) > 1:
        raise ConfigError(f"stdin can be read once, but the inputs name it {len(readers)} times "
                          f"({' and '.join(readers)})",
                          hint="give either - (the document on stdin) or @- (a list on stdin)")
    out: list[tuple[str, Path | StdinInput]] = []
    for arg in args:
        if arg == "-":
            out.append(("-", StdinInput(read_stdin(IngestLimits(), stdin))))
            continue
        if arg.startswith("@"):
            out += [(line, Path(line).expanduser()) for line in _read_list(arg, stdin)]
            continue
        path = Path(arg).expanduser()
        if path.is_dir():
            out += [(str(p), p) for p in _folder_files(path, recursive)]
        else:
            out.append((arg, path))
    seen: set = set()
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


def content_sha256(path: Path, *, include_secrets: bool = False) -> str:
    """sha256 of a file's bytes; for a folder, of what the folder loader would read
    (`list_folder` with the default limits: ignored, vendored and oversized files, secrets
    (unless `include_secrets`) and .git are not even opened), as (relative path, sha256 of
    the bytes) pairs in os.walk order (a folder's files, then its subfolders, each sorted).
    Files are hashed in 1 MiB blocks."""
    if not path.is_dir():
        with open(path, "rb") as handle:
            return _sha256_of(handle, limit=None).hexdigest()
    from hisparse_cli.documents import IngestLimits
    from hisparse_cli.documents.folder import list_folder
    from hisparse_cli.documents.walk import open_checked

    limits = IngestLimits()
    listing = list_folder(path.resolve(), limits, include_secrets=include_secrets)
    digest = hashlib.sha256()
    for rel, file_path in sorted(listing.files, key=lambda item: _walk_order(item[0])):
        digest.update(os.fsencode(rel) + b"\0")
        try:
            with open_checked(file_path) as handle:
                digest.update(_sha256_of(handle, limit=listing.byte_limit(rel, limits) + 1
                                         ).digest())
        except OSError as exc:  # the loader skips it too; its state is part of the content
            digest.update(f"unreadable: {exc.strerror or exc}".encode())
    return digest.hexdigest()


def _walk_order(rel: str) -> list[tuple[int, str]]:
    """Sort key of os.walk's top-down order: a folder's own files before its subfolders."""
    *folders, name = rel.split("/")
    return [(1, folder) for folder in folders] + [(0, name)]


def _sha256_of(handle, limit: int | None):
    digest = hashlib.sha256()
    left = limit
    while left is None or left > 0:
        block = handle.read(1 << 20 if left is None else min(1 << 20, left))
        if not block:
            break
        digest.update(block)
        if left is not None:
            left -= len(block)
    return digest


def printable(text: str) -> str:
    """`text` that can be written as UTF-8: a lone surrogate (os.fsdecode's escape of a
    file-name byte that is not UTF-8) becomes `\\xNN` (any other one `\\uDXXX`)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return "".join(ch if not "\ud800" <= ch <= "\udfff"
                       else f"\\x{ord(ch) - 0xDC00:02x}" if "\udc80" <= ch <= "\udcff"
                       else f"\\u{ord(ch):04x}" for ch in text)


def printable_record(value):
    """`value` (JSON-ready: dicts, lists, strings, numbers) with every string `printable`."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable(str(k)): printable_record(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [printable_record(v) for v in value]
    return value


def record_key(record: dict) -> tuple[str, str]:
    return record.get("input", ""), record.get("sha256") or ""


def is_record(value) -> bool:
    """A results-file record: a JSON object with a string `input` and an ok/error `status`."""
    return (isinstance(value, dict) and isinstance(value.get("input"), str)
            and value.get("status") in ("ok", "error"))


def _parse(line: bytes):
    """(record, None) for a record line, (None, why) otherwise; why is "torn" for a line a kill
    could have cut short (not JSON, starting like a record or NUL bytes)."""
    try:
        value = json.loads(line)
    except ValueError:
        stripped = line.strip().strip(b"\0")
        torn = RECORD_START.startswith(stripped[:len(RECORD_START)])
        return None, "torn" if torn else "not JSON"
    if is_record(value):
        return value, None
    return None, "not a JSON object with `input` and `status`"


class ResultsFile:
    """Append-only JSONL results (module docstring). `records` holds what is in the file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path).expanduser()
        self.records: list[dict] = []
        self.torn_bytes = 0  # bytes of a torn last line (`open` cuts them)
        self.unterminated = False  # the last record lacks its newline (`open` adds it)
        self._lock = FileLock(self.path)  # held from `open` to `close` (results_lock.py)

    def _refuse(self, number: int, why: str, torn: bool = False) -> InputError:
        if not self.records and not torn:  # no record before it: not a results file at all
            return InputError(f"{self.path} is not a hisparse results file (line {number}: "
                              f"{why}); it was left unchanged",
                              hint="--resume continues a file written by `hisparse batch`; "
                                   "choose another --out")
        return InputError(f"results file {self.path}: line {number} is not a result record "
                          f"({why}); the file was left unchanged",
                          hint=f"fix or delete line {number} by hand (the other lines are "
                               "finished documents), then rerun with --resume")

    def scan(self) -> int:
        """Read the records; return the byte length of the part to keep (module docstring:
        only a torn last line is left out). InputError for any other line that is not a
        record; the file is never changed here."""
        self.records, self.torn_bytes, self.unterminated = [], 0, False
        try:
            data = self.path.read_bytes() if self.path.exists() else b""
        except OSError as exc:
            raise InputError(f"cannot read results file {self.path}: {exc.strerror or exc}",
                             hint="check its permissions, or choose another --out") from None
        *complete, tail = data.split(b"\n")
        offset, cut, cut_line = 0, None, 0
        for number, line in enumerate(complete + [tail], 1):
            terminated = number <= len(complete)
            size = len(line) + terminated
            if not line.strip():  # blank: skipped (unterminated whitespace at the end: cut)
                if not terminated and cut is None:
                    cut = offset
            elif cut is not None:  # a torn-looking line with more lines after it
                raise self._refuse(cut_line, "not a complete JSON line", torn=True)
            else:
                record, why = _parse(line)
                if record is not None:
                    self.records.append(record)
                    self.unterminated = not terminated
                elif why == "torn":
                    cut, cut_line = offset, number
                else:
                    raise self._refuse(number, why)
            offset += size
        good = len(data) if cut is None else cut
        self.torn_bytes = len(data) - good
        return good

    def open(self, *, resume: bool) -> None:
        """Prepare for appending: take the file's lock (another run writing it: InputError),
        refuse to mix runs without --resume; with it, read the records, cut a torn last line
        and end an unterminated last record (`scan`). The lock is held until `close` (or
        the process ends)."""
        if self.path.is_dir():
            raise ConfigError(f"--out {self.path} is a folder", hint="give a .jsonl file path")
        if not self.path.parent.is_dir():
            raise InputError(f"cannot write {self.path}: folder {self.path.parent} does not "
                             "exist", hint="create it or choose another --out path")
        if not os.access(self.path if self.path.exists() else self.path.parent, os.W_OK):
            raise InputError(f"cannot write {self.path}: permission denied",
                             hint="choose another --out path")
        self._lock.acquire()  # before anything is read: a concurrent writer is refused first
        try:
            self._prepare(resume)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the lock (a results file this run created and left empty is removed)."""
        self._lock.release()

    def __del__(self) -> None:  # like a file object: a forgotten close() ends with the object
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.release()

    def _prepare(self, resume: bool) -> None:
        if not resume and self.path.stat().st_size > 0:
            raise ConfigError(f"results file {self.path} already exists",
                              hint="add --resume to continue it, or choose another --out")
        good = self.scan()
        if not (self.torn_bytes or self.unterminated):
            return
        try:
            with open(self.path, "r+b") as handle:
                handle.truncate(good)
                if self.unterminated:
                    handle.seek(0, os.SEEK_END)
                    handle.write(b"\n")
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            raise InputError(f"cannot write {self.path}: {exc.strerror or exc}",
                             hint="check its permissions and the free disk space") from None

    def append(self, record: dict) -> dict:
        """Write `record` (as printable text) as one line; all of it or, on an error or
        Ctrl-C half-way, none of it (InputError when the file cannot be written). Returns
        the record as written."""
        record = printable_record(record)
        data = (json.dumps(record, ensure_ascii=False, default=lambda o: printable(str(o)))
                + "\n").encode("utf-8")
        locked = self._lock.fd
        try:
            fd = locked if locked is not None else os.open(
                self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise self._write_error(exc) from None
        try:
            start = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except BaseException as exc:
                try:
                    os.ftruncate(fd, start)  # never leave a partial line behind
                except OSError:
                    pass  # --resume cuts a torn last line
                if isinstance(exc, OSError):
                    raise self._write_error(exc) from None
                raise
        finally:
            if fd != locked:
                os.close(fd)
        self.records.append(record)
        return record

    def _write_error(self, exc: OSError) -> InputError:
        return InputError(f"cannot write results file {self.path}: {exc.strerror or exc}",
                          hint="check its permissions and the free disk space; finished "
                               "documents stay in it, rerun with --resume")

    def latest(self) -> dict[tuple[str, str], dict]:
        """The last record of every (input, sha256)."""
        return {record_key(r): r for r in self.records}


__all__ = ["BatchItem", "StdinInput", "ResultsFile", "expand_inputs", "find_reference", "content_sha256",
           "record_key", "is_record", "printable", "printable_record", "DOCUMENT_SUFFIXES"]
