"""Relay clusters when ZooKeeper restarts or is down at start, and the ``[cluster]`` table."""

from __future__ import annotations

import asyncio
import socket
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from relay_cluster import PART, Writer, aiohttp_session, marker, slot_state, walsenders

from changebus.client import ChangeOp, Consumer, ConsumerConfig
from changebus.cluster import ClusterConfig
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from fix_pg import wait_until
from fix_zk import ZkServer

pytestmark = pytest.mark.zk


def _pg_relay_config(
    tmp_path: Path,
    pg_dsn: str,
    zk_server: ZkServer,
    zk_cluster: str,
    slot: str,
    name: str,
    session_timeout_s: float,
    **cluster: Any,
) -> RelayConfig:
    """Member ``name`` of a two-relay cluster over one Postgres slot (``cluster``: more
    ``[cluster]`` settings)."""
    source = FetcherConfig(
        "postgres",
        {"dsn": pg_dsn, "slot": slot, "status_interval_s": 0.2},
        retry_initial_s=0.1,
        retry_max_s=1.0,
    )
    return RelayConfig(
        data_dir=tmp_path / name,
        http=HttpConfig(port=0, max_wait_s=10),
        partitions=(PartitionConfig(PART, 1, capacity_bytes=16 << 20, fetcher=source),),
        flush_interval_s=0,
        cluster=ClusterConfig(
            zookeeper=zk_server.hosts,
            name=zk_cluster,
            member_id=name,
            session_timeout_s=session_timeout_s,
            **cluster,
        ),
    )


