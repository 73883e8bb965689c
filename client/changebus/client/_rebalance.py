"""Rebalance listener callbacks of a consumer group (after Kafka's ``ConsumerRebalanceListener``).

A group member tells the application which work units
(:class:`~changebus.schemas.Unit`) it gets and gives up::

    class Listener:
        def on_assigned(self, units: frozenset[Unit]) -> None: ...   # after the claim,
                                                                     # before a unit's first window
        def on_revoked(self, units: frozenset[Unit]) -> None: ...    # before a unit is taken away
        def on_lost(self, units: frozenset[Unit]) -> None: ...       # optional (default: on_revoked)

``on_revoked`` comes while the units are still owned: the application may
still commit what it processed of them (the consumer then writes their
positions and lets them go). ``on_lost`` comes when they are already gone
(the ZooKeeper session expired, or the store refused a commit because
another member claimed the unit): nothing of them can be committed any
more, and their windows after the last commit are delivered again
elsewhere.

Methods may be plain or ``async``. Plain methods run in a worker thread
(in callbacks mode the same worker thread as the window callbacks), so
they may block and may call the consumer's blocking methods
(:class:`~changebus.client.SyncConsumer.commit`); ``async`` methods are
awaited on the consumer's event loop. They are never called while a window
is being processed by the same consumer. A listener that raises is logged;
the rebalance goes on.

Thread-safety: a :class:`ListenerCalls` belongs to one consumer's event loop.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from changebus.schemas import Unit

from ._callbacks import AsyncCallbacks

if TYPE_CHECKING:
    from ._dispatch import Dispatcher

__all__ = ["ListenerCalls", "RebalanceListener"]

log = logging.getLogger(__name__)


@runtime_checkable
class RebalanceListener(Protocol):
    """Told about units given to and taken from this member (module docstring).

    Either method may be ``async``; ``on_lost(units)`` may be defined as
    well (otherwise ``on_revoked`` is called for lost units).
    """

    def on_assigned(self, units: frozenset[Unit]) -> Any:
        """``units`` are this member's now (claimed); their windows follow."""
        ...

    def on_revoked(self, units: frozenset[Unit]) -> Any:
        """``units`` are about to be taken away; commit what was processed of them."""
        ...


class ListenerCalls:
    """Calls the rebalance callbacks of a listener and of the callbacks object of ``run()``."""

    def __init__(self, listener: object | None) -> None:
        self._targets: list[object] = [listener] if listener is not None else []
        self._dispatcher: Dispatcher | None = None
        self._callbacks: object | None = None

    def use_callbacks(self, callbacks: object, dispatcher: Dispatcher) -> None:
        """Also call ``callbacks``' rebalance methods (in ``dispatcher``'s worker for sync ones)."""
        if all(t is not callbacks for t in self._targets):
            self._targets.append(callbacks)
        self._callbacks = callbacks
        # sync Callbacks run in the dispatcher's worker thread, with the window callbacks
        self._dispatcher = None if isinstance(callbacks, AsyncCallbacks) else dispatcher

    def forget_callbacks(self) -> None:
        """``run()`` ended: call the callbacks object's methods in a worker thread from now on."""
        self._dispatcher = None

    async def assigned(self, units: frozenset[Unit]) -> None:
        await self._call("on_assigned", units)

    async def revoked(self, units: frozenset[Unit]) -> None:
        await self._call("on_revoked", units)

    async def lost(self, units: frozenset[Unit]) -> None:
        await self._call("on_lost", units)

    async def _call(self, name: str, units: frozenset[Unit]) -> None:
        if not units:
            return
        for target in self._targets:
            method = name
            fn = getattr(target, name, None)
            if fn is None and name == "on_lost":
                method, fn = "on_revoked", getattr(target, "on_revoked", None)
            if fn is None:
                continue
            try:
                if inspect.iscoroutinefunction(fn):
                    await fn(units)
                elif target is self._callbacks and self._dispatcher is not None:
                    await self._dispatcher.call(method, units)
                else:
                    await asyncio.to_thread(fn, units)
            except Exception:  # the rebalance goes on; the application hears of it in the log
                log.exception("%s(%s) raised", method, ", ".join(sorted(map(str, units))))
