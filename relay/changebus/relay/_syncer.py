"""Grouped syncs of a buffer to disk, for ``durability = "fsync"``.

One job: make appended windows durable (``msync``) in groups, in a thread
of its own, and say how far they are (:attr:`GroupSyncer.synced_scn`), so
that the relay acknowledges the source only for windows that are on disk
(:class:`~._host.PartitionHost` acknowledges ``min(synced_scn, fence)``
after each sync: acks trail the appends asynchronously and never pass what
is on disk).

How it groups: the writer thread calls :meth:`GroupSyncer.request` after
every group commit (a lock and a notify, no I/O). The syncer thread takes
the buffer's newest published state ``T`` and msyncs what changed since
the state ``S`` of its previous sync, in this order:

1. the ring bytes of virtual positions ``[S.tail_pos, T.tail_pos)``: one or
   two page-aligned physical spans (the range may wrap past the end of
   ``ring.dat``; a range of a whole lap or more is the whole file);
2. the event table records ``[S.tail_event, T.tail_event)`` and the SCN
   index entries ``[S.index_tail, T.index_tail)`` (likewise circular);
3. ``meta.dat`` (one page: both slots);
4. the synced watermark ``synced.dat`` (``T``'s tail and last SCN, synced:
   :mod:`._watermark`), which recovery uses to tell windows that were synced
   and acknowledged from an unsynced tail;

then sets ``synced_scn = T.last_scn`` and wakes :meth:`GroupSyncer.wait_synced`
on the event loop. Whatever the
writer appends while a sync runs is covered by the next one: under load one
sync covers many groups, and an idle relay syncs each group at once. The
first sync after :meth:`start` covers the whole files (a restarted relay's
windows may still be only in the page cache).

Why this order is enough: recovery (:mod:`._recovery`) trusts ``meta.dat``
and checks every event it names against the event's CRCs. ``meta.dat`` on
disk may be *newer* than ``T`` (the writer keeps publishing, and the kernel
writes dirty pages back when it likes); the unsynced events it names are
then found damaged (or stale, from an earlier lap) and dropped, and the
source, never told about them, sends them again. A window at or below
``synced_scn`` is never dropped: its bytes were on disk before any
``meta.dat`` naming it was synced, and before the watermark that tells
recovery it was (damage at or below the watermark can only be an eviction's
newer bytes over the oldest windows: those count as evicted, the rest is
kept; damage above it is trimmed, never jumped over). The event table and
index are derived data (recovery repairs them from the ring); they are
synced so that a recovery rarely has to.

Readers see windows before they are synced (waiting for the disk would
cost every consumer the sync's latency). That is safe: after an OS crash
recovery keeps the windows up to the first damaged one and the source sends
the rest again from the last kept window's source position, with the same
SCNs and the same changes (the fetchers derive both from the source), so a
consumer that read such a window already is sent nothing twice, and nothing
different, once it comes back. (A SCHEMA_CHANGE the relay's registry
already holds is not announced again: docs/operations.md, "Durability".)

Not on the GIL: ``mmap.flush`` holds the GIL for the whole ``msync``, which
would stop the event loop and the writer; the syncer calls libc's ``msync``
through ctypes, which lets go of it (as :mod:`._prefault` does for
``madvise``). Linux and macOS.

A failed ``msync`` (``EIO``, ...) stops the syncer for good: the kernel may
have dropped the failed pages' error state, so a later sync that succeeds
would prove nothing. ``synced_scn`` stays where it was, the source is
acknowledged no further (it keeps its changes), :attr:`GroupSyncer.error`
says why (``/v1/status``), and a restart of the relay recovers from what is
on disk.

Thread-safety: :meth:`request` is called by the writer thread;
:meth:`start`, :meth:`wait_synced` and :meth:`stop` on the event loop
(``stop`` blocks: run it in a thread) and ``stop`` must return before the
buffer is closed; the
figures (``synced_scn``, ``syncs``, ``sync_seconds_total``, ``error``) are
plain values written by the syncer thread only, read by anyone.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import mmap
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from changebus.schemas import ConfigError
from changebus.schemas.files import libc_function

from ._watermark import Synced

if TYPE_CHECKING:
    from ._buffer import EventBuffer
    from ._meta import BufferMeta

__all__ = ["GroupSyncer", "Span", "circular_spans", "msync_spans"]

log = logging.getLogger("changebus.relay.durability")

#: ``MS_SYNC`` by platform (libc's headers)
_MS_SYNC = {"linux": 4, "darwin": 0x10}
_PAGE = mmap.PAGESIZE

#: ``(file name, address, length)``: a page-aligned range of one mapping to msync
Span = tuple[str, int, int]


def circular_spans(start: int, stop: int, size: int) -> list[tuple[int, int]]:
    """Page-aligned physical ``[a, b)`` byte ranges covering virtual bytes ``[start, stop)``.

    The file holds ``size`` bytes in a circle (virtual byte ``v`` lives at
    ``v % size``); a range of ``size`` bytes or more is the whole file.
    """
    if stop <= start:
        return []
    if stop - start >= size:
        return [(0, size)]
    a = start % size
    b = a + (stop - start)
    spans = [(a, b)] if b <= size else [(a, size), (0, b - size)]
    return [(x - x % _PAGE, min(-(-y // _PAGE) * _PAGE, size)) for x, y in spans]


@functools.cache
def _libc_msync() -> Any:
    flag = _MS_SYNC.get(sys.platform)
    if flag is None:
        raise ConfigError(f"durability = 'fsync' needs msync: not supported on {sys.platform}")
    fn = libc_function("msync", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int)
    if fn is None:
        raise ConfigError(f"durability = 'fsync' needs msync: libc has none on {sys.platform}")
    return fn


def msync_spans(spans: list[Span]) -> bool:
    """``msync(MS_SYNC)`` each span through libc, without the GIL; False: not on this platform.

    ``mmap.flush`` holds the GIL for the whole sync: a flush of many dirty
    MiB stops every other thread of the process meanwhile (the relay's
    event loop included). Raises :class:`OSError` when a sync fails.
    """
    flag = _MS_SYNC.get(sys.platform)
    if flag is None:
        return False
    fn = _libc_msync()
    for name, address, length in spans:
        if length and fn(address, length, flag) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"msync of {name}: {os.strerror(errno)}")
    return True


class GroupSyncer:
    """The syncer thread of one buffer (module docstring)."""

    def __init__(self, buffer: EventBuffer) -> None:
        self._buffer = buffer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._synced = asyncio.Event()
        _libc_msync()  # (refuses a platform without msync now, not at the first sync)
        self._cond = threading.Condition()
        self._wanted = True  # the first round syncs the whole files
        self._stopping = False
        self._thread: threading.Thread | None = None
        #: the newest SCN whose window is on disk (-1: none yet)
        self.synced_scn = -1
        #: syncs done, and the seconds they took together
        self.syncs = 0
        self.sync_seconds_total = 0.0
        #: why syncing stopped for good ("" while it works)
        self.error = ""

    def start(self) -> None:
        """Start the thread (event loop: :meth:`wait_synced` is woken there)."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(
            target=self._run, name=f"relay-syncer-{self._buffer.name}", daemon=True
        )
        self._thread.start()

    def request(self) -> None:
        """Writer thread: a group was published; the next sync covers it."""
        with self._cond:
            if not self._wanted:
                self._wanted = True
                self._cond.notify()

    async def wait_synced(self, above: int) -> int:
        """Wait until ``synced_scn > above``; returns it (event loop)."""
        while self.synced_scn <= above:
            self._synced.clear()
            if self.synced_scn > above:
                break
            await self._synced.wait()
        return self.synced_scn

    def _wake(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._synced.set)

    def stop(self) -> None:
        """Stop the thread (after the sync in progress, if any). Blocks."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def status(self) -> dict[str, Any]:
        """The figures of ``/v1/status`` (``durability``)."""
        out: dict[str, Any] = {
            "mode": "fsync",
            "synced_scn": self.synced_scn,
            "syncs": self.syncs,
            "sync_seconds_total": round(self.sync_seconds_total, 6),
        }
        if self.error:
            out["error"] = self.error
        return out

    def _run(self) -> None:
        since: BufferMeta | None = None
        while True:
            with self._cond:
                while not self._wanted and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                self._wanted = False
            upto = self._buffer.meta
            started = time.perf_counter()
            try:
                msync_spans(self._buffer.sync_spans(since, upto))
                mark = self._buffer.watermark
                if mark is not None:  # before any acknowledgement of it (module docstring)
                    mark.store(Synced(upto.tail_event, upto.tail_pos, upto.last_scn))
            except OSError as exc:
                self.error = f"msync failed, the source is acknowledged no further: {exc}"
                log.error("buffer %s: %s; restart the relay", self._buffer.name, self.error)
                return
            self.sync_seconds_total += time.perf_counter() - started
            self.syncs += 1
            since = upto
            if upto.last_scn > self.synced_scn:
                self.synced_scn = upto.last_scn
                self._wake()
