"""``changebus demo``: the whole pipeline on an embedded default, in one process.

What runs (everything private, on 127.0.0.1, removed at the end)::

    EmbeddedPostgres --pgoutput--> Relay (postgres fetcher) --HTTP--> Consumer (prints)
     (shop tables,                  mmapped ring buffer     \\------> SqliteReplica
      workload thread)                                                (checked at the end)

A bootstrap server (SQLite store) follows the relay from the start and seeds
the tables from Postgres (they existed before capture began); halfway
through, a second consumer with a replica of its own joins late: it reads a
snapshot and the log from the bootstrap server, then goes on from the relay.

A workload thread runs small shop transactions (new customers with orders,
payments, shipments, cancellations) for ``seconds``; the consumer prints every
transaction as it commits, with its SCN (the commit LSN) and the time from
the commit to the print. At the end it prints a summary (changes by kind,
SCN range, latency percentiles, the consumer's lag) and checks that the
SQLite replica, fed by the same stream, equals the source tables row for
row. Ctrl-C or SIGTERM ends the workload early; the summary still runs.

Blocking work (the server, the workload, the final comparison) runs in
threads; the relay and the consumers share the event loop.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import signal
import sqlite3
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import replace
from decimal import Decimal
from pathlib import Path
from typing import Any, TextIO

from changebus.schemas import Mode, lsn_to_scn

from ._apply_sqlite import SqliteReplica
from ._config import ConsumerConfig
from ._consumer import Consumer
from ._json import event_json, jsonable
from ._model import ChangeEvent, ChangeOp, Window

__all__ = ["run_demo"]

_PARTITION = "shop"
_TABLES = """
CREATE SCHEMA shop;
CREATE TABLE shop.customers (
    id int PRIMARY KEY, name text NOT NULL, email text NOT NULL, tier text NOT NULL
);
CREATE TABLE shop.orders (
    id int PRIMARY KEY, customer_id int NOT NULL, amount numeric(10,2) NOT NULL,
    status text NOT NULL, placed_at timestamptz NOT NULL DEFAULT now()
);
ALTER TABLE shop.customers REPLICA IDENTITY FULL;
ALTER TABLE shop.orders REPLICA IDENTITY FULL;
"""
_NAMES = (
    "Ada",
    "Grace",
    "Alan",
    "Edsger",
    "Barbara",
    "Donald",
    "Frances",
    "Ken",
    "Radia",
    "Leslie",
)
_COMPARE = {
    "shop.customers": "SELECT id, name, email, tier FROM {t}",
    "shop.orders": "SELECT id, customer_id, amount, status FROM {t}",
}


def _workload(dsn: str, rate: float, stop: threading.Event) -> tuple[int, int]:
    """Shop transactions at about ``rate`` per second until ``stop``.

    Returns the number of transactions and the SCN of a last, marker
    transaction: the consumer has seen everything once it reaches it.
    """
    import psycopg

    rnd = random.Random(2026)
    customers = orders = done = 0
    open_orders: list[int] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.wait(1 / rate if rate > 0 else 0):
            with conn.transaction():
                r = rnd.random()
                if r < 0.3 or not open_orders:
                    customers += 1
                    name = rnd.choice(_NAMES)
                    conn.execute(
                        "INSERT INTO shop.customers VALUES (%s, %s, %s, %s)",
                        (customers, name, f"{name.lower()}{customers}@example.org", "basic"),
                    )
                    for _ in range(rnd.randint(1, 3)):
                        orders += 1
                        open_orders.append(orders)
                        conn.execute(
                            "INSERT INTO shop.orders (id, customer_id, amount, status)"
                            " VALUES (%s, %s, %s, 'new')",
                            (orders, customers, Decimal(rnd.randint(100, 50000)) / 100),
                        )
                elif r < 0.6:
                    order = rnd.choice(open_orders)
                    conn.execute("UPDATE shop.orders SET status = 'paid' WHERE id = %s", (order,))
                    conn.execute(
                        "UPDATE shop.customers SET tier = 'gold' WHERE id ="
                        " (SELECT customer_id FROM shop.orders WHERE id = %s)",
                        (order,),
                    )
                elif r < 0.9:
                    order = open_orders.pop(rnd.randrange(len(open_orders)))
                    conn.execute(
                        "UPDATE shop.orders SET status = 'shipped' WHERE id = %s", (order,)
                    )
                else:
                    order = open_orders.pop(rnd.randrange(len(open_orders)))
                    conn.execute("DELETE FROM shop.orders WHERE id = %s", (order,))
            done += 1
        row = conn.execute("SELECT pg_logical_emit_message(true, 'demo', 'end')::text").fetchone()
    assert row is not None
    return done, lsn_to_scn(row[0])


def _rows(conn: Any, sql: str) -> set[tuple[str, ...]]:
    return {tuple(str(v) for v in row) for row in conn.execute(sql).fetchall()}


def _compare(dsn: str, replica_path: Path) -> dict[str, tuple[int, bool]]:
    """Rows per table and whether the replica's equal the source's (as text)."""
    import psycopg

    out: dict[str, tuple[int, bool]] = {}
    lite = sqlite3.connect(replica_path)
    try:
        with psycopg.connect(dsn) as pg:
            for table, sql in _COMPARE.items():
                source = _rows(pg, sql.format(t=table))
                replica = _rows(lite, sql.format(t='"' + table.replace(".", "_") + '"'))
                out[table] = (len(source), source == replica)
    finally:
        lite.close()
    return out


def _describe(event: ChangeEvent) -> str:
    """One readable line for a change: op, table, key, and what changed."""
    key = ", ".join(f"{k}={v}" for k, v in event.key.items())
    after, before = event.after or {}, event.before or {}
    if event.op is ChangeOp.UPDATE and before:
        changed = {k: (before.get(k), v) for k, v in after.items() if before.get(k) != v}
        what = ", ".join(f"{k}: {_text(a)} -> {_text(b)}" for k, (a, b) in changed.items())
        what = what or "(no column changed)"
    elif event.op is ChangeOp.DELETE:
        what = ""
    else:
        what = ", ".join(f"{k}={_text(v)}" for k, v in after.items() if k not in event.key)
    return f"  {event.op.value:<8} {event.table:<16} {key:<10} {what}".rstrip()


def _text(value: Any) -> str:
    return json.dumps(value, default=jsonable)


class _Printer:
    """Prints windows and keeps the figures of the summary."""

    def __init__(self, out: TextIO, as_json: bool) -> None:
        self.out = out
        self.as_json = as_json
        self.ops: Counter[str] = Counter()
        self.windows = 0
        self.first_scn = self.last_scn = -1
        self.first_position = self.last_position = ""
        self.latencies_ms: list[float] = []

    def window(self, window: Window) -> None:
        received_ns = time.time_ns()
        lag_ms = max(0.0, (received_ns - window.timestamp_ns) / 1e6)
        self.latencies_ms.append(lag_ms)
        self.windows += 1
        if self.first_scn < 0:
            self.first_scn, self.first_position = window.scn, window.source_position
        self.last_scn, self.last_position = window.scn, window.source_position
        for event in window.events:
            self.ops[event.op.value] += 1
        if self.as_json:
            for event in window.events:
                self.out.write(event_json(event) + "\n")
        else:
            self.out.write(
                f"SCN {window.source_position or window.scn}  transaction of "
                f"{len(window.events)} change(s), {lag_ms:.1f} ms after commit\n"
            )
            for event in window.events:
                self.out.write(_describe(event) + "\n")
        self.out.flush()

    def percentile(self, q: float) -> float:
        values = sorted(self.latencies_ms)
        if not values:
            return 0.0
        return values[min(len(values) - 1, int(q * len(values)))]


async def run_demo(seconds: float, rate: float, *, as_json: bool = False) -> int:
    """Run the demo (module docstring); returns the process exit status."""
    from changebus.fetchers.postgres import EmbeddedPostgres
    from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig

    out = sys.stdout
    stop = threading.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tmp = Path(await asyncio.to_thread(_private_dir))
    say = out.write
    server: EmbeddedPostgres | None = None
    try:
        say("# starting a private PostgreSQL server ...\n")
        out.flush()
        server = await asyncio.to_thread(EmbeddedPostgres.start, tmp / "pg")
        dsn = server.dsn()
        await asyncio.to_thread(_create_tables, dsn)
        config = RelayConfig(
            data_dir=tmp / "relay",
            http=HttpConfig(port=0),
            partitions=(
                PartitionConfig(
                    _PARTITION,
                    1,
                    capacity_bytes=32 << 20,
                    fetcher=FetcherConfig("postgres", {"dsn": dsn, "status_interval_s": 0.5}),
                ),
            ),
            flush_interval_s=0,
        )
        async with Relay(config) as relay:
            host = relay.hosts[_PARTITION]
            while host.status()["state"] != "streaming":
                if host.status()["state"] == "failed":
                    say(f"# the fetcher failed: {host.status()}\n")
                    return 1
                await asyncio.sleep(0.05)
            say(
                f"# Postgres 127.0.0.1:{server.port} -> relay {relay.url} -> consumer; "
                f"{rate:g} transactions/s for {seconds:g} s (Ctrl-C stops earlier)\n"
            )
            out.flush()
            return await _stream(relay.url, dsn, tmp, seconds, rate, stop, as_json)
    finally:
        stop.set()
        if server is not None:
            await asyncio.to_thread(server.stop)
        shutil.rmtree(tmp, ignore_errors=True)


def _private_dir() -> str:
    path = tempfile.mkdtemp(prefix="changebus-demo-")
    Path(path).chmod(0o755)  # the embedded server runs as an unprivileged user when we are root
    return path


def _create_tables(dsn: str) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(_TABLES)


class _LateReplica(SqliteReplica):
    """The replica of a consumer that joins late: counts its windows per phase."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, consumer_name="late")
        self.phases: Counter[str] = Counter()
        self.rows: Counter[str] = Counter()

    async def on_start_window(self, window: Window) -> Any:
        self.phases[window.phase] += 1
        self.rows[window.phase] += len(window.events)
        return await super().on_start_window(window)


