"""Private data files and safe names: how every changebus component touches its disk.

Row data is customer data, so what changebus writes is readable by its own
user only, whatever the process umask: directories it creates get mode
``0700``, files ``0600``, set explicitly (``os.open`` with the mode, then
``fchmod``/``chmod``, which the umask does not filter). Files made by other
code (``numpy.memmap``, SQLite) are created through :func:`private_file`
first; SQLite then gives its ``-wal`` and ``-shm`` files the database file's
mode. A file or directory that exists already is narrowed to the same mode
(an upgrade from a version that left them world-readable).

Names that become a path component (partition names: the relay's buffer
directories, the bootstrap store's rows) must be :func:`safe_name`: one
component of ``[A-Za-z0-9_.-]``, at most 128 characters, never ``.`` or
``..``.

The system calls Python has no call for, or only one holding the GIL
(``fallocate`` here, the relay's ``msync`` and ``madvise`` on its mappings),
go through :func:`libc_function`: libc found and loaded once per process
(:mod:`._libc`).

Every function here blocks (file system calls): call them from a worker
thread when on an event loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Final

from ._libc import libc_function as libc_function

log = logging.getLogger("changebus.files")

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "NAME_RULE",
    "libc_function",
    "narrow_files",
    "open_private",
    "private_dir",
    "private_file",
    "reserve_file",
    "safe_name",
]

#: mode of the directories changebus creates
DIR_MODE: Final = 0o700
#: mode of the files changebus creates
FILE_MODE: Final = 0o600
#: what :func:`safe_name` accepts, in words (for error messages)
NAME_RULE: Final = "[A-Za-z0-9_.-]{1,128} (and not be '.' or '..')"

_NAME: Final = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def safe_name(name: str) -> bool:
    """Whether ``name`` is a safe single path component (:data:`NAME_RULE`)."""
    return bool(_NAME.fullmatch(name)) and name not in (".", "..")


def private_dir(path: Path, *, narrow: bool = True) -> None:
    """Create ``path`` and its missing parents with mode ``0700``.

    ``narrow``: an existing ``path`` (not its parents) is set to ``0700`` too;
    leave it False for a directory the user chose that may be shared (the
    parent of a configured file, the current directory).
    """
    missing: list[Path] = []
    at = path
    while not at.exists():
        missing.append(at)
        if at.parent == at:
            break
        at = at.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made concurrently
            directory.mkdir(mode=DIR_MODE)
        os.chmod(directory, DIR_MODE)
    if narrow and not missing:
        try:
            os.chmod(path, DIR_MODE)
        except PermissionError:
            # not its owner (a volume's root owned by root, shared by group): the
            # directory is usable as it is; its mode is the owner's choice
            log.warning("%s: not narrowed to mode 0700 (this user does not own it)", path)


def open_private(path: Path, flags: int) -> int:
    """``os.open(path, flags)`` for a file of mode ``0600`` (created or narrowed)."""
    fd = os.open(path, flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def private_file(path: Path) -> None:
    """Make sure ``path`` exists with mode ``0600`` (contents untouched)."""
    os.close(open_private(path, os.O_RDONLY | os.O_CREAT))


def narrow_files(directory: Path) -> None:
    """Set every regular file directly in ``directory`` to mode ``0600``.

    For a directory changebus owns whole (a relay partition's): files an older
    version left world-readable are narrowed at start-up, whoever made them.
    """
    for entry in directory.iterdir():
        if entry.is_file() and not entry.is_symlink():
            os.chmod(entry, FILE_MODE)


#: errors of ``posix_fallocate`` that mean "this file system cannot reserve": not fatal
_NO_RESERVE: Final = frozenset({errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS})


def reserve_file(path: Path, size: int) -> bool:
    """Allocate the disk blocks of ``path``'s first ``size`` bytes; contents untouched.

    For a file that is memory-mapped and written through the mapping (the
    relay's ring and tables): a sparse file's blocks are allocated by the page
    faults of the first writes, and a full disk then kills the process with
    SIGBUS at some write instead of refusing to start. Reserved up front, the
    space is the file's from the start (the first pass's page faults cost about
    the same either way on this machine: docs/benchmarks.md, 2026-12-02).

    Linux's ``fallocate(2)`` where there is one: glibc's ``posix_fallocate``
    falls back to writing a byte per block on a file system that cannot
    reserve (NFS v3: millions of round trips for a large ring, at every start).
    Returns False when the file system cannot reserve (the file stays sparse,
    logged as a warning: ext3, older ZFS, NFS); raises :class:`OSError` naming
    ``path`` when the disk lacks the space (``ENOSPC``) or the file cannot be
    opened.
    """
    fd = os.open(path, os.O_RDWR)
    try:
        _allocate(fd, size)
    except OSError as exc:
        if exc.errno in _NO_RESERVE:
            log.warning(
                "%s: its %d bytes of disk were not reserved (%s): a disk that fills up may "
                "stop the process at a write (SIGBUS) instead of at start",
                path,
                size,
                exc.strerror,
            )
            return False
        raise OSError(exc.errno, f"cannot reserve {size} bytes: {exc.strerror}", str(path)) from exc
    finally:
        os.close(fd)
    return True


@functools.cache
def _fallocate() -> Callable[[int, int], None]:
    """``fallocate(fd, 0, 0, size)`` through libc when it has it, else ``posix_fallocate``
    (looked up at the first reservation, not at import: :mod:`._libc`)."""
    native = libc_function(
        "fallocate64", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64], ctypes.c_int
    )
    if native is None:  # (no libc of that kind: Windows, macOS)
        return lambda fd, size: os.posix_fallocate(fd, 0, size)

    def allocate(fd: int, size: int) -> None:
        while native(fd, 0, 0, size) != 0:
            err = ctypes.get_errno()
            if err != errno.EINTR:
                raise OSError(err, os.strerror(err))

    return allocate


def _allocate(fd: int, size: int) -> None:
    """Reserve ``size`` bytes of ``fd`` (raises OSError; EOPNOTSUPP where it cannot)."""
    _fallocate()(fd, size)
