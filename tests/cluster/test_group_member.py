"""Consumer-group coordination against a real ZooKeeper: even targets, sticky
rebalancing on leaves, expiries and joins, leader failover, fenced assignment
writes, the meta check, owner nodes, the unit checkpoint store and the lease.
Faults (SIGSTOP, kill -9, a damaged assignment, ZooKeeper restarting): in
test_group_member_faults.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from group_members import TIMEOUT_S, settled
from kazoo.client import KazooClient

from changebus.cluster import (
    CoordinationError,
    GroupMember,
    ZkSession,
    ZkUnitStore,
    read_group,
)
from changebus.cluster._group_layout import (
    Assignment,
    assignment_path,
    checkpoint_path,
    decode_assignment,
    meta_path,
    owner_path,
)
from changebus.cluster._group_leader import write_assignment
from changebus.schemas import ConfigError, PartitionCheckpoint, Unit, UnitCommit
from waiting import wait_until

pytestmark = pytest.mark.zk


async def test_three_members_get_even_disjoint_targets(make_member, zk_session, group) -> None:
    pairs = [await make_member(f"c{i}") for i in range(3)]
    await wait_until(lambda: settled(pairs), 10, "even targets, owned")
    members = [m for m, _ in pairs]
    assert [m.member_id for m in members] == sorted(m.member_id for m in members)
    assert [m.is_leader for m in members] == [True, False, False]
    assert all(len(m.target) == 4 for m in members)  # 12 units / 3
    assert all(m.lease_valid() for m in members)

    state = await read_group(await zk_session("status"), group)
    assert (state.buckets, state.partitions) == (6, ("orders", "users"))
    assert list(state.members) == [m.member_id for m in members]
    assert state.members[members[1].member_id]["name"] == "c1"
    assert state.leader == members[0].member_id
    assert {m: set(u) for m, u in state.assignment.items()} == {
        m.member_id: set(m.target) for m in members
    }
    assert state.owners == {u: m.member_id for m in members for u in sorted(m.owned)}
    assert state.generation >= 1
    assert len(state.units) == 12
    with pytest.raises(ConfigError, match="no consumer group nosuchgroup"):
        await read_group(members[0].session, "nosuchgroup")
    assert await ZkUnitStore(members[0].session).read("nosuchgroup") == {}


async def test_a_leaving_member_moves_only_its_units(make_member) -> None:
    pairs = [await make_member(f"c{i}") for i in range(3)]
    await wait_until(lambda: settled(pairs), 10, "even targets")
    before = {m.member_id: m.target for m, _ in pairs}
    seen = {m.member_id: len(f.targets) for m, f in pairs}
    leaver, _ = pairs[1]
    t0 = time.monotonic()
    await leaver.stop()
    rest = [pairs[0], pairs[2]]
    await wait_until(lambda: settled(rest), TIMEOUT_S + 1, "its units taken over")
    assert time.monotonic() - t0 < TIMEOUT_S + 1
    for member, follower in rest:
        assert before[member.member_id] <= member.target  # kept everything it had
        # nothing was taken away from the members that stayed
        assert all(
            before[member.member_id] <= t for t in follower.targets[seen[member.member_id] :]
        )


async def test_a_closed_session_moves_only_its_units(make_member, zk_session) -> None:
    pairs = [await make_member(f"c{i}") for i in range(3)]
    await wait_until(lambda: settled(pairs), 10, "even targets")
    before = {m.member_id: m.target for m, _ in pairs}
    victim = pairs[2][0]
    t0 = time.monotonic()
    await victim.session.stop()  # like a crash: ZooKeeper drops its nodes
    rest = pairs[:2]
    await wait_until(lambda: settled(rest), TIMEOUT_S + 1, "its units taken over")
    assert time.monotonic() - t0 < TIMEOUT_S + 1
    for member, _ in rest:
        assert before[member.member_id] <= member.target


def expire(hosts: str, session: ZkSession) -> None:
    """Expire ``session`` the way kazoo's test harness does (another connection closes it)."""
    sid, password = session.client.client_id
    other = KazooClient(hosts=hosts, client_id=(sid, password), timeout=1.0)
    other.start(timeout=10)
    other.stop()
    other.close()


