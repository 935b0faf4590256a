"""A source directory → one `Document(kind="repository")`.

What is read: every regular text file under the root that survives, in this order,
  1. version-control metadata (.git) and vendored/build/cache/virtualenv folders,
  2. symlinks (a link is never followed out of the root; linked directories are never
     followed; a linked file whose target stays inside the root is read),
  3. ignore rules: .git/info/exclude, then every .gitignore from the root down (deeper files
     and later lines win, `!` re-includes, as in git; an ignored directory is not entered),
  4. lock files, binaries (by extension or content), files over `max_file_bytes`, minified or
     machine-generated files (very long lines), empty files,
  5. the file-count and total-character caps.
Everything left out is reported in `Document.skipped` as (path, reason) — directories once,
with a trailing "/".

Order (deterministic): the root README first, then build/config files, then docs, then
sources, then everything else; alphabetical (case-insensitive) within each group. Each file
appears under a header line `===== path/to/file =====` and is one `Section`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pathspec

from hisparse_cli.documents.base import Document, Section
from hisparse_cli.documents.text import SNIFF_BYTES, decode_bytes, looks_binary
from hisparse_cli.errors import InputError

SKIP_DIRS = frozenset({
    "node_modules", "bower_components", "vendor", "third_party", "third-party", ".venv", "venv",
    "build", "dist", "target", "__pycache__", ".tox", ".nox", ".mypy_cache",
    ".pytest_cache", ".ruff_cache", ".hypothesis", ".eggs", ".gradle", ".next", ".nuxt",
    ".cache", ".idea", ".terraform", "htmlcov", ".ipynb_checkpoints", "Pods",
})
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
GROUP_README, GROUP_CONFIG, GROUP_DOCS, GROUP_SOURCE, GROUP_OTHER = range(5)
MINIFIED_MIN_CHARS = 2000
MINIFIED_MEAN_LINE = 300


@dataclass(frozen=True)
class _Ignore:
    """One ignore file's patterns, relative to the directory `base` ("" = root)."""

    base: str
    spec: pathspec.GitIgnoreSpec

    def decide(self, rel: str, is_dir: bool) -> bool | None:
        """True = ignored, False = re-included by `!`, None = no pattern matched."""
        if self.base:
            if not rel.startswith(self.base + "/"):
                return None
            rel = rel[len(self.base) + 1:]
        return self.spec.check_file(rel + "/" if is_dir else rel).include


def _read_ignore(path: Path, base: str) -> _Ignore | None:
    try:
        if path.is_symlink() or not path.is_file():
            return None
        data = path.read_bytes()[:1_000_000]
        lines = decode_bytes(data)[0].splitlines()
        return _Ignore(base, pathspec.GitIgnoreSpec.from_lines(lines))
    except (OSError, ValueError, TypeError):  # a malformed pattern must not abort the run
        return None


def _ignored(rules: list[_Ignore], rel: str, is_dir: bool) -> bool:
    decision = False
    for rule in rules:  # ordered from lowest to highest precedence: the last match wins
        verdict = rule.decide(rel, is_dir)
        if verdict is not None:
            decision = verdict
    return decision


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


