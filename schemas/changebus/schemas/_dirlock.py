"""``DirLock``: one process at a time in a data directory (an advisory ``flock``).

Two daemons started on the same data directory (an overlapping restart, a
rollout that starts the new process before the old one exits, a copy of a
unit file) would both recover, write and publish into the same files: a
relay's second process rewrites the ring's metadata and event table under
the first one's readers before it even fails to bind its port. A
:class:`DirLock` taken before anything in the directory is opened stops the
second process at once, with an error naming the directory and the pid that
holds it.

The lock is ``flock(LOCK_EX | LOCK_NB)`` on ``<dir>/.lock`` (mode 0600,
created when missing, holding the holder's pid as text for the message).
The kernel drops it when the holder's descriptor closes, also when the
process dies (kill -9), so a crash never leaves a stale lock. ``flock``
locks belong to the open file description: a second :class:`DirLock` of the
same directory in the same process is refused too. On a network file
system without ``flock`` support the lock is not taken and a warning says
so (the daemon still runs).

Thread-safety: one owner; :meth:`DirLock.release` is idempotent.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from pathlib import Path
from typing import Final

from .errors import ConfigError
from .files import FILE_MODE, private_dir

__all__ = ["DirLock"]

log = logging.getLogger("changebus.files")

LOCK_NAME: Final = ".lock"


class DirLock:
    """The lock of ``directory`` (created, or narrowed, to mode 0700), held until
    :meth:`release`; ``what`` names the directory's user in the error (``relay
    partition 'orders'``). Raises :class:`ConfigError` when another process (or
    another :class:`DirLock` of this process) holds it."""

    def __init__(self, directory: Path, what: str) -> None:
        private_dir(directory)
        self.path = directory / LOCK_NAME
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        with contextlib.suppress(OSError):  # (one left wider, or made under another umask)
            os.fchmod(self._fd, FILE_MODE)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = self._holder()
            self.release()
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                by = f" by process {holder}" if holder else ""
                raise ConfigError(
                    f"{what}: its directory {directory} is in use{by}; one process at a time "
                    "may use a data directory (stop the other one, or give this one its own "
                    "data_dir)"
                ) from None
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                log.warning("%s: %s cannot be locked here (%s)", what, directory, exc.strerror)
                return
            raise
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def _holder(self) -> str:
        """The pid the lock file names (empty: none readable)."""
        try:
            text = self.path.read_text(encoding="ascii", errors="replace").strip()
        except OSError:
            return ""
        return text if text.isdigit() else ""

    def release(self) -> None:
        """Drop the lock (the file stays: removing it would race with a new holder)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
