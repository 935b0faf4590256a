"""A source folder → one `Document(kind="repository")` (folder.py decides repository or
collection, and lists the files through a view: git's, or the walk — walk.py).

What is read: every regular text file of the view (git's files inside a git work tree, else
the walk's; version-control metadata, vendored/build/cache folders, secrets by name and
symlinks that lead out of the root or to an excluded file are left out there) that survives
  1. lock files, binaries (by extension or content), files over `max_file_bytes`, minified or
     machine-generated files (very long lines), empty files, files whose text holds a
     secret (a private key, a token: secret_files.py; `include_secrets` reads them),
  2. the file-count and total-character caps.
Everything left out is reported in `Document.skipped` as (path, reason) — directories once,
with a trailing "/".

Order (deterministic): the root README first, then build/config files, then docs, then
sources, then everything else; alphabetical (case-insensitive) within each group. Each file
appears under a header line `===== path/to/file =====` and is one `Section` (with its size
in bytes).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from hisparse_cli.documents.base import Document, Section
from hisparse_cli.documents.secret_files import secret_content
from hisparse_cli.documents.text import SNIFF_BYTES, decode_bytes, looks_binary
from hisparse_cli.documents.walk import SKIP_DIRS, Candidate, open_checked
from hisparse_cli.errors import InputError

LOCK_FILES = frozenset({
    "package-lock.json", "npm-shrinkwrap.json", "yarn.lock", "pnpm-lock.yaml", "bun.lockb",
    "poetry.lock", "Pipfile.lock", "uv.lock", "pdm.lock", "Cargo.lock", "composer.lock",
    "Gemfile.lock", "go.sum", "flake.lock", "mix.lock", "Podfile.lock", "packages.lock.json",
})
BINARY_SUFFIXES = frozenset(
    ".png .jpg .jpeg .gif .bmp .ico .webp .tif .tiff .psd .pdf .zip .gz .tgz .bz2 .xz .zst .7z "
    ".rar .tar .jar .war .whl .egg .so .dylib .dll .exe .o .a .lib .obj .class .pyc .pyo .pyd "
    ".wasm .bin .dat .db .sqlite .sqlite3 .woff .woff2 .ttf .otf .eot .mp3 .mp4 .wav .ogg .flac "
    ".avi .mov .mkv .webm .npy .npz .pt .pth .ckpt .safetensors .gguf .onnx .pkl .parquet "
    ".DS_Store".split())
CONFIG_FILES = frozenset({
    "pyproject.toml", "setup.py", "setup.cfg", "requirements.txt", "tox.ini", "noxfile.py",
    "environment.yml", "package.json", "tsconfig.json", "Cargo.toml", "go.mod", "Makefile",
    "CMakeLists.txt", "meson.build", "pom.xml", "build.gradle", "build.gradle.kts",
    "settings.gradle", "Gemfile", "composer.json", "Dockerfile", "docker-compose.yml",
    "BUILD", "BUILD.bazel", "WORKSPACE", "justfile", "Justfile",
})
DOC_SUFFIXES = frozenset({".md", ".markdown", ".rst", ".txt", ".adoc", ".org"})
SOURCE_SUFFIXES = frozenset(
    ".py .pyi .pyx .c .h .cc .cpp .cxx .hpp .hh .cu .cuh .m .mm .rs .go .java .kt .kts .scala "
    ".swift .js .jsx .mjs .cjs .ts .tsx .vue .svelte .rb .php .pl .pm .lua .r .jl .hs .ml .mli "
    ".ex .exs .erl .clj .cs .fs .dart .zig .nim .sh .bash .zsh .ps1 .sql .proto .graphql .cmake "
    ".f90 .triton".split())
# Suffixes that name a text file: a single file named so is read as text even when its
# content starts with "%PDF" (load_document sniffs only other names).
TEXT_SUFFIXES = DOC_SUFFIXES | SOURCE_SUFFIXES | frozenset(
    ".text .tex .html .htm .xml .json .yaml .yml .toml .ini .cfg .conf .csv .tsv .log".split())
GROUP_README, GROUP_CONFIG, GROUP_DOCS, GROUP_SOURCE, GROUP_OTHER = range(5)
MINIFIED_MIN_CHARS = 2000
MINIFIED_MEAN_LINE = 300


def _group(rel: str) -> int:
    path = PurePosixPath(rel)
    name, suffix = path.name, path.suffix.lower()
    if len(path.parts) == 1 and name.upper().startswith("README"):
        return GROUP_README
    if name in CONFIG_FILES or (name.startswith("requirements") and suffix == ".txt"):
        return GROUP_CONFIG
    if suffix in DOC_SUFFIXES or path.parts[0] in ("docs", "doc") or name.upper().startswith(
            "README"):
        return GROUP_DOCS
    if suffix in SOURCE_SUFFIXES:
        return GROUP_SOURCE
    return GROUP_OTHER


def sort_key(rel: str) -> tuple[int, str, str]:
    """Deterministic reading order: group, then case-insensitive path, then exact path."""
    return (_group(rel), rel.casefold(), rel)


def _too_large(size: int, max_file_bytes: int) -> str:
    return f"larger than the per-file limit of {max_file_bytes:,} bytes ({size:,} bytes)"


def _file_problem(rel: str, path: Path, max_file_bytes: int) -> str | None:
    name = PurePosixPath(rel).name
    if name in LOCK_FILES or name.endswith(".lock"):
        return "lock file"
    if PurePosixPath(name).suffix.lower() in BINARY_SUFFIXES or name in BINARY_SUFFIXES:
        return "binary file"
    if name.endswith((".min.js", ".min.css", ".min.mjs")) or name.endswith(".map"):
        return "minified or source-map file"
    try:
        size = path.stat().st_size
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    if size > max_file_bytes:
        return _too_large(size, max_file_bytes)
    if size == 0:
        return "empty file"
    return None


def _read_text(path: Path, max_file_bytes: int,
               include_secrets: bool = False) -> tuple[str | None, str, int]:
    """(text, "", bytes read) or (None, reason, 0). Reads at most `max_file_bytes` (+1 to
    notice growth)."""
    try:
        with open_checked(path) as handle:
            data = handle.read(max_file_bytes + 1)
    except OSError as exc:
        return None, f"unreadable: {exc.strerror or exc}", 0
    if len(data) > max_file_bytes:
        return None, _too_large(len(data), max_file_bytes), 0
    if looks_binary(data[:SNIFF_BYTES]):
        return None, "binary file", 0
    try:
        text = decode_bytes(data)[0]
    except InputError:
        return None, "undecodable text", 0
    if not text.strip():
        return None, "empty file", 0
    lines = text.count("\n") + 1
    if len(text) >= MINIFIED_MIN_CHARS and len(text) / lines > MINIFIED_MEAN_LINE:
        return None, "minified or machine-generated (very long lines)", 0
    secret = None if include_secrets else secret_content(text)
    if secret is not None:
        return None, secret, 0
    return text, "", len(data)


def repository_files(candidates: list[Candidate], skipped: list[tuple[str, str]], *,
                     max_file_bytes: int) -> list[tuple[str, Path]]:
    """What `load_repository` will try to read of a view's `candidates`, in reading order:
    (relative path, path to open) pairs that pass the per-file checks that need no content
    (a link's target is checked first, then its own name); the rest goes to `skipped`."""
    files = []
    for rel, file_path, target_rel in sorted(candidates, key=lambda item: sort_key(item[0])):
        reason = None
        if target_rel is not None and target_rel != rel:
            reason = _file_problem(target_rel, file_path, max_file_bytes)
            if reason is not None:
                reason = f"symlink to {target_rel}, which is not read: {reason}"
        reason = reason or _file_problem(rel, file_path, max_file_bytes)
        if reason is None:
            files.append((rel, file_path))
        else:
            skipped.append((rel, reason))
    return files


def header_name(rel: str) -> str:
    """`rel` for a `===== path =====` header: every character that is not printable (a newline
    or other control character in a file name, which could fake a header line of its own; a
    file-name byte that is not UTF-8) written as an escape (`\\n`, `\\x1b`, `\\xe9`)."""
    if rel.isprintable():
        return rel
    out = []
    for ch in rel:
        if ch.isprintable():
            out.append(ch)
        elif "\udc80" <= ch <= "\udcff":  # os.fsdecode's escape of a non-UTF-8 byte
            out.append(f"\\x{ord(ch) - 0xDC00:02x}")
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out)


