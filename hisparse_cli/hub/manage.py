"""Listing, locating and removing locally installed models (the `hisparse models` commands).

Functions return data (`ModelInfo`, paths, booleans) and print nothing; the CLI renders them.
Names accepted: a registry name or alias, or the folder name of a converted .gguf file
(`gguf-<sha256[:12]>`, as shown by `list_models`).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from hisparse_cli.errors import ModelError
from hisparse_cli.hub.registry import (
    DEFAULT_MODEL,
    GGUF_FOLDER_PREFIX,
    PROVENANCE_FILE,
    REGISTRY,
    find_spec,
    is_converted,
    model_dir,
    models_dir,
    pull_command,
    unknown_model_error,
    wheel_path,
)


@dataclass(frozen=True)
class ModelInfo:
    """One row of `hisparse models list`."""

    name: str
    description: str
    license: str | None  # None when unknown (converted user GGUF files)
    source: str  # "registry" or "gguf"
    installed: bool
    path: Path
    size_bytes: int  # converted folder on disk; 0 when not installed
    download_cached: bool  # the registry wheel is in <home>/downloads (offline re-conversion)
    download_bytes: int
    is_default: bool


def folder_size(path: Path) -> int:
    """Total bytes of the regular files under `path` (0 when absent; symlinks not followed)."""
    if not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _read_provenance(folder: Path) -> dict:
    try:
        return json.loads((folder / PROVENANCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def list_models() -> list[ModelInfo]:
    """Registry models (installed or not), then converted .gguf folders, sorted by name."""
    rows: list[ModelInfo] = []
    for spec in REGISTRY:
        folder, wheel = model_dir(spec), wheel_path(spec)
        installed = is_converted(folder)
        rows.append(
            ModelInfo(
                name=spec.name,
                description=spec.description,
                license=spec.license,
                source="registry",
                installed=installed,
                path=folder,
                size_bytes=folder_size(folder) if installed else 0,
                download_cached=wheel.is_file(),
                download_bytes=wheel.stat().st_size if wheel.is_file() else 0,
                is_default=spec.name == DEFAULT_MODEL,
            )
        )
    root = models_dir()
    converted = sorted(root.glob(f"{GGUF_FOLDER_PREFIX}*")) if root.is_dir() else []
    for folder in converted:
        if not is_converted(folder):
            continue
        origin = _read_provenance(folder).get("source", {}).get("path", "unknown file")
        rows.append(
            ModelInfo(
                name=folder.name,
                description=f"converted from {origin}",
                license=None,
                source="gguf",
                installed=True,
                path=folder,
                size_bytes=folder_size(folder),
                download_cached=False,
                download_bytes=0,
                is_default=False,
            )
        )
    return rows


def _folder_for(name: str) -> Path:
    spec = find_spec(name)
    if spec is not None:
        return model_dir(spec)
    if name.startswith(GGUF_FOLDER_PREFIX) and "/" not in name and "\\" not in name and ".." not in name:
        return models_dir() / name
    raise unknown_model_error(name, "installed")


def model_path(name: str) -> Path:
    """The installed folder of `name`; `ModelError` (with the pull command) when absent."""
    folder = _folder_for(name)
    if is_converted(folder):
        return folder
    spec = find_spec(name)
    hint = f"run `{pull_command(spec)}`" if spec else "pass the .gguf file to --model to convert it"
    raise ModelError(f"model {name!r} is not installed (expected at {folder})", hint=hint)


def remove_model(name: str, *, remove_download: bool = False) -> bool:
    """Delete the converted folder of `name` (and, with `remove_download`, its cached wheel).
    Returns True when anything was deleted."""
    folder = _folder_for(name)
    removed = False
    if folder.exists():  # rename first: an interrupted delete never leaves a half folder in place
        trash = folder.with_name(f".{folder.name}.removing")
        shutil.rmtree(trash, ignore_errors=True)
        folder.rename(trash)
        shutil.rmtree(trash)
        removed = True
    spec = find_spec(name)
    if remove_download and spec is not None and wheel_path(spec).is_file():
        wheel_path(spec).unlink()
        removed = True
    return removed
