"""What the Postgres -> relay -> bootstrap server -> consumer replica tests share.

The source tables (``acct``, ``item``) and a random workload of inserts, updates,
deletes and key changes on them; the configs of a relay (postgres fetcher) and a
bootstrap server; SCN markers; a SQLite replica recording the phases it applied
(and able to crash on a chosen window); running a replica until it is online past
a marker; and the row-by-row comparison of the replica with the source. Used by
test_bootstrap_e2e.py, test_bootstrap_e2e_faults.py, test_bootstrap_cluster.py,
test_bootstrap_data_loss.py and test_snapshot_pg.py.
"""

from __future__ import annotations

import asyncio
import random
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from changebus.bootstrap import (
    BootstrapConfig,
    BootstrapServer,
    HttpConfig as BootstrapHttp,
    StoreConfig,
)
from changebus.client import ConsumerConfig, SqliteReplica, Window
from changebus.fetchers.postgres import message_scn
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, RelayConfig
from changebus.schemas import Mode
from waiting import wait_until

TABLES = ("acct", "item")


def relay_config(tmp: Path, dsn: str, capacity_bytes: int = 8 << 20, port: int = 0) -> RelayConfig:
    return RelayConfig(
        data_dir=tmp / "relay",
        http=HttpConfig(port=port),
        partitions=(
            PartitionConfig(
                "pg",
                1,
                capacity_bytes=capacity_bytes,
                fetcher=FetcherConfig("postgres", {"dsn": dsn, "status_interval_s": 0.2}),
            ),
        ),
        flush_interval_s=0,
    )


def bootstrap_config(
    tmp: Path, relay_url: str, store: str, store_dsn: str = "", port: int = 0
) -> BootstrapConfig:
    st = (
        StoreConfig(kind="postgres", dsn=store_dsn)
        if store == "postgres"
        else StoreConfig(kind="sqlite", path=tmp / "boot" / "b.db")
    )
    return BootstrapConfig(
        relays=(relay_url,),
        data_dir=tmp / "boot",
        store=st,
        http=BootstrapHttp(port=port),
    )


