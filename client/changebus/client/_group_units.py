"""A group member's units: acquiring, claiming, lanes, revoking and losing them.

:class:`UnitOwner` follows the member's *target* (the units the group's
leader assigns it, :class:`changebus.cluster.GroupMember`) with its *held*
units (``held``: unit -> the :class:`~._group_lane.Lane` reading it):

* **acquire** (a background task, so the lanes already running keep
  flowing): for each unit of the target not held, create its owner node
  (:meth:`GroupMember.acquire`, which waits while the previous owner still
  holds it), then claim it in the store (``UnitStore.claim``: a new fencing
  token and the checkpoint to start from). Units claimed together with equal
  checkpoints start one lane; the consumer calls ``on_assigned`` before the
  first window of a unit (:meth:`take_assigned`).
* **revoke** (on the application's path, between windows: the consumer
  calls :meth:`revocable` and :meth:`let_go` after ``on_revoked``): the
  final commit of the units' positions, the units leave their lanes (a lane
  without units stops), then their owner nodes are released.
* **lose** (the ZooKeeper session is lost, or the store refused a commit):
  :meth:`drop` forgets the units at once without committing; their
  windows are no longer delivered and ``on_lost`` follows
  (:meth:`take_lost`).

* **lanes** (:mod:`._group_lanes`): a lane that keeps some units after a
  revoke is narrowed to them; lanes of a partition standing at the same
  window while the member is idle are merged.

A unit is never read by two members at once beyond what at-least-once
allows: it is claimed only after its owner node exists (the previous owner
released it after its final commit, or its session expired), and a zombie's
commit is refused by the store's fence.

Thread-safety: the event loop of the consumer only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any, TypeVar

import aiohttp

from changebus.cluster import GroupMember
from changebus.schemas import (
    ChangebusError,
    ConfigError,
    FencedError,
    Mode,
    PartitionCheckpoint,
    Unit,
    UnitClaim,
    UnitStore,
)

from ._config import ConsumerConfig
from ._group_lane import Lane, LaneBatch
from ._group_lanes import LaneSet
from ._group_position import GroupPositions
from ._queue import BoundedQueue

__all__ = ["UnitOwner"]

T = TypeVar("T")

log = logging.getLogger(__name__)

#: how long an acquisition waits for more units to be freed so they start in one lane
_GATHER_S = 0.05
#: ... at most, in all
_GATHER_MAX_S = 1.0
#: pause before acquiring again after a failure (ZooKeeper or the store away)
_RETRY_S = 0.5


def _where(checkpoint: PartitionCheckpoint | None, start: str) -> str:
    """Where a lane starts, for the log."""
    if checkpoint is None:
        return start
    if checkpoint.mode is not Mode.ONLINE:
        return f"its bootstrap's progress ({checkpoint.mode.value})"
    return f"SCN {checkpoint.window_scn}"


def _text(units: Iterable[Unit]) -> str:
    return ", ".join(str(u) for u in sorted(units)) or "none"


class UnitOwner:
    """The held units of one group member (module docstring)."""

    def __init__(
        self,
        config: ConsumerConfig,
        member: GroupMember,
        store: UnitStore,
        positions: GroupPositions,
        http: aiohttp.ClientSession,
        queue: BoundedQueue[LaneBatch],
        wake: Callable[[], None],
    ) -> None:
        self.config = config
        self.member = member
        self.store = store
        self.positions = positions
        self._http = http
        self._queue = queue
        self._wake = wake
        #: held units and their lanes; the lanes running (and each partition's relays)
        self.held: dict[Unit, Lane] = {}
        self.lanes = LaneSet(config, http, queue, self._spawn)
        self._acquiring: dict[Unit, asyncio.Task[UnitClaim | None]] = {}
        self._unannounced: set[Unit] = set()
        self._lost: set[Unit] = set()
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._foreign_fences: set[Unit] = set()  # (logged once each; the group's units)
        self._target: frozenset[Unit] = frozenset()
        #: the application's path has units to revoke
        self.revoke_due = False
        #: target changes seen, units lost (session or fence)
        self.rebalances = 0
        self.units_lost = 0

    # ---- events from the member and the store -----------------------------------

    def on_target(self, target: frozenset[Unit]) -> None:
        """The member's target changed (on the loop)."""
        if target != self._target:
            self.rebalances += 1
            self._target = target
            log.info(
                "group %s: member %s is assigned %s",
                self.config.group,
                self.member.member_id,
                _text(target),
            )
        self._changed.set()
        if any(u not in target for u in self.held):
            self.revoke_due = True
            self._wake()

    def on_lost(self, units: frozenset[Unit]) -> None:
        """The membership is lost: every held unit goes, uncommitted."""
        gone = frozenset(self.held) | units
        for task in self._acquiring.values():
            task.cancel()
        self.drop(gone)
        self._changed.set()

    def on_fenced(self, units: frozenset[Unit]) -> None:
        """The store refused commits of ``units``: another member claimed them."""
        self.drop(units)
        self._spawn(self.member.release(units))
        self._changed.set()

    def drop(self, units: Iterable[Unit]) -> None:
        """Forget ``units`` now, without committing (lost); ``on_lost`` follows."""
        gone = [u for u in units if u in self.held]
        if not gone:
            return
        self.units_lost += len(gone)
        log.warning(
            "group %s: member %s lost %s; their windows after the last commit are read again"
            " by their next owner",
            self.config.group,
            self.member.member_id,
            _text(gone),
        )
        self._lost.update(u for u in gone if u not in self._unannounced)
        self._forget(gone)
        self._changed.set()  # (a unit still targeted is acquired again: found by review)
        self._wake()

    # ---- for the application's path ---------------------------------------------

    def take_assigned(self) -> frozenset[Unit]:
        """Units claimed whose ``on_assigned`` is due (before their first window)."""
        units = frozenset(u for u in self._unannounced if u in self.held)
        self._unannounced.clear()
        return units

    def take_lost(self) -> frozenset[Unit]:
        """Units lost whose ``on_lost`` is due."""
        units = frozenset(self._lost)
        self._lost.clear()
        return units

    @property
    def pending(self) -> bool:
        """Whether the application's path has rebalance work (callbacks, revokes)."""
        return self.revoke_due or bool(self._unannounced) or bool(self._lost)

    def revocable(self) -> tuple[frozenset[Unit], frozenset[Unit]]:
        """``(units to revoke, those of them announced)``: held and no longer targeted."""
        self.revoke_due = False
        target = self.member.target
        gone = frozenset(u for u in self.held if u not in target)
        return gone, frozenset(u for u in gone if u not in self._unannounced)

    async def let_go(self, units: Iterable[Unit], *, narrow: bool = True) -> dict[Lane, Lane]:
        """Revoke ``units``: final commit of their accepted positions, leave the lanes, release.

        A lane that keeps some units is replaced by one reading just those
        (``narrow``, :meth:`LaneSet.narrow`); returns the replacements (old -> new).
        """
        gone = [u for u in units if u in self.held]
        if not gone:
            return {}
        for unit in gone:  # units whose lane handed nothing out yet: where it started
            lane = self.held[unit]
            if lane.dequeued is None:  # (else windows of it may wait, undelivered)
                possible, start = lane.restart_point()
                if possible and start is not None:
                    self.positions.settle_unstarted(unit, start)
        try:
            await self.positions.flush(gone, quiet=True)
        finally:
            self._unannounced.difference_update(gone)
            kept = self._forget(gone)
            await self.member.release(gone)
        log.info(
            "group %s: member %s gave up %s", self.config.group, self.member.member_id, _text(gone)
        )
        self._changed.set()
        return self.lanes.narrow(kept, self.held) if narrow else {}

    def _forget(self, units: Sequence[Unit]) -> set[Lane]:
        """Drop ``units`` from their lanes (a lane left empty stops); the lanes that keep some."""
        by_lane: dict[Lane, list[Unit]] = {}
        for unit in units:
            lane = self.held.pop(unit, None)
            if lane is not None:
                by_lane.setdefault(lane, []).append(unit)
        self.positions.remove(units)
        kept: set[Lane] = set()
        for lane, lost in by_lane.items():
            if lane.drop(lost):
                self.lanes.retire(lane)
            else:
                kept.add(lane)
        return kept

    # ---- acquiring ------------------------------------------------------------------

    async def run(self) -> None:
        """Follow the target until cancelled (acquisitions run as their own tasks)."""
        while True:
            await self._changed.wait()
            self._changed.clear()
            target = self.member.target
            for unit, task in list(self._acquiring.items()):
                if unit not in target:
                    task.cancel()
            new = [u for u in sorted(target) if u not in self.held and u not in self._acquiring]
            if new:
                self._spawn(self._acquire(new))
            if any(u not in target for u in self.held):
                self.revoke_due = True
                self._wake()

    async def _acquire(self, units: list[Unit]) -> None:
        """Acquire and claim ``units``; start lanes for those claimed, in gathers."""
        tasks = {asyncio.create_task(self._claim(u), name=f"changebus-claim-{u}"): u for u in units}
        self._acquiring.update((u, t) for t, u in tasks.items())
        pending = set(tasks)
        failed = False
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                # units freed together start in one lane: gather while claims keep coming
                gather_until = time.monotonic() + _GATHER_MAX_S
                while pending and time.monotonic() < gather_until:
                    more, pending = await asyncio.wait(pending, timeout=_GATHER_S)
                    if not more:
                        break
                    done |= more
                claims: list[UnitClaim] = []
                for task in done:
                    unit = tasks[task]
                    if self._acquiring.get(unit) is task:
                        del self._acquiring[unit]
                    if task.cancelled():
                        # the target may have got the unit back while the task ended: the
                        # pass that skipped it as "being acquired" must come again, or the
                        # unit stays with no owner (found by review)
                        self._changed.set()
                        continue
                    exc = task.exception()
                    if exc is not None:
                        if isinstance(exc, ConfigError):
                            raise exc
                        failed = True
                        log.warning(
                            "group %s: cannot take %s yet: %s", self.config.group, unit, exc
                        )
                        continue
                    claim = task.result()
                    if claim is not None:
                        claims.append(claim)
                    elif unit in self.member.target:
                        # (its owner node went meanwhile: nothing else looks at the unit
                        # again until the target changes; found by review)
                        failed = True
                if claims:
                    self._start(claims)
        finally:
            for task in pending:
                task.cancel()
                if self._acquiring.get(tasks[task]) is task:
                    del self._acquiring[tasks[task]]
                    self._changed.set()
        if failed:
            await asyncio.sleep(_RETRY_S)
            self._changed.set()

    async def _claim(self, unit: Unit) -> UnitClaim | None:
        member = self.member
        fence = await member.acquire(unit)
        try:
            if unit not in member.target:
                await member.release([unit])
                return None
            if unit not in member.owned or not member.member_id:
                # the membership (or the owner node) went meanwhile: a claim now would raise
                # the unit's generation under no owner, fencing its rightful next owner
                await member.release([unit])
                return None
            claim = await _uncancelled(
                self.store.claim(self.config.group, unit, member.member_id, fence)
            )
        except FencedError:
            self._spawn(member.release([unit]))
            if unit in member.owned and member.lease_valid() and unit not in self._foreign_fences:
                # its owner node is this member's and no later one can exist while it does:
                # the stored fence comes from another ZooKeeper history
                self._foreign_fences.add(unit)
                log.error(
                    "group %s: the unit store refused the claim of %s by its owner (fence %d):"
                    " it holds a higher fence, which a ZooKeeper ensemble replaced with a new"
                    " one (its data lost) leaves behind; reset the group's stored fences"
                    " (docs/client.md, 'Claim fences')",
                    self.config.group,
                    unit,
                    fence,
                )
            raise
        except BaseException:
            self._spawn(member.release([unit]))
            raise
        if unit not in member.target or unit not in member.owned:
            self._spawn(member.release([unit]))
            return None
        return claim

    def _start(self, claims: list[UnitClaim]) -> None:
        """New lanes for ``claims``: one per partition and equal checkpoint."""
        target, owned = self.member.target, self.member.owned
        dropped = [c.unit for c in claims if c.unit not in target or c.unit not in owned]
        if dropped:  # the target changed (or the membership was lost) while they were claimed
            self._spawn(self.member.release(dropped))
            claims = [c for c in claims if c.unit in target and c.unit in owned]
        groups: list[tuple[str, PartitionCheckpoint | None, list[UnitClaim]]] = []
        for claim in sorted(claims, key=lambda c: c.unit):
            for partition, checkpoint, members in groups:
                if partition == claim.unit.partition and checkpoint == claim.checkpoint:
                    members.append(claim)
                    break
            else:
                groups.append((claim.unit.partition, claim.checkpoint, [claim]))
        for partition, checkpoint, members in groups:
            lane = self.lanes.new(partition, [c.unit for c in members], checkpoint)
            for claim in members:
                self.positions.add(claim)
                self.held[claim.unit] = lane
                self._unannounced.add(claim.unit)
            lane.start()
            log.info(
                "group %s: member %s reads %s from %s",
                self.config.group,
                self.member.member_id,
                lane.describe(),
                _where(checkpoint, self.config.start),
            )
        self._wake()

    # ---- stopping ------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            if isinstance(exc, ChangebusError) and not exc.retriable:
                self._spawn(self._queue.fail(exc))  # the consumer raises it
            else:
                log.warning("group %s: %r", self.config.group, exc)

    async def stop_reading(self) -> None:
        """Cancel acquisitions and stop every lane (the units stay held).

        Returns once the claims in flight are through the store (:func:`_uncancelled`):
        the member's owner nodes are deleted after this, and a claim landing after
        that would fence the units' next owners.
        """
        claims = list(self._acquiring.values())
        for task in claims:
            task.cancel()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        if claims:
            await asyncio.wait(claims)
        await self.lanes.stop()


async def _uncancelled(call: Awaitable[T]) -> T:
    """Await a unit store's call; when cancelled, wait until the call is through, then raise.

    A store's write runs in a thread (PostgreSQL, files), where a cancel does not
    stop it. The caller releases the unit's owner node when cancelled: a claim
    still in flight would land after that, raise the unit's generation under the
    next owner and fence it (found by review). ZooKeeper's store waits for its
    own; waiting here covers every store.
    """
    task = asyncio.ensure_future(call)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({task})
        if not task.cancelled():
            task.exception()  # (retrieved: the cancel is what the caller gets)
        raise
