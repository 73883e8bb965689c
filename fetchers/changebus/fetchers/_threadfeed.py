"""Run a blocking producer in a thread and consume its items on the event loop.

:class:`ThreadFeed` starts ``produce(emit, stopping)`` in a daemon thread.
``emit(item)`` blocks the producer while the bounded queue is full (by count,
and by bytes when a ``weigh`` function is given), so a slow consumer slows
the source down instead of growing memory. The producer should
return when ``stopping`` is set. An exception in the producer is re-raised
to the consumer of :meth:`ThreadFeed.items`.

Thread-safety: ``emit`` may only be called from the producer thread; the
async side only from the loop that created the feed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Generic, TypeVar

__all__ = ["ThreadFeed"]

T = TypeVar("T")

_DONE = object()


class ThreadFeed(Generic[T]):
    """A bounded bridge from one producer thread to async consumers.

    The producer takes a slot of a semaphore of ``maxsize`` slots before it
    appends an item to ``_handover`` (a deque, under ``_lock``); the consumer
    gives the slot back when it takes the item, so at most ``maxsize`` items
    are in flight. The loop is woken with ``call_soon_threadsafe`` only when
    no wake-up is pending (``_wake_pending``): one wake-up moves every item
    handed over meanwhile. Each wake-up is a write to the loop's self-pipe, a
    system call after which the producer must win the GIL back; one per item
    made a fast producer wait on the GIL for most of its time.

    With ``weigh`` (an item's size in bytes) the items in flight are also
    bounded by ``max_bytes`` (always at least one item): windows of large
    transactions would otherwise fill ``maxsize`` slots with hundreds of MB.
    Memory kept that low is reused by the allocator instead of being freshly
    mapped; on the project's VMs every first-touched page costs a fault of
    several µs, which made an unbounded backlog drain a third slower.
    ``_bytes`` (under ``_lock``) counts the weight handed over and not yet
    taken by the consumer; the producer waits on ``_room`` while it is over.

    With ``hold_items`` above 1 the producer may also hold items back: the
    loop is woken once ``hold_items`` items wait or the oldest has waited
    ``hold_s``, and at the latest when the producer calls :meth:`flush`
    (which it must do before it waits for its source) or must wait for a
    slot (done here).
    """

    def __init__(
        self,
        produce: Callable[[Callable[[T], None], threading.Event], None],
        *,
        maxsize: int = 64,
        name: str = "changebus-feed",
        hold_items: int = 1,
        hold_s: float = 0.005,
        weigh: Callable[[T], int] | None = None,
        max_bytes: int = 8 << 20,
    ) -> None:
        self._produce = produce
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._lock = threading.Lock()
        self._handover: deque[object] = deque()
        self._wake_pending = False
        self._hold_items = hold_items
        self._hold_s = hold_s
        self._held_since = 0.0
        self._slots = threading.BoundedSemaphore(maxsize)
        self._weigh = weigh
        self._max_bytes = max_bytes
        self._bytes = 0
        self._room = threading.Condition(self._lock)
        self._loop = asyncio.get_running_loop()
        self.stopping = threading.Event()
        self._error: BaseException | None = None
        #: called by the producer thread about every 0.2 s while it waits for room (a
        #: source connection's own keepalives; outside the feed's lock)
        self.on_wait: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _emit(self, item: T) -> None:
        if not self._slots.acquire(blocking=False):
            self.flush()  # the consumer must see what is held before the producer waits
            while not self._slots.acquire(timeout=0.2):
                if self.stopping.is_set():
                    raise _Stopped
                if self.on_wait is not None:
                    self.on_wait()
        if self.stopping.is_set():
            raise _Stopped
        if self._weigh is not None:
            self._take_room(self._weigh(item))
        try:
            self._hand_over(item, hold=self._hold_items > 1)
        except RuntimeError:  # the loop closed
            raise _Stopped from None

    def _take_room(self, size: int) -> None:
        """Producer thread: wait until ``size`` more bytes fit (or nothing is in flight)."""
        with self._lock:
            if self._bytes == 0 or self._bytes + size <= self._max_bytes:
                self._bytes += size
                return
        self.flush()  # the consumer must see what is held before the producer waits
        while True:
            with self._lock:
                if not self._bytes or self._bytes + size <= self._max_bytes:
                    self._bytes += size
                    return
                self._room.wait(0.2)
                if not self._bytes or self._bytes + size <= self._max_bytes:
                    self._bytes += size
                    return
            if self.stopping.is_set():
                raise _Stopped
            if self.on_wait is not None:
                self.on_wait()

    def _give_room(self, size: int) -> None:
        """Loop thread: the consumer took an item of ``size`` bytes."""
        with self._lock:
            self._bytes -= size
            self._room.notify()

    def _hand_over(self, item: object, *, hold: bool = False) -> None:
        """Producer thread: queue ``item`` for the loop; wake it unless a wake-up is pending."""
        with self._lock:
            handover = self._handover
            handover.append(item)
            if self._wake_pending:
                return
            if hold:
                now = time.monotonic()
                if len(handover) == 1:
                    self._held_since = now
                if len(handover) < self._hold_items and now - self._held_since < self._hold_s:
                    return
            self._wake_pending = True
        self._loop.call_soon_threadsafe(self._move)

    def flush(self) -> None:
        """Producer thread: wake the loop for the items held back, if any."""
        with self._lock:
            if not self._handover or self._wake_pending:
                return
            self._wake_pending = True
        try:
            self._loop.call_soon_threadsafe(self._move)
        except RuntimeError:  # the loop closed
            raise _Stopped from None

    def _move(self) -> None:
        """Loop thread: move the handed-over items into the queue, in order."""
        with self._lock:
            items = list(self._handover)
            self._handover.clear()
            self._wake_pending = False
        for item in items:
            self._queue.put_nowait(item)

    def _run(self) -> None:
        try:
            self._produce(self._emit, self.stopping)
        except _Stopped:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, re-raised there
            self._error = exc
        finally:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._hand_over(_DONE)

    async def items(self) -> AsyncIterator[T]:
        """Items in production order; ends when the producer returns."""
        while True:
            item = await self.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def get(self) -> T | BaseException | None:
        """The next item, waiting for one (the :class:`WindowFeed` protocol).

        The producer's error is returned (not raised) as the last item,
        ``None`` marks its end; so a consumer that batches what is queued
        keeps the items that came before a failure.
        """
        return self._took(await self._queue.get())

    def get_nowait(self) -> T | BaseException | None:
        """As :meth:`get` without waiting; ``IndexError`` when nothing is queued."""
        try:
            return self._took(self._queue.get_nowait())
        except asyncio.QueueEmpty:
            raise IndexError("no item queued") from None

    def empty(self) -> bool:
        """Nothing queued on the loop's side (the producer may be handing over more)."""
        return self._queue.empty()

    def inject(self, error: BaseException) -> None:
        """Loop thread: deliver ``error`` after the items queued now (then nothing more)."""
        self._queue.put_nowait(_Injected(error))

    def _took(self, item: object) -> T | BaseException | None:
        if item is _DONE:
            return self._error
        if isinstance(item, _Injected):
            return item.error
        self._slots.release()
        if self._weigh is not None:
            self._give_room(self._weigh(item))  # type: ignore[arg-type]
        return item  # type: ignore[return-value]

    async def close(self) -> None:
        """Ask the producer to stop and wait for its thread."""
        self.stopping.set()
        await asyncio.to_thread(self._thread.join, 5.0)


class _Stopped(Exception):
    pass


class _Injected:
    """An error put on the queue by the loop (:meth:`ThreadFeed.inject`)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error
