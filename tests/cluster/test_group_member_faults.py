"""Consumer-group members under faults, against a real ZooKeeper: a SIGSTOPped member
fenced when it wakes, a damaged assignment repaired, ZooKeeper restarting, a deleted
member node, a member stopped while acquiring, a member process killed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from group_members import ROOT, SOURCE_ROOTS, TIMEOUT_S, settled

from changebus.cluster import (
    CoordinationError,
    ZkUnitStore,
    read_group,
)
from changebus.cluster._group_layout import (
    assignment_path,
    decode_assignment,
)
from changebus.schemas import PartitionCheckpoint, Unit, UnitCommit
from waiting import wait_until

pytestmark = pytest.mark.zk


async def _lines(proc: asyncio.subprocess.Process, into: list[dict[str, Any]]) -> None:
    assert proc.stdout is not None
    while line := await proc.stdout.readline():
        into.append(json.loads(line))


async def _zombie(
    zk_hosts: str, group: str
) -> tuple[asyncio.subprocess.Process, list[dict[str, Any]], asyncio.Task[None]]:
    """A member in a subprocess (zombie_member.py), once it owns its 4 of 12 units: the
    process, the events it prints (JSON lines) and the task that reads them."""
    env = {**os.environ, "PYTHONPATH": ":".join(str(ROOT / s) for s in SOURCE_ROOTS)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(Path(__file__).with_name("zombie_member.py")),
        zk_hosts,
        group,
        "6",
        str(TIMEOUT_S),
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    events: list[dict[str, Any]] = []
    reader = asyncio.create_task(_lines(proc, events))
    try:
        await wait_until(
            lambda: any(e["event"] == "owned" and len(e["units"]) == 4 for e in events),
            30,
            "the subprocess to own its units",
        )
    except BaseException:
        proc.kill()  # (stopped by pid: the test's finally is not reached)
        await proc.wait()
        reader.cancel()
        raise
    return proc, events, reader


async def test_sigstopped_member_is_fenced_when_it_wakes(make_member, zk_hosts, group) -> None:
    pairs = [await make_member(f"c{i}") for i in range(2)]
    await wait_until(lambda: settled(pairs), 10, "two members settled")
    proc, events, reader = await _zombie(zk_hosts, group)
    try:
        zombie_units = {
            Unit.parse(u) for u in [e for e in events if e["event"] == "owned"][-1]["units"]
        }
        await asyncio.sleep(0.5)  # a few of its commits
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        await wait_until(
            lambda: zombie_units <= (pairs[0][0].owned | pairs[1][0].owned),
            TIMEOUT_S + 3,
            "its units taken over",
        )
        took = time.monotonic() - stopped
        assert took < TIMEOUT_S + 1, took  # the session timeout + 1 s
        assert settled(pairs)
        # the new owners claim its units and commit far ahead of anything it wrote
        store = ZkUnitStore(pairs[0][0].session)
        ahead = PartitionCheckpoint(window_scn=5000, prev_scn=5000)
        owner_of = {u: m.member_id for m, _ in pairs for u in m.owned}
        for unit in sorted(zombie_units):
            claim = await store.claim(group, unit, owner_of[unit])
            result = await store.commit(group, [UnitCommit(unit, ahead, claim.token)])
            assert not result.fenced
        await asyncio.sleep(max(0.0, stopped + 2 * TIMEOUT_S - time.monotonic()))
        os.kill(proc.pid, signal.SIGCONT)

        await wait_until(
            lambda: any(e["event"] == "probe" and e["gap_s"] > TIMEOUT_S for e in events),
            10,
            "the probe after the gap",
        )
        probes = [e for e in events if e["event"] == "probe" and e["gap_s"] > TIMEOUT_S]
        assert all(p["valid"] is False for p in probes), probes
        await wait_until(lambda: any(e["event"] == "lost" for e in events), 10, "on_lost")
        (lost,) = [e for e in events if e["event"] == "lost"]
        assert {Unit.parse(u) for u in lost["units"]} == zombie_units
        await wait_until(lambda: any(e["event"] == "left" for e in events), 10, "it left")
        late = [e for e in events if e["event"] == "commit" and "written" in e]
        assert late, events
        for e in late:
            assert not set(e["written"]) & {str(u) for u in zombie_units}, e
        assert {u for e in late for u in e["fenced"]} == {str(u) for u in zombie_units}
        # the stored checkpoints are the new owners'
        stored = await store.read(group)
        for unit in zombie_units:
            assert stored[unit].checkpoint == ahead
            assert stored[unit].owner == owner_of[unit]
        await wait_until(lambda: settled(pairs), 10, "the two members settled again")
    finally:
        if proc.returncode is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            await proc.wait()
        reader.cancel()


async def test_the_leader_repairs_a_damaged_assignment(make_member, zk_session, group) -> None:
    pairs = [await make_member(f"c{i}") for i in range(2)]
    await wait_until(lambda: settled(pairs), 10, "even targets")
    targets = [m.target for m, _ in pairs]
    session = await zk_session("vandal")
    await session.op("set", assignment_path(group), b"\xffnot json")

    async def repaired() -> bool:
        data, _ = await session.op("get", assignment_path(group))
        try:
            decode_assignment(data, "assignment")
        except CoordinationError:
            return False
        return True

    for _ in range(40):
        if await repaired():
            break
        await asyncio.sleep(0.05)
    assert await repaired()
    await wait_until(lambda: settled(pairs), 5, "settled")
    assert [m.target for m, _ in pairs] == targets  # nobody lost a unit over it


@pytest.mark.usefixtures("no_blocking")
async def test_group_coordination_does_not_block_the_loop(make_member, zk_session, group) -> None:
    pairs = [await make_member(f"c{i}") for i in range(2)]
    await wait_until(lambda: settled(pairs), 10, "even targets")
    pairs.append(await make_member("c2"))
    await wait_until(lambda: settled(pairs), 10, "rebalanced")
    session = pairs[0][0].session
    store = ZkUnitStore(session)
    unit = sorted(pairs[0][0].owned)[0]
    claim = await store.claim(group, unit, pairs[0][0].member_id)
    checkpoint = PartitionCheckpoint(window_scn=1, prev_scn=1)
    assert not (await store.commit(group, [UnitCommit(unit, checkpoint, claim.token)])).fenced
    assert unit in await store.read(group)
    state = await read_group(session, group)
    assert len(state.members) == 3
    await asyncio.sleep(pairs[0][0].lease_s)  # a few heartbeats
    await pairs[2][0].stop()
    await wait_until(lambda: settled(pairs[:2]), 10, "rebalanced after a leave")


async def test_members_settle_again_after_zookeeper_restarts(make_member, zk_server) -> None:
    pairs = [await make_member(f"c{i}") for i in range(3)]
    await wait_until(lambda: settled(pairs), 10, "even targets")
    try:
        await asyncio.to_thread(zk_server.restart)
    finally:
        if zk_server.proc is None:
            await asyncio.to_thread(zk_server.start)
    # sessions may survive the restart or expire; either way the group settles again,
    # every member with a valid lease, and nobody owns a unit twice
    await wait_until(
        lambda: settled(pairs) and all(m.lease_valid() for m, _ in pairs), 30, "settled again"
    )
    state = await read_group(pairs[0][0].session, pairs[0][0].group)
    assert set(state.members) == {m.member_id for m, _ in pairs}
    assert state.owners == {u: m.member_id for m, _ in pairs for u in m.owned}


async def test_a_deleted_member_node_ends_the_membership(make_member, zk_session, group) -> None:
    pairs = [await make_member(f"c{i}") for i in range(2)]
    await wait_until(lambda: settled(pairs), 10, "even targets")
    victim, follower = pairs[1]
    old_path, old_owned = victim._member_path, victim.owned
    admin = await zk_session("admin")
    await admin.op("delete", old_path)  # the session lives on, the membership does not
    await wait_until(lambda: follower.lost, 5, "on_lost")
    assert follower.lost[0] == old_owned
    # its owner nodes were deleted (the session still held them), and it came back
    await wait_until(
        lambda: victim.member_id not in ("", old_path.rpartition("/")[2]) and settled(pairs),
        10,
        "re-registered and settled",
    )
    state = await read_group(admin, group)
    assert state.owners == {u: m.member_id for m, _ in pairs for u in m.owned}
    assert victim.lease_valid()


async def test_acquire_ends_when_the_member_stops(make_member) -> None:
    a, _ = await make_member("a", follow=False)
    b, _ = await make_member("b", follow=False)
    unit = Unit("users", 1)
    await a.acquire(unit)
    waiting = asyncio.create_task(b.acquire(unit))
    await asyncio.sleep(0.2)
    await b.stop()
    with pytest.raises(CoordinationError) as err:
        async with asyncio.timeout(TIMEOUT_S * 3):
            await waiting
    assert not err.value.retriable
    with pytest.raises(CoordinationError):
        await b.acquire(unit)
    assert a.owned == {unit} and not b.lease_valid()


async def test_a_killed_member_process_moves_its_units_within_the_session_timeout(
    make_member, zk_hosts, group
) -> None:
    pairs = [await make_member(f"c{i}") for i in range(2)]
    await wait_until(lambda: settled(pairs), 10, "two members settled")
    before = {m.member_id: m.target for m, _ in pairs}
    proc, events, reader = await _zombie(zk_hosts, group)
    try:
        owned = [e for e in events if e["event"] == "owned"][-1]["units"]
        taken = {Unit.parse(u) for u in owned}
        await wait_until(lambda: all(len(m.target) == 4 for m, _ in pairs), 10, "three members")
        kept = {m.member_id: m.target for m, _ in pairs}
        proc.kill()
        killed = time.monotonic()
        await proc.wait()
        await wait_until(lambda: settled(pairs), TIMEOUT_S + 3, "its units taken over")
        took = time.monotonic() - killed
        assert took < TIMEOUT_S + 1, took  # the session timeout + 1 s
        # the survivors kept theirs and took over exactly the units of the killed member
        assert all(kept[m.member_id] <= m.target for m, _ in pairs)
        assert {u for m, _ in pairs for u in m.target - kept[m.member_id]} == taken
        assert all(len(before[m.member_id]) == len(m.target) for m, _ in pairs)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        reader.cancel()


async def test_nodes_of_a_stop_while_zookeeper_is_away_go_when_the_session_reconnects(
    make_member, zk_session, zk_server, group
) -> None:
    """A group member and an election stopped while the connection was down left their
    ephemeral nodes (review). The program's session lives on: the group leader gave units
    to a member nobody ran, and a stopped candidate at the head of the line kept every
    other one from leading. The nodes are deleted once the same session is back."""
    from changebus.cluster import PartitionElection
    from changebus.cluster._group_layout import owner_path

    session = await zk_session("away", session_timeout_s=10.0)  # outlives the restart
    member, _ = await make_member("away", session=session, follow=False)
    unit = Unit("orders", 2)
    await member.acquire(unit)
    election = PartitionElection(session, "p-away")
    await election.start()
    async with asyncio.timeout(10):
        await election.wait_elected()
    nodes = [member.member_path, owner_path(group, unit), election._candidate]
    assert all(nodes)
    sid = session.session_id
    try:
        await asyncio.to_thread(zk_server.stop)
        await wait_until(lambda: not session.connected, 10, "the connection to drop")
        await member.stop()
        await election.stop()
        await asyncio.to_thread(zk_server.start)
    finally:
        if zk_server.proc is None:
            await asyncio.to_thread(zk_server.start)
    async with asyncio.timeout(15):
        await session.wait_connected()
    assert session.session_id == sid  # the same session: its ephemeral nodes lived on
    observer = await zk_session("observer")
    left: list[str] = list(nodes)

    async def still_there() -> list[str]:
        return [n for n in nodes if await observer.op("exists", n) is not None]

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = await still_there()
        if not left:
            break
        await asyncio.sleep(0.1)
    assert left == []


async def test_a_member_node_created_after_a_stop_while_zookeeper_was_away_is_deleted(
    make_member, zk_session, zk_server, group
) -> None:
    """A registration's create that kazoo queued while the connection was down runs once it
    is back, after ``stop``: the leader then gave units to a member nobody ran, for as long
    as the session lived on (review). It is deleted when the session connects again, and
    the other member takes every unit."""
    from changebus.cluster._group_layout import MEMBER_PREFIX, group_members_path

    session = await zk_session("away", session_timeout_s=40.0)  # outlives the restart
    member, _ = await make_member("away", session=session, follow=False)
    other, _ = await make_member("stays")
    parent = group_members_path(group)
    sid = session.session_id
    try:
        await asyncio.to_thread(zk_server.stop)
        await wait_until(lambda: not session.connected, 10, "the connection to drop")
        # what a registration cut off by stop() leaves: its create waiting in kazoo's queue
        queued = session.client.create_async(
            f"{parent}/{MEMBER_PREFIX}", member._record(), ephemeral=True, sequence=True
        )
        await member.stop()
    finally:
        if zk_server.proc is None:
            await asyncio.to_thread(zk_server.start)
    await wait_until(lambda: session.connected, 20, "the session back")
    assert session.session_id == sid  # the same session: the queued create ran in it
    assert str(await asyncio.to_thread(queued.get, timeout=10)).startswith(f"{parent}/")

    async def owners_of_session() -> list[str]:
        found = []
        for name in await session.op("get_children", parent):
            stat = await session.op("exists", f"{parent}/{name}")
            if stat is not None and stat.ephemeralOwner == sid:
                found.append(name)
        return found

    deadline = time.monotonic() + 10
    while await owners_of_session() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert await owners_of_session() == []
    await wait_until(lambda: len(other.target) == 12, 20, "the other member to get every unit")
