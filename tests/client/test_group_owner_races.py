"""Unit ownership races found by review, against stand-ins for the member and the store.

* A unit whose acquisition was cancelled (the target lost it) and that came back
  into the target before the cancelled task ended was skipped as "being
  acquired", and nothing looked at it again: it stayed with no owner until the
  target changed once more.
* A unit the store fenced (another member claimed it) is claimed again at once;
  the window the application still held of the old claim advanced the new one.

And the PostgreSQL sessions of unit stores and replicas get keepalives and
timeouts unless their DSN sets its own (a dead path held a revoke for minutes).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from changebus.client import ConsumerConfig
from changebus.client._group_units import UnitOwner
from changebus.client._pgsession import SESSION_DEFAULTS, connect
from changebus.schemas import ConfigError, Unit, UnitClaim


class _Member:
    def __init__(self) -> None:
        self.target: frozenset[Unit] = frozenset()
        self.owned: frozenset[Unit] = frozenset()
        self.member_id = "m-1"

    async def acquire(self, unit: Unit) -> int:
        self.owned |= {unit}
        return 1

    async def release(self, units: Any) -> None:
        self.owned -= frozenset(units)


class _SlowStore:
    """Claims take a while, and a cancelled one waits for its thread (as ZkUnitStore)."""

    async def claim(self, group: str, unit: Unit, owner: str, fence: int = -1) -> UnitClaim:
        try:
            await asyncio.sleep(0.3)
        except asyncio.CancelledError:
            await asyncio.sleep(0.3)
            raise
        return UnitClaim(unit, None, token=1, generation=1)


async def test_a_unit_targeted_again_while_its_cancelled_claim_ends_is_taken() -> None:
    cfg = ConsumerConfig(
        relays=("http://relay:1",), zookeeper="zk:1", group="g", partitions=("p",), buckets=2
    )
    member = _Member()
    started: list[list[Unit]] = []
    owner = UnitOwner(cfg, member, _SlowStore(), None, None, None, lambda: None)  # type: ignore[arg-type]
    owner._start = lambda claims: started.append([c.unit for c in claims])  # type: ignore[method-assign]
    task = asyncio.create_task(owner.run())
    unit = Unit("p", 0)

    def target(units: set[Unit]) -> None:
        member.target = frozenset(units)
        owner.on_target(member.target)

    try:
        target({unit})
        await asyncio.sleep(0.1)  # (its claim is under way)
        target(set())  # the target loses it: the claim is cancelled ...
        await asyncio.sleep(0.05)
        target({unit})  # ... and gets it back before the cancelled claim has ended
        for _ in range(40):
            if started:
                break
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
    assert started == [[unit]]


def test_sessions_get_keepalives_and_timeouts_unless_the_dsn_sets_them(pg_dsn: str) -> None:
    conn = connect(pg_dsn, 0)
    try:
        given = {o.keyword.decode(): o.val for o in conn.pgconn.info if o.val is not None}
    finally:
        conn.close()
    for key, value in SESSION_DEFAULTS.items():
        assert given[key] == str(value).encode(), key
    conn = connect(pg_dsn + " keepalives_idle=99", 0)
    try:
        given = {o.keyword.decode(): o.val for o in conn.pgconn.info if o.val is not None}
    finally:
        conn.close()
    assert given["keepalives_idle"] == b"99"
    # a DSN libpq cannot parse: refused as a config error that does not quote it
    with pytest.raises(ConfigError) as info:
        connect(pg_dsn + " nonsense", 0)
    assert "nonsense" not in str(info.value)


def test_a_fenced_units_yielded_window_does_not_advance_its_next_claim() -> None:
    """The store fenced a unit (another member claimed it) and it is claimed again at
    once: the window of the old claim the application still held advanced the new
    claim's position at the next commit (found by review). It is forgotten."""
    from changebus.client._group import GroupConsumer
    from changebus.client._model import Window

    cfg = ConsumerConfig(
        relays=("http://relay:1",), zookeeper="zk:1", group="g", partitions=("p",), buckets=2
    )
    group = GroupConsumer(cfg, None, None, None)
    fenced, kept = Unit("p", 0), Unit("p", 1)
    group._uncommitted = {
        str(fenced): Window(scn=100, timestamp_ns=0, partition="p"),
        str(kept): Window(scn=90, timestamp_ns=0, partition="p"),
    }
    group._on_fenced(frozenset({fenced}))
    assert list(group._uncommitted) == [str(kept)]