async def test_an_expired_member_loses_its_units_and_comes_back(make_member, zk_hosts) -> None:
    pairs = [await make_member(f"c{i}") for i in range(3)]
    await wait_until(lambda: settled(pairs), 10, "even targets")
    victim, follower = pairs[1]
    old_id, old_owned = victim.member_id, victim.owned
    assert old_owned
    others = {m.member_id: m.target for m, _ in pairs if m is not victim}
    await asyncio.to_thread(expire, zk_hosts, victim.session)
    await wait_until(lambda: follower.lost, 10, "on_lost")
    assert follower.lost[0] == old_owned
    assert not victim.lease_valid() or victim.member_id != old_id
    # it registers again with a new id, and the group settles with it again
    await wait_until(
        lambda: victim.member_id not in ("", old_id) and settled(pairs), 15, "re-registration"
    )
    assert victim.registrations == 2 and victim.lease_valid()
    assert frozenset() in follower.targets  # the target was emptied with the loss
    members = [m for m, _ in pairs]
    assert [m.is_leader for m in members] == [True, False, False]
    for member, _ in pairs:
        if member is not victim:
            assert others[member.member_id] & member.target  # the others kept most of theirs


async def test_a_fourth_member_takes_a_quarter_and_the_others_keep_the_rest(make_member) -> None:
    pairs = [await make_member(f"c{i}", ["orders"], 64) for i in range(3)]
    await wait_until(lambda: settled(pairs), 10, "even targets")
    before = {m.member_id: m.target for m, _ in pairs}
    seen = [len(f.targets) for _, f in pairs]
    newcomer = await make_member("c3", ["orders"], 64)
    pairs.append(newcomer)
    await wait_until(lambda: settled(pairs), 10, "rebalanced")
    assert len(newcomer[0].target) == 16
    for (member, follower), n in zip(pairs[:3], seen, strict=True):
        assert member.target <= before[member.member_id]
        assert len(member.target) == 16
        # each old member's targets only ever shrank: units moved only to the newcomer
        assert all(t <= before[member.member_id] for t in follower.targets[n:])
    moved = sum(len(before[m.member_id] - m.target) for m, _ in pairs[:3])
    assert moved == 16  # the minimum: the newcomer's quota


async def test_leader_failover_still_rebalances(make_member) -> None:
    pairs = [await make_member(f"c{i}") for i in range(3)]
    await wait_until(lambda: settled(pairs), 10, "even targets")
    leader = pairs[0][0]
    assert leader.is_leader
    await leader.stop()
    rest = pairs[1:]
    await wait_until(lambda: settled(rest), TIMEOUT_S + 1, "rebalanced by the new leader")
    assert rest[0][0].is_leader and not rest[1][0].is_leader
    # the new leader also handles joins
    rest.append(await make_member("c3"))
    await wait_until(lambda: settled(rest), 10, "rebalanced after a join")


async def test_a_deposed_leaders_assignment_write_is_refused(
    make_member, zk_session, group
) -> None:
    pairs = [await make_member(f"c{i}") for i in range(2)]
    await wait_until(lambda: settled(pairs), 10, "even targets")
    old_leader = pairs[0][0]
    old_path = old_leader._member_path
    await old_leader.session.stop()  # deposed: its member node is gone
    survivor = pairs[1][0]
    await wait_until(lambda: survivor.is_leader and len(survivor.target) == 12, 10, "new leader")
    session = await zk_session("intruder")
    node = assignment_path(group)
    data, stat = await session.op("get", node)
    current = decode_assignment(data, node)
    forged = Assignment(current.generation + 1, old_path.rpartition("/")[2], {"m-x": ()})
    assert not await write_assignment(session, group, old_path, forged, stat.version)
    # a live member with a stale version is refused too
    stale = Assignment(current.generation + 1, survivor.member_id, {survivor.member_id: ()})
    assert not await write_assignment(
        session, group, survivor._member_path, stale, stat.version - 1
    )
    data2, _ = await session.op("get", node)
    assert data2 == data
    assert len(survivor.target) == 12


