"""Unit-store writes that outlived a cancelled caller (found by review), on a real file store.

The PostgreSQL and file unit stores write in a thread, which a cancel does not
stop. Two callers let go while the write went on:

* a claim cancelled by a rebalance (or a shutdown): the member released the
  unit's owner node at once, the next owner claimed the unit, and the late
  claim then raised the generation under it: the rightful owner was fenced and
  replayed;
* a checkpoint flush cancelled by a shutdown: the final flush of the newer
  checkpoint could land first and be overwritten by the older one, so the
  checkpoint went backwards (replay after the restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path
from typing import Any

from changebus.client import ConsumerConfig
from changebus.client._group_position import GroupPositions
from changebus.client._group_units import UnitOwner
from changebus.client._model import Window
from changebus.client._unitstore_file import FileUnitStore
from changebus.schemas import PartitionCheckpoint, Unit, UnitCommit

UNIT = Unit("p", 0)


class _Member:
    def __init__(self) -> None:
        self.target: frozenset[Unit] = frozenset()
        self.owned: frozenset[Unit] = frozenset()
        self.member_id = "m-1"
        self.released = asyncio.Event()

    async def acquire(self, unit: Unit) -> int:
        self.owned |= {unit}
        return 1  # (the owner node's czxid: the claim's fence)

    async def release(self, units: Any) -> None:
        self.owned -= frozenset(units)
        self.released.set()


def _gate(
    store: FileUnitStore, name: str, calls: int = 1
) -> tuple[threading.Event, threading.Event]:
    """Make the first ``calls`` calls of the store's ``name`` (in its thread) wait for a gate."""
    entered, gate = threading.Event(), threading.Event()
    original = getattr(store, name)
    seen: list[int] = []

    def gated(*args: Any) -> Any:
        seen.append(1)
        if len(seen) <= calls:
            entered.set()
            gate.wait(10)
        return original(*args)

    setattr(store, name, gated)
    return entered, gate


async def _until(event: threading.Event) -> None:
    for _ in range(500):
        if event.is_set():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the store's thread was not entered")


def _owner(store: FileUnitStore, member: _Member) -> UnitOwner:
    cfg = ConsumerConfig(
        relays=("http://relay:1",), zookeeper="zk:1", group="g", partitions=("p",), buckets=2
    )
    owner = UnitOwner(cfg, member, store, None, None, None, lambda: None)  # type: ignore[arg-type]
    owner._start = lambda claims: None  # type: ignore[method-assign]
    return owner


async def test_a_cancelled_claim_lands_before_the_unit_is_released(tmp_path: Path) -> None:
    mine, theirs = FileUnitStore(tmp_path), FileUnitStore(tmp_path)
    entered, gate = _gate(mine, "_claim")
    member = _Member()
    owner = _owner(mine, member)
    task = asyncio.create_task(owner.run())
    try:
        member.target = frozenset({UNIT})
        owner.on_target(member.target)
        await _until(entered)  # the claim is in the store's thread ...
        member.target = frozenset()
        owner.on_target(member.target)  # ... when a rebalance takes the unit away
        released_early = False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(member.released.wait(), 0.3)
            released_early = True
        gate.set()
        await asyncio.wait_for(member.released.wait(), 10)
        # the next owner acquires the released owner node and claims
        claim = await theirs.claim("g", UNIT, "m-2", 2)  # (a later owner node: a larger zxid)
        await asyncio.sleep(0.1)  # (a claim still in flight would land now)
        stored = (await theirs.read("g"))[UNIT]
        commit = UnitCommit(UNIT, PartitionCheckpoint(window_scn=5, prev_scn=5), claim.token)
        result = await theirs.commit("g", [commit])
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert not released_early  # released only once the claim was through
    assert stored.owner == "m-2"
    assert result.fenced == frozenset()


async def test_stop_reading_waits_for_a_claim_in_flight(tmp_path: Path) -> None:
    """A shutdown deletes the member's owner nodes after ``stop_reading``: a claim still
    in the store's thread then would land under the unit's next owner."""
    store = FileUnitStore(tmp_path)
    entered, gate = _gate(store, "_claim")
    member = _Member()
    owner = _owner(store, member)
    task = asyncio.create_task(owner.run())
    try:
        member.target = frozenset({UNIT})
        owner.on_target(member.target)
        await _until(entered)
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, gate.set)
        await owner.stop_reading()
        assert gate.is_set()  # it returned only after the claim was let through ...
        stored = (await store.read("g"))[UNIT]
        assert stored.owner == "m-1"  # ... and written
    finally:
        gate.set()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_cancelled_flush_is_not_overtaken_by_the_final_one(tmp_path: Path) -> None:
    store = FileUnitStore(tmp_path)
    claim = await store.claim("g", UNIT, "m-1")
    entered, gate = _gate(store, "_commit")  # the periodic flush's write is slow
    positions = GroupPositions(store, "g", 3600.0)
    positions.add(claim)
    positions.advance(Window(scn=100, timestamp_ns=1, partition="p", unit=str(UNIT)))
    await positions.persist()
    flusher = asyncio.create_task(positions.flush(quiet=True))
    await _until(entered)
    positions.advance(Window(scn=200, timestamp_ns=2, partition="p", unit=str(UNIT)))
    await positions.persist()  # the application commits 200 (no flush: one is running)
    flusher.cancel()  # a shutdown cancels the flusher ...
    with contextlib.suppress(asyncio.CancelledError):
        await flusher
    final = asyncio.create_task(positions.flush([UNIT], quiet=True))  # ... and flushes
    await asyncio.sleep(0.3)
    gate.set()
    assert await asyncio.wait_for(final, 10) == frozenset()
    await asyncio.sleep(0.1)
    stored = (await store.read("g"))[UNIT]
    assert stored.checkpoint is not None and stored.checkpoint.window_scn == 200
