"""Which files under a folder may be read: the two views of a tree, and the rules they share.

A view lists candidate files and reports what it leaves out (`skipped`, with reasons):
  * `GitView` (git_view.py): inside a git work tree, the files git sees — tracked ones (also
    those a .gitignore matches) and untracked ones that are not ignored;
  * `RepositoryWalk` (here): elsewhere (or without a usable git), a walk of the folder that
    applies the ignore rules itself.
`git_view.tree_view(root, file_problem)` picks one. Rules every view applies, in order:
  1. version-control metadata (`.git`, `.hg`, `.svn`, `.bzr`, `CVS`, `_darcs`, `.pijul`,
     `.jj`, `.sl`, Fossil's `.fslckout` / `_FOSSIL_` / `*.fossil`) is never read,
  2. ignore rules (the walk: the enclosing work tree's `info/exclude` (lowest precedence),
     then every `.gitignore` from the work tree's top down to the entry's folder — deeper
     files and later lines win, `!` re-includes; an ignored folder is not entered. The work
     tree is the nearest folder at or above the root holding `.git` (a folder, or a
     worktree/submodule `gitdir:` file): summarizing `repo/src` applies `repo/.gitignore`.
     Above the root only those ignore files are read. Git's view: what git ignores),
  3. vendored/build/cache folders (SKIP_DIRS, `*.egg-info`) and virtualenvs are not entered
     (tracked or not),
  4. symlinks: a linked folder is never entered; a linked file is read only when its real
     target is inside the root and the target's own path passes every rule here and the
     caller's per-file check (`file_problem`: secrets by name), so a link cannot expose
     what the view would skip (`link.txt -> .git/config`, `-> .env`, an ignored file, ...).
     A file is listed with its real path (a link's target); files in a folder that is a
     symlink are never listed.
`open_checked` opens an admitted file so that a swap after the listing is caught: the last
component may not be a symlink, it must be a regular file, and its real path must still be
the one the view admitted.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

import pathspec

from hisparse_cli.documents.text import decode_bytes

SKIP_DIRS = frozenset({
    "node_modules", "bower_components", "vendor", "third_party", "third-party", ".venv", "venv",
    "build", "dist", "target", "__pycache__", ".tox", ".nox", ".mypy_cache",
    ".pytest_cache", ".ruff_cache", ".hypothesis", ".eggs", ".gradle", ".next", ".nuxt",
    ".cache", ".idea", ".terraform", "htmlcov", ".ipynb_checkpoints", "Pods",
})
VCS_NAMES = frozenset({".git", ".hg", ".svn", ".bzr", "CVS", "_darcs", ".pijul", ".jj", ".sl",
                       ".fslckout", "_FOSSIL_"})
IGNORE_FILE_MAX_BYTES = 1_000_000
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)

FileProblem = Callable[[str, Path], "str | None"]  # (relative path, path) → skip reason


@dataclass(frozen=True)
class _Ignore:
    """One ignore file's patterns, relative to the folder `base` ("" = the work tree's top)."""

    base: str
    spec: pathspec.GitIgnoreSpec

    def decide(self, rel: str, is_dir: bool) -> bool | None:
        """True = ignored, False = re-included by `!`, None = no pattern matched."""
        if self.base:
            if not rel.startswith(self.base + "/"):
                return None
            rel = rel[len(self.base) + 1:]
        return self.spec.check_file(rel + "/" if is_dir else rel).include


def _read_small(path: Path, limit: int) -> bytes | None:
    """At most `limit` bytes of a regular, non-symlink file, or None."""
    try:
        if path.is_symlink() or not path.is_file():
            return None
        with path.open("rb") as handle:
            return handle.read(limit)
    except OSError:
        return None


def _read_ignore(path: Path, base: str) -> _Ignore | None:
    data = _read_small(path, IGNORE_FILE_MAX_BYTES)
    if data is None:
        return None
    try:
        return _Ignore(base, pathspec.GitIgnoreSpec.from_lines(decode_bytes(data)[0].splitlines()))
    except (ValueError, TypeError):  # a malformed pattern must not abort the run
        return None


def _ignored(rules: list[_Ignore], rel: str, is_dir: bool) -> bool:
    decision = False
    for rule in rules:  # ordered from lowest to highest precedence: the last match wins
        verdict = rule.decide(rel, is_dir)
        if verdict is not None:
            decision = verdict
    return decision


def _git_dir(top: Path) -> Path:
    """The git directory of the work tree `top`: `.git` itself, or where its `gitdir:` file
    points (worktrees, submodules), then the common directory of a worktree."""
    git = top / ".git"
    pointer = _read_small(git, 4096)
    if pointer is not None and pointer.startswith(b"gitdir:"):
        git = top / os.fsdecode(pointer[len(b"gitdir:"):].strip())
    common = _read_small(git / "commondir", 4096)
    return git / os.fsdecode(common.strip()) if common else git


def _work_tree_top(root: Path) -> Path | None:
    return next((d for d in (root, *root.parents) if os.path.lexists(d / ".git")), None)


def _join(prefix: str, rel: str) -> str:
    return f"{prefix}/{rel}" if prefix and rel else prefix or rel


Candidate = tuple[str, Path, "str | None"]  # (relative path, real path, link target's rel)


class TreeView:
    """What the views share: the folder rules, the symlink rules and the skip report.
    Subclasses give `entry_problem` (why an entry is not read) and `files()`."""

    source = ""  # "git" | "walk": which view listed the files

    def __init__(self, root: Path, file_problem: FileProblem) -> None:
        self.root = root
        self.file_problem = file_problem
        self.skipped: list[tuple[str, str]] = []
        self.root_ignored = False  # the root lies in a folder the work tree ignores

    def folder_problem(self, rel: str) -> str | None:
        """Why the folder `rel` is not entered by its name (rule 3), or None."""
        name = rel.rpartition("/")[2]
        if name in SKIP_DIRS or name.endswith(".egg-info"):
            return "vendored/build/cache folder"
        if (self.root / rel / "pyvenv.cfg").is_file():
            return "virtualenv folder"
        return None

    def entry_problem(self, rel: str, is_dir: bool) -> str | None:  # pragma: no cover
        raise NotImplementedError

    def link_target(self, path: Path) -> tuple[Path | None, str]:
        """(real target, "") for a symlink that may be read, else (None, reason)."""
        try:
            target = path.resolve(strict=True)
        except (OSError, RuntimeError):
            return None, "broken or looping symlink"
        if not target.is_relative_to(self.root):
            return None, "symlink points outside the repository (not followed)"
        if target.is_dir():
            return None, "symlinked directory (not followed)"
        if not target.is_file():
            return None, "not a regular file"
        rel = target.relative_to(self.root).as_posix()
        parts = rel.split("/")
        for depth in range(1, len(parts) + 1):  # every folder on the way, then the file
            reason = self.entry_problem("/".join(parts[:depth]), depth < len(parts))
            if reason is None and depth == len(parts):
                reason = self.file_problem(rel, target)
            if reason is not None:
                return None, f"symlink to {rel}, which is not read: {reason}"
        return target, ""

    def files(self, walk_cap: int) -> list[Candidate]:  # pragma: no cover
        raise NotImplementedError


class RepositoryWalk(TreeView):
    """The walk of one root (resolved): `files()` lists what may be read, `skipped` why the
    rest is not. `file_problem` is the caller's per-file check (files and link targets)."""

    source = "walk"

    def __init__(self, root: Path, file_problem: FileProblem) -> None:
        super().__init__(root, file_problem)
        work_tree = _work_tree_top(root)
        top = work_tree or root
        self.prefix = root.relative_to(top).as_posix() if top != root else ""
        rules: list[_Ignore] = []
        exclude = _read_ignore(_git_dir(top) / "info" / "exclude", "") if work_tree else None
        if exclude is not None:
            rules.append(exclude)
        parts = self.prefix.split("/") if self.prefix else []
        for depth in range(len(parts)):  # the work tree's top down to the root's parent
            base = "/".join(parts[:depth])
            local = _read_ignore(top.joinpath(*parts[:depth]) / ".gitignore", base)
            if local is not None:
                rules.append(local)
            if _ignored(rules, "/".join(parts[:depth + 1]), True):
                self.root_ignored = True
        self._rules: dict[str, list[_Ignore]] = {"": self._with_local(rules, "")}

    def _with_local(self, inherited: list[_Ignore], rel_dir: str) -> list[_Ignore]:
        local = _read_ignore(self.root / rel_dir / ".gitignore", _join(self.prefix, rel_dir))
        return inherited + [local] if local is not None else inherited

    def rules_for(self, rel_dir: str) -> list[_Ignore]:
        """The ignore rules that apply to the entries of folder `rel_dir` ("" = the root).
        Only called for folders that passed `entry_problem` themselves."""
        if rel_dir not in self._rules:
            parent = rel_dir.rpartition("/")[0]
            self._rules[rel_dir] = self._with_local(self.rules_for(parent), rel_dir)
        return self._rules[rel_dir]

    def entry_problem(self, rel: str, is_dir: bool) -> str | None:
        """Why the entry `rel` (not a symlink) is not read or entered, or None."""
        name = rel.rpartition("/")[2]
        if name in VCS_NAMES or name.endswith(".fossil"):
            return "version-control metadata"
        if _ignored(self.rules_for(rel.rpartition("/")[0]), _join(self.prefix, rel), is_dir):
            return "ignored by .gitignore"
        return self.folder_problem(rel) if is_dir else None

    def files(self, walk_cap: int) -> list[Candidate]:
        """Candidate files (relative posix path, path to open, the target's relative path for
        a link) in walk order; a link's path to open is its real target. Stops after
        `walk_cap` files so that pointing the tool at a huge tree (a home directory) ends
        quickly; the stop is reported in `skipped`."""
        found: list[Candidate] = []
        if self.root_ignored:
            self.skipped.append((".", "ignored by the enclosing repository's .gitignore"))
            return found

        def visit(directory: Path, rel_dir: str) -> None:
            try:
                entries = sorted(os.scandir(directory), key=lambda e: e.name)
            except OSError as exc:
                self.skipped.append((rel_dir + "/" if rel_dir else ".",
                                     f"unreadable: {exc.strerror}"))
                return
            for entry in entries:
                rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
                if len(found) >= walk_cap:
                    self.skipped.append((rel, f"directory walk stopped after {walk_cap:,} files"))
                    return
                path = Path(entry.path)
                is_dir = entry.is_dir(follow_symlinks=False)
                reason = self.entry_problem(rel, is_dir)
                if reason is not None:
                    self.skipped.append((rel + "/" if is_dir else rel, reason))
                elif entry.is_symlink():
                    target, reason = self.link_target(path)
                    if target is None:
                        self.skipped.append((rel, reason))
                    else:
                        found.append((rel, target, target.relative_to(self.root).as_posix()))
                elif is_dir:
                    visit(path, rel)
                elif entry.is_file(follow_symlinks=False):
                    problem = self.file_problem(rel, path)
                    if problem is None:
                        found.append((rel, path, None))
                    else:
                        self.skipped.append((rel, problem))
                else:
                    self.skipped.append((rel, "not a regular file"))

        visit(self.root, "")
        return found


def inside_vcs_metadata(root: Path) -> bool:
    """Is `root` (resolved) version-control metadata itself, or inside it (`repo/.git`)?"""
    return any(part in VCS_NAMES or part.endswith(".fossil") for part in root.parts)


def open_checked(path: Path) -> BinaryIO:
    """Open a file the walk admitted, for reading; OSError when it changed since: a symlink
    now (O_NOFOLLOW), not a regular file, or its real path no longer `path` (a folder on the
    way swapped for a link)."""
    handle = os.fdopen(os.open(path, _OPEN_FLAGS), "rb")
    try:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if os.path.realpath(path) != str(path) or not os.path.samestat(info, os.stat(path)):
            raise OSError(errno.ELOOP, "path changed while being read")
    except BaseException:
        handle.close()
        raise
    return handle


__all__ = ["TreeView", "RepositoryWalk", "inside_vcs_metadata", "open_checked",
           "Candidate", "SKIP_DIRS", "VCS_NAMES"]
