"""Consumer-group owner nodes and claims when ZooKeeper answers badly, against a real
ZooKeeper: a create whose answer was lost, a delete still in flight when the same
member takes the unit again, and a group tree deleted under live members."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from changebus.cluster import CoordinationError, GroupMember, ZkUnitStore, _group_owners
from changebus.cluster._group_layout import checkpoint_path, checkpoints_path, owner_path
from changebus.schemas import Unit

pytestmark = pytest.mark.zk

MemberFactory = Callable[[str], Awaitable[GroupMember]]


@pytest.fixture
def group() -> str:
    return f"g{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def member(zk_session, group: str) -> AsyncIterator[MemberFactory]:
    """Members that follow no target: the tests acquire and release by hand."""
    made: list[GroupMember] = []

    async def make(name: str) -> GroupMember:
        m = GroupMember(await zk_session(name), group, ["orders"], 2, name=name)
        await m.start()
        await asyncio.sleep(0)
        made.append(m)
        return m

    yield make
    for m in made:
        with contextlib.suppress(CoordinationError):
            await m.stop()


async def test_a_create_whose_answer_was_lost_does_not_block_the_unit(
    member: MemberFactory, group: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ZooKeeper made the owner node but the answer never came (a connection lost
    mid-request): the member must not leave the node behind, or the unit's next owner
    waits for as long as this member's session lives."""
    a, b = await member("a"), await member("b")
    unit = Unit("orders", 1)
    real = _group_owners.create_owner  # type: ignore[attr-defined]

    async def answer_lost(*args: Any, **kw: Any) -> Any:
        await real(*args, **kw)
        raise CoordinationError("ZooKeeper request failed: ConnectionLoss")

    monkeypatch.setattr(_group_owners, "create_owner", answer_lost)
    with pytest.raises(CoordinationError):
        await a.acquire(unit)
    monkeypatch.setattr(_group_owners, "create_owner", real)
    assert unit not in a.owned
    async with asyncio.timeout(10):  # the unit moved to b: b gets it
        await b.acquire(unit)
    data, stat = await b.session.op("get", owner_path(group, unit))
    assert stat.ephemeralOwner == b.session.session_id and b.member_id.encode() in data
    assert unit not in a.owned and b.owned == {unit}


async def test_a_delete_in_flight_does_not_undo_the_same_members_new_create(
    member: MemberFactory, group: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release's delete still on its way while the member takes the unit again: the
    create found the node (its own session's) and took it over, then the delete landed,
    leaving the unit owned without its node: a second member could take it too."""
    a = await member("a")
    unit = Unit("orders", 0)
    await a.acquire(unit)
    real = _group_owners.delete_owners  # type: ignore[attr-defined]

    async def slow(*args: Any, **kw: Any) -> None:
        await asyncio.sleep(0.3)
        await real(*args, **kw)

    monkeypatch.setattr(_group_owners, "delete_owners", slow)
    releasing = asyncio.create_task(a.release([unit]))
    await asyncio.sleep(0.05)
    assert unit not in a.owned  # released at once; its delete still on the way
    async with asyncio.timeout(10):
        await a.acquire(unit)
        await releasing
    assert a.owned == {unit}
    stat = await a.session.op("exists", owner_path(group, unit))
    assert stat is not None and stat.ephemeralOwner == a.session.session_id
    b = await member("b")
    with pytest.raises(TimeoutError):  # held: b must wait
        async with asyncio.timeout(1):
            await b.acquire(unit)


async def test_claims_work_again_after_the_group_tree_was_deleted(zk_session, group: str) -> None:
    """``changebus group delete --force`` under live members: their claims recreate
    ``checkpoints/`` (they failed with NoNode forever: the store made it only once)."""
    session = await zk_session("store")
    store = ZkUnitStore(session)
    unit = Unit("orders", 0)
    first = await store.claim(group, unit, "m-0000000001")
    await session.op("delete", checkpoint_path(group, unit))
    await session.op("delete", checkpoints_path(group))
    again = await store.claim(group, unit, "m-0000000002")
    assert again.generation == 1 and first.generation == 1
    assert await session.op("exists", checkpoint_path(group, unit)) is not None


async def test_a_stale_node_taken_over_meanwhile_is_not_deleted(
    member: MemberFactory, group: str
) -> None:
    """A node of this session left stale (a lost create, an ended registration) is taken
    over by a new acquire while its drop waits for the unit: the drop must not delete
    what is the unit's owner node again."""
    a = await member("a")
    unit = Unit("orders", 1)
    await a.acquire(unit)
    a.owned = a.owned - {unit}  # as after a create whose answer was lost
    a._owners.stale.add(unit)
    async with a._owners.lock(unit):  # a take-over holds the unit while the drop starts
        dropping = asyncio.create_task(a._owners.drop_stale())
        await asyncio.sleep(0.1)
        assert not dropping.done()
        a.owned = a.owned | {unit}  # (the take-over done: the node is the owner's)
    await dropping
    stat = await a.session.op("exists", owner_path(group, unit))
    assert stat is not None and stat.ephemeralOwner == a.session.session_id


async def test_a_stale_drop_waiting_for_a_take_over_does_not_delete_its_node(
    member: MemberFactory, group: str
) -> None:
    """The same race with the real take-over: the drop waited for the unit's lock while
    an acquire's create took the node over; the create let the lock go before the
    acquire marked the unit owned, so the drop found it unowned and deleted it."""
    a = await member("a")
    unit = Unit("orders", 0)
    await a.acquire(unit)
    a.owned = a.owned - {unit}  # as after a create whose answer was lost
    a._owners.stale.add(unit)
    taking = asyncio.create_task(a.acquire(unit))
    for _ in range(5):  # until its create holds the unit's lock
        await asyncio.sleep(0)
    assert a._owners.lock(unit).locked()
    await asyncio.gather(taking, a._owners.drop_stale())
    assert a.owned == {unit}
    stat = await a.session.op("exists", owner_path(group, unit))
    assert stat is not None and stat.ephemeralOwner == a.session.session_id
