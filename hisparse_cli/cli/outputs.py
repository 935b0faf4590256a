"""Files a command writes its result to (`summarize --out FILE`, `eval --out DIR`).

    target = check_output_file(out)        # before the model loads: ConfigError / InputError
    write_atomic(target, text)             # temp file in the folder + fsync + rename

A path is checked before any work is done, so a typo costs nothing: a folder where a file
is wanted is a usage error (exit 2, as for `batch --out`); a missing folder, one that cannot
be written (permissions, a read-only or virtual file system: a temporary file is created
there and removed) is an input problem (exit 3). A new file gets the mode the umask gives
(0666 & ~umask), a replaced file keeps its mode; a symlink is written through, and a target
that is not a regular file (/dev/null, a FIFO) is written in place, never replaced.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from hisparse_cli.errors import ConfigError, InputError


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _folder(path: Path) -> Path:
    return path.parent if str(path.parent) else Path(".")


def _probe_folder(folder: Path, path: Path, flag: str) -> None:
    """Create and remove a temporary file in `folder`: InputError when that fails."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".hisparse-check.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise InputError(f"cannot write {path}: cannot create a file in {folder} "
                         f"({exc.strerror or exc})",
                         hint=f"choose another {flag} path, or fix the folder's permissions"
                         ) from None
    os.close(fd)
    Path(tmp).unlink(missing_ok=True)


def check_output_file(path: Path, flag: str = "--out") -> Path:
    """The file `path` names (user home expanded, a symlink followed), checked writable."""
    path = Path(os.path.realpath(path.expanduser())) if path.expanduser().is_symlink() \
        else path.expanduser()
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder", hint="give a file path")
    folder = _folder(path)
    if not folder.is_dir():
        raise InputError(f"cannot write {path}: folder {folder} does not exist",
                         hint=f"create the folder or choose another {flag} path")
    if path.exists() and not path.is_file():  # /dev/null, a FIFO: written in place
        if not os.access(path, os.W_OK):
            raise InputError(f"cannot write {path}: permission denied",
                             hint=f"choose another {flag} path")
        return path
    if path.exists() and not os.access(path, os.W_OK):
        raise InputError(f"cannot write {path}: the file is read-only",
                         hint=f"make it writable (chmod u+w) or choose another {flag} path")
    _probe_folder(folder, path, flag)
    return path


def check_output_folder(path: Path, flag: str = "--out") -> Path:
    """A folder results are written into (created later, with its parents): not a file, and
    its nearest existing ancestor writable."""
    path = path.expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path} is a file, not a folder",
                          hint="give a folder path (it is created when missing)")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"cannot create folder {path}: {existing} is not a folder",
                         hint=f"choose another {flag} path")
    _probe_folder(existing, path, flag)
    return path


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` via a temporary file in the same folder + fsync + rename: the
    file is either the old one or the whole new one. Its mode: the old file's, or 0666 minus
    the umask for a new one. A non-regular target (/dev/null, a FIFO) is written in place."""
    path = path.expanduser()
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    if path.exists() and not path.is_file():
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
        return
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    folder = _folder(path)
    if not folder.is_dir():
        raise InputError(f"cannot write {path}: folder {folder} does not exist",
                         hint="create the folder or choose another --out path")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


__all__ = ["check_output_file", "check_output_folder", "write_atomic"]
