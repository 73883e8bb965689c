"""The chaos checkers against the real pipeline: both workloads (Postgres with TOAST and a DDL,
MariaDB) through a relay into the product's replicas (SQLite and Postgres) and a ``changebus
tail`` killed with -9 and restarted: every reader sees what the source holds (no false
difference from naming or types), the bank samplers see the sum in every online sample, and the
tail checker passes the real tail's output while its lines cover the whole ledger."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from _chaos_check import (
    BankSampler,
    TailChecker,
    compare,
    compare_tables,
    ledger_gaps,
    ledger_reached,
    pg_bank_sample,
    pg_replica_ledger_high,
    pg_replica_rows,
    reached,
    source_rows,
    sqlite_bank_sample,
    sqlite_ledger_high,
    sqlite_rows,
    tail_checkpoint_scn,
)
from _chaos_workload import TABLES, SourceWorkload, WorkloadConfig
from changebus.bootstrap import (
    BootstrapConfig,
    BootstrapServer,
    HttpConfig as BootstrapHttp,
    StoreConfig,
)
from changebus.client import Consumer, ConsumerConfig, PostgresReplica, SqliteReplica, Window
from changebus.client._apply import Replica
from changebus.client._json import event_json
from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import lsn_to_scn
from waiting import wait_until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        str(ROOT / s)
        for s in ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client", "discovery")
    ),
}
CONFIG = WorkloadConfig(
    accounts=10, kv_keys=30, docs=3, big_bytes=20_000, writers=2, rate_tps=30.0, ddl_after_s=1.5
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_tail(url: str, checkpoint: Path, out: Path) -> subprocess.Popen[bytes]:
    with out.open("wb") as stdout:
        return subprocess.Popen(
            [
                *(sys.executable, "-m", "changebus.schemas", "tail", "--relay", url),
                *("--partition", "pg", "--from", "earliest", "--checkpoint", str(checkpoint)),
            ],
            stdout=stdout,
            stderr=subprocess.DEVNULL,
            env=ENV,
        )


def tail_ledger(outputs: list[Path]) -> set[tuple[int, int]]:
    keys: set[tuple[int, int]] = set()
    for path in outputs:
        for raw in path.read_text().splitlines():
            if raw.endswith("}"):
                doc = json.loads(raw)
                if doc["table"] == "public.ledger" and doc["op"] == "insert":
                    keys.add((doc["key"]["writer"], doc["key"]["seq"]))
    return keys


@pytest.mark.pg
@pytest.mark.mysql
async def test_checkers_agree_with_the_real_pipeline(
    pg_dsn: str, mysql_server: EmbeddedMariaDB, mysql_db: str, tmp_path: Path
) -> None:
    replica_dsn = pg_dsn.replace("dbname=", "dbname=r")
    with psycopg.connect(pg_dsn.rsplit("dbname=", 1)[0] + "dbname=postgres", autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{replica_dsn.rsplit("dbname=", 1)[1]}"')
    try:
        await run_pipeline(pg_dsn, replica_dsn, mysql_server, mysql_db, tmp_path)
    finally:
        with psycopg.connect(
            pg_dsn.rsplit("dbname=", 1)[0] + "dbname=postgres", autocommit=True
        ) as c:
            c.execute(f'DROP DATABASE "{replica_dsn.rsplit("dbname=", 1)[1]}" WITH (FORCE)')


async def run_pipeline(
    pg_dsn: str, replica_dsn: str, server: EmbeddedMariaDB, db: str, tmp: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = RelayConfig(
        data_dir=tmp / "relay",
        http=HttpConfig(port=port),
        partitions=(
            PartitionConfig(
                "pg",
                1,
                capacity_bytes=32 << 20,
                fetcher=FetcherConfig("postgres", {"dsn": pg_dsn, "status_interval_s": 0.2}),
            ),
            PartitionConfig(
                "my",
                2,
                capacity_bytes=32 << 20,
                fetcher=FetcherConfig("mysql", server.options(databases=[db])),
            ),
        ),
        flush_interval_s=0,
    )

    def pg_connect() -> Any:
        return psycopg.connect(pg_dsn, connect_timeout=5)

    def my_connect() -> Any:
        return server.connect(db)

    pg_work = SourceWorkload("pg", pg_connect, CONFIG, seed=11)
    my_work = SourceWorkload("mysql", my_connect, CONFIG, seed=12)
    replicas: dict[str, Replica] = {
        "pg-sqlite": SqliteReplica(tmp / "pg.db"),
        "pg-pg": PostgresReplica(replica_dsn),
        "my-sqlite": SqliteReplica(tmp / "my.db"),
    }
    partition = {"pg-sqlite": "pg", "pg-pg": "pg", "my-sqlite": "my"}
    total = CONFIG.total_balance
    samplers = [
        BankSampler("pg-sqlite", sqlite_bank_sample(tmp / "pg.db"), CONFIG.accounts, total),
        BankSampler("pg-pg", pg_bank_sample(replica_dsn), CONFIG.accounts, total),
        BankSampler(
            "my-sqlite", sqlite_bank_sample(tmp / "my.db", schema=db), CONFIG.accounts, total
        ),
    ]
    checkpoint = tmp / "tail.cp"
    outputs = [tmp / "tail.0.out"]
    restarts: list[int] = []
    async with Relay(config) as relay:
        for name in ("pg", "my"):
            await wait_until(
                lambda n=name: relay.hosts[n].status()["state"] == "streaming",
                60,
                name,
            )
        tasks = [
            asyncio.create_task(
                r.run(ConsumerConfig(relays=(url,), partition=partition[name], wait_s=0.2))
            )
            for name, r in replicas.items()
        ]
        tail = start_tail(url, checkpoint, outputs[0])
        for s in samplers:
            s.start()
        try:
            await asyncio.to_thread(pg_work.create_tables)
            await asyncio.to_thread(my_work.create_tables)
            pg_work.start()
            my_work.start()
            await wait_until(
                lambda: checkpoint.exists() and len(tail_ledger(outputs)) > 20, 60, "tail", 0.05
            )
            tail.send_signal(signal.SIGKILL)  # mid-stream
            await asyncio.to_thread(tail.wait)
            restarts.append(tail_checkpoint_scn(checkpoint))
            outputs.append(tmp / "tail.1.out")
            tail = start_tail(url, checkpoint, outputs[1])
            await asyncio.sleep(2.5)
            await asyncio.to_thread(pg_work.stop)
            await asyncio.to_thread(my_work.stop)
            assert pg_work.ddl_done.is_set() and my_work.ddl_done.is_set()
            pg_high, my_high = pg_work.high_water(), my_work.high_water()
            highs: dict[str, Callable[[], dict[int, int]]] = {
                "pg-sqlite": lambda: sqlite_ledger_high(tmp / "pg.db"),
                "pg-pg": lambda: pg_replica_ledger_high(replica_dsn),
                "my-sqlite": lambda: sqlite_ledger_high(tmp / "my.db", schema=db),
            }
            readers: dict[str, Callable[[str], Any]] = {
                "pg-sqlite": lambda t: sqlite_rows(tmp / "pg.db", t),
                "pg-pg": lambda t: pg_replica_rows(replica_dsn, t),
                "my-sqlite": lambda t: sqlite_rows(tmp / "my.db", t, schema=db),
            }
            for name, read_high in highs.items():
                high = my_high if name.startswith("my") else pg_high
                await wait_until(
                    lambda r=read_high, h=high: reached(r(), h),
                    60,
                    f"{name} has the whole ledger",
                    0.2,
                )
            source_ledger = set(source_rows("pg", pg_connect, "ledger"))
            await wait_until(
                lambda: tail_ledger(outputs) >= source_ledger, 60, "the tail saw the ledger", 0.2
            )
        finally:
            for s in samplers:
                s.stop()
            tail.send_signal(signal.SIGTERM)
            await asyncio.to_thread(tail.wait, 30)
            for r in replicas.values():
                r.stop()
            await asyncio.gather(*tasks, return_exceptions=True)
            for r in replicas.values():
                await r.close()
            pg_work.stop()
            my_work.stop()

    for name, read in readers.items():
        kind, connect = ("mysql", my_connect) if name.startswith("my") else ("pg", pg_connect)
        diff = compare_tables(lambda t, k=kind, c=connect: source_rows(k, c, t), read)  # type: ignore[misc]
        assert diff.ok, (name, diff)
        assert ledger_gaps(read("ledger")) == []
    for kind, connect in (("pg", pg_connect), ("mysql", my_connect)):
        kv = source_rows(kind, connect, "kv")  # the DDL ran mid-run: old rows NULL, new not
        assert any(r[4] is None for r in kv.values()), kind
        assert any(r[4] is not None for r in kv.values()), kind
    # docs updated without their big column: unchanged TOAST, not sent by pgoutput
    lines = [json.loads(x) for p in outputs for x in p.read_text().splitlines() if x.endswith("}")]
    assert any(d["table"] == "public.docs" and d["not_sent"] == ["big"] for d in lines)
    for s in samplers:
        assert s.violations == [], s.violations
        assert s.samples > 10, (s.replica, s.samples, s.exempt, s.errors)
    checker = TailChecker()
    assert checker.check(outputs, restarts) == []
    assert checker.incarnations == 2 and checker.lines > 100
    assert restarts[0] > 0


class PhaseReplica(SqliteReplica):
    """Records the phases of the windows it applies."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.phases: set[str] = set()

    async def on_start_window(self, window: Window) -> Any:
        self.phases.add(window.phase)
        return await super().on_start_window(window)


