"""A folder → the files that will be read, and whether they are a repository or a collection.

    listing = list_folder(root, limits)          # kind, files in reading order, skipped
    document = load_folder(path, limits)          # the Document (repository or collection)

The files come from a view (walk.py: git's inside a git work tree, else the walk), with
secrets left out by name unless `include_secrets`; `collection.is_collection` decides the
kind on the listed files; the kind's own per-file checks then order and filter them
(repo.repository_files, collection.collection_files). `batch` fingerprints a folder by
exactly these files (`FolderListing.files`). A root that is itself version-control metadata
(`repo/.git`) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hisparse_cli.documents.base import Document
from hisparse_cli.documents.collection import collection_files, is_collection, load_collection
from hisparse_cli.documents.formats import byte_limit, document_format
from hisparse_cli.documents.repo import load_repository, repository_files
from hisparse_cli.documents.secret_files import secret_name
from hisparse_cli.documents.git_view import tree_view
from hisparse_cli.documents.walk import inside_vcs_metadata
from hisparse_cli.errors import InputError


@dataclass(frozen=True)
class FolderListing:
    kind: str  # "repository" | "collection"
    files: tuple[tuple[str, Path], ...]  # (relative path, real path), in reading order
    skipped: tuple[tuple[str, str], ...]
    root_ignored: bool  # the enclosing work tree ignores the root itself
    view: str  # "git" | "walk"

    def byte_limit(self, rel: str, limits) -> int:
        """The most bytes the reader takes of member `rel` (what `batch` hashes of it)."""
        if self.kind == "repository":
            return limits.max_file_bytes
        return byte_limit(document_format(rel), limits)


def list_folder(root: Path, limits, *, include_secrets: bool = False) -> FolderListing:
    """What `load_folder` will read of the folder `root` (module docstring)."""
    root = root.resolve()
    if inside_vcs_metadata(root):
        raise InputError(f"{root} is version-control metadata, which is never read",
                         hint="summarize the work tree around it instead")

    def name_problem(rel: str, _path: Path) -> str | None:
        return None if include_secrets else secret_name(rel)

    view = tree_view(root, name_problem)
    candidates = view.files(walk_cap=10 * limits.max_files)
    skipped = list(view.skipped)
    if is_collection([target or rel for rel, _, target in candidates]):
        kind, files = "collection", collection_files(candidates, skipped, limits)
    else:
        kind = "repository"
        files = repository_files(candidates, skipped, max_file_bytes=limits.max_file_bytes)
    return FolderListing(kind, tuple(files), tuple(skipped), view.root_ignored, view.source)


def load_folder(path: Path, limits, *, password: str | None = None,
                include_secrets: bool = False) -> Document:
    """A folder as one Document: a repository or a document collection."""
    listing = list_folder(path, limits, include_secrets=include_secrets)
    if listing.root_ignored:
        raise InputError(f"{path} is ignored by the .gitignore of the git repository around "
                         "it, so none of its files are read",
                         hint="summarize a folder the repository does not ignore")
    files, skipped = list(listing.files), list(listing.skipped)
    if listing.kind == "collection":
        doc = load_collection(path, files, skipped, limits=limits, password=password,
                              include_secrets=include_secrets)
    else:
        doc = load_repository(path, files, skipped, max_file_bytes=limits.max_file_bytes,
                              max_total_chars=limits.max_total_chars,
                              max_files=limits.max_files, include_secrets=include_secrets)
    doc.meta["view"] = listing.view
    return doc


__all__ = ["FolderListing", "list_folder", "load_folder"]