async def test_a_claim_that_found_its_unit_not_owned_is_tried_again() -> None:
    """A claim whose owner node went meanwhile (returned None, the unit still targeted) was
    not tried again until the target changed: the unit stayed with no owner (review)."""
    import changebus.client._group_units as units

    cfg = ConsumerConfig(
        relays=("http://relay:1",), zookeeper="zk:1", group="g", partitions=("p",), buckets=2
    )

    class _LosesOnce(_Member):
        lost = False

        async def acquire(self, unit: Unit) -> int:
            fence = await super().acquire(unit)
            if not self.lost:  # (its node deleted under it: a session hiccup, say)
                self.lost = True
                self.owned -= {unit}
            return fence

    member = _LosesOnce()
    started: list[list[Unit]] = []
    owner = UnitOwner(cfg, member, _SlowStore(), None, None, None, lambda: None)  # type: ignore[arg-type]
    owner._start = lambda claims: started.append([c.unit for c in claims])  # type: ignore[method-assign]
    task = asyncio.create_task(owner.run())
    unit = Unit("p", 0)
    try:
        member.target = frozenset({unit})
        owner.on_target(member.target)
        for _ in range(int((units._RETRY_S + 3) / 0.05)):
            if started:
                break
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
    assert member.lost and started == [[unit]]


class _Positions:
    """GroupPositions over a store that keeps what is written."""

    def __init__(self) -> None:
        self.written: dict[Unit, Any] = {}

    async def commit(self, group: str, commits: Any) -> Any:
        from changebus.schemas import CommitResult

        for c in commits:
            self.written[c.unit] = c.checkpoint
        return CommitResult(tokens={c.unit: c.token for c in commits}, fenced=frozenset())


class _RevokingOwner:
    """The UnitOwner calls ``_rebalance`` makes, revoking ``gone``; ``let_go`` writes their
    final positions as the real one does."""

    def __init__(self, held: dict[Unit, Any], gone: frozenset[Unit], positions: Any) -> None:
        self.held = held
        self.revoke_due = True
        self._gone = gone
        self._positions = positions

    def take_lost(self) -> frozenset[Unit]:
        return frozenset()

    def revocable(self) -> tuple[frozenset[Unit], frozenset[Unit]]:
        self.revoke_due = False
        return self._gone, self._gone

    async def let_go(self, gone: frozenset[Unit]) -> dict[Any, Any]:
        await self._positions.flush(gone, quiet=True)
        for unit in gone:
            del self.held[unit]
        return {}

    def take_assigned(self) -> frozenset[Unit]:
        return frozenset()


async def test_a_revoked_units_window_yielded_and_not_committed_is_read_again_by_the_next_owner() -> (
    None
):
    """Iterator mode without auto_commit: the application holds window W (SCN 110) of unit U
    when U is revoked, and the lane's next batch (SCN 120, events of V only) waits for its
    position-only advance. The revoke accepted U's position first and advanced it past W
    after, so U's stored checkpoint said 120 and no owner ever read W again (review)."""
    from changebus.client._group import GroupConsumer
    from changebus.client._group_lane import Lane, LaneBatch
    from changebus.client._group_position import GroupPositions
    from changebus.client._model import Window
    from changebus.schemas import PartitionCheckpoint

    cfg = ConsumerConfig(
        relays=("http://relay:1",), zookeeper="zk:1", group="g", partitions=("p",), buckets=2
    )
    store = _Positions()
    positions = GroupPositions(store, "g", 1.0)  # type: ignore[arg-type]
    u, v = Unit("p", 0), Unit("p", 1)
    start = PartitionCheckpoint(window_scn=100, prev_scn=100, timestamp_ns=1)
    for unit in (u, v):
        positions.add(UnitClaim(unit, start, token=1, generation=1))
    lane = object.__new__(Lane)
    lane.partition, lane.units, lane.texts = "p", {0: u, 1: v}, {0: str(u), 1: str(v)}
    w = Window(110, 2, "p", unit=str(u))  # yielded, not committed
    wv = Window(120, 3, "p", unit=str(v))
    lane.unadvanced = LaneBatch(lane, 120, 3, None, ((v, wv),), 10)
    consumer = GroupConsumer(cfg, None, None, None)
    consumer._mode = "iterator"
    consumer._positions = positions
    consumer._uncommitted = {str(u): w, str(v): wv}
    owner = _RevokingOwner({u: lane, v: lane}, frozenset({u}), positions)
    await consumer._rebalance(owner)  # type: ignore[arg-type]
    # its position stays before W (written as it was, or not at all: the claim's is kept),
    # so W is the next owner's first window
    assert store.written.get(u, start).window_scn == 100
    assert str(u) not in consumer._uncommitted and str(v) in consumer._uncommitted