def _table_and_slot(pg_dsn: str) -> str:
    """The source table the tests write, and a fresh slot name for the pair of relays."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL)")
    return f"cb_{uuid.uuid4().hex[:10]}"


async def _leader_and_follower(a: Relay, b: Relay) -> Relay:
    """Wait until one of ``a`` and ``b`` leads and the other follows, both streaming; the leader."""
    hosts = [a.hosts[PART], b.hosts[PART]]
    await wait_until(
        lambda: (
            sorted(h.role for h in hosts) == ["follower", "leader"]
            and all(h.state == "streaming" for h in hosts)
        ),
        30,
        "a leader and a follower",
    )
    return a if a.hosts[PART].role == "leader" else b


@pytest.mark.pg
@pytest.mark.usefixtures("no_blocking")
async def test_zookeeper_restart_under_load(
    tmp_path: Path, pg_dsn: str, zk_server: ZkServer, zk_cluster: str
) -> None:
    slot = _table_and_slot(pg_dsn)

    def config(name: str) -> RelayConfig:
        return _pg_relay_config(tmp_path, pg_dsn, zk_server, zk_cluster, slot, name, 2.0)

    async with Relay(config("a")) as a, Relay(config("b")) as b:
        hosts = [a.hosts[PART], b.hosts[PART]]
        leader = await _leader_and_follower(a, b)
        epoch = leader.hosts[PART].epoch or 0
        with Writer(pg_dsn, rate=200) as w:
            await wait_until(lambda: w.committed >= 100, 30, "100 transactions")
            await asyncio.to_thread(zk_server.stop)
            host = leader.hosts[PART]
            # fenced by whichever notices first; the member's step-down (role) may come after
            await wait_until(
                lambda: host.state == "fenced" and host.role == "follower",
                10,
                "the leader fenced and stepped down",
            )
            async with aiohttp_session() as http:
                async with http.get(f"{leader.url}/readyz") as resp:
                    assert resp.status == 503
                    body = await resp.json()
                # whichever notices the lost session first fences it: the step-down, or the
                # source acknowledgement that finds the leadership lease invalid
                assert body["partitions"][PART].startswith(
                    ("fenced: stepped down", "fenced: the leadership lease is not valid")
                ), body
                async with http.get(f"{leader.url}/metrics") as resp:
                    text = await resp.text()
                assert (
                    f'changebus_relay_partition_leader{{partition="{PART}",role="follower"}} 0.0'
                    in text
                )
                for r in (a, b):  # both keep serving what they hold
                    async with http.get(f"{r.url}/v1/stream?partition={PART}&scn=-1") as resp:
                        assert resp.status == 200
                        if r is leader:  # no longer under its epoch: every fence refuses it
                            assert "X-Changebus-Epoch" not in resp.headers
                assert host.epoch is None
            # nobody acknowledges the slot while nobody can prove it leads
            await wait_until(lambda: not walsenders(pg_dsn), 10, "the source closed")
            confirmed = slot_state(pg_dsn, slot)[1]
            await asyncio.sleep(1.0)
            assert slot_state(pg_dsn, slot)[1] == confirmed
            await asyncio.to_thread(zk_server.start)
            await wait_until(
                lambda: (
                    any(h.role == "leader" and h.state == "streaming" for h in hosts)
                    and all(h.state == "streaming" for h in hosts)
                    and all((h.epoch or 0) > epoch for h in hosts)
                ),
                60,
                "a new leader after ZooKeeper came back",
            )
            # both are registered (again, or still: ZooKeeper restores unexpired sessions)
            # with the new epoch, as every member sees them
            new_epoch = max(h.epoch or 0 for h in hosts)

            def registered() -> bool:
                for r in (a, b):
                    assert r.cluster is not None
                    members = r.cluster.table.snapshot().members
                    if sorted(members) != ["a", "b"]:
                        return False
                    if any(m.partitions[PART].epoch != new_epoch for m in members.values()):
                        return False
                return True

            await wait_until(registered, 20, "both registered with the new epoch")
            before = w.committed
            await wait_until(lambda: w.committed >= before + 100, 30, "100 more transactions")
        end = marker(pg_dsn)
        await wait_until(lambda: all(h.buffer.meta.last_scn >= end for h in hosts), 30, "caught up")
        leader = a if a.hosts[PART].role == "leader" else b
        windows: list[Any] = []
        cfg = ConsumerConfig(relays=(a.url, b.url), partition=PART, start="earliest", wait_s=0.5)
        async with asyncio.timeout(60), Consumer(cfg) as consumer:
            async for window in consumer:
                windows.append(window)
                if window.scn >= end:
                    break
    scns = [win.scn for win in windows]
    assert scns == sorted(set(scns))
    ids = sorted(int(e.key["id"]) for win in windows for e in win.events if e.op == ChangeOp.INSERT)
    assert ids == list(range(w.committed))


async def test_a_leader_whose_lease_lapsed_within_its_session_does_not_leave_the_partition_leaderless(
    tmp_path: Path, pg_dsn: str, zk_server: ZkServer, zk_cluster: str
) -> None:
    """A pause past the lease but within the ZooKeeper session (a short SIGSTOP).

    The fence refuses the term and the member steps down, but it still holds
    the election: unless it gives the term up, nobody can lead again until its
    session dies (the chaos test found a partition leaderless for minutes).
    """
    slot = _table_and_slot(pg_dsn)

    def config(name: str) -> RelayConfig:
        return _pg_relay_config(tmp_path, pg_dsn, zk_server, zk_cluster, slot, name, 4.0)

    async with Relay(config("a")) as a, Relay(config("b")) as b:
        hosts = [a.hosts[PART], b.hosts[PART]]
        leader = await _leader_and_follower(a, b)
        epoch = leader.hosts[PART].epoch or 0
        assert leader.cluster is not None
        term = leader.cluster.roles[PART].election.leadership
        assert term is not None and term.epoch == epoch
        with Writer(pg_dsn, rate=200) as w:
            await wait_until(lambda: w.committed >= 50, 30, "50 transactions")
            # the lease lapses (a paused process) until the ingest notices; then the
            # heartbeats renew it: the session never ended
            deadline = asyncio.get_running_loop().time() + 10
            while leader.hosts[PART].state != "fenced":
                assert asyncio.get_running_loop().time() < deadline, "the leader was not fenced"
                term.confirmed_at = float("-inf")
                await asyncio.sleep(0.005)
            await wait_until(
                lambda: (
                    any(h.role == "leader" and h.state == "streaming" for h in hosts)
                    and all(h.state == "streaming" and (h.epoch or 0) >= epoch for h in hosts)
                    and len({h.epoch for h in hosts}) == 1
                ),
                20,
                "a leader streaming again",
            )
            # Which check notices the lapsed lease first depends on timing. The source
            # acknowledgement's fence refuses the term: a refused epoch is never led again,
            # so the election must have taken a newer one (before the fix nobody led until
            # the session ended). Or the append's lease check stops the ingest first: the
            # heartbeats then renew the lease of a session that never ended, so nobody else
            # can have led, and the same member may lead the same epoch again.
            if leader.cluster.roles[PART]._refused_epoch >= epoch:
                assert all((h.epoch or 0) > epoch for h in hosts)
            elif hosts[0].epoch == epoch:
                assert leader.hosts[PART].role == "leader"
            before = w.committed
            await wait_until(lambda: w.committed >= before + 50, 30, "50 more transactions")
        end = marker(pg_dsn)
        await wait_until(lambda: all(h.buffer.meta.last_scn >= end for h in hosts), 30, "caught up")


async def test_a_relay_started_while_zookeeper_is_down_serves_and_joins_later(
    tmp_path: Path,
    pg_dsn: str,
    zk_server: ZkServer,
    zk_cluster: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Also: an error other than "ZooKeeper did not answer" in one try (kazoo's own,
    such as NoAuthError from a tree whose ACL other credentials own) does not end the
    background joining for good (it did: the relay never joined; review)."""
    from kazoo.exceptions import NoAuthError

    real_join, tries = Relay._join, []

    async def join(self: Relay, cluster: ClusterConfig) -> Any:
        tries.append(1)
        if len(tries) == 2:  # (the 1st, at start, is answered by nobody: joins later)
            raise NoAuthError()
        return await real_join(self, cluster)

    monkeypatch.setattr(Relay, "_join", join)
    slot = _table_and_slot(pg_dsn)
    source = FetcherConfig(
        "postgres", {"dsn": pg_dsn, "slot": slot}, retry_initial_s=0.1, retry_max_s=1.0
    )
    config = RelayConfig(
        data_dir=tmp_path / "late",
        http=HttpConfig(port=0, max_wait_s=10),
        partitions=(PartitionConfig(PART, 1, capacity_bytes=16 << 20, fetcher=source),),
        flush_interval_s=0,
        cluster=ClusterConfig(
            zookeeper=zk_server.hosts,
            name=zk_cluster,
            member_id="late",
            session_timeout_s=2.0,
            connect_timeout_s=1.0,
        ),
    )
    await asyncio.to_thread(zk_server.stop)
    try:
        async with Relay(config) as relay, aiohttp_session() as http:
            host = relay.hosts[PART]

            def member() -> object:
                return relay.cluster

            assert member() is None  # not joined, yet serving
            async with http.get(f"{relay.url}/v1/status") as resp:
                assert resp.status == 200
            async with http.get(f"{relay.url}/readyz") as resp:
                assert resp.status == 503
                body = await resp.json()
            assert body["partitions"][PART].startswith("fenced: not in the cluster")
            assert not walsenders(pg_dsn)  # nobody reads the source without a leader
            await asyncio.to_thread(zk_server.start)
            await wait_until(
                lambda: host.role == "leader" and host.state == "streaming",
                60,
                "the relay joined and leads",
            )
            assert member() is not None
            assert len(tries) >= 3  # (the second failed with NoAuthError)
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute("INSERT INTO t VALUES (1, 1)")
            end = marker(pg_dsn)
            await wait_until(lambda: host.buffer.meta.last_scn >= end, 30, "the insert relayed")
            async with http.get(f"{relay.url}/readyz") as resp:
                assert resp.status == 200
    finally:
        if zk_server.proc is None:  # the test failed while ZooKeeper was down
            await asyncio.to_thread(zk_server.start)


