"""One writer per results file: an exclusive OS lock held on the file for the whole run.

    lock = FileLock(path)        # acquire(): InputError (exit 3) while another process holds it
    fd = lock.acquire()          # the file, opened for appending (created when missing)
    ...                          # append through `fd`
    lock.release()               # also released by the kernel when the process ends

The lock is `flock(LOCK_EX | LOCK_NB)` on the results file itself: a second `hisparse batch`
(or `--resume`) on the same file is refused at once instead of waiting, and a lock left by a
process that was killed (even SIGKILL) disappears with it: there is no lock file to clean up.
flock locks belong to the open file, not the process, so reading the file through another
descriptor (`scan`) does not drop it (POSIX `lockf` locks would be dropped). After locking,
the path must still name the locked file (a writer that unlinked or replaced it meanwhile
means: open again). A file this lock created is removed again on release when nothing was
written to it, so a run refused or stopped before its first record leaves nothing behind.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from hisparse_cli.errors import InputError

_ATTEMPTS = 5


class FileLock:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.fd: int | None = None
        self._created = False

    def acquire(self) -> int:
        """Open (creating it when missing) and lock the file; return the descriptor, opened
        for reading and appending. InputError when another process holds the lock."""
        import fcntl

        if self.fd is not None:
            return self.fd
        for _ in range(_ATTEMPTS):
            existed = os.path.lexists(self.path)
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                             0o644)
            except OSError as exc:
                raise InputError(f"cannot open results file {self.path}: {exc.strerror or exc}",
                                 hint="check its permissions, or choose another --out") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise InputError(
                        f"results file {self.path} is being written by another hisparse run "
                        "(it holds the file's lock)",
                        hint="wait for that run to finish (a killed run's lock is released by "
                             "the system), or choose another --out") from None
                raise InputError(f"cannot lock results file {self.path}: "
                                 f"{exc.strerror or exc}",
                                 hint="put the results file on a local file system, or "
                                      "choose another --out") from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except OSError:
                same = False  # removed meanwhile
            if same:
                self.fd, self._created = fd, not existed
                return fd
            os.close(fd)  # the path now names another file: lock that one
        raise InputError(f"results file {self.path} keeps being replaced by another process",
                         hint="choose another --out")

    def release(self) -> None:
        """Unlock and close; a file this lock created and nothing was written to is removed."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            if self._created and os.fstat(fd).st_size == 0:
                try:
                    if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                        os.unlink(self.path)
                except OSError:
                    pass
        finally:
            os.close(fd)  # closing the last descriptor releases the flock


__all__ = ["FileLock"]