async def tail_lines(config: ConsumerConfig, out: Path, phases: set[str]) -> None:
    """What ``changebus tail`` prints (event_json lines), from an in-process consumer."""
    async with Consumer(config) as consumer:
        with out.open("w") as f:
            async for window in consumer:
                phases.add(window.phase)
                for event in window.events:
                    f.write(event_json(event) + "\n")
                f.flush()


@pytest.mark.pg
async def test_bootstrapping_consumers_are_exempt_not_false_violations(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Late consumers go through the bootstrap server while the workload writes: the bank
    sampler exempts their snapshot and catch-up (not a violation) and checks them online; the
    tail checker accepts the snapshot's out-of-order SCNs; everything ends equal."""
    config = RelayConfig(
        data_dir=tmp_path / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "pg",
                1,
                capacity_bytes=256 << 10,
                fetcher=FetcherConfig("postgres", {"dsn": pg_dsn, "status_interval_s": 0.2}),
            ),
        ),
        flush_interval_s=0,
    )
    cfg = WorkloadConfig(
        accounts=10, kv_keys=200, docs=4, big_bytes=20_000, rate_tps=80.0, ddl_after_s=0.5
    )

    def connect() -> Any:
        return psycopg.connect(pg_dsn, connect_timeout=5)

    work = SourceWorkload("pg", connect, cfg, seed=5)
    db = tmp_path / "late.db"
    replica = PhaseReplica(db)
    sampler = BankSampler("late", sqlite_bank_sample(db), cfg.accounts, cfg.total_balance)
    out = tmp_path / "tail.0.out"
    tail_phases: set[str] = set()
    async with Relay(config) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        bcfg = BootstrapConfig(
            relays=(relay.url,),
            data_dir=tmp_path / "boot",
            store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
            http=BootstrapHttp(port=0),
        )
        async with BootstrapServer(bcfg) as boot:
            await asyncio.to_thread(work.create_tables)
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                marker = conn.execute(
                    "SELECT pg_logical_emit_message(false, 'created', 'x')::text"
                ).fetchone()
            assert marker is not None
            created = lsn_to_scn(marker[0])
            work.start()
            try:
                # until the relay evicted the initial rows (the late consumers must bootstrap)
                await wait_until(
                    lambda: (
                        relay.hosts["pg"].status()["prev_scn"] > created and work.transactions > 150
                    ),
                    60,
                    "eviction",
                    0.1,
                )
                consumer = ConsumerConfig(
                    relays=(relay.url,),
                    partition="pg",
                    bootstrap_servers=(boot.url,),
                    bootstrap_page_bytes=16 << 10,
                    wait_s=0.2,
                    yield_empty_windows=False,
                )
                tasks = [
                    asyncio.create_task(replica.run(consumer)),
                    asyncio.create_task(tail_lines(consumer, out, tail_phases)),
                ]
                sampler.start()
                await asyncio.sleep(3.0)  # bootstrapping while the writers go on
            finally:
                await asyncio.to_thread(work.stop)
            high = work.high_water()
            try:
                await wait_until(
                    lambda: ledger_reached(sqlite_rows(db, "ledger"), high), 90, "replica", 0.2
                )
                source_ledger = set(source_rows("pg", connect, "ledger"))
                await wait_until(lambda: tail_ledger([out]) >= source_ledger, 60, "the tail", 0.2)
                await asyncio.sleep(0.5)  # a few online samples at the end
            finally:
                sampler.stop()
                replica.stop()
                tasks[1].cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await replica.close()
    assert "snapshot" in replica.phases and "snapshot" in tail_phases
    for table in TABLES:
        diff = compare(source_rows("pg", connect, table), sqlite_rows(db, table), table=table)
        assert diff.ok, diff
    assert sampler.violations == []
    assert sampler.exempt > 0 and sampler.samples > 0, (sampler.exempt, sampler.samples)
    checker = TailChecker()
    assert checker.check([out], []) == []
