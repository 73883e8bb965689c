"""A partition's writer thread, and which groups may skip it.

:class:`WriterThread` is the one thread that appends to a partition's
buffer (and opens, flushes and closes it), with a count of the jobs it has
in flight. :func:`fits_inline` says whether a group may instead be appended
on the event loop itself: the buffer has one writer at a time, so only
while the thread is idle, and only a group whose append cannot block the
loop (see its docstring). Event loop only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from changebus.fetchers import Window
from changebus.schemas import Op

from ._buffer import EventBuffer

__all__ = ["INLINE_BYTES", "INLINE_EVENTS", "WriterThread", "fits_inline"]

T = TypeVar("T")

#: a group at most this large may be appended on the event loop, by bytes and by events
INLINE_BYTES = 256 * 1024
INLINE_EVENTS = 256
#: events an inline append may evict (their windows are counted on the loop)
_INLINE_EVICT_EVENTS = 16 * 1024
_SCHEMA_CHANGE = int(Op.SCHEMA_CHANGE)


class WriterThread:
    """One worker thread for a partition's buffer writes; ``idle`` while no job is in flight.

    A job counts as in flight from :meth:`run` until the loop sees its
    future done (a little past the thread's end: conservative).
    """

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"relay-writer-{name}")
        self._jobs = 0

    @property
    def idle(self) -> bool:
        return self._jobs == 0

    def run(self, fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
        """Run ``fn(*args)`` on the thread."""
        self._jobs += 1
        future = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        future.add_done_callback(self._done)
        return future

    def _done(self, _future: asyncio.Future[Any]) -> None:
        self._jobs -= 1

    async def shutdown(self) -> None:
        """Let the thread finish its jobs and exit (joined in another thread)."""
        await asyncio.to_thread(self._executor.shutdown, wait=True)


def fits_inline(writer: WriterThread, buffer: EventBuffer, batch: Sequence[Window]) -> bool:
    """Whether ``batch`` may be appended on the event loop without blocking it.

    The loop appends only while ``writer`` is idle (and it submits nothing
    meanwhile). The group must be small, framed by changebus's encoders
    (event sizes known: no scan, no CRCs), one ``append_windows`` call (no
    mirrored registry entries, no SCHEMA_CHANGE event: registering one
    writes the registry file) and need no wait for readers: no reader holds
    a pin (readers pin only on the loop, so none can appear meanwhile); and
    the room it needs must be quick to make (``EventBuffer.room_is_cheap``).
    """
    if not writer.idle or buffer.pinned:
        return False
    limit = min(INLINE_BYTES, buffer.capacity // 4, buffer.config.window_limit)
    max_events = min(INLINE_EVENTS, buffer.config.slots // 4)
    size = events = 0
    for window in batch:
        sizes = window.event_sizes
        if window.schemas or not sizes:
            return False
        size += len(window.data)
        events += len(sizes)
        if size > limit or events > max_events:
            return False
        data = window.data
        at = 3  # the op byte of each event header
        for n in sizes:
            if data[at] == _SCHEMA_CHANGE:
                return False
            at += n
    # and the room it needs is quick to make: a few whole windows evicted, found by
    # bisection (the head of a window of millions of events was scanned to its end)
    return buffer.room_is_cheap(size, events, _INLINE_EVICT_EVENTS)