async def _stream(
    url: str,
    dsn: str,
    tmp: Path,
    seconds: float,
    rate: float,
    stop: threading.Event,
    as_json: bool,
) -> int:
    from changebus.bootstrap import (
        BootstrapConfig,
        BootstrapServer,
        HttpConfig as BootstrapHttp,
        SeedConfig,
        StoreConfig,
    )

    out = sys.stdout
    printer = _Printer(out, as_json)
    config = ConsumerConfig(
        relays=(url,), partition=_PARTITION, wait_s=1.0, client_id="demo", yield_empty_windows=True
    )
    boot_config = BootstrapConfig(
        relays=(url,),
        data_dir=tmp / "bootstrap",
        store=StoreConfig(kind="sqlite", path=tmp / "bootstrap" / "store.db"),
        http=BootstrapHttp(port=0),
        # the tables existed before capture began: their snapshot is whole once seeded
        seed=SeedConfig(dsn=dsn, on_start=True),
    )
    replica = SqliteReplica(tmp / "replica.db", consumer_name="demo")
    late = _LateReplica(tmp / "late.db")
    tasks: list[asyncio.Task[Any]] = []
    workload = asyncio.create_task(asyncio.to_thread(_workload, dsn, rate, stop))
    loop = asyncio.get_running_loop()
    timer = loop.call_later(seconds, stop.set)
    transactions = 0
    async with BootstrapServer(boot_config) as boot:
        late_config = replace(config, client_id="late", bootstrap_servers=(boot.url,))

        def join_late() -> None:
            out.write(
                f"# a consumer joins late: it catches up from the bootstrap server {boot.url}\n"
            )
            tasks.append(asyncio.create_task(late.run(late_config)))

        tasks.append(asyncio.create_task(replica.run(config)))
        joiner = loop.call_later(seconds / 2, join_late)
        try:
            async with Consumer(config) as consumer:
                end_scn = -1
                async for window in consumer:
                    if window.events:
                        printer.window(window)
                    if end_scn < 0 and workload.done():
                        transactions, end_scn = workload.result()
                    if 0 <= end_scn <= window.scn:
                        break
                lag = consumer.stats()["queued_windows"]
            await _wait_replica(replica, printer.last_scn)
            if tasks[1:]:
                await _wait_replica(late, printer.last_scn)
        finally:
            timer.cancel()
            joiner.cancel()
            stop.set()
            replica.stop()
            late.stop()
            await asyncio.gather(*tasks, workload, return_exceptions=True)
            await replica.close()
            await late.close()
    checks = await asyncio.to_thread(_compare, dsn, tmp / "replica.db")
    total = sum(printer.ops.values())
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(printer.ops.items()))
    out.write(
        f"# summary: {total} changes ({kinds}) in {printer.windows} transactions "
        f"({transactions} committed by the workload), "
        f"SCN {printer.first_position}..{printer.last_position}\n"
        f"# commit -> consumer: p50 {printer.percentile(0.5):.1f} ms, "
        f"p99 {printer.percentile(0.99):.1f} ms; windows still queued at the end: {lag}\n"
    )
    ok = _report(out, "SQLite replica vs source", checks)
    if tasks[1:]:
        p, r = late.phases, late.rows
        out.write(
            f"# late consumer: {r['snapshot']} rows from the bootstrap snapshot, "
            f"{p['catchup']} transactions of catch-up, then {p['online']} live from the relay\n"
        )
        late_checks = await asyncio.to_thread(_compare, dsn, tmp / "late.db")
        ok = _report(out, "late consumer's replica vs source", late_checks) and ok
    out.flush()
    return 0 if ok else 1


def _report(out: TextIO, what: str, checks: dict[str, tuple[int, bool]]) -> bool:
    tables = ", ".join(
        f"{t} {n} rows {'equal' if eq else 'DIFFERENT'}" for t, (n, eq) in checks.items()
    )
    out.write(f"# {what}: {tables}\n")
    return all(equal for _, equal in checks.values())


async def _wait_replica(replica: Any, scn: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stored = replica.checkpoint
        if (
            stored is not None
            and _PARTITION in stored.partitions
            and stored.get(_PARTITION).mode is Mode.ONLINE
            and stored.get(_PARTITION).window_scn >= scn
        ):
            return
        await asyncio.sleep(0.05)
