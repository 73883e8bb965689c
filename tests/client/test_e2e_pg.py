"""End to end on a real Postgres: source tables -> pgoutput -> relay -> client -> replica.

The consumers run as ``changebus`` subprocesses so that they can be killed
with SIGKILL; the relay runs in the test's loop on a fixed port so that it can
be stopped and started again under the same URL. Every test ends by
comparing the consumer's state with the source tables, row by row.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import signal
import socket
import sqlite3
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from test_client_cli import ENV

from changebus.fetchers.postgres import message_scn
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import Checkpoint
from fix_pg import caught_up, wait_until

pytestmark = pytest.mark.pg

TABLES = """
CREATE TABLE acct (id int PRIMARY KEY, bal numeric(12,2) NOT NULL, name text, active bool);
CREATE TABLE orders (acct int, no int, amount bigint, note text, PRIMARY KEY (acct, no));
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def pg_relay(tmp: Path, dsn: str, port: int) -> AsyncIterator[Relay]:
    """A relay with the postgres fetcher on ``port`` (the same data dir every time)."""
    config = RelayConfig(
        data_dir=tmp / "relay",
        http=HttpConfig(port=port),
        partitions=(
            PartitionConfig(
                "pg",
                1,
                capacity_bytes=16 << 20,
                fetcher=FetcherConfig("postgres", {"dsn": dsn, "status_interval_s": 0.2}),
            ),
        ),
        flush_interval_s=0,
    )
    async with Relay(config) as relay:
        yield relay


def workload(dsn: str, seed: int, txns: int, pause_s: float) -> None:
    """Random multi-row, multi-table transactions: inserts, updates, deletes."""
    rnd = random.Random(seed)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for i in range(txns):
            with conn.transaction():
                for _ in range(rnd.randint(1, 5)):
                    k = rnd.randint(1, 60)
                    r = rnd.random()
                    if r < 0.35:
                        conn.execute(
                            "INSERT INTO acct VALUES (%s, %s, %s, %s) ON CONFLICT (id) DO UPDATE"
                            " SET bal = EXCLUDED.bal, name = EXCLUDED.name",
                            (k, Decimal(rnd.randint(0, 10**6)) / 100, f"n{k}-{i}", k % 2 == 0),
                        )
                    elif r < 0.55:
                        conn.execute("UPDATE acct SET bal = bal + 1.25 WHERE id = %s", (k,))
                    elif r < 0.65:
                        conn.execute("DELETE FROM acct WHERE id = %s", (k,))
                    elif r < 0.9:
                        conn.execute(
                            "INSERT INTO orders VALUES (%s, %s, %s, %s) ON CONFLICT (acct, no)"
                            " DO UPDATE SET amount = orders.amount + 1",
                            (k, rnd.randint(1, 4), rnd.randint(-(2**40), 2**40), "x" * (k % 7)),
                        )
                    else:
                        conn.execute("DELETE FROM orders WHERE acct = %s", (k,))
            if pause_s:
                threading.Event().wait(pause_s)


def source_rows(dsn: str) -> dict[str, set[tuple[Any, ...]]]:
    with psycopg.connect(dsn) as conn:
        acct = conn.execute("SELECT id, bal::text, name, active FROM acct").fetchall()
        orders = conn.execute("SELECT acct, no, amount, note FROM orders").fetchall()
    return {"acct": set(acct), "orders": set(orders)}


class Target:
    """Where ``changebus replicate`` writes: a SQLite file or another Postgres database."""

    def __init__(self, kind: str, tmp: Path, dsn: str) -> None:
        self.kind = kind
        self.path = tmp / "replica.db"
        self.dsn = dsn.replace("dbname=", "dbname=r")
        if kind == "postgres":
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(f'CREATE DATABASE "{self.dsn.rsplit("dbname=", 1)[1]}"')

    def drop(self, dsn: str) -> None:
        if self.kind == "postgres":
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE "{self.dsn.rsplit("dbname=", 1)[1]}" WITH (FORCE)')

    @property
    def args(self) -> tuple[str, ...]:
        return ("--sqlite", str(self.path)) if self.kind == "sqlite" else ("--postgres",)

    @property
    def env(self) -> dict[str, str]:
        # the DSN travels in the environment, never on the command line
        return {"CHANGEBUS_REPLICA_DSN": self.dsn} if self.kind == "postgres" else {}

    def scn(self) -> int:
        try:
            rows = self._query("SELECT checkpoint FROM changebus_checkpoints")
        except (sqlite3.OperationalError, psycopg.errors.UndefinedTable):
            return -1
        return Checkpoint.parse(rows[0][0]).get("pg").window_scn if rows else -1

    def rows(self) -> dict[str, set[tuple[Any, ...]]]:
        prefix = "public_" if self.kind == "sqlite" else "public."
        acct = self._query(f"SELECT id, bal, name, active FROM {prefix}acct")
        orders = self._query(f"SELECT acct, no, amount, note FROM {prefix}orders")
        return {
            "acct": {(i, str(Decimal(b)), n, bool(a)) for i, b, n, a in acct},
            "orders": {tuple(r) for r in orders},
        }

    def _query(self, sql: str) -> list[tuple[Any, ...]]:
        if self.kind == "sqlite":
            if not self.path.exists():
                raise sqlite3.OperationalError("no file yet")
            conn = sqlite3.connect(self.path)
            try:
                return conn.execute(sql).fetchall()
            finally:
                conn.close()
        with psycopg.connect(self.dsn) as pg:
            return pg.execute(sql).fetchall()