# ---- configuration -------------------------------------------------------------------


def test_cluster_table_in_the_relay_config(tmp_path: Path) -> None:
    from changebus.relay._cluster import member_server_id
    from changebus.schemas import ConfigError
    from changebus.schemas.config import load_config

    cfg = tmp_path / "relay.toml"
    cfg.write_text(
        '[cluster]\nzookeeper = "127.0.0.1:2181"\nname = "prod"\nmember_id = "r1"\n'
        "session_timeout_s = 3.0\n"
    )
    config = load_config(RelayConfig, cfg, env={})
    assert config.cluster == ClusterConfig("127.0.0.1:2181", "prod", "r1", session_timeout_s=3.0)
    assert load_config(RelayConfig, None, env={}).cluster is None  # stand-alone as before
    cfg.write_text('[cluster]\nzookeeper = "127.0.0.1:2181"\nname = "prod"\n')
    with pytest.raises(ConfigError, match="member_id"):
        load_config(RelayConfig, cfg, env={})
    ids = {member_server_id(m, "main") for m in ("r0", "r1", "r2", "relay-a", "relay-b")}
    assert len(ids) == 5 and all(0x4352_0000 <= i <= 0x4352_FFFF for i in ids)


async def test_a_leader_that_cannot_read_its_source_gives_the_partition_to_one_that_can(
    tmp_path: Path, pg_dsn: str, zk_server: ZkServer, zk_cluster: str
) -> None:
    """Member a leads first but its own DSN points nowhere (a wrong port): it must not
    hold the term for good. After source_give_up_s it queues behind b, which leads."""
    slot = _table_and_slot(pg_dsn)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = pg_dsn.replace(
            f"port={pg_dsn.split('port=')[1].split()[0]}", f"port={s.getsockname()[1]}"
        )
    give_up = {"source_give_up_s": 2.0}
    a_cfg = _pg_relay_config(tmp_path, dead, zk_server, zk_cluster, slot, "a", 4.0, **give_up)
    b_cfg = _pg_relay_config(tmp_path, pg_dsn, zk_server, zk_cluster, slot, "b", 4.0, **give_up)
    async with Relay(a_cfg) as a:
        ha = a.hosts[PART]
        await wait_until(lambda: ha.role == "leader", 30, "a leads first")
        assert ha.state != "streaming"
        async with Relay(b_cfg) as b:
            hb = b.hosts[PART]
            await wait_until(
                lambda: hb.role == "leader" and hb.state == "streaming",
                30,
                "b leads and streams",
            )
            assert (hb.epoch or 0) > 1
            await wait_until(lambda: ha.role == "follower", 10, "a follows b")
            assert a.cluster is not None
            assert "source was not read" in a.cluster.roles[PART].step_down_reason
            with Writer(pg_dsn, rate=200) as w:
                await wait_until(lambda: w.committed >= 50, 30, "50 transactions")
            end = marker(pg_dsn)
            await wait_until(
                lambda: ha.buffer.meta.last_scn >= end and hb.buffer.meta.last_scn >= end,
                30,
                "both hold every window",
            )