def _walk(root: Path, skipped: list[tuple[str, str]], walk_cap: int) -> list[tuple[str, Path]]:
    """Candidate files (relative posix path, absolute path) after folder/link/ignore rules.

    Stops collecting after `walk_cap` files so that pointing the tool at a huge tree (a home
    directory) ends quickly; the stop is reported in `skipped`.
    """
    rules: list[_Ignore] = []
    exclude = _read_ignore(root / ".git" / "info" / "exclude", "")
    if exclude is not None:
        rules.append(exclude)
    found: list[tuple[str, Path]] = []

    def visit(directory: Path, rel_dir: str, inherited: list[_Ignore]) -> None:
        local = _read_ignore(directory / ".gitignore", rel_dir)
        active = inherited + [local] if local is not None else inherited
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as exc:
            skipped.append((rel_dir + "/" if rel_dir else ".", f"unreadable: {exc.strerror}"))
            return
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            if len(found) >= walk_cap:
                skipped.append((rel, f"directory walk stopped after {walk_cap:,} files"))
                return
            path = Path(entry.path)
            if entry.name == ".git":
                skipped.append((rel + "/", "version-control metadata"))
                continue
            if entry.is_symlink():
                reason = _symlink_problem(path, root)
                if reason is not None:
                    skipped.append((rel, reason))
                    continue
            is_dir = entry.is_dir(follow_symlinks=False)
            if _ignored(active, rel, is_dir):
                skipped.append((rel + "/" if is_dir else rel, "ignored by .gitignore"))
                continue
            if is_dir:
                if entry.name in SKIP_DIRS or entry.name.endswith(".egg-info"):
                    skipped.append((rel + "/", "vendored/build/cache folder"))
                elif (path / "pyvenv.cfg").is_file():
                    skipped.append((rel + "/", "virtualenv folder"))
                else:
                    visit(path, rel, active)
            elif entry.is_file():  # follows an in-root file link; skips sockets, fifos, ...
                found.append((rel, path))
            else:
                skipped.append((rel, "not a regular file"))

    visit(root, "", rules)
    return found


def _symlink_problem(path: Path, root: Path) -> str | None:
    """Why a symlink is not read, or None for a link to a file inside the root."""
    try:
        target = path.resolve(strict=True)
    except (OSError, RuntimeError):
        return "broken or looping symlink"
    if not target.is_relative_to(root):
        return "symlink points outside the repository (not followed)"
    if target.is_dir():
        return "symlinked directory (not followed)"
    return None


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
        return f"larger than the per-file limit of {max_file_bytes:,} bytes ({size:,} bytes)"
    if size == 0:
        return "empty file"
    return None


def _read_text(path: Path) -> tuple[str | None, str]:
    """(text, "") or (None, reason)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        return None, f"unreadable: {exc.strerror}"
    if looks_binary(data[:SNIFF_BYTES]):
        return None, "binary file"
    try:
        text = decode_bytes(data)[0]
    except InputError:
        return None, "undecodable text"
    if not text.strip():
        return None, "empty file"
    lines = text.count("\n") + 1
    if len(text) >= MINIFIED_MIN_CHARS and len(text) / lines > MINIFIED_MEAN_LINE:
        return None, "minified or machine-generated (very long lines)"
    return text, ""


def load_repository(path: Path, *, max_file_bytes: int, max_total_chars: int,
                    max_files: int) -> Document:
    """Read a directory tree as one document (see the module docstring for the rules)."""
    root = path.resolve()
    skipped: list[tuple[str, str]] = []
    candidates = sorted(_walk(root, skipped, walk_cap=10 * max_files), key=lambda item: sort_key(item[0]))
    parts: list[str] = []
    sections: list[Section] = []
    offset = 0
    cap_reason = ""
    for rel, file_path in candidates:
        if cap_reason:
            skipped.append((rel, cap_reason))
            continue
        reason = _file_problem(rel, file_path, max_file_bytes)
        text = None
        if reason is None:
            text, reason = _read_text(file_path)
        if text is None:
            skipped.append((rel, reason))
            continue
        block = f"===== {rel} =====\n{text.rstrip()}\n\n"
        if offset + len(block) > max_total_chars:
            cap_reason = f"total size cap of {max_total_chars:,} characters reached"
        elif len(sections) >= max_files:
            cap_reason = f"file-count cap of {max_files:,} files reached"
        if cap_reason:
            skipped.append((rel, cap_reason))
            continue
        sections.append(Section(label=rel, start=offset, end=offset + len(block) - 1))
        parts.append(block)
        offset += len(block)
    if not sections:
        reasons = sorted({reason for _, reason in skipped})
        raise InputError(f"{path} contains no readable text files",
                         hint=("everything was skipped: " + "; ".join(reasons[:5]))
                         if reasons else "the directory is empty")
    return Document(text="".join(parts).rstrip("\n") + "\n", kind="repository",
                    source=str(path), sections=tuple(sections), skipped=tuple(skipped),
                    title=root.name, genre="code",
                    meta={"files": len(sections), "skipped": len(skipped)})


__all__ = ["load_repository", "sort_key", "SKIP_DIRS", "LOCK_FILES"]
