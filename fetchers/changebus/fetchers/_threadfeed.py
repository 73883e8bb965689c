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
    """A bounded bridge from one producer thread to async consumers."""

    def __init__(
        self,
        produce: Callable[[Callable[[T], None], threading.Event], None],
        *,
        maxsize: int = 64,
        name: str = "changebus-feed",
    ) -> None:
        self._produce = produce
        self._queue: asyncio.Queue[object] = asyncio.Queue(maxsize)
        self._loop = asyncio.get_running_loop()
        self.stopping = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _emit(self, item: T) -> None:
        if self.stopping.is_set():
            raise _Stopped
        fut = asyncio.run_coroutine_threadsafe(self._queue.put(item), self._loop)
        while True:
            try:
                fut.result(timeout=0.2)
                return
            except TimeoutError:
                if self.stopping.is_set():
                    fut.cancel()
                    raise _Stopped from None

    def _run(self) -> None:
        try:
            self._produce(self._emit, self.stopping)
        except _Stopped:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, re-raised there
            self._error = exc
        finally:
            if not self._loop.is_closed():
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    asyncio.run_coroutine_threadsafe(self._queue.put(_DONE), self._loop)

    async def items(self) -> AsyncIterator[T]:
        """Items in production order; ends when the producer returns."""
        while True:
            item = await self._queue.get()
            if item is _DONE:
                if self._error is not None:
                    raise self._error
                return
            yield item  # type: ignore[misc]

    async def close(self) -> None:
        """Ask the producer to stop and wait for its thread."""
        self.stopping.set()
        while not self._queue.empty():  # unblock a producer waiting for room
            self._queue.get_nowait()
        await asyncio.to_thread(self._thread.join, 5.0)


class _Stopped(Exception):
    pass
