"""Postgres -> relay (postgres fetcher, tiny buffer) -> bootstrap server -> consumer replica.

Every test ends by comparing the consumer's tables with the source tables row
by row. Sizes are scaled down from the issue's 100k changes to keep the suite
fast (a few thousand changes per test); bench/bootstrap_e2e.py runs the issue's ~100k
changes through the same pipeline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import pytest
from boot_e2e import (
    TABLES,
    TINY,
    WatchedReplica,
    assert_same,
    bootstrap_caught_up,
    bootstrap_config,
    consumer_config,
    create_tables,
    relay_config,
    replica_rows,
    replica_to,
    replicate_until,
    source_rows,
    stored_checkpoint,
    sync_marker,
    workload,
)

from changebus.bootstrap import BootstrapServer, SeedConfig
from changebus.client import FellOffRelayError, SqliteReplica
from changebus.relay import Relay
from changebus.schemas import Mode
from waiting import wait_until

# relays and bootstrap servers run in the test's event loop: none may block that loop
pytestmark = [pytest.mark.pg, pytest.mark.usefixtures("no_blocking")]


@pytest.fixture(params=["sqlite", "postgres"])
def store_kind(request: Any) -> str:
    return str(request.param)


@pytest.fixture
def store_dsn(store_kind: str, pg_server: Any) -> Iterator[str]:
    if store_kind == "sqlite":
        yield ""
        return
    name = f"boot_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield pg_server.dsn(name)
    finally:
        with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


async def test_late_consumer_with_writers_running(
    tmp_path: Path, pg_dsn: str, store_kind: str, store_dsn: str
) -> None:
    """A consumer started late (the relay evicted most windows) catches up exactly,
    while writers keep writing during its snapshot; then one that was offline
    falls off (410) and gets only what changed."""
    create_tables(pg_dsn)
    async with Relay(relay_config(tmp_path, pg_dsn, TINY)) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        bcfg = bootstrap_config(tmp_path, relay.url, store_kind, store_dsn)
        async with BootstrapServer(bcfg) as boot:
            await asyncio.to_thread(workload, pg_dsn, 1, 1500)
            await bootstrap_caught_up(boot, sync_marker(pg_dsn))
            status = relay.hosts["pg"].status()
            assert status["prev_scn"] > boot.service.workers["pg"].base_scn  # evicted
            writer = threading.Thread(target=workload, args=(pg_dsn, 2, 600))
            writer.start()
            db = tmp_path / "replica.db"
            replica = WatchedReplica(db)
            try:
                cfg = consumer_config(relay.url, boot.url, bootstrap_page_bytes=8 << 10)
                # runs while the writer writes; ends once online after the writer's end
                task = asyncio.create_task(replicate_until(replica, cfg, 2**62, 120))
                await asyncio.to_thread(writer.join)
                marker = sync_marker(pg_dsn)
                await wait_until(
                    lambda: (
                        (pc := stored_checkpoint(replica)) is not None
                        and pc.mode is Mode.ONLINE
                        and pc.window_scn >= marker
                    ),
                    90,
                    "the replica",
                )
                replica.stop()
                await task
            finally:
                await replica.close()
            assert_same(replica_rows(db), source_rows(pg_dsn))
            assert replica.phases.count("snapshot") > 3  # several pages
            assert "catchup" in replica.phases and replica.phases[-1] == "online"
            # offline while the relay moves on: 410, then only the changed keys
            await asyncio.to_thread(workload, pg_dsn, 3, 1500, 300, 2)
            marker = sync_marker(pg_dsn)
            await bootstrap_caught_up(boot, marker)
            replica2 = WatchedReplica(db)
            try:
                await replicate_until(replica2, cfg, marker)
            finally:
                await replica2.close()
            assert_same(replica_rows(db), source_rows(pg_dsn))
            assert replica2.phases[0] in ("snapshot", "catchup")
            async with aiohttp.ClientSession() as s, s.get(f"{boot.url}/metrics") as r:
                text = await r.text()
            served = [ln for ln in text.splitlines() if 'what="snapshot_rows"' in ln]
            assert served and float(served[0].split()[-1]) > 0


async def test_no_bootstrap_server_raises_unless_jump_chosen(tmp_path: Path, pg_dsn: str) -> None:
    create_tables(pg_dsn)
    async with Relay(relay_config(tmp_path, pg_dsn, TINY)) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        await asyncio.to_thread(workload, pg_dsn, 5, 1200)
        marker = sync_marker(pg_dsn)
        await wait_until(lambda: relay.hosts["pg"].buffer.meta.last_scn >= marker)
        db = tmp_path / "r.db"
        replica = SqliteReplica(db)
        try:
            # a checkpoint the relay no longer has
            cfg = consumer_config(
                relay.url, None, start=str(relay.hosts["pg"].status()["prev_scn"] - 1)
            )
            with pytest.raises(FellOffRelayError, match="bootstrap"):
                await asyncio.wait_for(replica.run(cfg), 30)
        finally:
            await replica.close()
        replica = SqliteReplica(tmp_path / "r2.db")
        try:
            cfg = consumer_config(
                relay.url,
                None,
                start=str(relay.hosts["pg"].status()["prev_scn"] - 1),
                on_fell_off="latest",
            )
            task = asyncio.create_task(replica.run(cfg))
            marks: list[int] = []

            async def online_past_a_marker() -> bool:
                marks.append(await asyncio.to_thread(sync_marker, pg_dsn))
                pc = stored_checkpoint(replica)
                return pc is not None and pc.mode is Mode.ONLINE and pc.window_scn >= marks[0]

            for _ in range(200):
                if await online_past_a_marker():
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the consumer did not jump to the newest SCN")
            replica.stop()
            await asyncio.wait_for(task, 30)
            # it skipped the evicted windows: it has only rows changed after the jump
            assert sum(len(r) for r in replica_rows(tmp_path / "r2.db").values()) == 0
        finally:
            await replica.close()


async def test_seed_from_the_source_while_writers_write(
    tmp_path: Path, pg_dsn: str, store_kind: str, store_dsn: str
) -> None:
    """Rows written before capture began reach a new consumer through the seed (an
    exported snapshot aligned with an SCN), merged with changes made meanwhile."""
    create_tables(pg_dsn)
    await asyncio.to_thread(workload, pg_dsn, 11, 400)  # before the relay: not in the stream
    before = source_rows(pg_dsn)
    async with Relay(relay_config(tmp_path, pg_dsn)) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for t in TABLES:  # the relay learns the tables' schemas
                conn.execute(f"INSERT INTO {t} VALUES (100000, 1, 'x')")
        bcfg = bootstrap_config(tmp_path, relay.url, store_kind, store_dsn)
        bcfg = dataclasses.replace(bcfg, seed=SeedConfig(dsn=pg_dsn, on_start=True, chunk_rows=100))
        writer = threading.Thread(target=workload, args=(pg_dsn, 12, 600))
        writer.start()
        async with BootstrapServer(bcfg) as boot:
            w = boot.service.workers["pg"]
            await wait_until(lambda: w.seed.state in ("done", "failed"), 90, "the seed")
            assert w.seed.state == "done", w.seed.error
            assert w.seed.rows >= sum(len(r) for r in before.values())
            first_seed = w.seed.scn
            await asyncio.to_thread(writer.join)
            marker = sync_marker(pg_dsn)
            await bootstrap_caught_up(boot, marker)
            db = tmp_path / "replica.db"
            await replica_to(db, consumer_config(relay.url, boot.url), marker)
            now = source_rows(pg_dsn)
            assert_same(replica_rows(db), now)
            # some rows were never changed after capture began: only the seed had them
            untouched = sum(1 for t in TABLES for k, r in before[t].items() if now[t].get(k) == r)
            assert untouched > 10
            # re-seed one table on demand
            async with (
                aiohttp.ClientSession() as s,
                s.post(f"{boot.url}/v1/seed?tables=public.acct") as r,
            ):
                assert r.status == 202
            await wait_until(lambda: w.seed.state in ("done", "failed"), 60, "the re-seed")
            assert w.seed.state == "done" and w.seed.tables_total == 1
            assert w.seed.scn > first_seed
