"""The bounded hand-off between the fetcher task and the consumer (flow control).

:class:`WindowQueue` holds decoded windows in order, bounded by count and by
bytes (the windows' wire size). :meth:`~WindowQueue.put` waits while the
queue is full, so a slow application stops the fetcher, which stops reading
the HTTP response, which makes the relay's push wait: back-pressure all the
way, with no credit protocol. A window larger than the byte bound is still
admitted when the queue is empty, so progress is always possible.

A terminal error (:meth:`~WindowQueue.fail`) is queued behind the windows
already held: the consumer first receives everything fetched before the
failure, then the error. :meth:`~WindowQueue.close` wakes everyone;
``get`` then raises :class:`QueueClosed`.

:class:`BoundedQueue` is the mechanism, for any item with an ``nbytes``
size (a consumer group queues the per-lane batches of :mod:`._group_lane`
through it). :class:`WindowSink` is what the fetcher and the bootstrapper
fill: a :class:`WindowQueue`, or a group lane's splitting sink, which also
gets the raw window a decoded window came from (its key hashes).

Single event loop only (asyncio primitives, no locks).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, Protocol, TypeVar

from ._assembler import RawWindow
from ._model import Window

__all__ = ["BoundedQueue", "QueueClosed", "WindowQueue", "WindowSink"]


class QueueClosed(Exception):
    """The queue was closed (the consumer is shutting down)."""


class _Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


T = TypeVar("T", bound=_Sized)


class WindowSink(Protocol):
    """Where decoded windows go: ``put`` waits while there is no room (flow control).

    ``raw`` is the validated raw window ``window`` was decoded from, when
    there is one (its data events are ``window.events``, in order).
    """

    async def put(self, window: Window, raw: RawWindow | None = None) -> None: ...

    async def fail(self, error: BaseException) -> None: ...


class BoundedQueue(Generic[T]):
    """Items in order, at most ``max_windows`` and about ``max_bytes``."""

    def __init__(self, max_windows: int, max_bytes: int) -> None:
        self.max_windows = max_windows
        self.max_bytes = max_bytes
        self._items: deque[T] = deque()
        self._bytes = 0
        self._error: BaseException | None = None
        self._closed = False
        self._closing: asyncio.Future[None] | None = None
        self._changed = asyncio.Condition()
        #: times a put had to wait for room (flow control engaged)
        self.waits = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def _full(self, size: int) -> bool:
        if not self._items:
            return False
        return len(self._items) >= self.max_windows or self._bytes + size > self.max_bytes

    async def put(self, window: T) -> None:
        """Append ``window``, waiting while the queue is full."""
        async with self._changed:
            if self._full(window.nbytes):
                self.waits += 1
                await self._changed.wait_for(lambda: self._closed or not self._full(window.nbytes))
            if self._closed:
                raise QueueClosed
            self._items.append(window)
            self._bytes += window.nbytes
            self._changed.notify_all()

    async def fail(self, error: BaseException) -> None:
        """Queue a terminal error behind the windows held."""
        async with self._changed:
            if self._error is None:
                self._error = error
            self._changed.notify_all()

    async def get(self) -> T:
        """The next window; the terminal error once the windows are drained."""
        async with self._changed:
            await self._changed.wait_for(
                lambda: self._closed or bool(self._items) or self._error is not None
            )
            if self._closed:
                raise QueueClosed
            if self._items:
                window = self._items.popleft()
                self._bytes -= window.nbytes
                self._changed.notify_all()
                return window
            assert self._error is not None
            raise self._error

    def close_threadsafe(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close the queue from any thread, through its ``loop`` (idempotent; no-op once closed)."""
        if not loop.is_closed():
            loop.call_soon_threadsafe(self._close_once)

    def _close_once(self) -> None:
        if self._closing is None:
            self._closing = asyncio.ensure_future(self.close())

    async def close(self) -> None:
        """Drop everything and wake all waiters (they raise :class:`QueueClosed`)."""
        async with self._changed:
            self._closed = True
            self._items.clear()
            self._bytes = 0
            self._changed.notify_all()


class WindowQueue(BoundedQueue[Window]):
    """The consumer's queue of decoded windows (a :class:`WindowSink`)."""

    async def put(self, window: Window, raw: RawWindow | None = None) -> None:
        """Append ``window`` (``raw`` is not needed here), waiting while the queue is full."""
        await super().put(window)
