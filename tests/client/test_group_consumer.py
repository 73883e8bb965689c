"""Consumer groups in one event loop: members on a real ZooKeeper sharing a real relay's partition.

Each test uses its own group name on the session's ZooKeeper. What a group
delivers is compared with what a plain consumer reads from the same relay
(every event once, by ``(scn, seq)``); each unit's windows must come in SCN
order, and each event must belong to its window's unit (its key's bucket).
"""

from __future__ import annotations

import asyncio

import pytest
from group_support import (
    BUCKETS,
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
    MemoryCheckpointPersister,
    SyncConsumer,
    Window,
)
from changebus.schemas import ConfigError, Unit
from waiting import wait_until

pytestmark = pytest.mark.zk


async def test_two_members_share_a_partition_exactly_once(
    make_relay: MakeRelay, zk_hosts: str
) -> None:
    async with make_relay(
        max_windows=500, windows_per_s=250, events_per_window=4, keys=500, wait=False
    ) as relay:
        group = new_group()
        rec = Recorder()
        a = Consumer(group_config(relay, zk_hosts, group, member_name="a"))
        b = Consumer(group_config(relay, zk_hosts, group, member_name="b"))
        async with iterating(a, "a", rec):
            await wait_until(lambda: len(a.units) == BUCKETS and rec.keys, 10, "a alone")
            async with iterating(b, "b", rec):
                while relay.hosts["syn"].state != "finished":
                    await asyncio.sleep(0.05)
                expected = await everything(relay)
                await wait_until(lambda: rec.distinct() >= expected, 30, "every event")
                await wait_until(
                    lambda: len(a.units) == len(b.units) == BUCKETS // 2, 10, "an even split"
                )
                await asyncio.sleep(0.3)  # a duplicate would show up now
                stats = a.stats()
                assert stats["member_id"].startswith("m-")
                assert stats["lanes"] >= 1 and len(stats["units"]) == BUCKETS // 2
                assert stats["rebalances"] >= 2
                assert set(a.units).isdisjoint(b.units)
                # a's lanes were narrowed to the buckets it kept: the relay filters for them
                owner = a._group._owner  # type: ignore[union-attr]
                assert owner is not None
                for lane in owner.lanes:
                    key_filter = lane.fetcher.stream.config.key_filter
                    assert key_filter is not None
                    assert key_filter.buckets == frozenset(lane.units)
        assert not rec.errors, rec.errors[:5]
        assert len(rec.keys) == len(expected), "an event was delivered twice"
        assert rec.distinct() == expected
        assert rec.by_member["a"] and rec.by_member["b"]


class Listening(AsyncCallbacks):
    """Callbacks of one member that check the rebalance order and record windows."""

    def __init__(
        self, name: str, rec: Recorder, log: list[tuple[str, str, frozenset[Unit]]]
    ) -> None:
        self.name = name
        self.rec = rec
        self.log = log
        self.mine: set[Unit] = set()

    async def on_assigned(self, units: frozenset[Unit]) -> None:
        assert not (units & self.mine)
        self.mine |= units
        self.log.append((self.name, "assigned", units))

    async def on_revoked(self, units: frozenset[Unit]) -> None:
        assert units <= self.mine
        self.mine -= units
        self.log.append((self.name, "revoked", units))

    async def on_start_window(self, window: Window) -> None:
        if Unit.parse(window.unit) not in self.mine:
            self.rec.errors.append(f"{self.name}: window of {window.unit} not assigned")

    async def on_end_window(self, window: Window) -> None:
        self.rec.take(self.name, window)


async def test_a_member_leaving_hands_its_units_over(make_relay: MakeRelay, zk_hosts: str) -> None:
    async with make_relay(
        max_windows=600, windows_per_s=300, events_per_window=3, keys=300, wait=False
    ) as relay:
        group = new_group()
        rec = Recorder()
        log: list[tuple[str, str, frozenset[Unit]]] = []
        members = {n: Consumer(group_config(relay, zk_hosts, group, member_name=n)) for n in "abc"}
        callbacks = {n: Listening(n, rec, log) for n in members}
        runs = {n: asyncio.create_task(c.run(callbacks[n])) for n, c in members.items()}
        try:
            await wait_until(
                lambda: all(len(c.units) in (5, 6) for c in members.values()), 15, "three shares"
            )
            await wait_until(lambda: len(rec.keys) > 300, 15, "some events")
            c_units = members["c"].units
            members["c"].stop()
            await runs.pop("c")
            await members["c"].close()
            assert log[-1] == ("c", "revoked", c_units)
            await wait_until(
                lambda: len(members["a"].units) + len(members["b"].units) == BUCKETS,
                10,
                "c's units taken over",
            )
            while relay.hosts["syn"].state != "finished":
                await asyncio.sleep(0.05)
            expected = await everything(relay)
            await wait_until(lambda: rec.distinct() >= expected, 30, "every event")
            await asyncio.sleep(0.3)
        finally:
            for name, task in runs.items():
                members[name].stop()
                await task
            for c in members.values():
                await c.close()
        assert not rec.errors, rec.errors[:5]
        # a graceful hand-over commits everything delivered: nothing comes twice
        assert len(rec.keys) == len(expected)
        assert rec.distinct() == expected
        # c's units were assigned to a or b only after c revoked them
        c_revoked = max(i for i, e in enumerate(log) if e[:2] == ("c", "revoked"))
        for name, kind, units in log[c_revoked + 1 :]:
            if kind == "assigned":
                assert units <= c_units, (name, units)
        taken = frozenset().union(*(u for n, k, u in log[c_revoked + 1 :] if k == "assigned"))
        assert taken == c_units
        # every member was told at close what it gave up
        for name in "ab":
            assert log[[i for i, e in enumerate(log) if e[0] == name][-1]][1] == "revoked"


