"""Run a blocking producer in a thread and consume its items on the event loop.

:class:`ThreadFeed` starts ``produce(emit, stopping)`` in a daemon thread.
``emit(item)`` blocks the producer while the bounded queue is full, so a slow
consumer slows the source down instead of growing memory. The producer should
return when ``stopping`` is set. An exception in the producer is re-raised
to the consumer of :meth:`ThreadFeed.items`.

Thread-safety: ``emit`` may only be called from the producer thread; the
async side only from the loop that created the feed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from typing import Generic, TypeVar

__all__ = ["ThreadFeed"]

T = TypeVar("T")

_DONE = object()


class ThreadFeed(Generic[T]):
    """A bounded bridge from one producer thread to async consumers.

    The producer takes a slot of a semaphore of ``maxsize`` slots before it
    hands an item to the loop with ``call_soon_threadsafe`` (no round trip:
    it does not wait for the loop to run); the consumer gives the slot back
    when it takes the item, so at most ``maxsize`` items are in flight.
    """

    def __init__(
        self,
        produce: Callable[[Callable[[T], None], threading.Event], None],
        *,
        maxsize: int = 64,
        name: str = "changebus-feed",
    ) -> None:
        self._produce = produce
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._slots = threading.BoundedSemaphore(maxsize)
        self._loop = asyncio.get_running_loop()
        self.stopping = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _emit(self, item: T) -> None:
        while not self._slots.acquire(timeout=0.2):
            if self.stopping.is_set():
                raise _Stopped
        if self.stopping.is_set():
            raise _Stopped
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop closed
            raise _Stopped from None

    def _run(self) -> None:
        try:
            self._produce(self._emit, self.stopping)
        except _Stopped:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, re-raised there
            self._error = exc
        finally:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(self._queue.put_nowait, _DONE)

    async def items(self) -> AsyncIterator[T]:
        """Items in production order; ends when the producer returns."""
        while True:
            item = await self._queue.get()
            if item is _DONE:
                if self._error is not None:
                    raise self._error
                return
            self._slots.release()
            yield item  # type: ignore[misc]

    async def close(self) -> None:
        """Ask the producer to stop and wait for its thread."""
        self.stopping.set()
        await asyncio.to_thread(self._thread.join, 5.0)


class _Stopped(Exception):
    pass