async def test_meta_mismatch_is_a_clear_config_error(make_member, zk_session, group) -> None:
    await make_member("c0", ["orders"], 64)
    session = await zk_session("c1")
    with pytest.raises(ConfigError) as err:
        await GroupMember(session, group, ["orders"], 32).start()
    message = str(err.value)
    assert "64 buckets" in message and "configured with 32" in message and group in message
    with pytest.raises(ConfigError) as err2:
        await GroupMember(session, group, ["orders", "users"], 64).start()
    assert "orders, users" in str(err2.value) and "reads partitions orders " in str(err2.value)
    # garbage in meta: a clear error naming the node, not a crash
    other = f"{group}x"
    await session.ensure_path(meta_path(other).rpartition("/")[0])
    await session.op("create", meta_path(other), b"{not json")
    with pytest.raises(CoordinationError) as err3:
        await GroupMember(session, other, ["orders"], 64).start()
    assert meta_path(other) in str(err3.value)


async def test_acquire_waits_while_another_member_holds_the_unit(make_member, group) -> None:
    a, _ = await make_member("a", follow=False)
    b, _ = await make_member("b", follow=False)
    unit = Unit("orders", 3)
    fence_a = await a.acquire(unit)
    assert a.owned == {unit}
    waiting = asyncio.create_task(b.acquire(unit))
    await asyncio.sleep(0.5)
    assert not waiting.done()
    # a cancelled waiter leaves nothing behind
    cancelled = asyncio.create_task(b.acquire(unit))
    await asyncio.sleep(0.1)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await a.release([unit])
    await a.release([unit])  # idempotent
    assert a.owned == frozenset()
    async with asyncio.timeout(2):
        fence_b = await waiting
    assert b.owned == {unit}
    data, stat = await b.session.op("get", owner_path(group, unit))
    assert stat.ephemeralOwner == b.session.session_id and b.member_id.encode() in data
    # the fence to claim with is the owner node's creation zxid: larger for each later owner
    assert fence_b == stat.czxid > fence_a > 0
    assert await b.acquire(unit) == fence_b  # already owned: returns at once
    with pytest.raises(ConfigError):
        await b.acquire(Unit("elsewhere", 0))


async def test_a_late_claim_with_an_older_owner_node_is_refused_by_a_file_store(
    make_member, group, tmp_path
) -> None:
    """Stores other than ZooKeeper's cannot check the owner node in the claim: a member
    paused between its acquire and its claim, past its session, raised the generation
    after its successor had claimed, fencing the rightful owner (found by review). The
    claim carries the owner node's czxid now, and the store refuses an older one."""
    from changebus.client import FileUnitStore
    from changebus.schemas import FencedError

    a, _ = await make_member("a", follow=False)
    b, _ = await make_member("b", follow=False)
    unit = Unit("orders", 1)
    store = FileUnitStore(tmp_path / "units")
    fence_a = await a.acquire(unit)
    await a.release([unit])  # (as the expiry of a's session would: the node goes)
    fence_b = await b.acquire(unit)
    claim_b = await store.claim(group, unit, b.member_id, fence_b)
    with pytest.raises(FencedError):
        await store.claim(group, unit, a.member_id, fence_a)  # a wakes and claims late
    at = PartitionCheckpoint(window_scn=5, prev_scn=5)
    done = await store.commit(group, [UnitCommit(unit, at, claim_b.token)])
    assert done.fenced == frozenset()  # the rightful owner was not fenced
    stored = (await store.read(group))[unit]
    assert (stored.owner, stored.generation, stored.fence) == (b.member_id, 1, fence_b)