async def test_restarted_group_continues_from_the_committed_checkpoints(
    make_relay: MakeRelay, zk_hosts: str
) -> None:
    async with make_relay(max_windows=200, events_per_window=3, keys=200) as relay:
        expected = await everything(relay)
        group = new_group()
        first = Recorder()
        a = Consumer(group_config(relay, zk_hosts, group, member_name="a"))
        async with iterating(a, "a", first):
            await wait_until(lambda: len(first.keys) >= 200, 20, "some events")
        assert a.stats()["units"] == []  # closed: every unit revoked and released
        second = Recorder()
        b = Consumer(group_config(relay, zk_hosts, group, member_name="b"))
        async with iterating(b, "b", second):
            await wait_until(lambda: first.distinct() | second.distinct() >= expected, 20, "all")
            await asyncio.sleep(0.3)
        # the second run starts where the first committed: no event twice
        assert not (first.distinct() & second.distinct())
        assert len(first.keys) + len(second.keys) == len(expected)


async def test_sync_consumer_in_a_group_with_a_listener(
    make_relay: MakeRelay, zk_hosts: str
) -> None:
    calls: list[tuple[str, frozenset[Unit]]] = []

    class Listener:
        def on_assigned(self, units: frozenset[Unit]) -> None:
            calls.append(("assigned", units))

        def on_revoked(self, units: frozenset[Unit]) -> None:
            calls.append(("revoked", units))

    async with make_relay(max_windows=50, events_per_window=2, keys=100) as relay:
        expected = await everything(relay)
        cfg = group_config(relay, zk_hosts, new_group(), buckets=4)

        def consume() -> set[tuple[int, int]]:
            seen: set[tuple[int, int]] = set()
            with SyncConsumer(cfg, listener=Listener()) as c:
                for window in c:
                    assert window.unit.startswith("syn.")
                    seen.update(e.dedupe_key for e in window.events)
                    if seen >= expected:
                        break
            return seen

        assert await asyncio.to_thread(consume) == expected
    everything_units = frozenset(Unit("syn", b) for b in range(4))
    assert calls == [("assigned", everything_units), ("revoked", everything_units)]


async def test_a_bucket_count_other_than_the_groups_is_refused(
    make_relay: MakeRelay, zk_hosts: str
) -> None:
    async with make_relay(max_windows=5) as relay:
        group = new_group()
        async with Consumer(group_config(relay, zk_hosts, group)):
            other = Consumer(group_config(relay, zk_hosts, group, buckets=32))
            with pytest.raises(ConfigError, match=r"16 buckets.*32"):
                await other.start()
            await other.close()


def test_a_plain_checkpoint_persister_is_refused_in_a_group() -> None:
    cfg = ConsumerConfig(
        relays=("http://127.0.0.1:1",), partition="syn", group="g", zookeeper="127.0.0.1:1"
    )
    with pytest.raises(ConfigError, match="UnitStore"):
        Consumer(cfg, persister=MemoryCheckpointPersister())
    with pytest.raises(ConfigError, match="consumer groups"):
        Consumer(ConsumerConfig(relays=("http://127.0.0.1:1",)), listener=Callbacks())
    with pytest.raises(ConfigError, match="give the relays"):
        ConsumerConfig(partition="syn", group="g", zookeeper="127.0.0.1:1")


async def test_columnar_is_refused_where_windows_are_split_or_events_handed_on() -> None:
    """``columnar`` leaves ``events`` empty: a group (which splits windows by their
    events) moved every unit's position on with nothing delivered, and callbacks or a
    replica saw no event while the checkpoint passed the rows (review)."""
    with pytest.raises(ConfigError, match="not in a group"):
        ConsumerConfig(
            relays=("http://127.0.0.1:1",),
            partition="syn",
            group="g",
            zookeeper="127.0.0.1:1",
            columnar=True,
        )
    consumer = Consumer(ConsumerConfig(relays=("http://127.0.0.1:1",), columnar=True))
    try:
        with pytest.raises(ConfigError, match="iterator"):
            await consumer.run(Callbacks())
    finally:
        await consumer.close()
