"""A consumer group that starts late bootstraps per lane: Postgres -> relay (tiny buffer) ->
bootstrap server -> two group members replicating into one SQLite database; the result is
compared with the source row by row."""

from __future__ import annotations

import asyncio
import random
import sqlite3
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from changebus.bootstrap import (
    BootstrapConfig,
    BootstrapServer,
    HttpConfig as BootstrapHttp,
    StoreConfig,
)
from changebus.client import ConsumerConfig, SqliteReplica, Window
from changebus.fetchers.postgres import message_scn
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import Mode
from waiting import wait_until

pytestmark = [pytest.mark.pg, pytest.mark.zk]

TABLES = ("acct", "item")
TINY = 256 << 10  # relay buffer: a few hundred windows
BUCKETS = 8


def relay_config(tmp: Path, dsn: str) -> RelayConfig:
    return RelayConfig(
        data_dir=tmp / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "pg",
                1,
                capacity_bytes=TINY,
                fetcher=FetcherConfig("postgres", {"dsn": dsn, "status_interval_s": 0.2}),
            ),
        ),
        flush_interval_s=0,
    )


def workload(dsn: str, seed: int, txns: int, keys: int = 300) -> None:
    rnd = random.Random(seed)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(txns):
            with conn.transaction():
                for _ in range(rnd.randint(1, 4)):
                    t = rnd.choice(TABLES)
                    k = rnd.randint(1, keys)
                    if rnd.random() < 0.8:
                        conn.execute(
                            f"INSERT INTO {t} VALUES (%s, %s, %s) ON CONFLICT (id) DO UPDATE "
                            "SET bal = EXCLUDED.bal, name = EXCLUDED.name",
                            (k, rnd.randint(0, 10**6), f"n{k}"),
                        )
                    else:
                        conn.execute(f"DELETE FROM {t} WHERE id = %s", (k,))


def sync_marker(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_logical_emit_message(false, 'sync', 'x')::text").fetchone()
    assert row is not None
    return message_scn(row[0])


def rows_of(conn: Any, table: str) -> dict[int, tuple[Any, ...]]:
    return {r[0]: tuple(r) for r in conn.execute(f"SELECT id, bal, name FROM {table}").fetchall()}


class Phases(SqliteReplica):
    """Records the phases of its windows; stops its consumer after ``stop_after`` snapshot pages."""

    def __init__(self, path: Path, stop_after: int = 0) -> None:
        super().__init__(path)
        self.phases: list[str] = []
        self.stop_after = stop_after

    async def on_start_window(self, window: Window) -> Any:
        self.phases.append(window.phase)
        if self.stop_after and self.phases.count("snapshot") == self.stop_after:
            self.stop()  # the group stops in the middle of its snapshot
        return await super().on_start_window(window)


async def test_a_late_group_bootstraps_per_lane(tmp_path: Path, pg_dsn: str, zk_hosts: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for t in TABLES:
            conn.execute(f"CREATE TABLE {t} (id int8 PRIMARY KEY, bal int8, name text)")
    async with Relay(relay_config(tmp_path, pg_dsn)) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        bcfg = BootstrapConfig(
            relays=(relay.url,),
            data_dir=tmp_path / "boot",
            store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
            http=BootstrapHttp(port=0),
        )
        async with BootstrapServer(bcfg) as boot:
            await asyncio.to_thread(workload, pg_dsn, 1, 1500)
            marker = sync_marker(pg_dsn)
            worker = boot.service.workers["pg"]
            await wait_until(lambda: worker.applier_scn >= marker, 60, "the applier")
            assert relay.hosts["pg"].status()["prev_scn"] > worker.base_scn  # evicted
            db = tmp_path / "replica.db"
            group = f"g{uuid.uuid4().hex[:10]}"
            cfg = ConsumerConfig(
                relays=(relay.url,),
                partition="pg",
                group=group,
                zookeeper=zk_hosts,
                buckets=BUCKETS,
                zookeeper_session_timeout_s=2.0,
                commit_interval_s=0.1,
                bootstrap_servers=(boot.url,),
                bootstrap_page_bytes=8 << 10,
                wait_s=0.5,
                backoff_initial_s=0.05,
                backoff_max_s=0.5,
            )
            # a first member stops in the middle of the snapshot: its units' checkpoints
            # hold the bootstrap progress, from which the next members go on
            first = Phases(db, stop_after=3)
            try:
                await asyncio.wait_for(first.run(cfg), 60)
                stored = await first.read(group)
            finally:
                await first.close()
            assert len(stored) == BUCKETS
            assert any(
                s.checkpoint is not None and s.checkpoint.mode is not Mode.ONLINE
                for s in stored.values()
            )
            members = [Phases(db), Phases(db)]
            runs = [asyncio.create_task(m.run(cfg)) for m in members]

            async def online() -> bool:
                stored = await members[0].read(group)
                return len(stored) == BUCKETS and all(
                    s.checkpoint is not None
                    and s.checkpoint.mode is Mode.ONLINE
                    and s.checkpoint.window_scn >= marker
                    for s in stored.values()
                )

            try:
                for _ in range(900):
                    if await online():
                        break
                    await asyncio.sleep(0.1)
                assert await online(), "every unit online after the marker"
            finally:
                for m in members:
                    m.stop()
                for task in runs:
                    await task
                for m in members:
                    await m.close()
    phases = [p for m in members for p in m.phases]
    assert "snapshot" in phases
    replica = sqlite3.connect(db)
    try:
        with psycopg.connect(pg_dsn) as src:
            for t in TABLES:
                assert rows_of(replica, f'"public_{t}"') == rows_of(src, t)
    finally:
        replica.close()