async def changebus(*args: str, env: dict[str, str] | None = None) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "changebus.schemas",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**ENV, **(env or {})},
    )


async def sync_marker(dsn: str) -> int:
    """The SCN of a logical message written now: everything committed before is <= it."""

    def emit() -> int:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT pg_logical_emit_message(false, 'sync', 'x')::text"
            ).fetchone()
        assert row is not None
        return message_scn(row[0])

    return await asyncio.to_thread(emit)


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_replica_equals_source_across_consumer_kill_9_and_relay_restart(
    pg_dsn: str, tmp_path: Path, kind: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(TABLES)
    target = Target(kind, tmp_path, pg_dsn)
    try:
        await replicate_through_failures(pg_dsn, tmp_path, target)
    finally:
        target.drop(pg_dsn)


async def replicate_through_failures(pg_dsn: str, tmp_path: Path, target: Target) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    writer = asyncio.create_task(asyncio.to_thread(workload, pg_dsn, 7, 400, 0.004))
    replicate = ("replicate", "--relay", url, *target.args, "--log-level", "info")
    async with pg_relay(tmp_path, pg_dsn, port):
        first = await changebus(*replicate, env=target.env)
        await wait_until(lambda: target.scn() > 0)
        await asyncio.sleep(0.3)
        first.send_signal(signal.SIGKILL)  # mid-stream, mid-window
        await first.wait()
        killed_at = target.scn()
        second = await changebus(*replicate, env=target.env)
        await asyncio.sleep(0.3)
    # the relay is down now (clean stop); the consumer keeps retrying the same URL
    await asyncio.sleep(0.5)
    async with pg_relay(tmp_path, pg_dsn, port) as relay:
        await writer
        end = await sync_marker(pg_dsn)
        await caught_up(relay, pg_dsn)
        await wait_until(lambda: target.scn() >= end, 60)
        second.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(second.communicate(), 30)
        assert second.returncode == 0, err.decode()
        assert "stopped:" in err.decode() and "dbname" not in err.decode()  # no DSN in logs
    assert 0 < killed_at < end
    expected = source_rows(pg_dsn)
    assert expected["acct"] and expected["orders"]
    assert target.rows() == expected


async def test_tail_killed_with_9_repeats_only_its_last_window(
    pg_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(TABLES)
    ckpt = tmp_path / "tail.json"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    async with pg_relay(tmp_path, pg_dsn, port) as relay:
        await wait_until(lambda: relay.hosts["pg"].status()["state"] == "streaming")
        await asyncio.to_thread(workload, pg_dsn, 11, 300, 0)
        await caught_up(relay, pg_dsn)
        args = ("tail", "--relay", url, "--from", "earliest", "--checkpoint", str(ckpt))
        first = await changebus(*args)
        assert first.stdout is not None
        run1: list[dict[str, Any]] = []
        while len(run1) < 400:
            try:
                line = await asyncio.wait_for(first.stdout.readline(), 30)
            except TimeoutError:
                first.kill()
                line = b""
            assert line, (await first.communicate())[1].decode()[-3000:]
            run1.append(json.loads(line))
        first.send_signal(signal.SIGKILL)
        rest, _ = await first.communicate()
        run1 += [json.loads(x) for x in rest.decode().splitlines() if x.endswith("}")]
        last = relay.hosts["pg"].buffer.meta.last_scn
        everything = await asyncio.to_thread(all_events, url, last)
        second = await changebus(*args)
        assert second.stdout is not None
        run2: list[dict[str, Any]] = []
        while not run2 or (run2[-1]["scn"], run2[-1]["seq"]) != everything[-1]:
            line = await asyncio.wait_for(second.stdout.readline(), 30)
            assert line, (await second.communicate())[1].decode()[-3000:]
            run2.append(json.loads(line))
        second.send_signal(signal.SIGTERM)
        rest, err = await asyncio.wait_for(second.communicate(), 30)
        assert second.returncode == 0, err.decode()
        assert not rest.strip()
    # a consumer killed in the middle of a push is no error of the relay's
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    ids1 = [(e["scn"], e["seq"]) for e in run1]
    ids2 = [(e["scn"], e["seq"]) for e in run2]
    assert len(set(ids1)) == len(ids1) and len(set(ids2)) == len(ids2)
    repeated = set(ids1) & set(ids2)
    # only events of the last window the killed run was printing come again
    assert {scn for scn, _ in repeated} <= {ids1[-1][0]}
    # and together the two runs saw every event, in commit order, no gap
    assert sorted(set(ids1) | set(ids2)) == everything
    assert ids1 + [i for i in ids2 if i not in repeated] == everything


def all_events(url: str, last_scn: int) -> list[tuple[int, int]]:
    """Every (SCN, seq) up to ``last_scn``, read by an in-process consumer."""
    from changebus.client import ConsumerConfig, SyncConsumer

    out: list[tuple[int, int]] = []
    cfg = ConsumerConfig(relays=(url,), wait_s=0.2, yield_empty_windows=True)
    with SyncConsumer(cfg) as consumer:
        for window in consumer:
            out.extend((e.scn, e.seq) for e in window.events)
            if window.scn >= last_scn:
                break
    return out