@pytest.mark.pg
@pytest.mark.usefixtures("no_blocking")
async def test_a_new_leader_holds_the_source_until_followers_registered_again(
    tmp_path: Path,
    pg_dsn: str,
    zk_server: ZkServer,
    zk_cluster: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Right after a term began the routing table may list no follower yet (their sessions
    ended with the leader's, ZooKeeper restarting): the leader acknowledged the source up
    to its own end, past what a follower lacked (found by review). For a grace period it
    holds at where its buffer ended when the term began."""
    from changebus.relay import _cluster

    monkeypatch.setattr(_cluster, "_HOLD_GRACE_S", 2.0)
    slot = _table_and_slot(pg_dsn)
    cfg = _pg_relay_config(tmp_path, pg_dsn, zk_server, zk_cluster, slot, "a", 2.0)
    async with Relay(cfg) as relay:
        host = relay.hosts[PART]
        await wait_until(lambda: host.role == "leader", 30, "the leader")
        assert relay.cluster is not None
        role = relay.cluster.roles[PART]
        assert role.follower_hold() == role._lead_from < (1 << 63) - 1
        await wait_until(lambda: role.follower_hold() == (1 << 63) - 1, 10, "the grace's end")


@pytest.mark.pg
async def test_a_new_term_holds_the_source_where_its_followers_were_last_seen(
    tmp_path: Path,
    pg_dsn: str,
    zk_server: ZkServer,
    zk_cluster: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A member elected again while its followers are not registered (their sessions
    ended with its own) held the source only at its buffer's end during the grace: a
    follower that lagged behind it then lacked windows the slot no longer kept (review).
    The grace now also holds where the followers were when this member last saw them."""
    from changebus.relay import _cluster

    monkeypatch.setattr(_cluster, "_HOLD_GRACE_S", 0.0)  # (the second term's: below)
    slot = _table_and_slot(pg_dsn)
    cfg_a = _pg_relay_config(tmp_path, pg_dsn, zk_server, zk_cluster, slot, "a", 2.0)
    cfg_b = _pg_relay_config(tmp_path, pg_dsn, zk_server, zk_cluster, slot, "b", 2.0)
    async with Relay(cfg_a) as a:
        ha = a.hosts[PART]
        await wait_until(lambda: ha.role == "leader", 30, "a leads")
        assert a.cluster is not None
        role = a.cluster.roles[PART]
        async with Relay(cfg_b) as b:
            hb = b.hosts[PART]
            await wait_until(lambda: hb.role == "follower", 30, "b follows")
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute("INSERT INTO t SELECT g, g FROM generate_series(1, 50) g")
            end = marker(pg_dsn)
            await wait_until(lambda: role._followers_held >= end, 30, "b registered the rows")
            seen = role._followers_held
        # b is gone (its node with it: it holds nothing back now); a goes on alone
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO t SELECT g, g FROM generate_series(51, 100) g")
        later = marker(pg_dsn)
        await wait_until(lambda: ha.buffer.meta.last_scn >= later, 30, "a read on")
        assert role.follower_hold() == (1 << 63) - 1  # (no grace for a's first term)
        assert role._followers_held == seen  # where b was last seen
        monkeypatch.setattr(_cluster, "_HOLD_GRACE_S", 30.0)
        terms = role.terms
        role.election.requeue("a new term, as after a session lost")
        await wait_until(lambda: role.terms > terms and ha.role == "leader", 30, "a leads again")
        # no follower registered now: the new term holds at b's last position, not a's end
        assert role.follower_hold() == seen < ha.buffer.meta.last_scn


async def test_a_leader_behind_an_epoch_a_member_registered_takes_a_newer_one(
    tmp_path: Path, pg_dsn: str, zk_server: ZkServer, zk_cluster: str
) -> None:
    """ZooKeeper lost its data: a relay that knew only the epochs it saw itself took a
    small epoch, while members that had seen newer ones refused to follow it for good
    (they keep their min_epoch; found by review). A member registering a newer epoch
    than the leader's term makes the leader step down and take one past it."""
    from changebus.cluster import PartitionState, Registry, ZkSession

    slot = _table_and_slot(pg_dsn)
    config = _pg_relay_config(tmp_path, pg_dsn, zk_server, zk_cluster, slot, "lone", 2.0)
    ghost = ZkSession(
        ClusterConfig(
            zookeeper=zk_server.hosts,
            name=zk_cluster,
            member_id="seen-more",
            advertised_url="http://seen-more.test:1",
            session_timeout_s=2.0,
        )
    )
    async with Relay(config) as relay:
        host = relay.hosts[PART]
        await wait_until(lambda: host.role == "leader", 60, "the relay leads")
        role = relay.cluster.roles[PART]  # type: ignore[union-attr]
        first = role.plan[1]
        assert role.plan[0] == "lead" and first < 10
        await ghost.start()
        registry = Registry(ghost, "relay")
        registry.update({PART: PartitionState("follower", 10, 0, 0)})  # it followed epoch 10
        await registry.start()
        try:
            await wait_until(
                lambda: role.plan[0] == "lead" and role.plan[1] > 10, 30, "a newer epoch"
            )
            assert host.role == "leader"
        finally:
            await registry.stop()
            await ghost.stop()


@pytest.mark.pg
@pytest.mark.usefixtures("no_blocking")
async def test_a_leader_whose_disk_syncs_failed_leaves_the_election_at_once(
    tmp_path: Path,
    pg_dsn: str,
    zk_server: ZkServer,
    zk_cluster: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``durability = "fsync"`` and the leader's msync fails for good: its ingest stops.
    It used to keep the term, unread, for ``source_give_up_s`` (60 s), and to take it
    again whenever it stood alone in line (review). It leaves the election at once."""
    import dataclasses

    slot = _table_and_slot(pg_dsn)

    def config(name: str) -> RelayConfig:
        cfg = _pg_relay_config(tmp_path, pg_dsn, zk_server, zk_cluster, slot, name, 2.0)
        (part,) = cfg.partitions
        return dataclasses.replace(cfg, partitions=(dataclasses.replace(part, durability="fsync"),))

    async with Relay(config("a")) as a, Relay(config("b")) as b:
        leader = await _leader_and_follower(a, b)
        other = b if leader is a else a
        broken = leader.hosts[PART]

        def failing(since: Any, upto: Any) -> Any:
            raise OSError(5, "msync: Input/output error")

        # (this relay's disk only: the other's buffer syncs as before)
        monkeypatch.setattr(broken.buffer, "sync_spans", failing)
        with Writer(pg_dsn, rate=200) as w:
            await wait_until(
                lambda: (
                    other.hosts[PART].role == "leader" and other.hosts[PART].state == "streaming"
                ),
                15,
                "the other member leading",
            )
            assert leader.cluster is not None
            role = leader.cluster.roles[PART]
            assert role.withdrawn and broken.role != "leader"
            before = w.committed
            await wait_until(lambda: w.committed >= before + 50, 30, "50 more transactions")
        end = marker(pg_dsn)
        await wait_until(
            lambda: other.hosts[PART].buffer.meta.last_scn >= end, 30, "the new leader caught up"
        )
        async with aiohttp_session() as http, http.get(f"{leader.url}/readyz") as resp:
            assert resp.status == 503
            body = await resp.json()
        assert body["partitions"][PART].startswith("sync failed"), body
        # it stays out: nothing brings it back into the line while it runs
        await asyncio.sleep(1.0)
        assert leader.hosts[PART].role != "leader" and role.election.leadership is None


@pytest.mark.pg
@pytest.mark.usefixtures("no_blocking")
async def test_a_follower_whose_chain_failed_for_good_follows_again_and_holds_nothing_meanwhile(
    tmp_path: Path,
    pg_dsn: str,
    zk_server: ZkServer,
    zk_cluster: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A follower's chain stopped by a non-retriable error (a 401 after a token rotation,
    a TLS error) was never started again, and the follower stayed registered with a
    frozen max_scn: the leader held the source's acknowledgements at it for good, and the
    slot's WAL grew (review). It is not registered while failed, and follows again."""
    from changebus.schemas import ChangebusError

    slot = _table_and_slot(pg_dsn)

    def config(name: str) -> RelayConfig:
        return _pg_relay_config(tmp_path, pg_dsn, zk_server, zk_cluster, slot, name, 2.0)

    async with Relay(config("a")) as a, Relay(config("b")) as b:
        leader = await _leader_and_follower(a, b)
        follower = b if leader is a else a
        host = follower.hosts[PART]
        # (and a member's recovery re-reads what a crash dropped: it is not data loss)
        assert host.buffer.replayable and leader.hosts[PART].buffer.replayable
        real = host._create_fetcher
        made = 0

        async def refused_once() -> Any:
            nonlocal made
            fetcher = await real()
            made += 1
            if made == 1:

                async def refuse(_resume: Any) -> int:
                    raise ChangebusError("401 from the leader: unknown bearer token")

                fetcher.start = refuse  # type: ignore[method-assign,assignment]
            return fetcher

        assert follower.cluster is not None and leader.cluster is not None
        election = follower.cluster.roles[PART].election
        place = election._candidate
        monkeypatch.setattr(host, "_create_fetcher", refused_once)
        await host.switch_fetcher(host.config.fetcher)  # (its chain starts again: refused)
        await wait_until(lambda: host.state == "failed", 10, "the chain failed")
        assert not follower.cluster.roles[PART].registered()
        # and it went to the back of the leader line: elected next, it would lead from
        # behind what the source acknowledged meanwhile (a DATA_LOSS a healthy follower
        # avoids)
        await wait_until(
            lambda: election._candidate not in (None, place), 10, "the candidacy requeued"
        )
        me = follower.cluster.config.member_id

        def unlisted() -> bool:  # (what the leader's follower hold and the clients go by)
            assert leader.cluster is not None
            members = leader.cluster.table.snapshot().members
            return me in members and PART not in members[me].partitions

        await wait_until(unlisted, 10, "the failed follower out of the routing table")
        with Writer(pg_dsn, rate=200) as w:
            await wait_until(lambda: w.committed >= 50, 30, "50 transactions")
        end = marker(pg_dsn)
        await wait_until(
            lambda: host.state == "streaming" and host.buffer.meta.last_scn >= end,
            30,
            "the follower following again and caught up",
        )
        assert made >= 2 and host.role == "follower"
