"""A late consumer through the whole pipeline: Postgres -> relay -> bootstrap server -> replica.

A private Postgres 15 receives ``--txns`` random transactions from three
writers (inserts, updates, deletes, some primary-key changes and TOASTed
values over two tables; about 100,000 row changes by default). Two relays
capture it (two slots):

* relay **A** with a small buffer (``--buffer`` bytes: it keeps a few
  thousand of the ~45,000 windows) feeds a bootstrap server (SQLite store,
  or Postgres with ``--store postgres``);
* relay **B** with a buffer that keeps everything: the baseline.

Once everything is captured, two new consumers (SQLite replicas) start from
nothing: one on relay A with the bootstrap server (it falls off, takes the
snapshot and the catch-up, and returns to the relay), one on relay B reading
every window (the baseline). Both must end with the source's rows exactly
(compared row by row). ``bootstrap_vs_relay_ratio`` = time through the
bootstrap server / time reading the whole stream from relay B.

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sqlite3
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

import _common  # noqa: F401  (puts the checkout on sys.path)
from changebus.bootstrap import (
    BootstrapConfig,
    BootstrapServer,
    HttpConfig as BootHttp,
    StoreConfig,
)
from changebus.client import ConsumerConfig, SqliteReplica
from changebus.fetchers.postgres import EmbeddedPostgres, message_scn
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import Mode

TABLES = ("acct", "item")


def relay_config(base: Path, name: str, dsn: str, capacity: int) -> RelayConfig:
    options = {"dsn": dsn, "slot": f"cb_{name}", "status_interval_s": 0.2}
    return RelayConfig(
        data_dir=base / f"relay-{name}",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "pg", 1, capacity_bytes=capacity, fetcher=FetcherConfig("postgres", options)
            ),
        ),
        flush_interval_s=0,
    )


def workload(dsn: str, seed: int, txns: int, keys: int) -> None:
    rnd = random.Random(seed)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(txns):
            # two writers may move rows to the same new key: that transaction is undone
            with contextlib.suppress(psycopg.errors.UniqueViolation):
                one_transaction(conn, rnd, keys)


def one_transaction(conn: Any, rnd: random.Random, keys: int) -> None:
    with conn.transaction():
        for _ in range(rnd.randint(1, 5)):
            t, k, r = rnd.choice(TABLES), rnd.randint(1, keys), rnd.random()
            if r < 0.65:
                name = f"n{k}-{rnd.randint(0, 99)}" * (400 if rnd.random() < 0.05 else 1)
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


def rows_of(conn: Any, table: str) -> dict[int, tuple[Any, ...]]:
    return {r[0]: tuple(r) for r in conn.execute(f"SELECT id, bal, name FROM {table}")}


async def wait_for(pred: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.05)


async def replicate(db: Path, cfg: ConsumerConfig, marker: int) -> tuple[float, list[str]]:
    """A new replica until its checkpoint is online at ``marker``; (seconds, phases)."""
    phases: list[str] = []

    class Watched(SqliteReplica):
        async def on_start_window(self, window: Any) -> Any:
            phases.append(window.phase)
            return await super().on_start_window(window)

    replica = Watched(db)

    async def watch() -> None:
        while True:
            stored = replica._stored
            pc = stored.get("pg") if stored is not None else None
            if pc is not None and pc.mode is Mode.ONLINE and pc.window_scn >= marker:
                replica.stop()
                return
            await asyncio.sleep(0.02)

    t0 = time.perf_counter()
    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait_for(replica.run(cfg), 1800)
    finally:
        watcher.cancel()
        await replica.close()
    return time.perf_counter() - t0, phases


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--txns", type=int, default=45_000, help="transactions (1-5 changes each)")
    ap.add_argument("--keys", type=int, default=20_000)
    ap.add_argument("--buffer", type=int, default=2 << 20, help="relay A's buffer in bytes")
    ap.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="changebus-pg-") as tmp:
        base = Path(tmp)
        pg = EmbeddedPostgres.start(base)
        try:
            with psycopg.connect(pg.dsn(), autocommit=True) as conn:
                conn.execute("CREATE DATABASE src")
                conn.execute("CREATE DATABASE store")
            dsn = pg.dsn("src")
            with psycopg.connect(dsn, autocommit=True) as conn:
                for t in TABLES:
                    conn.execute(f"CREATE TABLE {t} (id int8 PRIMARY KEY, bal int8, name text)")
                    conn.execute(f"ALTER TABLE {t} ALTER COLUMN name SET STORAGE EXTERNAL")
            store = (
                StoreConfig(kind="postgres", dsn=pg.dsn("store"))
                if args.store == "postgres"
                else StoreConfig(kind="sqlite", path=base / "boot" / "b.db")
            )
            async with Relay(relay_config(base, "a", dsn, args.buffer)) as relay_a:
                await wait_for(lambda: relay_a.hosts["pg"].state == "streaming", 60, "relay A")
                relay_b = Relay(relay_config(base, "b", dsn, 1 << 30))
                await relay_b.start()  # after A: A creates the publication
                await wait_for(lambda: relay_b.hosts["pg"].state == "streaming", 60, "relay B")
                try:
                    boot_cfg = BootstrapConfig(
                        relays=(relay_a.url,),
                        data_dir=base / "boot",
                        store=store,
                        http=BootHttp(port=0),
                    )
                    async with BootstrapServer(boot_cfg) as boot:
                        t0 = time.perf_counter()
                        per = args.txns // 3
                        writers = [
                            threading.Thread(target=workload, args=(dsn, s, per, args.keys))
                            for s in (1, 2, 3)
                        ]
                        for w in writers:
                            w.start()
                        for w in writers:
                            await asyncio.to_thread(w.join)
                        write_s = time.perf_counter() - t0
                        with psycopg.connect(dsn, autocommit=True) as conn:
                            row = conn.execute(
                                "SELECT pg_logical_emit_message(false, 'sync', 'x')::text"
                            ).fetchone()
                        assert row is not None
                        marker = message_scn(row[0])
                        worker = boot.service.workers["pg"]
                        await wait_for(lambda: worker.applier_scn >= marker, 1800, "bootstrap")
                        await wait_for(
                            lambda: relay_b.hosts["pg"].buffer.meta.last_scn >= marker,
                            1800,
                            "relay B",
                        )
                        captured_s = time.perf_counter() - t0
                        changes = await boot.service.stores.read(
                            lambda s: s.changed_since("pg", -1, marker, 1 << 62)
                        )
                        a_status = relay_a.hosts["pg"].status()
                        b_status = relay_b.hosts["pg"].status()
                        boot_s, phases = await replicate(
                            base / "boot-replica.db",
                            ConsumerConfig(
                                relays=(relay_a.url,),
                                bootstrap_servers=(boot.url,),
                                partition="pg",
                                backoff_max_s=0.5,
                            ),
                            marker,
                        )
                        relay_s, _ = await replicate(
                            base / "relay-replica.db",
                            ConsumerConfig(
                                relays=(relay_b.url,), partition="pg", backoff_max_s=0.5
                            ),
                            marker,
                        )
                finally:
                    await relay_b.stop()
            with psycopg.connect(dsn) as conn:
                source = {t: rows_of(conn, t) for t in TABLES}
            for db in ("boot-replica.db", "relay-replica.db"):
                lite = sqlite3.connect(base / db)
                try:
                    for t in TABLES:
                        assert rows_of(lite, f'"public_{t}"') == source[t], (db, t)
                finally:
                    lite.close()
        finally:
            pg.stop()
    counts = {p: phases.count(p) for p in ("snapshot", "catchup", "online")}
    rows = sum(len(v) for v in source.values())
    print(
        f"source: {changes:,} row changes in {args.txns:,} transactions, written in {write_s:.1f} s"
    )
    print(
        f"relay A keeps {a_status['windows']:,} windows ({args.buffer:,} bytes), "
        f"relay B {b_status['windows']:,}; captured by the bootstrap server ({args.store}) "
        f"{captured_s:.1f} s after the first write"
    )
    print(
        f"late consumer via the bootstrap server: {boot_s:.2f} s "
        f"({counts['snapshot']} snapshot pages, {counts['catchup']} catch-up windows, "
        f"{counts['online']} relay windows); exact: {rows:,} rows"
    )
    print(f"baseline, the whole stream from relay B: {relay_s:.2f} s; exact")
    print(f"bootstrap / relay: {boot_s / relay_s:.3f}")
    print(
        json.dumps(
            {
                "changes": changes,
                "transactions": args.txns,
                "store": args.store,
                "source_rows": rows,
                "relay_a_windows": a_status["windows"],
                "bootstrap_s": round(boot_s, 3),
                "relay_s": round(relay_s, 3),
                "bootstrap_vs_relay_ratio": round(boot_s / relay_s, 3),
                "snapshot_pages": counts["snapshot"],
                "catchup_windows": counts["catchup"],
                "exact": True,
            },
            separators=(",", ":"),
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
