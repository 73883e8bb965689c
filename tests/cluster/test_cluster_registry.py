"""Registry, routing table and ``changebus cluster status`` against a real ZooKeeper."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.security import OPEN_ACL_UNSAFE, make_digest_acl

from changebus.cluster import (
    CoordinationError,
    MemberInfo,
    PartitionElection,
    PartitionState,
    Registry,
    RoutingTable,
    member_path,
)
from changebus.cluster._layout import members_path
from waiting import wait_until

pytestmark = pytest.mark.zk

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client", "discovery")


async def _owner(session, path: str) -> int | None:
    stat = await session.op("exists", path)
    return None if stat is None else int(stat.ephemeralOwner)


async def test_registry_publishes_and_throttles(zk_session, zk_cluster) -> None:
    session = await zk_session("r1")
    registry = Registry(session, "relay", min_interval_s=0.3)
    await registry.start()
    path = member_path(zk_cluster, "r1")
    data, _ = await session.op("get", path)
    assert json.loads(data) == {"kind": "relay", "url": "http://r1.test:1", "partitions": {}}

    for scn in range(1, 51):  # a burst of updates: a few writes, the newest wins
        registry.update({"p0": PartitionState("leader", 3, 1, scn)})
    await asyncio.sleep(0)

    async def newest() -> bool:
        data, _ = await session.op("get", path)
        return bool(json.loads(data)["partitions"].get("p0", {}).get("max_scn") == 50)

    for _ in range(100):
        if await newest():
            break
        await asyncio.sleep(0.05)
    _, stat = await session.op("get", path)
    assert await newest()
    assert stat.version <= 3, f"{stat.version} writes for one burst"
    await registry.stop()
    assert await session.op("exists", path) is None


async def test_registry_comes_back_after_a_zookeeper_restart(
    zk_session, zk_server, zk_cluster
) -> None:
    session = await zk_session("r2", session_timeout_s=2.0)
    registry = Registry(session, "bootstrap", min_interval_s=0.05)
    await registry.start()
    path = member_path(zk_cluster, "r2")
    try:
        await asyncio.to_thread(zk_server.restart)
    finally:
        if zk_server.proc is None:
            await asyncio.to_thread(zk_server.start)
    async with asyncio.timeout(15):
        await session.wait_connected()
    registry.update({"p0": PartitionState("follower", 1, 5, 9)})

    async def present() -> bool:
        try:
            data, _ = await session.op("get", path)
        except (CoordinationError, NoNodeError):
            return False
        return bool(json.loads(data)["partitions"].get("p0", {}).get("max_scn") == 9)

    for _ in range(150):
        if await present():
            break
        await asyncio.sleep(0.1)
    assert await present()
    assert await _owner(session, path) == session.session_id
    await registry.stop()


@pytest.mark.parametrize("wiped", [False, True], ids=["expired", "expired_and_tree_gone"])
async def test_registry_registers_again_after_the_session_expires(
    zk_session, zk_hosts, zk_cluster, wiped
) -> None:
    """``expired_and_tree_gone``: ZooKeeper lost the cluster's nodes as well (restored
    without its data, an operator's ``deleteall``): the registry's task once died on
    the missing parent (NoNodeError) and the relay never registered again (found by
    review)."""
    session = await zk_session("r3", session_timeout_s=1.0)
    registry = Registry(session, "relay", min_interval_s=0.05)
    registry.update({"p0": PartitionState("follower", 2, 0, 7)})
    await registry.start()
    path = member_path(zk_cluster, "r3")
    old_sid = session.session_id
    assert await _owner(session, path) == old_sid

    # expire the session the way kazoo's test harness does: another connection
    # takes over the same session id and password, then closes it
    sid, password = session.client.client_id

    def expire() -> None:
        if wiped:
            admin = KazooClient(hosts=zk_hosts, timeout=5.0)
            admin.start(timeout=10)
            admin.delete(members_path(zk_cluster), recursive=True)
            admin.stop()
            admin.close()
        other = KazooClient(hosts=zk_hosts, client_id=(sid, password), timeout=1.0)
        # (on a loaded machine the 1 s session may have expired by itself meanwhile: the
        # server then refuses its id and the take-over times out, which is no failure;
        # the new session below is what counts)
        with contextlib.suppress(KazooTimeoutError):
            other.start(timeout=10)
            other.stop()
        other.close()

    await asyncio.to_thread(expire)
    await wait_until(
        lambda: session.session_id not in (0, old_sid) and session.state == "connected",
        15,
        "a new session",
    )

    async def registered() -> bool:
        try:
            return bool(await _owner(session, path) == session.session_id)
        except CoordinationError:
            return False

    for _ in range(100):
        if await registered():
            break
        await asyncio.sleep(0.05)
    assert await registered()
    assert registry.registrations == 2
    data, _ = await session.op("get", path)
    assert json.loads(data)["partitions"]["p0"]["max_scn"] == 7
    await registry.stop()


async def test_routing_table_follows_members_and_leaders(zk_session) -> None:
    watcher = await zk_session("")
    table = RoutingTable(watcher)
    await table.start()
    assert table.snapshot().members == {}

    s1, s2 = await zk_session("r1"), await zk_session("r2")
    reg1 = Registry(s1, "relay", min_interval_s=0.05)
    reg2 = Registry(s2, "relay", min_interval_s=0.05)
    await reg1.start()
    await reg2.start()
    await wait_until(lambda: set(table.snapshot().members) == {"r1", "r2"}, 10, "two members")

    election = PartitionElection(s1, "p0")
    follower = PartitionElection(s2, "p0")
    seen: list[tuple[str, int] | None] = []

    async def follow() -> None:
        async for leader in table.leader_changes("p0"):
            seen.append(None if leader is None else (leader.member_id, leader.epoch))

    following = asyncio.create_task(follow())
    await election.start()
    async with asyncio.timeout(10):
        term = await election.wait_elected()
    await follower.start()
    reg1.update({"p0": PartitionState("leader", term.epoch, 1, 100)})
    reg2.update({"p0": PartitionState("follower", term.epoch, 1, 90)})
    await wait_until(
        lambda: (
            table.leader("p0") is not None
            and table.snapshot().lag("r2", "p0") == 10
            and table.snapshot().lag("r1", "p0") == 0
        ),
        10,
        "leader and lag",
    )
    leader = table.leader("p0")
    assert leader is not None
    assert (leader.member_id, leader.url, leader.epoch) == ("r1", "http://r1.test:1", term.epoch)
    snap = table.snapshot()
    assert [m.member_id for m in snap.serving("p0")] == ["r1", "r2"]
    assert snap.members["r2"] == MemberInfo(
        "r2", "relay", "http://r2.test:1", {"p0": PartitionState("follower", term.epoch, 1, 90)}
    )

    # the leader leaves: its member node and its leadership disappear, r2 takes over
    version = table.snapshot().version
    changes: list[int] = []
    table.add_listener(lambda s: changes.append(s.version))
    await election.stop()
    await reg1.stop()
    await wait_until(
        lambda: (
            set(table.snapshot().members) == {"r2"}
            and (table.leader("p0") or term).member_id == "r2"
        ),
        10,
        "r2 alone and leading",
    )
    new = table.leader("p0")
    assert new is not None and new.epoch == term.epoch + 1
    async with asyncio.timeout(1):
        assert (await table.wait_changed(version)).version > version
    assert changes
    # the leader_changes iterator is read by its own task: it may see r2 a moment later
    await wait_until(lambda: seen[-1] == ("r2", new.epoch), 10, "leader_changes to show r2")
    assert seen[0] is None and seen[1] == ("r1", term.epoch)
    following.cancel()
    await follower.stop()
    await reg2.stop()
    await table.stop()


def _status(zk_hosts: str, cluster: str, *extra: str) -> str:
    env = {**os.environ, "PYTHONPATH": ":".join(str(ROOT / s) for s in SOURCE_ROOTS)}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "changebus.schemas",
            "cluster",
            "status",
            "--zookeeper",
            zk_hosts,
            "--cluster",
            cluster,
            *extra,
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=60,
    ).stdout


async def test_cluster_status_prints_the_table_and_json(zk_session, zk_hosts, zk_cluster) -> None:
    s1, s2 = await zk_session("relay-a"), await zk_session("relay-b")
    reg1 = Registry(s1, "relay", min_interval_s=0.05)
    reg2 = Registry(s2, "relay", min_interval_s=0.05)
    election = PartitionElection(s1, "pg")
    await election.start()
    async with asyncio.timeout(10):
        term = await election.wait_elected()
    reg1.update({"pg": PartitionState("leader", term.epoch, 10, 500)})
    reg2.update({"pg": PartitionState("follower", term.epoch, 10, 480)})
    await reg1.start()
    await reg2.start()

    out = json.loads(await asyncio.to_thread(_status, zk_hosts, zk_cluster, "--json"))
    assert out["cluster"] == zk_cluster
    assert out["partitions"] == {
        "pg": {"leader": "relay-a", "url": "http://relay-a.test:1", "epoch": term.epoch}
    }
    by_id = {m["member_id"]: m for m in out["members"]}
    assert by_id["relay-a"]["partitions"]["pg"] == {
        "role": "leader",
        "epoch": term.epoch,
        "min_scn": 10,
        "max_scn": 500,
        "lag": 0,
    }
    assert by_id["relay-b"]["partitions"]["pg"]["lag"] == 20
    assert by_id["relay-b"]["kind"] == "relay"
    assert by_id["relay-b"]["url"] == "http://relay-b.test:1"

    text = await asyncio.to_thread(_status, zk_hosts, zk_cluster)
    lines = text.splitlines()
    assert lines[0] == f"cluster {zk_cluster}: 2 member(s)"
    assert lines[1].split() == [
        "MEMBER",
        "KIND",
        "URL",
        "PARTITION",
        "ROLE",
        "EPOCH",
        "MIN_SCN",
        "MAX_SCN",
        "LAG",
    ]
    assert lines[2].split() == [
        "relay-a",
        "relay",
        "http://relay-a.test:1",
        "pg",
        "leader",
        str(term.epoch),
        "10",
        "500",
        "0",
    ]
    assert lines[3].split()[-1] == "20"
    assert f"pg  relay-a  {term.epoch}  http://relay-a.test:1" in text
    await election.stop()
    await reg1.stop()
    await reg2.stop()


async def test_cluster_status_of_an_empty_cluster_writes_nothing(
    zk_session, zk_hosts, zk_cluster
) -> None:
    out = json.loads(await asyncio.to_thread(_status, zk_hosts, zk_cluster, "--json"))
    assert out == {"cluster": zk_cluster, "members": [], "partitions": {}}
    session = await zk_session("")
    assert await session.op("exists", f"/changebus/{zk_cluster}") is None


async def test_the_routing_table_keeps_refreshing_after_zookeeper_refuses_a_read(
    zk_session, zk_hosts: str, zk_cluster: str
) -> None:
    """A refusal (NoAuth: an ACL locks the members node for a while) must not end the
    table's refresh task: readers would keep a frozen table for good."""
    admin = KazooClient(hosts=zk_hosts, timeout=5.0)
    admin.start(10)
    try:
        members = members_path(zk_cluster)
        admin.ensure_path(members)
        table = RoutingTable(await zk_session(""))
        await table.start()
        admin.add_auth("digest", "admin:pw")
        admin.set_acls(members, [make_digest_acl("admin", "pw", all=True)])
        s1 = await zk_session("r1")
        election = PartitionElection(s1, "p0")
        await election.start()  # a change under partitions/: the table refreshes, is refused
        await asyncio.sleep(1.5)
        admin.set_acls(members, OPEN_ACL_UNSAFE)
        reg = Registry(s1, "relay", min_interval_s=0.05)
        await reg.start()
        await wait_until(lambda: set(table.snapshot().members) == {"r1"}, 10, "the member seen")
        await wait_until(lambda: table.leader("p0") is not None, 10, "the leader seen")
        await reg.stop()
        await election.stop()
        await table.stop()
    finally:
        admin.stop()
        admin.close()


