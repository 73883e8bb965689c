"""Consumers that find their relays in a cluster's routing table (real ZooKeeper, real relays).

The relays do not register themselves here: the test registers each one with
:class:`changebus.cluster.Registry` on its own ZooKeeper session (member id,
advertised URL = the relay's URL, role), and takes the registration away by
closing that session, the way a relay's ephemeral node disappears.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from changebus.client import Consumer, ConsumerConfig, RelayUnavailableError
from changebus.cluster import ClusterConfig, PartitionState, Registry, ZkSession
from changebus.relay import Relay
from changebus.schemas import ConfigError
from changebus.schemas.security import ClientAuth

pytestmark = pytest.mark.zk

MakeRelay = Callable[..., AbstractAsyncContextManager[Relay]]
ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client", "discovery")
FAST: dict[str, Any] = {"wait_s": 0.3, "backoff_initial_s": 0.01, "backoff_max_s": 0.2}
ALL = list(range(1000, 1300))  # the synthetic source's windows


@pytest.fixture
def register(zk_hosts: str, zk_cluster: str) -> Callable[..., AbstractAsyncContextManager[None]]:
    """``async with register(member_id, url, role="leader", kind="relay")``: a registration."""

    @asynccontextmanager
    async def factory(
        member_id: str, url: str, role: str = "leader", kind: str = "relay"
    ) -> AsyncIterator[None]:
        session = ZkSession(
            ClusterConfig(
                zookeeper=zk_hosts,
                name=zk_cluster,
                member_id=member_id,
                advertised_url=url,
                session_timeout_s=2.0,
                connect_timeout_s=10.0,
            )
        )
        await session.start()
        registry = Registry(session, kind)  # type: ignore[arg-type]
        try:
            await registry.start()
            registry.update({"syn": PartitionState(role, 1, 1000, 1299)})  # type: ignore[arg-type]
            await registry.flush()
            yield
        finally:
            with contextlib.suppress(Exception):
                await registry.stop()
            await session.stop()

    return factory


def config(zk_hosts: str, zk_cluster: str, **kw: Any) -> ConsumerConfig:
    return ConsumerConfig(zookeeper=zk_hosts, cluster=zk_cluster, partition="syn", **{**FAST, **kw})


async def take(consumer: Consumer, n: int, scns: list[int]) -> None:
    async with asyncio.timeout(30):
        async for window in consumer:
            scns.append(window.scn)
            if len(scns) >= n:
                return


async def test_a_consumer_given_only_zookeeper_reads_the_partition(
    make_relay: MakeRelay, register: Any, zk_hosts: str, zk_cluster: str
) -> None:
    async with make_relay() as relay, register("r1", relay.url):
        scns: list[int] = []
        async with Consumer(config(zk_hosts, zk_cluster)) as c:
            await take(c, len(ALL), scns)
            assert c.stats()["relay"] == relay.url
    assert scns == ALL


@pytest.mark.parametrize("stop_relay", [True, False])
async def test_the_consumer_moves_on_when_its_member_goes_away(
    make_relay: MakeRelay, register: Any, zk_hosts: str, zk_cluster: str, stop_relay: bool
) -> None:
    """The member read from goes away (stopped and unregistered, or only unregistered: a
    deposed relay that still answers); a new one registers; no window lost or repeated."""
    scns: list[int] = []
    async with make_relay() as second, contextlib.AsyncExitStack() as first_stack:
        first = await first_stack.enter_async_context(make_relay())
        registration = contextlib.AsyncExitStack()
        await registration.enter_async_context(register("r1", first.url))
        cfg = config(zk_hosts, zk_cluster, queue_windows=2, queue_bytes=4096, max_bytes=2000)
        async with Consumer(cfg) as c:
            await take(c, 60, scns)
            assert c.stats()["relay"] == first.url
            await registration.aclose()  # the ephemeral node goes
            if stop_relay:
                await first_stack.aclose()
            await asyncio.sleep(0.3)
            async with register("r2", second.url):
                async with asyncio.timeout(20):  # the table's change reaches the consumer
                    while c.stats()["relays"] != [second.url]:
                        await asyncio.sleep(0.02)
                await take(c, len(ALL), scns)
                stats = c.stats()
                assert stats["relay"] == second.url
                assert stats["relays"] == [second.url]
            if not stop_relay:
                assert first.hosts["syn"].state == "finished"  # still up: left by the table alone
    assert scns == ALL


async def test_prefer_followers_picks_a_follower(
    make_relay: MakeRelay, register: Any, zk_hosts: str, zk_cluster: str
) -> None:
    async with (
        make_relay() as leader,
        make_relay() as follower,
        register("a-leader", leader.url, "leader"),
        register("b-follower", follower.url, "follower"),
    ):
        for prefer, expected in ((True, follower.url), (False, leader.url)):
            scns: list[int] = []
            async with Consumer(config(zk_hosts, zk_cluster, prefer_followers=prefer)) as c:
                await take(c, 10, scns)
                assert c.stats()["relay"] == expected
                assert c.stats()["relays"][-1] != expected
            assert scns == ALL[:10]


async def test_an_empty_table_waits_until_a_relay_registers(
    make_relay: MakeRelay, register: Any, zk_hosts: str, zk_cluster: str
) -> None:
    scns: list[int] = []
    async with make_relay() as relay:
        c = Consumer(config(zk_hosts, zk_cluster))
        try:
            reader = asyncio.create_task(take(c, 5, scns))  # starts the consumer: it waits
            await asyncio.sleep(1.0)
            assert not reader.done() and scns == []
            async with register("late", relay.url):
                await reader
                assert c.stats()["relay"] == relay.url
        finally:
            await c.close()
    assert scns == ALL[:5]


async def test_an_empty_table_gives_up_after_max_attempts(zk_hosts: str, zk_cluster: str) -> None:
    c = Consumer(config(zk_hosts, zk_cluster, max_attempts=3, backoff_max_s=0.05))
    with pytest.raises(RelayUnavailableError, match="no relay of cluster"):
        async with asyncio.timeout(20):
            await c.start()
    await c.close()


async def test_bootstrap_servers_come_from_the_table(
    make_relay: MakeRelay, register: Any, zk_hosts: str, zk_cluster: str
) -> None:
    async with (
        make_relay() as relay,
        register("r1", relay.url),
        register("b1", "http://127.0.0.1:9/boot", kind="bootstrap"),
    ):
        c = Consumer(config(zk_hosts, zk_cluster, start="latest"))
        async with c:
            assert c._fetcher is not None
            assert c._fetcher._boot is not None  # the table's bootstrap server is configured
            assert c._fetcher._boot.config.bootstrap_servers == ("http://127.0.0.1:9/boot",)
            async with register("b0", "http://127.0.0.1:9/boot0", kind="bootstrap"):
                async with asyncio.timeout(20):  # the table's bootstrap servers are followed
                    while c._fetcher._boot._failover.urls != (
                        "http://127.0.0.1:9/boot0",
                        "http://127.0.0.1:9/boot",
                    ):
                        await asyncio.sleep(0.02)


async def test_bootstrap_servers_without_a_scheme_are_skipped(
    make_relay: MakeRelay,
    register: Any,
    zk_hosts: str,
    zk_cluster: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A member that registered an advertised_url without its scheme: relays were
    skipped, bootstrap servers were not. Every consumer of the cluster failed at
    start (ConfigError), or, from a change of the table, the URL reached the
    failover and was retried for ever (found by review). Skipped now, with a
    warning that names it without its password."""
    from changebus.client._cluster import read_route

    bad = "reader:s3cret@127.0.0.1:9/boot"
    good = "http://127.0.0.1:9/boot"
    caplog.set_level("WARNING", logger="changebus.client._cluster")
    async with (
        make_relay() as relay,
        register("r1", relay.url),
        register("b0", bad, kind="bootstrap"),
        Consumer(config(zk_hosts, zk_cluster, start="latest")) as c,
    ):

        def boot_urls() -> tuple[str, ...]:
            assert c._fetcher is not None
            boot = c._fetcher._boot
            return () if boot is None else boot._failover.urls

        assert boot_urls() == ()  # none usable (yet)
        async with register("b1", good, kind="bootstrap"):
            async with asyncio.timeout(20):  # the table's good one is followed
                while boot_urls() != (good,):
                    await asyncio.sleep(0.02)
            async with register("b2", "127.0.0.1:9/boot2", kind="bootstrap"):
                await asyncio.sleep(0.5)  # (a change of the table: not passed on)
                assert boot_urls() == (good,)
                found = await read_route(zk_hosts, zk_cluster, ("syn",), kind="bootstrap")
                assert found == (good,)
    text = caplog.text
    assert "'127.0.0.1:9/boot'" in text and "127.0.0.1:9/boot2" in text and "skipped" in text
    assert "s3cret" not in text and "reader" not in text


