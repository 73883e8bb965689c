"""Waking the readers of one partition when its buffer publishes windows.

One job: turn "the buffer published" (from the writer thread, or from the
event loop for an inline append) into wake-ups on the loop, coalesced when
many readers wait, and call the wake-up listeners (the HTTP layer's tail
broadcast, :mod:`._broadcast`) at each of them.

Data structure: ``_new_window`` is the event the waiting readers wait on; a
wake-up sets it and replaces it with a fresh one, so every reader waiting at
that moment wakes once. ``waiters`` counts the readers in :meth:`Wakeups.wait`
now; ``_tick`` is the scheduled wake-up, if any; ``_last`` the loop time of
the last one.

Coalescing: one waiter is woken at once. With ``n`` waiters, wake-ups are at
least ``min(n - 1, 50) * 100 us`` apart: waiters wake together, share one
selection (the response cache, :mod:`._respcache`) and each gets a larger
batch, instead of every commit costing one response per waiter.

Thread-safety: :meth:`Wakeups.published` may be called from any thread;
everything else on the loop that called :meth:`Wakeups.start`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

__all__ = ["Wakeups"]

log = logging.getLogger("changebus.relay.ingest")

#: wake-up coalescing for many waiting readers (module docstring)
_TICK_PER_WAITER_S = 0.0001
_MAX_TICK_S = 0.005


class Wakeups:
    """The wake-ups of one partition's readers (module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        #: readers waiting in :meth:`wait` now
        self.waiters = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._new_window: asyncio.Event | None = None
        self._tick: asyncio.TimerHandle | None = None
        self._last = 0.0
        self._listeners: list[Callable[[], None]] = []

    def start(self) -> None:
        """Bind to the running loop (the partition's start)."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._new_window = asyncio.Event()

    def stop(self) -> None:
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None

    def published(self) -> None:
        """The buffer published windows (writer thread, or the loop for an inline append)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if threading.get_ident() == self._loop_thread:
            self._on_publish()  # an inline append: no wake-up of the loop needed
        else:
            loop.call_soon_threadsafe(self._on_publish)

    def _on_publish(self) -> None:
        """Loop thread: wake the waiting readers now or at the next tick (coalescing)."""
        if self._tick is not None:
            return  # a wake-up is already scheduled; it will see this window
        assert self._loop is not None
        interval = min(max(self.waiters - 1, 0) * _TICK_PER_WAITER_S, _MAX_TICK_S)
        at = self._last + interval
        if at <= self._loop.time():
            self._wake()
        else:
            self._tick = self._loop.call_at(at, self._wake)

    def _wake(self) -> None:
        assert self._new_window is not None
        assert self._loop is not None
        self._tick = None
        self._last = self._loop.time()
        self._new_window.set()
        self._new_window = asyncio.Event()
        for listener in self._listeners:
            try:
                listener()
            except Exception:  # serving must never break the ingest that woke it
                log.exception("partition %s: a wake-up listener failed", self.name)

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (on the loop) at every wake-up of the waiting readers."""
        self._listeners.append(listener)

    async def wait(self, seconds: float) -> bool:
        """Wait until a window is published (True) or ``seconds`` pass."""
        assert self._new_window is not None
        self.waiters += 1
        try:
            async with asyncio.timeout(seconds):
                await self._new_window.wait()
        except TimeoutError:
            return False
        finally:
            self.waiters -= 1
        return True
