"""The consumer-group engine behind :class:`~changebus.client.Consumer` with ``config.group``.

Structure of one member::

    ZkSession --- GroupMember (registration, target, owner nodes, lease)
                      |  on_target / on_lost
                  UnitOwner (acquire + claim, lanes, revoke, drop)  --- UnitStore (fenced checkpoints)
                      |
    relays --> Lane 1 (RelayFetcher, mod filter, split) --+
           --> Lane 2 ...                                 +--> BoundedQueue[LaneBatch]
                                                               |
                            next_window(): rebalance callbacks, fence, one unit window
                                   |
                     iterator (async for)  /  Dispatcher (callbacks)
                                   |
                      GroupPositions (per-unit checkpoints) --commit_interval_s--> store

Delivery path (:meth:`GroupConsumer.next_window`, the only place windows
reach the application): before each window it runs the rebalance work that
is due -- ``on_lost`` for units lost, ``on_revoked`` then the revocation of
units no longer assigned, ``on_assigned`` for units claimed -- so listener
callbacks never run while a window is being processed, ``on_revoked`` comes
while the units are still held and ``on_assigned`` before a unit's first
window. Then the fence: the window is handed over only while the member's
lease is valid (:meth:`GroupMember.lease_valid`) and its unit still owned;
while the lease is in doubt (ZooKeeper disconnected) it waits, and a unit
whose owner node is gone is dropped. A window the dispatcher replays after
a rollback passes the same fence again (:meth:`GroupConsumer._readmit`). So
a member frozen past its session delivers nothing when it wakes, not even
the windows it kept for a replay.

The rebalance work runs on the application's path on purpose (a unit is
never taken away in the middle of one of its windows); the price is that a
member busy with one long window, or an iterator the application stops
pulling from, hands its revoked units over only when it asks for the next
window. Acquiring runs in the background: the units a member keeps go on
flowing while new ones are claimed.

Ordering: the windows of one unit come in SCN order (one lane reads a unit
at a time; a unit changes lanes only at a point where every window of its
old lane up to there was handed out); nothing is promised across units.
Lanes: one per claim batch, narrowed when units leave, merged when the
member is idle and lanes of a partition stand at the same window
(:mod:`._group_lanes`).

Commits: iterator ``commit()`` (auto-commit: when the next window is asked
for) and the callbacks' ``on_checkpoint`` accept positions; the store is
written at most every ``commit_interval_s`` (a timer writes what waits),
on revoke (the units' final commit) and on close. An explicit
:meth:`GroupConsumer.commit` writes at once.

Thread-safety: the consumer's event loop, except :meth:`GroupConsumer.stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any, Literal

import aiohttp

from changebus.cluster import CoordinationError, GroupMember, ZkSession, ZkUnitStore
from changebus.schemas import Checkpoint, Unit, UnitStore, ended, stop_task

from ._callbacks import AsyncCallbacks, Callbacks
from ._cluster import ClusterRoute
from ._config import ConsumerConfig
from ._dispatch import Dispatcher
from ._errors import DataLossDetectedError
from ._group_join import connect, follow_relays
from ._group_lane import WAKE, Lane, LaneBatch
from ._group_position import GroupPositions
from ._group_units import UnitOwner
from ._http import open_session
from ._model import Window
from ._queue import BoundedQueue, QueueClosed
from ._rebalance import ListenerCalls

__all__ = ["GroupConsumer"]

log = logging.getLogger(__name__)

#: how often a delivery waiting for the lease looks again
_LEASE_POLL_S = 0.02
#: how often at most a lane's units without events advance (busy member; idle: at once)
_ADVANCE_S = 0.05


class GroupConsumer:
    """One member of ``config.group`` (module docstring); used through ``Consumer``."""

    def __init__(
        self,
        config: ConsumerConfig,
        store: UnitStore | None,
        listener: object | None,
        session: aiohttp.ClientSession | None,
    ) -> None:
        self.config = config
        self._store = store
        self._own_store = store is None
        self._calls = ListenerCalls(listener)
        self._http = session
        self._own_http = session is None
        self._zk: ZkSession | None = None
        self.member: GroupMember | None = None
        self._owner: UnitOwner | None = None
        self._positions: GroupPositions | None = None
        self._queue: BoundedQueue[LaneBatch] | None = None
        self._routes: list[ClusterRoute] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._ready: deque[tuple[Lane, Unit, Window]] = deque()
        self._uncommitted: dict[str, Window] = {}
        self._dispatcher: Dispatcher | None = None
        self._mode: Literal["", "iterator", "callbacks"] = ""
        self._failed: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self._closed = False
        self._starting: asyncio.Task[None] | None = None
        self._start_ended = asyncio.Event()  # (set once start() released or finished)
        #: stop() came before the queue existed (during start): start closes it at once
        self._stop_requested = False
        self.windows = 0
        #: ``time.monotonic()`` when the fence last let a window through (a window handed
        #: on starts after it; a frozen member's in-flight window is told apart by it)
        self.admitted_at = 0.0

    # ---- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Join the group and start following its assignment (implied by iteration and ``run``).

        Raises :class:`~changebus.schemas.ConfigError` when the group's stored
        bucket count or partitions differ from this member's configuration.
        """
        if self._started:
            return
        if self._closed:
            raise RuntimeError("this consumer is closed")
        self._started = True
        self._loop = asyncio.get_running_loop()
        # the start runs as a task of its own, which close() can end: it may wait for
        # ZooKeeper for ever (``max_attempts`` 0), and a close() meanwhile found nothing
        # to release, then the start went on, joined, claimed units and delivered
        # windows from a closed consumer whose nodes nobody removed (review)
        starting = self._starting = asyncio.create_task(
            self._start(self.config), name="changebus-group-start"
        )
        try:
            try:
                await asyncio.wait({starting})
                starting.result()
            except BaseException:
                await stop_task(starting)  # (this caller cancelled: the start ends too)
                await self._shutdown()
                if self._closed_meanwhile() and starting.cancelled():
                    return  # ended by close(): the consumer is closed
                raise
            if self._closed_meanwhile():  # close() came as the start ended: left to us
                await self._shutdown()
        finally:
            self._start_ended.set()

    def _closed_meanwhile(self) -> bool:
        """close() ran (a fresh read: mypy keeps ``_closed`` narrowed across awaits)."""
        return self._closed

    async def _start(self, cfg: ConsumerConfig) -> None:
        zk = self._zk = await connect(cfg)
        member = self.member = GroupMember(
            zk, cfg.group, cfg.partitions, cfg.buckets, name=cfg.member_name
        )
        if self._store is None:
            # a claim lands only while this member's node exists (one transaction)
            self._store = ZkUnitStore(zk, fence=lambda: member.member_path)
        if self._http is None:
            self._http = await open_session(cfg.auth)
        queue = self._queue = BoundedQueue[LaneBatch](cfg.queue_windows, cfg.queue_bytes)
        if self._stop_requested:  # stop() ran while this start was under way
            queue.close_threadsafe(asyncio.get_running_loop())
        positions = self._positions = GroupPositions(self._store, cfg.group, cfg.commit_interval_s)
        owner = self._owner = UnitOwner(
            cfg, member, self._store, positions, self._http, queue, self._wake
        )
        positions.on_fenced = self._on_fenced
        for partition in cfg.partitions:
            route = await follow_relays(cfg, partition, owner.lanes)
            if route is not None:
                self._routes.append(route)
        member.on_lost(self._on_lost)
        member.on_target(owner.on_target)
        await member.start()
        self._tasks.append(asyncio.create_task(owner.run(), name="changebus-group-units"))
        if cfg.commit_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._flusher(), name="changebus-group-commits"))
        owner.on_target(member.target)

    async def _flusher(self) -> None:
        """Write accepted positions that wait, every ``commit_interval_s``."""
        assert self._positions is not None
        while True:
            await asyncio.sleep(self.config.commit_interval_s)
            await self._positions.flush(quiet=True)

    def _on_lost(self, units: frozenset[Unit]) -> None:
        if self._owner is not None:
            self._owner.on_lost(units)
        self._uncommitted.clear()  # not committed any more: nothing of the lost units is
        self._purge_replay()

    def _on_fenced(self, units: frozenset[Unit]) -> None:
        """Another member claimed ``units``: their windows yielded or kept for a replay
        are of the claim that ended, and must not advance the next one (the unit is
        claimed again at once: the next commit moved its new position to the old
        claim's window, and the window after it then failed for good; found by review)."""
        if self._owner is not None:
            self._owner.on_fenced(units)
        texts = {str(u) for u in units}
        for text in texts:
            self._uncommitted.pop(text, None)
        self._purge_replay(texts)

    def _wake(self) -> None:
        """A consumer waiting for windows has rebalance work: queue a wake-up when it is idle."""
        queue = self._queue
        if queue is not None and not len(queue) and not queue.closed:
            task = asyncio.ensure_future(queue.put(WAKE))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def close(self) -> None:
        """Revoke every unit (``on_revoked``, final commit, release), leave the group; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._starting is not None and not self._start_ended.is_set():
            self._starting.cancel()  # start() releases what it opened, then returns
            await self._start_ended.wait()
            return
        await self._shutdown()

    async def _shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            await ended(task)
        self._tasks.clear()
        owner, member = self._owner, self.member
        try:
            if owner is not None:
                await owner.stop_reading()
                self._ready.clear()
                held = frozenset(owner.held)
                if held:
                    gone, announced = held, held - frozenset(owner.take_assigned())
                    await self._calls.revoked(frozenset(u for u in gone if u in announced))
                    if self._mode == "iterator":
                        self._accept_iterator(gone)
                    await owner.let_go(gone, narrow=False)
            if self._queue is not None:
                await self._queue.close()
        finally:
            if member is not None:
                with contextlib.suppress(CoordinationError):
                    await member.stop()
            for route in self._routes:
                await route.stop()
            self._routes.clear()
            if self._own_store and self._store is not None:
                await self._store.close()
            if self._zk is not None:
                await self._zk.stop()
            if self._own_http and self._http is not None:
                await self._http.close()
                self._http = None

    def stop(self) -> None:
        """End a running ``run`` or iteration after the current window (any thread).

        A stop during :meth:`start` is kept: the queue is closed as soon as it exists.
        """
        self._stop_requested = True
        if self._loop is not None and self._queue is not None:
            self._queue.close_threadsafe(self._loop)

    # ---- delivery -----------------------------------------------------------------

    async def next_window(self) -> Window:
        """The next unit window for the application (module docstring); QueueClosed at the end."""
        owner, queue, positions = self._owner, self._queue, self._positions
        assert owner is not None
        assert queue is not None
        assert positions is not None
        while True:
            if owner.pending:
                await self._rebalance(owner)
            if self._ready:
                lane, unit, window = self._ready.popleft()
                if owner.held.get(unit) is not lane:
                    continue  # revoked or lost meanwhile
                if not await self._fence(owner, unit, lane):
                    continue
                self.windows += 1
                return window
            if not len(queue):
                for lane in owner.lanes:  # idle: the positions of units without events catch up
                    if lane.unadvanced is not None:
                        lane.advance_idle(lane.unadvanced, positions, self._held())
                owner.lanes.merge(owner.held)  # lanes of a partition at one position become one
            batch = await queue.get()
            lane_ = batch.lane
            if lane_ is None or lane_.stopped:
                continue
            lane_.dequeued = batch
            now = time.monotonic()
            if now - lane_.advanced_at >= _ADVANCE_S:
                lane_.advanced_at = now
                lane_.advance_idle(batch, positions, self._held())
            else:
                lane_.unadvanced = batch
            self._ready.extend((lane_, u, w) for u, w in batch.windows)

    async def _fence(self, owner: UnitOwner, unit: Unit, lane: Lane | None = None) -> bool:
        """Whether ``unit``'s window may go to the application now (waits while the lease is in doubt).

        ``lane``: the lane the window came from, which must still read the
        unit; None for a window replayed after a rollback (the unit held at all).
        """
        member = self.member
        assert member is not None
        assert self._queue is not None
        waited = False
        while True:
            held = owner.held.get(unit)
            if held is None or (lane is not None and held is not lane) or self._queue.closed:
                return False
            if member.lease_valid():
                if unit in member.owned:
                    if waited:
                        log.info("group %s: the lease is back; delivering again", self.config.group)
                    self.admitted_at = time.monotonic()
                    return True
                owner.drop([unit])  # the owner node is gone: someone else may hold it
                return False
            if not waited:
                log.warning(
                    "group %s: the member's lease is in doubt (ZooKeeper); holding deliveries",
                    self.config.group,
                )
                waited = True
            await asyncio.sleep(_LEASE_POLL_S)

    async def _readmit(self, window: Window) -> bool:
        """The fence again for a window the dispatcher replays after a rollback."""
        owner = self._owner
        if owner is None or not window.unit:
            return False
        return await self._fence(owner, Unit.parse(window.unit))

    async def _rebalance(self, owner: UnitOwner) -> None:
        """Run the rebalance work due, on the application's path (module docstring)."""
        lost = owner.take_lost()
        if lost:
            await self._calls.lost(lost)
        if owner.revoke_due:
            gone, announced = owner.revocable()
            if gone:
                await self._calls.revoked(announced)
                gone = frozenset(u for u in gone if u in owner.held)
                texts = {str(u) for u in gone}
                self._purge_replay(texts)
                for lane in {owner.held[u] for u in gone}:
                    if lane.unadvanced is not None:  # their final positions as far as known
                        lane.advance_idle(lane.unadvanced, self._positions_(), self._held())
                if self._mode == "iterator":
                    # after the advance: a unit's window yielded and not committed holds its
                    # position back there (accepted first, the unit moved past it: review)
                    self._accept_iterator(gone)
                replaced = await owner.let_go(gone)
                if replaced:  # windows not handed out yet now belong to the narrowed lanes
                    self._ready = deque(
                        (replaced.get(lane, lane), unit, window)
                        for lane, unit, window in self._ready
                    )
        assigned = owner.take_assigned()
        if assigned:
            await self._calls.assigned(assigned)

    def _held(self) -> dict[str, Window] | None:
        """Iterator mode: the windows yielded and not committed, by unit (else None)."""
        return self._uncommitted if self._mode == "iterator" else None

    def _positions_(self) -> GroupPositions:
        assert self._positions is not None
        return self._positions

    def _accept_iterator(self, units: frozenset[Unit]) -> None:
        """Iterator mode: positions of ``units`` are final (their uncommitted window is not)."""
        assert self._positions is not None
        for unit in units:
            self._uncommitted.pop(str(unit), None)
        self._positions.accept(units)

    def _purge_replay(self, texts: set[str] | None = None) -> None:
        """Windows of units gone leave the dispatcher's replay list (all of units not held)."""
        dispatcher, owner = self._dispatcher, self._owner
        if dispatcher is None or owner is None:
            return
        held = {str(u) for u in owner.held}
        dispatcher.replay[:] = [
            w
            for w in dispatcher.replay
            if w.unit in held and (texts is None or w.unit not in texts)
        ]

    # ---- iterator API -------------------------------------------------------------

    async def anext(self) -> Window:
        """The next window; commits the previous ones first when ``auto_commit``."""
        if self._mode == "callbacks":
            raise RuntimeError("this consumer is running callbacks")
        self._mode = "iterator"
        if self._failed is not None:
            raise self._failed
        if self._closed:
            raise StopAsyncIteration
        await self.start()
        if self._closed:  # (close() ran while the start awaited)
            raise StopAsyncIteration
        if self.config.auto_commit and self._uncommitted:
            await self._commit(force=False)
        try:
            window = await self.next_window()
        except QueueClosed:
            raise StopAsyncIteration from None
        except Exception as exc:
            self._failed = exc
            raise
        if window.data_loss is not None and self.config.on_data_loss == "raise":
            self._failed = DataLossDetectedError.reported_in(window)
            raise self._failed
        self._uncommitted[window.unit] = window
        return window

    async def commit(self) -> None:
        """Accept the positions after the windows yielded and write them to the store now."""
        await self._commit(force=True)

    async def _commit(self, *, force: bool) -> None:
        positions = self._positions
        if positions is None:
            return
        for window in self._uncommitted.values():
            positions.advance(window)
        self._uncommitted.clear()
        await positions.persist()
        if force:
            await positions.flush()

    # ---- callbacks API --------------------------------------------------------------

    async def run(self, callbacks: Callbacks | AsyncCallbacks) -> None:
        """Dispatch unit windows to ``callbacks`` until ``stop``/``close`` or an error."""
        if self._mode:
            raise RuntimeError(f"this consumer is already used in {self._mode} mode")
        self._mode = "callbacks"
        await self.start()
        if self._closed:  # (close() ran while the start awaited)
            return
        assert self._positions is not None
        dispatcher = Dispatcher(
            callbacks, self.config, self._positions, self.next_window, self._readmit
        )
        self._dispatcher = dispatcher
        self._calls.use_callbacks(callbacks, dispatcher)
        try:
            await dispatcher.run()
        except QueueClosed:
            return
        except Exception as exc:
            self._failed = exc
            raise
        finally:
            self._calls.forget_callbacks()
            self._dispatcher = None

    # ---- state ------------------------------------------------------------------------

    @property
    def checkpoint(self) -> Checkpoint:
        if self._positions is None:
            raise RuntimeError("the consumer has not started")
        return self._positions.current

    @property
    def committed(self) -> Checkpoint:
        if self._positions is None:
            raise RuntimeError("the consumer has not started")
        return self._positions.committed

    @property
    def units(self) -> frozenset[Unit]:
        """The units this member holds now."""
        return frozenset(self._owner.held) if self._owner is not None else frozenset()

    def stats(self) -> dict[str, Any]:
        """Counters for monitoring (module docstring of ``Consumer.stats``)."""
        owner, member, positions, queue = self._owner, self.member, self._positions, self._queue
        lanes = sorted(owner.lanes, key=lambda lane: lane.name) if owner is not None else []
        streams = [lane.fetcher.stream for lane in lanes]
        return {
            "group": self.config.group,
            "member_id": member.member_id if member is not None else "",
            "units": sorted(str(u) for u in owner.held) if owner is not None else [],
            "target": sorted(str(u) for u in member.target) if member is not None else [],
            "lanes": len(lanes),
            "lane_units": {lane.name: lane.describe() for lane in lanes},
            "rebalances": owner.rebalances if owner is not None else 0,
            "fenced_commits": positions.fenced_commits if positions is not None else 0,
            "units_lost": owner.units_lost if owner is not None else 0,
            "lease_valid": member.lease_valid() if member is not None else False,
            "relays": sorted({u for s in streams for u in s.relays}),
            "requests": sum(s.requests for s in streams),
            "failovers": sum(s.failovers for s in streams),
            "windows_fetched": sum(s.windows for s in streams),
            "windows_delivered": self.windows,
            "queued_windows": len(queue) if queue is not None else 0,
            "queued_bytes": queue.nbytes if queue is not None else 0,
            "queue_full_waits": queue.waits if queue is not None else 0,
            "checkpoints_persisted": positions.persisted if positions is not None else 0,
            "schema_fetches": sum(lane.cache.fetches for lane in lanes),
            "bootstraps": sum(lane.fetcher.bootstraps for lane in lanes),
        }