async def test_failover_set_urls_keeps_the_server_in_use_and_wakes_a_backoff() -> None:
    from changebus.client._backoff import Backoff
    from changebus.client._failover import Failover
    from changebus.schemas import TransportError

    f = Failover(("http://a", "http://b"), Backoff(5.0, 5.0, 1.0))
    f.index = 1
    assert not f.set_urls(("http://c", "http://b")) and f.url == "http://b"
    assert not f.set_urls(())  # an empty list changes nothing
    assert f.set_urls(("http://d",)) and f.url == "http://d" and f.switches == 1
    sleeper = asyncio.create_task(f.failed(TransportError("down")))  # a 5 s backoff sleep
    await asyncio.sleep(0.05)
    assert not sleeper.done()
    f.set_urls(("http://e",))
    async with asyncio.timeout(1):
        await sleeper  # cut short by the new list
    assert f.url == "http://e" and f.attempts == 1


def test_config_names_the_fix() -> None:
    with pytest.raises(ConfigError, match="or zookeeper and cluster"):
        ConsumerConfig()
    with pytest.raises(ConfigError, match="go together"):
        ConsumerConfig(zookeeper="127.0.0.1:2181")
    with pytest.raises(ConfigError, match="name the partition"):
        ConsumerConfig(zookeeper="127.0.0.1:2181", cluster="c")
    cfg = ConsumerConfig(zookeeper="127.0.0.1:2181", cluster="c", partition="p")
    assert cfg.relays == () and cfg.uses_cluster


async def test_tail_with_zookeeper_prints_windows(
    make_relay: MakeRelay, register: Any, zk_hosts: str, zk_cluster: str
) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / s) for s in SOURCE_ROOTS)}
    async with make_relay(max_windows=40) as relay, register("r1", relay.url):
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "changebus.schemas",
            "tail",
            "--zookeeper",
            zk_hosts,
            "--cluster",
            zk_cluster,
            "--partition",
            "syn",
            "--from",
            "earliest",
            "--limit",
            "30",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    lines = [json.loads(line) for line in out.decode().splitlines()]
    assert len(lines) == 30 and lines[0]["scn"] == 1000


async def test_spark_options_resolve_the_relays_from_the_table(
    make_relay: MakeRelay, register: Any, zk_hosts: str, zk_cluster: str
) -> None:
    from changebus.client.spark._options import SourceOptions
    from changebus.client.spark._read import RangeSpec, _config
    from changebus.client.spark._relay import partition_bounds, resolve_cluster

    with pytest.raises(ConfigError, match="zookeeper and cluster"):
        SourceOptions.parse({})
    opts = SourceOptions.parse(
        {"zookeeper": zk_hosts, "cluster": zk_cluster, "preferFollowers": "true"}, mode="batch"
    )
    assert opts.relays == () and opts.prefer_followers
    with pytest.raises(RelayUnavailableError, match="no relay of cluster"):
        await resolve_cluster(opts)
    async with (
        make_relay() as leader,
        make_relay() as follower,
        register("a", leader.url, "leader"),
        register("b", follower.url, "follower"),
        register("boot", "http://127.0.0.1:9/boot", kind="bootstrap"),
    ):
        resolved = await resolve_cluster(opts)
        assert resolved.relays == (follower.url, leader.url)
        assert resolved.bootstrap == ("http://127.0.0.1:9/boot",)
        bounds = await partition_bounds(opts)  # planning reads the table itself
        assert bounds["syn"].max_scn == 1299
        cfg = _config(
            resolved, RangeSpec("syn", -1, 1299), -1, {}
        )  # an executor's consumer follows the table
        assert cfg.uses_cluster and cfg.prefer_followers and cfg.relays == resolved.relays
        # one of several SCN sub-ranges must not take a snapshot: it reads the relays
        # resolved at planning, not the table, and the bootstrap server's log only
        sub = _config(resolved, RangeSpec("syn", -1, 600, may_bootstrap=False), -1, {})
        assert not sub.uses_cluster and sub.bootstrap_catchup_only
        assert sub.relays == resolved.relays
        assert sub.bootstrap_servers == resolved.bootstrap
        assert not cfg.bootstrap_catchup_only


async def test_replicate_with_zookeeper_applies_the_stream(
    make_relay: MakeRelay, register: Any, zk_hosts: str, zk_cluster: str, tmp_path: Path
) -> None:
    import signal
    import sqlite3

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / s) for s in SOURCE_ROOTS)}
    db = tmp_path / "replica.db"

    def rows() -> int:
        if not db.exists():
            return 0
        with contextlib.closing(sqlite3.connect(db)) as conn:
            names = [
                r[0]
                for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
                if "synthetic" in r[0]
            ]
            return sum(conn.execute(f'SELECT count(*) FROM "{n}"').fetchone()[0] for n in names)

    async with make_relay() as relay, register("r1", relay.url):
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "changebus.schemas",
            "replicate",
            "--zookeeper",
            zk_hosts,
            "--cluster",
            zk_cluster,
            "--partition",
            "syn",
            "--sqlite",
            str(db),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        try:
            async with asyncio.timeout(60):
                while rows() == 0:
                    await asyncio.sleep(0.2)
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    assert f"replicating cluster '{zk_cluster}'" in err.decode()


async def test_zookeeper_away_at_start_is_waited_for(
    make_relay: MakeRelay, register: Any, zk_server: Any, zk_hosts: str, zk_cluster: str
) -> None:
    scns: list[int] = []
    async with make_relay() as relay, register("r1", relay.url):
        await asyncio.to_thread(zk_server.stop)
        try:
            c = Consumer(config(zk_hosts, zk_cluster, connect_timeout_s=1.0))
            reader = asyncio.create_task(take(c, 5, scns))  # starts the consumer: it retries
            await asyncio.sleep(3.0)  # longer than one connection attempt
            assert not reader.done() and scns == []
        finally:
            await asyncio.to_thread(zk_server.start)
        try:
            await reader  # the member's session survived the restart: it is still listed
        finally:
            await c.close()
    assert scns == ALL[:5]


async def test_zookeeper_away_gives_up_after_max_attempts(
    zk_server: Any, zk_hosts: str, zk_cluster: str
) -> None:
    await asyncio.to_thread(zk_server.stop)
    try:
        c = Consumer(config(zk_hosts, zk_cluster, connect_timeout_s=1.0, max_attempts=2))
        with pytest.raises(RelayUnavailableError, match="did not answer in 2 attempts"):
            async with asyncio.timeout(30):
                await c.start()
        await c.close()
    finally:
        await asyncio.to_thread(zk_server.start)


async def test_a_failed_start_closes_the_routing_tables_zookeeper_session(
    make_relay: MakeRelay, register: Any, zk_hosts: str, zk_cluster: str, tmp_path: Path
) -> None:
    """The routing table is opened first (its ZooKeeper session and threads); a start
    that then fails (here: a token file that cannot be read) left it running."""
    missing = tmp_path / "no-such-token"
    async with make_relay() as relay, register("r1", relay.url):
        consumer = Consumer(config(zk_hosts, zk_cluster, auth=ClientAuth(token_file=missing)))
        with pytest.raises(ConfigError):
            await consumer.start()
        assert consumer._route is None  # stopped: its session closed
        await consumer.close()