def load_repository(path: Path, files: list[tuple[str, Path]], skipped: list[tuple[str, str]],
                    *, max_file_bytes: int, max_total_chars: int, max_files: int,
                    include_secrets: bool = False) -> Document:
    """Read `files` (from `repository_files`, in order) as one document (the module
    docstring has the rules); `skipped` holds what the listing left out already."""
    root = path.resolve()
    skipped = list(skipped)
    parts: list[str] = []
    sections: list[Section] = []
    offset = 0
    cap_reason = ""
    for rel, file_path in files:
        if cap_reason:
            skipped.append((rel, cap_reason))
            continue
        text, reason, size = _read_text(file_path, max_file_bytes, include_secrets)
        if text is None:
            skipped.append((rel, reason))
            continue
        name = header_name(rel)
        block = f"===== {name} =====\n{text.rstrip()}\n\n"
        if offset + len(block) > max_total_chars:
            cap_reason = f"total size cap of {max_total_chars:,} characters reached"
        elif len(sections) >= max_files:
            cap_reason = f"file-count cap of {max_files:,} files reached"
        if cap_reason:
            skipped.append((rel, cap_reason))
            continue
        sections.append(Section(label=name, start=offset, end=offset + len(block) - 1,
                                bytes=size))
        parts.append(block)
        offset += len(block)
    if not sections:
        raise nothing_readable(path, skipped)
    return Document(text="".join(parts).rstrip("\n") + "\n", kind="repository",
                    source=str(path), sections=tuple(sections),
                    skipped=tuple(skipped), title=root.name, genre="code",
                    meta={"files": len(sections), "skipped": len(skipped)})


def nothing_readable(path: Path, skipped: list[tuple[str, str]]) -> InputError:
    reasons = sorted({reason for _, reason in skipped})
    return InputError(f"{path} contains no readable text files",
                      hint=("everything was skipped: " + "; ".join(reasons[:5]))
                      if reasons else "the directory is empty")


__all__ = ["load_repository", "repository_files", "sort_key", "header_name",
           "nothing_readable", "SKIP_DIRS", "LOCK_FILES", "TEXT_SUFFIXES", "CONFIG_FILES",
           "BINARY_SUFFIXES"]