def create_tables(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for t in TABLES:
            conn.execute(f"CREATE TABLE {t} (id int8 PRIMARY KEY, bal int8, name text)")
            # long names live out of line: updates of other columns do not send them
            conn.execute(f"ALTER TABLE {t} ALTER COLUMN name SET STORAGE EXTERNAL")


def workload(dsn: str, seed: int, txns: int, keys: int = 300, per_txn: int = 5) -> None:
    """Random inserts, updates and deletes (upserts of existing keys dominate).

    Some names are long (TOASTed: an update of ``bal`` leaves them unsent) and
    some updates change a row's primary key.
    """
    rnd = random.Random(seed)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(txns):
            with conn.transaction():
                for _ in range(rnd.randint(1, per_txn)):
                    t = rnd.choice(TABLES)
                    k = rnd.randint(1, keys)
                    r = rnd.random()
                    if r < 0.65:
                        name = f"n{k}-{rnd.randint(0, 99)}"
                        if rnd.random() < 0.05:
                            name = name * 400
                        conn.execute(
                            f"INSERT INTO {t} VALUES (%s, %s, %s) ON CONFLICT (id) DO UPDATE "
                            "SET bal = EXCLUDED.bal, name = EXCLUDED.name",
                            (k, rnd.randint(0, 10**6), name),
                        )
                    elif r < 0.7:
                        k2 = rnd.randint(1, keys)
                        conn.execute(
                            f"UPDATE {t} SET id = %s WHERE id = %s "
                            f"AND NOT EXISTS (SELECT 1 FROM {t} WHERE id = %s)",
                            (k2, k, k2),
                        )
                    elif r < 0.85:
                        conn.execute(f"UPDATE {t} SET bal = bal + 1 WHERE id = %s", (k,))
                    else:
                        conn.execute(f"DELETE FROM {t} WHERE id = %s", (k,))


def source_rows(dsn: str) -> dict[str, dict[int, tuple[Any, ...]]]:
    out: dict[str, dict[int, tuple[Any, ...]]] = {}
    with psycopg.connect(dsn) as conn:
        for t in TABLES:
            out[t] = {r[0]: tuple(r) for r in conn.execute(f"SELECT id, bal, name FROM {t}")}
    return out


def sync_marker(dsn: str) -> int:
    """An SCN at or after every change committed so far."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_logical_emit_message(false, 'sync', 'x')::text").fetchone()
    assert row is not None
    return message_scn(row[0])


TINY = 256 << 10  # relay buffer: a few hundred windows


class WatchedReplica(SqliteReplica):
    """A SQLite replica recording the phases of the windows it applied.

    ``hook(phase, n)`` runs before the n-th window of a phase; it may raise
    :class:`Crash` to end the consumer abruptly there (like a kill: whatever
    the replica committed stays, nothing else is stored).
    """

    def __init__(self, path: Path, hook: Callable[[str, int], None] | None = None) -> None:
        super().__init__(path)
        self.phases: list[str] = []
        self._hook = hook

    async def on_start_window(self, window: Window) -> Any:
        self.phases.append(window.phase)
        if self._hook is not None:
            self._hook(window.phase, self.phases.count(window.phase))
        return await super().on_start_window(window)


class Crash(BaseException):
    """Ends a consumer run abruptly (not an error the consumer handles)."""


def consumer_config(relay: str, boot: str | None, **kw: Any) -> ConsumerConfig:
    return ConsumerConfig(
        relays=(relay,),
        partition="pg",
        wait_s=0.5,
        bootstrap_servers=(boot,) if boot else (),
        backoff_initial_s=0.05,
        backoff_max_s=0.5,
        **kw,
    )


def assert_same(
    got: dict[str, dict[int, tuple[Any, ...]]], want: dict[str, dict[int, tuple[Any, ...]]]
) -> None:
    for t in TABLES:
        g, w = got[t], want[t]
        bad = sorted(k for k in set(g) | set(w) if g.get(k) != w.get(k))
        detail = [(k, str(g.get(k))[:60], str(w.get(k))[:60]) for k in bad[:5]]
        assert not bad, f"{t}: {len(bad)} rows differ of {len(w)}: {detail}"


def replica_rows(path: Path) -> dict[str, dict[int, tuple[Any, ...]]]:
    conn = sqlite3.connect(path)
    try:
        out: dict[str, dict[int, tuple[Any, ...]]] = {}
        for t in TABLES:
            try:
                rows = conn.execute(f'SELECT id, bal, name FROM "public_{t}"').fetchall()
            except sqlite3.OperationalError:
                rows = []
            out[t] = {r[0]: tuple(r) for r in rows}
        return out
    finally:
        conn.close()


def stored_checkpoint(replica: SqliteReplica) -> Any:
    stored = replica._stored
    return stored.get("pg") if stored is not None else None


async def replicate_until(
    replica: SqliteReplica, cfg: ConsumerConfig, marker: int, seconds: float = 90
) -> None:
    """Run the replica until its stored checkpoint is online at or after ``marker``."""

    async def watch() -> None:
        while True:
            pc = stored_checkpoint(replica)
            if pc is not None and pc.mode is Mode.ONLINE and pc.window_scn >= marker:
                replica.stop()
                return
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait_for(replica.run(cfg), seconds)
    finally:
        watcher.cancel()


async def replica_to(db: Path, cfg: ConsumerConfig, marker: int) -> WatchedReplica:
    """A :class:`WatchedReplica` of ``db`` run until online at ``marker``, then closed."""
    replica = WatchedReplica(db)
    try:
        await replicate_until(replica, cfg, marker)
    finally:
        await replica.close()
    return replica


async def bootstrap_caught_up(boot: BootstrapServer, marker: int) -> None:
    w = boot.service.workers["pg"]
    await wait_until(lambda: w.applier_scn >= marker, 60, "the bootstrap applier")