async def test_zk_unit_store_claims_fence_and_read(zk_session, group) -> None:
    session = await zk_session("store")
    store, other = ZkUnitStore(session), ZkUnitStore(session)
    u0, u1 = Unit("orders", 0), Unit("orders", 1)
    first = await store.claim(group, u0, "m-0000000001")
    assert (first.checkpoint, first.generation) == (None, 1)
    cp1 = PartitionCheckpoint(window_scn=10, prev_scn=10, timestamp_ns=5)
    result = await store.commit(group, [UnitCommit(u0, cp1, first.token)])
    assert not result.fenced and result.tokens[u0] > first.token
    token = result.tokens[u0]
    # the answer to a commit got lost: the same claim's older token still writes
    cp2 = PartitionCheckpoint(window_scn=20, prev_scn=20)
    again = await store.commit(group, [UnitCommit(u0, cp2, first.token)])
    assert not again.fenced and again.tokens[u0] > token

    # another member claims the unit: generation up, checkpoint handed over
    second = await other.claim(group, u0, "m-0000000002")
    assert (second.checkpoint, second.generation) == (cp2, 2)
    cp3 = PartitionCheckpoint(window_scn=30, prev_scn=30)
    stale = await store.commit(group, [UnitCommit(u0, cp3, again.tokens[u0])])
    assert stale.fenced == {u0} and not stale.tokens
    stored = (await store.read(group))[u0]
    assert (stored.checkpoint, stored.owner, stored.generation) == (cp2, "m-0000000002", 2)

    # several units in one commit, one of them fenced
    c1 = await other.claim(group, u1, "m-0000000002")
    mixed = await other.commit(
        group,
        [UnitCommit(u0, cp3, second.token), UnitCommit(u1, cp1, c1.token)],
    )
    assert not mixed.fenced
    newer = await store.claim(group, u1, "m-0000000003")
    both = await other.commit(
        group,
        [UnitCommit(u0, cp3, mixed.tokens[u0]), UnitCommit(u1, cp2, mixed.tokens[u1])],
    )
    assert both.fenced == {u1} and set(both.tokens) == {u0}
    everything = await store.read(group)
    assert set(everything) == {u0, u1}
    assert everything[u1].checkpoint == cp1 and everything[u1].owner == "m-0000000003"
    assert everything[u1].generation == newer.generation == 2
    assert everything[u0].checkpoint == cp3 and everything[u0].updated_ns > 0
    # the store's own old claim is fenced after its new claim
    renewed = await store.claim(group, u0, "m-0000000001")
    refused = await store.commit(group, [UnitCommit(u0, cp1, first.token)])
    assert refused.fenced == {u0}
    ok = await store.commit(group, [UnitCommit(u0, cp1, renewed.token)])
    assert not ok.fenced
    assert await store.commit(group, []) == type(ok)()

    # garbage in a checkpoint node: read skips it, claim names the node
    bad = Unit("orders", 2)
    await session.op("create", checkpoint_path(group, bad), b"\x00garbage")
    assert set(await store.read(group)) == {u0, u1}
    with pytest.raises(CoordinationError) as err:
        await store.claim(group, bad, "m-0000000001")
    assert checkpoint_path(group, bad) in str(err.value)
    await store.close()