async def test_a_unit_with_no_position_whose_lane_handed_windows_out_is_not_settled() -> None:
    """The settling is for a lane that handed nothing out: with a batch dequeued, the
    unit's windows may wait undelivered, and a position at that batch skipped them
    (review of the change)."""
    from types import SimpleNamespace

    from changebus.client._group_lane import Lane
    from changebus.client._group_position import GroupPositions

    store = _Positions()
    positions = GroupPositions(store, "g", 1.0)  # type: ignore[arg-type]
    u = Unit("p", 0)
    positions.add(UnitClaim(u, None, token=1, generation=1))
    lane = object.__new__(Lane)
    lane.dequeued = SimpleNamespace(scn=110, timestamp_ns=1, checkpoint=None)  # type: ignore[assignment]
    lane.start_checkpoint, lane._start_setting = None, "earliest"
    cfg = ConsumerConfig(
        relays=("http://relay:1",), zookeeper="zk:1", group="g", partitions=("p",), buckets=2
    )
    owner = UnitOwner(cfg, _Member(), None, positions, None, None, lambda: None)  # type: ignore[arg-type]
    owner.held[u] = lane
    lane.drop = lambda units: True  # type: ignore[method-assign]
    owner.lanes.retire = lambda lane: None  # type: ignore[method-assign]
    await owner.let_go([u], narrow=False)
    assert u not in store.written  # the next owner starts as its config says, not at 110


async def test_a_unit_moved_before_its_lane_handed_anything_is_stored_where_the_lane_began() -> (
    None
):
    """A unit claimed without a checkpoint, its lane started at the newest window, moved to
    another member before any batch was dequeued: nothing was written, and the next owner
    started at its own newest window; the windows between were read by nobody (review).
    The lane's resolved start is written."""
    from types import SimpleNamespace

    from changebus.client._group_lane import Lane
    from changebus.client._group_position import GroupPositions

    store = _Positions()
    positions = GroupPositions(store, "g", 1.0)  # type: ignore[arg-type]
    u = Unit("p", 0)
    positions.add(UnitClaim(u, None, token=1, generation=1))
    lane = object.__new__(Lane)
    lane.dequeued, lane.start_checkpoint, lane._start_setting = None, None, "latest"
    stream = SimpleNamespace(resolved_latest=None)
    fetcher = SimpleNamespace(stream=stream, phase="online")
    lane.fetcher = fetcher  # type: ignore[assignment]
    assert lane.restart_point() == (False, None)  # the relay has not said where yet
    stream.resolved_latest = -1  # an empty buffer: "latest" again, not a position
    assert lane.restart_point() == (False, None)
    stream.resolved_latest = 500
    fetcher.phase = "snapshot"  # bootstrapping: past that
    assert lane.restart_point() == (False, None)
    fetcher.phase = "online"
    cfg = ConsumerConfig(
        relays=("http://relay:1",), zookeeper="zk:1", group="g", partitions=("p",), buckets=2
    )
    member = _Member()
    owner = UnitOwner(cfg, member, None, positions, None, None, lambda: None)  # type: ignore[arg-type]
    owner.held[u] = lane
    lane.drop = lambda units: True  # type: ignore[method-assign]
    owner.lanes.retire = lambda lane: None  # type: ignore[method-assign]
    await owner.let_go([u], narrow=False)
    assert store.written[u].window_scn == 500
