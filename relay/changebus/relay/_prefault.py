"""Fault in the ring's pages ahead of the writer, in bulk, off the GIL.

The first write to each page of a memory-mapped file costs a page fault:
on the project's VMs ~8 µs per 2.5 KB event when the writer touches the
pages one by one (the ring of a new buffer, or of a restarted relay whose
file is not in the page cache), more than everything else the relay does per
event. ``madvise(MADV_POPULATE_WRITE)`` (Linux >= 5.14) faults a whole range
in one system call, several times cheaper per page, and does not change the
bytes. :class:`Prefaulter` runs it in a daemon thread, through ctypes (which
lets go of the GIL during the call), a bounded distance ahead of the
writer's tail, until it has covered the ring once; after that every page has
been written and stays mapped unless the kernel reclaims it (then the
writer simply faults it in again, as before).

The pages are the file's page cache (shared and reclaimable), not the
process's own memory, and only ``ahead_bytes`` beyond the tail are touched
early, so a large buffer is not pulled into memory at start-up.

Thread-safety: :meth:`advance` is called by the buffer's single writer;
:meth:`close` must run before the mapping is unmapped (it waits for a
running call to finish). The thread holds the ring only weakly between
calls: a buffer dropped without :meth:`close` does not leak its mapping.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import weakref

import numpy as np
import numpy.typing as npt

from changebus.schemas.files import libc_function

__all__ = ["Prefaulter"]

log = logging.getLogger("changebus.relay.buffer")

_MADV_POPULATE_WRITE = 23
_CHUNK = 4 << 20
_PAGE = 4096


def _madvise() -> ctypes._NamedFuncPointer | None:
    """libc's ``madvise`` (None: no libc, or no such function there)."""
    return libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int)


class Prefaulter:
    """Populates ``[tail, tail + ahead_bytes)`` of the memory-mapped ``ring``.

    Positions are virtual (bytes ever written, as in the buffer); the
    physical offset is ``pos % capacity``. ``_done`` is the virtual position
    up to which pages were populated, ``_target`` how far the writer wants
    them; the thread stops for good once ``capacity`` bytes past its start are
    done (or when ``madvise`` is refused: an older kernel).
    """

    def __init__(self, ring: npt.NDArray[np.uint8], start: int, ahead_bytes: int) -> None:
        capacity = int(ring.size)
        # weak: a buffer dropped without close() frees its mapping; the thread then ends
        self._ring = weakref.ref(ring)
        self._address = int(ring.ctypes.data)
        self._capacity = capacity
        self._ahead = min(ahead_bytes, capacity)
        self._start = start - start % _PAGE
        self._done = self._start
        self._target = start + self._ahead  # written by the writer, read by the thread
        self._wake = threading.Event()
        self._closed = False
        self._fn = _madvise()
        self._thread: threading.Thread | None = None
        if self._fn is not None and self._ahead > 0:
            self._thread = threading.Thread(target=self._run, name="relay-prefault", daemon=True)
            self._thread.start()

    def advance(self, tail: int) -> None:
        """Writer: the tail moved to ``tail``; keep populating ahead of it (never blocks)."""
        if self._thread is None:
            return
        target = tail + self._ahead
        if target - self._done > self._ahead // 2:
            self._target = target
            self._wake.set()

    def _run(self) -> None:
        fn = self._fn
        assert fn is not None
        end = self._start + self._capacity
        while not self._closed:
            lo = self._done  # page-aligned: madvise refuses (EINVAL) any other start
            target = -(-self._target // _PAGE) * _PAGE
            hi = min(target, end, lo + _CHUNK)
            if hi <= lo:
                if lo >= end:
                    return  # the whole ring was covered once
                if self._wake.wait(1.0):
                    self._wake.clear()
                elif self._ring() is None:
                    return
                continue
            phys = lo % self._capacity
            length = min(hi - lo, self._capacity - phys)
            ring = self._ring()  # the mapping stays while the call runs
            if ring is None:
                return
            rc = fn(self._address + phys, length, _MADV_POPULATE_WRITE)
            del ring
            if rc != 0:
                log.debug(
                    "MADV_POPULATE_WRITE refused (errno %d): no prefaulting", ctypes.get_errno()
                )
                return
            self._done = lo + length

    def close(self) -> None:
        """Stop the thread; returns once no ``madvise`` call is running (before unmapping)."""
        thread = self._thread
        if thread is None:
            return
        self._closed = True
        self._wake.set()
        thread.join()
        self._thread = None