async def test_one_look_readers_share_a_snapshot_for_a_moment(
    zk_session, zk_hosts, zk_cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Spark driver and executors ask the routing table once per partition and per
    decision; each look opened a ZooKeeper session of its own (a plan over a thousand
    partitions opened a thousand). Looks within SNAPSHOT_TTL_S share one snapshot; a
    later look sees the members that came meanwhile."""
    from changebus.client import _cluster

    monkeypatch.setattr(_cluster, "SNAPSHOT_TTL_S", 1.0)
    reads = 0
    read_table = _cluster._read_table

    async def counted(*args: object) -> object:
        nonlocal reads
        reads += 1
        return await read_table(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(_cluster, "_read_table", counted)
    s1 = await zk_session("r1")
    reg1 = Registry(s1, "relay", min_interval_s=0.05)
    reg1.update({f"p{i}": PartitionState("follower", 1, 1, 10) for i in range(10)})
    await reg1.start()
    for i in range(10):
        routes = await _cluster.read_routes(zk_hosts, zk_cluster, (f"p{i}",))
        assert routes == {f"p{i}": ("http://r1.test:1",)}
    urls = await _cluster.read_route(zk_hosts, zk_cluster, ("p3",), kind="relay")
    assert urls == ("http://r1.test:1",) and reads == 1
    s2 = await zk_session("r2")
    reg2 = Registry(s2, "relay", min_interval_s=0.05)
    reg2.update({"p0": PartitionState("follower", 1, 1, 10)})
    await reg2.start()
    await asyncio.sleep(1.1)
    routes = await _cluster.read_routes(zk_hosts, zk_cluster, ("p0",))
    assert set(routes["p0"]) == {"http://r1.test:1", "http://r2.test:1"} and reads == 2
    # a look that finds nobody serving in the shared snapshot looks again at once (a
    # member that registered meanwhile is not kept waiting)
    reg2.update(
        {"p0": PartitionState("follower", 1, 1, 10), "late": PartitionState("follower", 1, 1, 10)}
    )

    async def late_registered() -> bool:
        data, _ = await s2.op("get", member_path(zk_cluster, "r2"))
        return "late" in json.loads(data)["partitions"]

    for _ in range(100):
        if await late_registered():
            break
        await asyncio.sleep(0.02)
    routes = await _cluster.read_routes(zk_hosts, zk_cluster, ("p0", "late"))
    assert routes["late"] == ("http://r2.test:1",) and reads == 3  # (cached look, then fresh)
    urls = await _cluster.read_route(zk_hosts, zk_cluster, ("nobody",), kind="relay")
    assert urls == () and reads == 4  # (looked again: still nobody)
    await reg1.stop()
    await reg2.stop()


async def test_a_connection_lost_right_after_connecting_is_not_a_new_session(
    zk_session,
) -> None:
    """kazoo's thread reports CONNECTED; the connection drops before the event loop
    handles the report. The loop read the session id then: none, so it announced a
    new session (id 0) with the old one alive, and members registered again while
    their owner nodes stayed with the live session (found by review). The id is now
    taken on kazoo's thread, with the report."""
    from kazoo.client import KazooState

    session = await zk_session("r8")
    sid = session.session_id
    changes: list[Any] = []
    remove = session.add_listener(changes.append)
    zk = session.client

    def report_then_drop() -> None:
        session._on_kazoo_state(KazooState.CONNECTED)  # kazoo's thread, as it reconnects
        zk._live.clear()  # ...and the connection is gone again before the loop runs

    try:
        await asyncio.to_thread(report_then_drop)
        await asyncio.sleep(0.1)  # the loop handles the report
    finally:
        zk._live.set()
        remove()
    assert session.session_id == sid
    assert not any(c.new_session for c in changes)


async def test_a_members_new_positions_are_read_without_the_whole_table(zk_session) -> None:
    """Members rewrite their nodes twice a second while their SCNs move, and a whole
    read of the table is 2 + M + 3P requests (3,104 at 30 members and 1,024 partitions,
    by every process watching). A member node's new data is read alone."""
    watcher = await zk_session("")
    table = RoutingTable(watcher, refresh_s=60.0)
    await table.start()
    s1 = await zk_session("r1")
    reg = Registry(s1, "relay", min_interval_s=0.05)
    await reg.start()
    await wait_until(lambda: set(table.snapshot().members) == {"r1"}, 10, "the member")
    whole = 0
    real = table._refresh

    async def counted() -> None:
        nonlocal whole
        whole += 1
        await real()

    table._refresh = counted  # type: ignore[method-assign]
    for scn in range(100, 105):
        reg.update({"p0": PartitionState("leader", 1, 1, scn)})
        await wait_until(
            lambda scn=scn: (
                table.snapshot().members["r1"].partitions.get("p0")
                == PartitionState("leader", 1, 1, scn)
            ),
            10,
            f"SCN {scn} in the table",
        )
    assert whole == 0
    await reg.stop()  # the member goes: its node and the children of members/ change
    await wait_until(lambda: table.snapshot().members == {}, 10, "the member gone")
    assert whole >= 1
    await table.stop()


async def test_the_registry_keeps_trying_after_a_thousand_failed_writes(
    zk_session, zk_cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its back-off was ``0.05 * 2**failures``: at 1,024 failures in a row (about 17
    minutes of a ZooKeeper refusing the writes, an ACL changed say) the float overflowed
    and the task ended without a word; the relay was never written again (review)."""
    session = await zk_session("r9")
    registry = Registry(session, "relay", min_interval_s=0.0)
    await registry.start()
    path = member_path(zk_cluster, "r9")
    real_op, real_sleep = session.op, asyncio.sleep
    refused = [0]

    async def refusing(name: str, *args: Any, **kwargs: Any) -> Any:
        if name in ("set", "create") and refused[0] < 1100:
            refused[0] += 1
            raise CoordinationError("refused (test)")
        return await real_op(name, *args, **kwargs)

    async def quick(_delay: float, *args: Any) -> Any:
        return await real_sleep(0, *args)

    monkeypatch.setattr(session, "op", refusing)
    monkeypatch.setattr(asyncio, "sleep", quick)  # (the back-off, 1 s a try, skipped)
    try:
        registry.update({"p0": PartitionState("leader", 3, 1, 77)})

        async def written() -> bool:
            data, _ = await real_op("get", path)
            return bool(json.loads(data)["partitions"].get("p0", {}).get("max_scn") == 77)

        for _ in range(400):
            if await written():
                break
            await real_sleep(0.05)
        assert refused[0] == 1100
        assert registry._task is not None and not registry._task.done()
        assert await written()
    finally:
        monkeypatch.undo()
        await registry.stop()


async def test_a_refresh_asks_for_every_partitions_first_candidate_at_once(zk_session) -> None:
    """Each partition's first candidate was read in turn, one round trip each: seconds a
    refresh at a thousand partitions (review). They are asked for all at once now."""
    s1 = await zk_session("r-pipe")
    elections = [PartitionElection(s1, f"pp{i}") for i in range(4)]
    for e in elections:
        await e.start()
    async with asyncio.timeout(10):
        for e in elections:
            await e.wait_elected()
    watcher = await zk_session("")
    table = RoutingTable(watcher, refresh_s=60.0)
    await table.start()
    try:
        await wait_until(lambda: all(table.leader(f"pp{i}") for i in range(4)), 10, "leaders")
        steps: list[str] = []
        call = watcher.call

        class Recorded:
            def __init__(self, result: Any, path: str) -> None:
                self.result, self.path = result, path

            def get(self, timeout: float | None = None) -> Any:
                steps.append(f"wait {self.path}")
                return self.result.get(timeout=timeout)

        class Client:
            def __init__(self, zk: Any) -> None:
                self.zk = zk

            def get_async(self, path: str, *args: Any, **kwargs: Any) -> Recorded:
                steps.append(f"ask {path}")
                return Recorded(self.zk.get_async(path, *args, **kwargs), path)

            def __getattr__(self, name: str) -> Any:
                return getattr(self.zk, name)

        async def recorded(func: Any) -> Any:
            return await call(lambda zk: func(Client(zk)))

        watcher.call = recorded
        await table._refresh()
        watcher.call = call
        candidates = [s for s in steps if "/election/" in s]
        asked = [i for i, s in enumerate(steps) if s in candidates and s.startswith("ask")]
        waited = [i for i, s in enumerate(steps) if s in candidates and s.startswith("wait")]
        assert len(asked) == 4 and len(waited) == 4
        assert max(asked) < min(waited), candidates  # all asked before the first wait
        assert all(table.leader(f"pp{i}") for i in range(4))
    finally:
        await table.stop()
        for e in elections:
            await e.stop()
