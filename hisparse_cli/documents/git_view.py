"""A folder inside a git work tree, read as git sees it (`GitView`).

Listed: `git ls-files -z --cached --others --exclude-standard`, run in the root: the tracked
files under it (also those a .gitignore matches: tracked is tracked) and the untracked files
that are not ignored (.gitignore files, info/exclude, core.excludesFile). Reported as
skipped: what git ignores (`git ls-files --others --ignored --exclude-standard --directory`:
an ignored folder once), tracked files missing from the work tree, submodules and nested
repositories (not read: summarize them on their own). The shared rules of walk.py still
apply to every listed path (version-control metadata, vendored/build folders, secrets by
name, symlinks), and a listed path under a folder that is a symlink is never opened.

git runs as a subprocess (no shell) with its index left alone (GIT_OPTIONAL_LOCKS=0), no
prompt, no fsmonitor hook (`-c core.fsmonitor=false`: a repository's config cannot make it
run a program) and no GIT_DIR/GIT_WORK_TREE from the caller's environment. `GitView.open`
returns None — and the walk is used — when git is not installed, the root is not in a work
tree, or git fails (a repository owned by someone else, a broken index, a timeout).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from hisparse_cli.documents.walk import VCS_NAMES, Candidate, FileProblem, RepositoryWalk, TreeView

GIT_TIMEOUT_S = 60.0
MAX_IGNORED_REPORTED = 2000
_REDIRECTS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_COMMON_DIR",
              "GIT_OBJECT_DIRECTORY", "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_NAMESPACE",
              "GIT_CEILING_DIRECTORIES", "GIT_DISCOVERY_ACROSS_FILESYSTEM")


def run_git(root: Path, *args: str) -> bytes | None:
    """stdout of `git -C root ARGS`, or None when git is missing, fails or times out."""
    exe = shutil.which("git")
    if exe is None:
        return None
    env = {k: v for k, v in os.environ.items() if k not in _REDIRECTS}
    env.update(GIT_OPTIONAL_LOCKS="0", GIT_TERMINAL_PROMPT="0", LC_ALL="C")
    try:
        done = subprocess.run([exe, "-c", "core.fsmonitor=false", "-C", str(root), *args],
                              stdin=subprocess.DEVNULL, capture_output=True, env=env,
                              timeout=GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _paths(output: bytes) -> list[str]:
    return [os.fsdecode(p) for p in output.split(b"\0") if p]


class GitView(TreeView):
    """The files of `root` as git lists them (module docstring)."""

    source = "git"

    def __init__(self, root: Path, file_problem: FileProblem, listed: list[str],
                 ignored: list[str]) -> None:
        super().__init__(root, file_problem)
        self.listed = sorted(set(listed))
        self._listed_set = set(self.listed)
        self.ignored = ignored
        if not self.listed:  # nothing to read: say so when the enclosing tree ignores it
            self.root_ignored = RepositoryWalk(root, file_problem).root_ignored

    @classmethod
    def open(cls, root: Path, file_problem: FileProblem) -> "GitView | None":
        if run_git(root, "rev-parse", "--is-inside-work-tree") != b"true\n":
            return None
        listed = run_git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
        if listed is None:
            return None
        ignored = run_git(root, "ls-files", "-z", "--others", "--ignored",
                          "--exclude-standard", "--directory")
        return cls(root, file_problem, _paths(listed), _paths(ignored or b""))

    def entry_problem(self, rel: str, is_dir: bool) -> str | None:
        name = rel.rpartition("/")[2]
        if name in VCS_NAMES or name.endswith(".fossil"):
            return "version-control metadata"
        if is_dir:
            return self.folder_problem(rel)
        return None if rel in self._listed_set else "ignored by .gitignore"

    def _folders_problem(self, rel: str, reported: set[str]) -> bool:
        """Whether a folder on the way to `rel` is not entered (reported once)."""
        parts = rel.split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            folder = "/".join(parts[:depth])
            reason = self.entry_problem(folder, True)
            if reason is None and (self.root / folder).is_symlink():
                reason = "symlinked directory (not followed)"
            if reason is not None:
                if folder not in reported:
                    reported.add(folder)
                    self.skipped.append((folder + "/", reason))
                return True
        return False

    def files(self, walk_cap: int) -> list[Candidate]:
        found: list[Candidate] = []
        if self.root_ignored:
            self.skipped.append((".", "ignored by the enclosing repository's .gitignore"))
            return found
        if os.path.lexists(self.root / ".git"):
            self.skipped.append((".git/", "version-control metadata"))
        reported: set[str] = set()
        for rel in self.listed:
            if len(found) >= walk_cap:
                self.skipped.append((rel, f"listing stopped after {walk_cap:,} files"))
                continue
            if rel.endswith("/") or self._folders_problem(rel, reported):
                if rel.endswith("/"):
                    self.skipped.append((rel, "nested git repository (not read: summarize "
                                              "it on its own)"))
                continue
            path = self.root / rel
            reason = self.entry_problem(rel, False)
            if reason is not None:
                self.skipped.append((rel, reason))
            elif path.is_symlink():
                target, reason = self.link_target(path)
                if target is None:
                    self.skipped.append((rel, reason))
                else:
                    found.append((rel, target, target.relative_to(self.root).as_posix()))
            elif not os.path.lexists(path):
                self.skipped.append((rel, "tracked but missing from the work tree"))
            elif path.is_dir():
                self.skipped.append((rel + "/", "git submodule (not read: summarize it on "
                                                "its own)"))
            elif not path.is_file():
                self.skipped.append((rel, "not a regular file"))
            else:
                problem = self.file_problem(rel, path)
                if problem is None:
                    found.append((rel, path, None))
                else:
                    self.skipped.append((rel, problem))
        for rel in self.ignored[:MAX_IGNORED_REPORTED]:
            self.skipped.append((rel, "ignored by .gitignore"))
        if len(self.ignored) > MAX_IGNORED_REPORTED:
            self.skipped.append((f"... {len(self.ignored) - MAX_IGNORED_REPORTED:,} more",
                                 "ignored by .gitignore"))
        return found


def tree_view(root: Path, file_problem: FileProblem) -> TreeView:
    """Git's view of `root` when it lies in a git work tree and git can list it, else the
    walk (documents/walk.py)."""
    return GitView.open(root, file_problem) or RepositoryWalk(root, file_problem)


__all__ = ["GitView", "run_git", "tree_view"]