async def test_lease_is_invalid_after_the_session_is_lost(make_member, zk_hosts) -> None:
    member, follower = await make_member("solo")
    await wait_until(lambda: follower.settled and len(member.owned) == 12, 10, "all units")
    await asyncio.sleep(member.lease_s)  # heartbeats keep it
    assert member.lease_valid()
    # each heartbeat sets the same watch again: kazoo keeps one, not one per beat
    watchers = member.session.client._data_watchers[member._member_path]
    assert len(watchers) == 1, watchers
    old = member.member_id
    await asyncio.to_thread(expire, zk_hosts, member.session)
    await wait_until(lambda: not member.lease_valid(), 5, "the lease to end")
    await wait_until(lambda: follower.lost, 5, "on_lost")
    assert follower.lost[0] == frozenset(member.units)
    await wait_until(
        lambda: member.member_id not in ("", old) and len(member.owned) == 12, 15, "back"
    )
    assert member.lease_valid() and follower.settled
    await member.session.stop()
    assert not member.lease_valid()


async def test_a_cancelled_claim_has_ended_when_its_cancel_returns(
    zk_session, group, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim runs in a ZooKeeper worker thread. Cancelled, it returned at once while
    the thread went on, and the consumer's cleanup released the unit's owner node at
    once: the next owner could recreate it (version 0 again, as the claim had read it)
    and claim, and the late claim then fenced it (review). The cancel now waits for it."""
    from changebus.cluster import _group_store

    session = await zk_session("slow-claim")
    store = ZkUnitStore(session)
    unit = Unit("orders", 1)
    assert (await store.claim(group, unit, "m-1")).generation == 1
    real = _group_store.decode_unit_record  # type: ignore[attr-defined]

    def slow(data: bytes, node: str) -> object:
        time.sleep(0.6)  # (in the claim's thread, between its reads and its write)
        return real(data, node)

    monkeypatch.setattr(_group_store, "decode_unit_record", slow)
    task = asyncio.create_task(store.claim(group, unit, "m-1"))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    monkeypatch.undo()
    at_cancel = (await store.read(group))[unit].generation
    await asyncio.sleep(1.0)
    assert (await store.read(group))[unit].generation == at_cancel == 2


async def test_a_claim_lands_only_while_the_claimant_is_a_member_holding_the_unit(
    zk_session, group
) -> None:
    """Ownership was checked on the loop, then the claim went to ZooKeeper: a member paused
    in between past its session raised the generation after its successor had claimed,
    fencing the rightful owner (found by review). The claim now checks the member node
    and the unit's owner node in its own transaction."""
    from changebus.cluster import CoordinationError
    from changebus.cluster._group_layout import encode_owner, owner_path

    session = await zk_session("fenced-store")
    path = f"/changebus/groups/{group}/members/m-1"
    await session.op("create", path, b"", ephemeral=True, makepath=True)
    member = [path]
    store = ZkUnitStore(session, fence=lambda: member[0])
    unit = Unit("orders", 0)
    owner = owner_path(group, unit)
    await session.op("create", owner, encode_owner("m-1"), ephemeral=True, makepath=True)
    first = await store.claim(group, unit, "m-1")  # creates the node, under the fence
    again = await store.claim(group, unit, "m-1")  # sets it, under the fence
    assert (first.generation, again.generation) == (1, 2)
    # the unit moved on: its owner node went (released), then names another member. A live
    # member's late claim raised the generation over the new owner's (found by review)
    await session.op("delete", owner)
    with pytest.raises(CoordinationError, match="does not hold"):
        await store.claim(group, unit, "m-1")
    await session.op("create", owner, encode_owner("m-2"), ephemeral=True)
    successor = await ZkUnitStore(session).claim(group, unit, "m-2")
    assert successor.generation == 3
    with pytest.raises(CoordinationError, match="does not hold"):
        await store.claim(group, unit, "m-1")
    assert (await store.read(group))[unit].generation == 3
    await session.op("delete", path)  # the membership is gone (its session expired)
    with pytest.raises(CoordinationError, match="no member now"):
        await store.claim(group, unit, "m-1")
    member[0] = ""  # no registration at all
    with pytest.raises(CoordinationError, match="no member now"):
        await store.claim(group, unit, "m-1")
    stored = (await store.read(group))[unit]
    assert (stored.owner, stored.generation) == ("m-2", 3)  # the successor's claim stands


async def test_a_wake_without_a_new_assignment_decodes_nothing(
    make_member, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every member decoded the whole assignment at every wake (at least every 2 s, on
    the event loop: 20 ms for 16k units over 100 members). An assignment node that did
    not change since the member's target was set from it is not decoded again."""
    from changebus.cluster import _group_follow, _group_leader

    decoded = 0
    real = _group_follow.decode_assignment  # type: ignore[attr-defined]

    def counting(data: bytes, node: str) -> Any:
        nonlocal decoded
        decoded += 1
        return real(data, node)

    monkeypatch.setattr(_group_follow, "decode_assignment", counting)
    # (the leader decoded it too, and balanced the units again, at every wake of its own)
    monkeypatch.setattr(_group_leader, "decode_assignment", counting)
    pairs = [await make_member(f"c{i}") for i in range(2)]
    await wait_until(lambda: settled(pairs), 10, "even targets, owned")
    await asyncio.sleep(0.3)
    before = decoded
    for member, _ in pairs:
        for _ in range(5):
            member._wake_assignment.set()
            member._wake_leader.set()
            await asyncio.sleep(0.2)  # (the leader settles a moment after a wake)
    assert decoded == before
    assert all(len(m.target) == 6 for m, _ in pairs)
    third = await make_member("c2")  # a new assignment: decoded, and followed
    await wait_until(lambda: settled([*pairs, third]), 10, "three members settled")
    assert decoded > before


async def test_two_members_of_one_group_cannot_share_a_session(zk_session, group) -> None:
    """Ownership is per session: an owner node the session holds counts as the member's
    own, so a second member of the group on the same session took the first's units at
    once, and both delivered them (review). The second is refused; after the first
    stops, a new member may use the session."""
    session = await zk_session("shared")
    first = GroupMember(session, group, ["orders"], 4, name="first")
    await first.start()
    try:
        with pytest.raises(ConfigError, match="a session of its own"):
            await GroupMember(session, group, ["orders"], 4, name="second").start()
        assert first.member_id  # the first one runs on
        other = GroupMember(session, f"{group}-other", ["orders"], 4, name="elsewhere")
        await other.start()  # another group on the same session is fine
        await other.stop()
    finally:
        await first.stop()
    again = GroupMember(session, group, ["orders"], 4, name="again")
    await again.start()
    await again.stop()


async def test_a_zk_unit_store_without_a_member_fence_checks_the_claims_fence(
    zk_session, group
) -> None:
    """A ZkUnitStore the application made (no member fence) threw the claim's fence away:
    a member paused between taking the unit's owner node and claiming it, whose node was
    made again by the next owner meanwhile, raised the generation over that owner's
    claim (review). The fence (the owner node's czxid) is checked in the claim's
    transaction now."""
    from changebus.schemas import FencedError

    session = await zk_session("fence")
    store = ZkUnitStore(session)
    unit = Unit("orders", 7)
    path = owner_path(group, unit)

    def make_owner(zk: Any) -> int:
        zk.create(path, b"m", makepath=True)
        return int(zk.exists(path).czxid)

    def drop_owner(zk: Any) -> None:
        zk.delete(path)

    first = await session.call(make_owner)
    assert (await store.claim(group, unit, "m-1", first)).generation == 1
    await session.call(drop_owner)
    second = await session.call(make_owner)  # the next owner's node
    assert second > first
    with pytest.raises(FencedError) as raised:
        await store.claim(group, unit, "m-1", first)
    assert raised.value.units == frozenset({str(unit)})
    assert (await store.claim(group, unit, "m-2", second)).generation == 2
    await session.call(drop_owner)
    with pytest.raises(FencedError):  # (no owner node at all)
        await store.claim(group, unit, "m-2", second)
    assert (await store.read(group))[unit].generation == 2
