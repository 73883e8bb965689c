"""The C library through ctypes: found and loaded once, for every changebus component.

Some system calls are reached through libc rather than Python's own modules:
``fallocate`` (:mod:`.files`: a whole reservation, never glibc's byte-per-block
fallback), ``madvise`` and ``msync`` (the relay's buffer: ctypes lets go of the
GIL during the call, ``mmap.flush`` does not). :func:`libc_function` hands out
those functions, typed.

The library is looked up (``ctypes.util.find_library("c")``, which may run
``ldconfig``) and loaded at the first call, not at import, and once per
process, with ``use_errno=True``: after a call that failed,
``ctypes.get_errno()`` is its ``errno``. Where ``find_library`` finds nothing
(musl, a system without ``ldconfig``) the process's own symbols are used
(``CDLL(None)``, which holds libc on Linux and macOS); where that is refused
(Windows) or a function is missing (``fallocate64`` on macOS, ``madvise`` on
an odd platform) :func:`libc_function` returns None and the caller falls back.

Invariant: each :func:`libc_function` call returns a function object of its
own (``CDLL[name]``, not ``CDLL.name``, which ctypes caches on the shared
library object), so setting ``argtypes``/``restype`` for one caller never
changes another's.

Thread-safety: any thread. The library is memoized by :func:`functools.cache`:
two first calls at once may both load it, and ``dlopen`` gives both the same
handle.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ctypes import _CDataType

__all__ = ["libc", "libc_function"]


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library, loaded with ``use_errno`` (None: no C library of that kind)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except (OSError, TypeError):  # (no libc of that kind: Windows)
        return None


def libc_function(
    name: str, argtypes: Sequence[type[_CDataType]], restype: type[_CDataType]
) -> ctypes._NamedFuncPointer | None:
    """libc's function ``name`` with these argument and result types (None: not there).

    A fresh function object per call (module docstring): the caller keeps it.
    """
    lib = libc()
    if lib is None:
        return None
    try:
        fn = lib[name]
    except AttributeError:
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn
