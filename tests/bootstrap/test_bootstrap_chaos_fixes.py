"""Regressions found by the chaos harness (bench/chaos.py), bootstrap side.

* MySQL seed with a follower first: the server asked "the relays" in order for the
  partition's fetcher status and took the first answer, a follower's (kind
  ``relay``: no MySQL server id, no SCN base), so the seed failed ("not a running
  mysql fetcher") whenever the first relay was not the one reading the source --
  in a relay cluster, two times in three. Now chaining relays are skipped.
* A gap's re-seed that failed with a retriable error (the source restarting, the
  relay reading it not reachable) stayed failed until an operator sent
  ``POST /v1/seed``: the gap was never repaired by itself. Now it is tried again,
  with backoff, while the gap is open.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import psycopg
import pytest

from _chaos_proxy import FaultProxy
from changebus.bootstrap import (
    BootstrapConfig,
    BootstrapServer,
    HttpConfig as BootstrapHttp,
    SeedConfig,
    StoreConfig,
)
from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from fix_mysql import mysql_execute
from waiting import wait_until

pytestmark = pytest.mark.usefixtures("no_blocking")


def _relay(data: Path, name: str, fetcher: FetcherConfig, capacity: int = 1 << 20) -> RelayConfig:
    return RelayConfig(
        data_dir=data,
        http=HttpConfig(port=0, max_wait_s=10),
        partitions=(PartitionConfig(name, 1, capacity_bytes=capacity, fetcher=fetcher),),
        flush_interval_s=0,
    )


@pytest.mark.mysql
async def test_a_mysql_seed_skips_a_chaining_relay_listed_first(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    server, db = mysql_server, mysql_db
    mysql_execute(server, db, "CREATE TABLE acct (id int PRIMARY KEY, bal bigint)")
    source = FetcherConfig("mysql", server.options(databases=[db]))
    async with Relay(_relay(tmp_path / "leader", "my", source)) as leader:
        await wait_until(lambda: leader.hosts["my"].state == "streaming", 30, "the mysql relay")
        mysql_execute(server, db, *(f"INSERT INTO acct VALUES ({i}, {i * 10})" for i in range(20)))
        chain = FetcherConfig(
            "relay",
            {"upstream": [leader.url], "wait_s": 1.0, "backoff_initial_s": 0.02},
            retry_initial_s=0.05,
        )
        async with Relay(_relay(tmp_path / "follower", "my", chain)) as follower:
            await wait_until(
                lambda: (
                    follower.hosts["my"].buffer.meta.last_scn
                    == leader.hosts["my"].buffer.meta.last_scn
                ),
                30,
                "the follower",
            )
            cfg = BootstrapConfig(
                relays=(follower.url, leader.url),  # the follower first, as a cluster may list
                data_dir=tmp_path / "boot",
                store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
                http=BootstrapHttp(port=0),
                seed=SeedConfig(
                    kind="mysql",
                    dsn=f"mysql://root:@127.0.0.1:{server.port}",
                    on_start=True,
                    schema_wait_s=30,
                ),
            )
            async with BootstrapServer(cfg) as boot:
                w = boot.service.workers["my"]
                await wait_until(lambda: w.seed.state in ("done", "failed"), 60, "the seed")
                assert w.seed.state == "done", w.seed.error
                assert w.seed.rows == 20


@pytest.mark.pg
async def test_a_gap_is_seeded_again_by_itself_after_a_retriable_seed_failure(
    tmp_path: Path, pg_dsn: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, v text NOT NULL)")
    conninfo = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    proxy = FaultProxy("seed", "127.0.0.1", int(str(conninfo["port"])))
    await proxy.start()
    try:
        proxy.refuse()  # the seed source is not reachable at first
        seed_dsn = psycopg.conninfo.make_conninfo(pg_dsn, port=proxy.port)
        source = FetcherConfig("postgres", {"dsn": pg_dsn, "status_interval_s": 0.2})
        async with Relay(_relay(tmp_path / "relay", "pg", source, capacity=64 << 10)) as relay:
            host = relay.hosts["pg"]
            await wait_until(lambda: host.state == "streaming", 30, "the relay")
            cfg = BootstrapConfig(
                relays=(relay.url,),
                data_dir=tmp_path / "boot",
                store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
                http=BootstrapHttp(port=0),
                seed=SeedConfig(kind="postgres", dsn=seed_dsn, schema_wait_s=30),
            )
            async with BootstrapServer(cfg) as boot:
                w = boot.service.workers["pg"]
                with psycopg.connect(pg_dsn, autocommit=True) as conn:
                    conn.execute("INSERT INTO items VALUES (1, 'small')")
                    # one transaction larger than the relay's ring: a DATA_LOSS window
                    with conn.transaction():
                        for i in range(2, 200):
                            conn.execute("INSERT INTO items VALUES (%s, %s)", (i, "x" * 1000))
                    conn.execute("INSERT INTO items VALUES (1000, 'after')")
                await wait_until(lambda: w.gap is not None, 30, "the gap")
                await wait_until(lambda: w.seed.state == "failed", 30, "a failed seed")
                assert "connect" in w.seed.error
                proxy.heal()
                await wait_until(lambda: w.gap is None, 60, "the gap repaired by itself")
                assert w.seed.state == "done"
                assert w.seed.rows == 200
                await asyncio.sleep(0)
    finally:
        await proxy.close()


@pytest.mark.pg
async def test_a_gap_seed_waits_for_a_ddl_the_relay_has_not_streamed_yet(
    tmp_path: Path, pg_dsn: str
) -> None:
    """The seed finds a column the relay's schema lacks (DDL, no row changed since): that
    is transient, so the gap's seed is tried again and succeeds once the relay saw it."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, v text NOT NULL)")
        conn.execute("CREATE TABLE filler (id int PRIMARY KEY, v text NOT NULL)")
    source = FetcherConfig("postgres", {"dsn": pg_dsn, "status_interval_s": 0.2})
    async with Relay(_relay(tmp_path / "relay", "pg", source, capacity=64 << 10)) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming", 30, "the relay")
        cfg = BootstrapConfig(
            relays=(relay.url,),
            data_dir=tmp_path / "boot",
            store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
            http=BootstrapHttp(port=0),
            seed=SeedConfig(kind="postgres", dsn=pg_dsn, schema_wait_s=30),
        )
        async with BootstrapServer(cfg) as boot:
            w = boot.service.workers["pg"]
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute("INSERT INTO items VALUES (1, 'a'), (2, 'b')")
                conn.execute("INSERT INTO filler VALUES (1, 'a')")
                await wait_until(lambda: w.applier_scn > 0, 30, "the bootstrap server reading")
                conn.execute("ALTER TABLE items ADD COLUMN extra text")  # no row changes yet
                with conn.transaction():  # larger than the relay's ring: a DATA_LOSS window
                    for i in range(2, 200):
                        conn.execute("INSERT INTO filler VALUES (%s, %s)", (i, "x" * 1000))
            await wait_until(lambda: w.gap is not None, 30, "the gap")
            await wait_until(lambda: "changed since" in w.seed.error, 30, "a refused seed")
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute("UPDATE items SET extra = 'x' WHERE id = 1")  # the relay sees it
            await wait_until(lambda: w.gap is None, 60, "the gap repaired by itself")
            assert w.seed.state == "done"


async def test_a_cancelled_seed_stops_its_thread_before_it_ends() -> None:
    """A seed task cancelled (a new gap restarts the seed) ends only when its thread did."""
    import threading

    from changebus.bootstrap._seeding import Seeding
    from changebus.bootstrap._seedtypes import SeedProgress, SeedRequest

    seeding = Seeding.__new__(Seeding)
    seeding._stop_seed = threading.Event()
    running = threading.Event()
    ended = threading.Event()

    def seeder(
        request: Any, write: Any, progress: Any, *, stop: threading.Event | None = None
    ) -> int:
        assert stop is not None
        running.set()
        stop.wait(30)  # a table being copied; the seeder looks at ``stop`` between tables
        ended.set()
        return -1

    task = asyncio.create_task(
        seeding._run_seeder(seeder, SeedRequest("dsn", 1, ()), lambda *_: None, SeedProgress())
    )
    await asyncio.to_thread(running.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ended.is_set()
