"""Consumer groups in one event loop under faults: a lost ZooKeeper session, a fenced
commit, replicas sharing one database, the cluster table, lanes merging, schema
changes and gaps, rebalance calls in a sync worker thread, a file unit store, and a
stop during start. Helpers: group_support.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from group_support import (
    BUCKETS,
    FAST,
    MakeRelay,
    Recorder,
    everything,
    group_config,
    iterating,
    new_group,
)

from changebus.client import (
    AsyncCallbacks,
    Callbacks,
    Consumer,
    ConsumerConfig,
    SyncConsumer,
    Window,
)
from changebus.schemas import Unit
from waiting import wait_until

pytestmark = pytest.mark.zk


class Lost(AsyncCallbacks):
    """Records windows and the rebalance callbacks, ``on_lost`` included."""

    def __init__(self, name: str, rec: Recorder) -> None:
        self.name = name
        self.rec = rec
        self.calls: list[tuple[str, frozenset[Unit]]] = []

    async def on_assigned(self, units: frozenset[Unit]) -> None:
        self.calls.append(("assigned", units))

    async def on_revoked(self, units: frozenset[Unit]) -> None:
        self.calls.append(("revoked", units))

    async def on_lost(self, units: frozenset[Unit]) -> None:
        self.calls.append(("lost", units))

    async def on_end_window(self, window: Window) -> None:
        self.rec.take(self.name, window)


def _expire(hosts: str, client_id: tuple[int, bytes]) -> None:
    """Expire a ZooKeeper session: open it a second time and close it."""
    from kazoo.client import KazooClient

    twin = KazooClient(hosts=hosts, client_id=client_id)
    twin.start(10)
    twin.stop()
    twin.close()


async def test_a_lost_session_drops_the_units_and_they_come_back(
    make_relay: MakeRelay, zk_hosts: str
) -> None:
    async with make_relay(
        max_windows=800, windows_per_s=300, events_per_window=3, keys=300, wait=False
    ) as relay:
        group = new_group()
        rec = Recorder()
        rec._replay_ok = True  # a lost unit replays what was not committed
        a = Consumer(group_config(relay, zk_hosts, group, member_name="a"))
        b = Consumer(group_config(relay, zk_hosts, group, member_name="b"))
        cb_a, cb_b = Lost("a", rec), Lost("b", rec)
        runs = [asyncio.create_task(a.run(cb_a)), asyncio.create_task(b.run(cb_b))]
        try:
            await wait_until(lambda: len(a.units) == len(b.units) == 8, 15, "two shares")
            await wait_until(lambda: len(rec.keys) > 200, 15, "some events")
            held = a.units
            first_id = a.stats()["member_id"]
            zk = a._group._zk  # type: ignore[union-attr]
            assert zk is not None
            await asyncio.to_thread(_expire, zk_hosts, zk.client.client_id)
            await wait_until(lambda: ("lost", held) in cb_a.calls, 15, "on_lost")
            assert a.stats()["units_lost"] == 8
            # a joins again under a new member id and gets units again
            await wait_until(
                lambda: a.stats()["member_id"] not in ("", first_id) and len(a.units) == 8,
                15,
                "a back in the group",
            )
            while relay.hosts["syn"].state != "finished":
                await asyncio.sleep(0.05)
            expected = await everything(relay)
            await wait_until(lambda: rec.distinct() >= expected, 30, "every event")
        finally:
            for c, task in zip((a, b), runs, strict=True):
                c.stop()
                await task
                await c.close()
        assert not rec.errors, rec.errors[:5]
        assert rec.distinct() == expected
        assert cb_a.calls[0][0] == "assigned"
        lost_at = cb_a.calls.index(("lost", held))
        assert all(kind != "revoked" or not (u & held) for kind, u in cb_a.calls[:lost_at])


async def test_a_fenced_commit_drops_the_unit(make_relay: MakeRelay, zk_hosts: str) -> None:
    from changebus.cluster import ClusterConfig, ZkSession, ZkUnitStore

    async with make_relay(
        max_windows=600, windows_per_s=300, events_per_window=3, keys=300, wait=False
    ) as relay:
        group = new_group()
        rec = Recorder()
        rec._replay_ok = True
        a = Consumer(group_config(relay, zk_hosts, group, member_name="a"))
        cb = Lost("a", rec)
        run = asyncio.create_task(a.run(cb))
        session = ZkSession(ClusterConfig(zookeeper=zk_hosts, name="groups"))
        await session.start()
        try:
            await wait_until(lambda: len(a.units) == BUCKETS, 15, "all units")
            await wait_until(lambda: len(rec.keys) > 100, 15, "some events")
            victim = Unit("syn", 3)
            claim = await ZkUnitStore(session).claim(group, victim, "intruder")
            assert claim.generation >= 2
            await wait_until(lambda: ("lost", frozenset({victim})) in cb.calls, 10, "on_lost")
            stats = a.stats()
            assert stats["fenced_commits"] >= 1 and stats["units_lost"] >= 1
            # still assigned to a: it claims the unit again and goes on
            await wait_until(
                lambda: cb.calls[-1] == ("assigned", frozenset({victim})), 10, "the unit back"
            )
            assert victim in a.units
        finally:
            a.stop()
            await run
            await a.close()
            await session.stop()
        assert not rec.errors, rec.errors[:5]


async def test_replicas_in_a_group_share_one_database(
    make_relay: MakeRelay, zk_hosts: str, tmp_path: Any
) -> None:
    import sqlite3

    from changebus.client import ChangeOp, SqliteReplica

    db = tmp_path / "shared.db"
    async with make_relay(
        max_windows=300, events_per_window=3, keys=40, update_ratio=0.4, delete_ratio=0.2
    ) as relay:
        tables: dict[str, dict[Any, dict[str, Any]]] = {}
        cfg = ConsumerConfig(relays=(relay.url,), partition="syn", **FAST)
        last = relay.hosts["syn"].buffer.meta.last_scn
        async with Consumer(cfg) as c:
            async for w in c:
                for e in w.events:
                    rows = tables.setdefault(e.table, {})
                    if e.op is ChangeOp.DELETE:
                        rows.pop(tuple(e.key.values()), None)
                    elif e.after is not None:
                        rows[tuple(e.key.values())] = dict(e.after)
                if w.scn >= last:
                    break
        group = new_group()
        replicas = [SqliteReplica(db), SqliteReplica(db)]
        runs = [asyncio.create_task(replicas[0].run(group_config(relay, zk_hosts, group)))]
        await asyncio.sleep(0.5)  # the second member takes units from a running first one
        runs.append(asyncio.create_task(replicas[1].run(group_config(relay, zk_hosts, group))))

        async def done() -> bool:
            stored = await replicas[0].read(group)
            return len(stored) == BUCKETS and all(
                s.checkpoint is not None and s.checkpoint.window_scn >= last
                for s in stored.values()
            )

        try:
            for _ in range(300):
                if await done():
                    break
                await asyncio.sleep(0.1)
            assert await done(), "every unit's checkpoint at the last window"
            # (a unit moves rows between keys of its own bucket: run() told it the count)
            assert [r.unit_buckets for r in replicas] == [BUCKETS, BUCKETS]
        finally:
            for r in replicas:
                r.stop()
            for task in runs:
                await task
            for r in replicas:
                await r.close()
    conn = sqlite3.connect(db)
    try:
        for source, rows in tables.items():
            table = source.replace(".", "_")
            got = {
                (r[0],): {"id": r[0], "n": r[1], "payload": r[2]}
                for r in conn.execute(f'SELECT id, n, payload FROM "{table}"')
            }
            assert got == rows
    finally:
        conn.close()


async def test_members_find_the_relays_in_the_cluster_table(
    make_relay: MakeRelay, zk_hosts: str, zk_cluster: str
) -> None:
    from changebus.cluster import ClusterConfig, PartitionState, Registry, ZkSession

    async with make_relay(max_windows=100, events_per_window=3, keys=200) as relay:
        expected = await everything(relay)
        session = ZkSession(
            ClusterConfig(
                zookeeper=zk_hosts, name=zk_cluster, member_id="r1", advertised_url=relay.url
            )
        )
        await session.start()
        registry = Registry(session, "relay")
        await registry.start()
        registry.update({"syn": PartitionState("leader", 1, 1000, 1099)})
        await registry.flush()
        try:
            group = new_group()
            rec = Recorder()
            members = [
                Consumer(
                    ConsumerConfig(
                        zookeeper=zk_hosts,
                        cluster=zk_cluster,
                        partitions=("syn",),
                        group=group,
                        buckets=BUCKETS,
                        member_name=name,
                        **FAST,
                    )
                )
                for name in "ab"
            ]
            async with iterating(members[0], "a", rec), iterating(members[1], "b", rec):
                await wait_until(lambda: rec.distinct() >= expected, 30, "every event")
                # a member's relays come from its live lanes, which a rebalance rebuilds
                await wait_until(
                    lambda: members[0].stats()["relays"] == [relay.url], 10, "a's relay list"
                )
        finally:
            await registry.stop()
            await session.stop()
        assert not rec.errors, rec.errors[:5]
        assert rec.distinct() == expected


async def test_lanes_at_one_position_merge(make_relay: MakeRelay, zk_hosts: str) -> None:
    async with make_relay(
        max_windows=400, windows_per_s=200, events_per_window=3, keys=300, wait=False
    ) as relay:
        group = new_group()
        rec = Recorder()
        a = Consumer(group_config(relay, zk_hosts, group, member_name="a"))
        b = Consumer(group_config(relay, zk_hosts, group, member_name="b"))
        async with iterating(a, "a", rec):
            await wait_until(lambda: len(a.units) == BUCKETS and rec.keys, 10, "a alone")
            async with iterating(b, "b", rec):
                await wait_until(lambda: len(b.units) == BUCKETS // 2, 10, "b's share")
                await wait_until(lambda: len(rec.by_member["b"]) > 5, 10, "b reading")
            # b left: a reads b's units in a lane of their own, then one lane again
            await wait_until(lambda: len(a.units) == BUCKETS, 10, "a alone again")
            while relay.hosts["syn"].state != "finished":
                await asyncio.sleep(0.05)
            expected = await everything(relay)
            await wait_until(lambda: rec.distinct() >= expected, 30, "every event")
            await wait_until(lambda: a.stats()["lanes"] == 1, 10, "one lane")
            await asyncio.sleep(0.3)
        assert not rec.errors, rec.errors[:5]
        assert len(rec.keys) == len(expected)
        assert rec.distinct() == expected


async def test_schema_changes_go_with_bucket_0_and_a_gap_to_every_unit(
    scripted_relay: Any, window_type: Any, zk_hosts: str
) -> None:
    from changebus.schemas import Column, DataLoss, Op, TableSchema

    users = TableSchema(
        "app.users", (Column("id", "long", nullable=False), Column("name", "string")), ("id",), 1
    )
    W = window_type
    rows = [(users, 1, Op.INSERT, {"id": i, "name": f"u{i}"}, None) for i in range(40)]
    script = [
        W(10, rows=rows[:20], announce=[(1, users)]),
        W(20, loss=DataLoss(11, 19, "test gap")),
        W(30, rows=rows[20:]),
    ]
    async with scripted_relay(script) as relay:
        rec = Recorder(buckets=4)
        cfg = group_config(relay, zk_hosts, new_group(), buckets=4, on_data_loss="deliver")
        got: list[Window] = []
        async with Consumer(cfg) as c:
            async for window in c:
                got.append(window)
                rec.take("a", window)
                if len(rec.distinct()) == 40 and sum(w.data_loss is not None for w in got) == 4:
                    break
    assert not rec.errors, rec.errors[:5]
    changes = [w for w in got if w.schema_changes]
    assert [(w.scn, w.unit) for w in changes] == [(10, "syn.0")]
    assert sorted(w.unit for w in got if w.data_loss is not None) == [f"syn.{b}" for b in range(4)]
    assert {w.unit for w in got if w.scn == 10 and w.events} == {f"syn.{b}" for b in range(4)}


async def test_sync_callbacks_get_the_rebalance_calls_in_their_worker_thread(
    make_relay: MakeRelay, zk_hosts: str
) -> None:
    import threading

    async with make_relay(max_windows=60, events_per_window=2, keys=100) as relay:
        expected = await everything(relay)
        cfg = group_config(relay, zk_hosts, new_group(), buckets=4)
        calls: list[tuple[str, str, frozenset[Unit]]] = []
        seen: set[tuple[int, int]] = set()
        threads: set[str] = set()

        def consume() -> None:
            consumer = SyncConsumer(cfg)

            class Sync(Callbacks):
                def on_assigned(self, units: frozenset[Unit]) -> None:
                    calls.append(("assigned", threading.current_thread().name, units))

                def on_revoked(self, units: frozenset[Unit]) -> None:
                    calls.append(("revoked", threading.current_thread().name, units))

                def on_end_window(self, window: Window) -> None:
                    threads.add(threading.current_thread().name)
                    seen.update(e.dedupe_key for e in window.events)
                    if seen >= expected:
                        consumer.stop()

            try:
                consumer.run(Sync())
            finally:
                consumer.close()

        await asyncio.to_thread(consume)
    units = frozenset(Unit("syn", b) for b in range(4))
    assert seen == expected
    assert [(kind, u) for kind, _, u in calls] == [("assigned", units), ("revoked", units)]
    # on_assigned ran where the window callbacks run (on_revoked at close: after run ended)
    assert calls[0][1] in threads and threads == {calls[0][1]}


async def test_members_with_a_file_unit_store(
    make_relay: MakeRelay, zk_hosts: str, tmp_path: Any
) -> None:
    from changebus.client import FileUnitStore

    async with make_relay(
        max_windows=300, windows_per_s=200, events_per_window=3, keys=300, wait=False
    ) as relay:
        group = new_group()
        rec = Recorder()
        stores = [FileUnitStore(tmp_path / "units"), FileUnitStore(tmp_path / "units")]
        a = Consumer(group_config(relay, zk_hosts, group, member_name="a"), stores[0])
        b = Consumer(group_config(relay, zk_hosts, group, member_name="b"), stores[1])
        try:
            async with iterating(a, "a", rec):
                await wait_until(lambda: len(a.units) == BUCKETS and rec.keys, 10, "a alone")
                async with iterating(b, "b", rec):
                    await wait_until(lambda: len(b.units) == BUCKETS // 2, 10, "b's share")
                    while relay.hosts["syn"].state != "finished":
                        await asyncio.sleep(0.05)
                    expected = await everything(relay)
                    await wait_until(lambda: rec.distinct() >= expected, 30, "every event")
            stored = await stores[0].read(group)
        finally:
            for store in stores:
                await store.close()
        assert not rec.errors, rec.errors[:5]
        assert len(rec.keys) == len(expected) and rec.distinct() == expected
        last = relay.hosts["syn"].buffer.meta.last_scn
        assert len(stored) == BUCKETS
        assert all(s.checkpoint is not None for s in stored.values())
        assert max(s.checkpoint.window_scn for s in stored.values() if s.checkpoint) == last
        # the units b took over were claimed twice (by a, then by b)
        assert sorted(s.generation for s in stored.values()).count(2) >= BUCKETS // 2


@pytest.mark.parametrize("grouped", [True, False], ids=["group", "plain"])
async def test_a_stop_during_start_is_kept(
    make_relay: MakeRelay, zk_hosts: str, grouped: bool
) -> None:
    """stop() while start() is under way (no queue yet) ends the run instead of being lost.

    The shared-database replica test hung on a quiet machine this way: its second
    member was stopped while it was still joining the group, and ran on for ever.
    """
    async with make_relay(max_windows=50, events_per_window=3, keys=40) as relay:
        config = (
            group_config(relay, zk_hosts, new_group())
            if grouped
            else ConsumerConfig(relays=(relay.url,), partition="syn", **FAST)
        )
        consumer = Consumer(config)
        run = asyncio.create_task(consumer.run(Callbacks()))
        await asyncio.sleep(0)  # the run is inside start(), before its queue exists
        consumer.stop()
        try:
            await asyncio.wait_for(run, 20)
        finally:
            await consumer.close()
        assert run.done() and run.exception() is None


@pytest.mark.parametrize("mode", ["iterator", "callbacks"])
async def test_close_during_a_start_that_waits_for_zookeeper_ends_it(mode: str) -> None:
    """ZooKeeper away at start-up is waited for without limit (``max_attempts`` 0); a
    close() meanwhile (a SIGTERM handler) found nothing to release and returned, and the
    start went on: it would have joined, claimed units and delivered windows from a
    closed consumer whose nodes nobody removed (review). The start ends with close()."""
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = ConsumerConfig(
        relays=("http://127.0.0.1:1",),
        zookeeper=f"127.0.0.1:{port}",
        group="g",
        partitions=("p",),
        buckets=2,
        connect_timeout_s=0.2,
        backoff_initial_s=0.05,
        backoff_max_s=0.2,
    )
    consumer = Consumer(cfg)
    got: list[Any] = []

    async def consume() -> None:
        if mode == "iterator":
            async for window in consumer:
                got.append(window)
        else:
            await consumer.run(AsyncCallbacks())

    task = asyncio.create_task(consume())
    await asyncio.sleep(1.0)  # a few attempts to connect
    assert not task.done()
    await asyncio.wait_for(consumer.close(), 10)
    await asyncio.wait_for(task, 10)  # the iteration or run ends, without an error
    assert got == []
    group = consumer._group
    assert group is not None
    assert group._zk is None and group.member is None and not group._tasks
