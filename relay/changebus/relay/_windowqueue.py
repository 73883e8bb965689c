"""The bounded queue between a partition's fetcher and its buffer writer.

:class:`WindowQueue` holds windows (and the fetcher's end marker or error)
in arrival order, bounded both by count and by bytes of window data. The
byte bound matters for large transactions: 4096 windows of 250 KB would be
a GB of memory that is written once and freed, and every page of it freshly
mapped costs a page fault (several µs each on the project's VMs). Kept to a
few MB, the same memory is reused and stays in cache between the fetcher
that wrote it and the writer that copies it into the ring.

At least one item is always accepted, so a window larger than the byte
bound still passes (alone).

It is the ingest's queue for a fetcher without ``window_feed()``
(:class:`changebus.fetchers.WindowFeed`, the same queue protocol, which the
ingest reads directly): a pump task copies ``windows()`` into it.

Thread-safety: none; one event loop, one producer (the pump) and one
consumer (the ingest loop).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

from changebus.fetchers import Window, window_bytes

__all__ = ["WindowQueue"]

T = TypeVar("T")


def _weight(item: object) -> int:
    return window_bytes(item) if isinstance(item, Window) else 0


class WindowQueue(Generic[T]):
    """A FIFO of windows bounded by ``max_items`` and ``max_bytes`` (see the module docstring).

    ``_bytes`` is the data size of the queued windows; ``_room`` is set while
    the producer may put, ``_ready`` while an item waits.
    """

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self._items: deque[T] = deque()
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._bytes = 0
        self._room = asyncio.Event()
        self._room.set()
        self._ready = asyncio.Event()

    def _full(self) -> bool:
        return bool(self._items) and (
            len(self._items) >= self._max_items or self._bytes >= self._max_bytes
        )

    async def put(self, item: T) -> None:
        """Append ``item``, after waiting while the queue is full."""
        while self._full():
            self._room.clear()
            await self._room.wait()
        self._items.append(item)
        self._bytes += _weight(item)
        self._ready.set()

    async def get(self) -> T:
        """The oldest item, waiting for one."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self.get_nowait()

    def get_nowait(self) -> T:
        """The oldest item; ``IndexError`` when empty."""
        item = self._items.popleft()
        self._bytes -= _weight(item)
        if not self._full():
            self._room.set()
        return item

    def empty(self) -> bool:
        return not self._items

    def inject(self, item: T) -> None:
        """Append ``item`` (an error stopping the ingest) without waiting for room."""
        self._items.append(item)
        self._ready.set()

    @property
    def bytes(self) -> int:
        """Window data bytes queued now."""
        return self._bytes
