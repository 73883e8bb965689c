"""``--progress`` on ``changebus tail`` and ``replicate``: a catch-up bar on stderr.

The tail reads a relay holding thousands of windows while its stdout is a
pipe nobody reads at first: the consumer cannot finish, so the bar must
show the distance to the relay's newest SCN; once stdout is drained the bar
closes with "caught up", and the printed stream is the relay's, every event
once, in order. ``replicate --progress`` from a Postgres-fed relay says it
caught up and its replica equals the source. The bar's phases (snapshot
rows, catch-up, online) are checked on recorded stats too.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import socket
import sqlite3
import sys
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import psycopg
import pytest

from changebus.client._progress import CatchUpProgress
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        str(ROOT / s)
        for s in ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client", "discovery")
    ),
}
MakeRelay = Callable[..., AbstractAsyncContextManager[Relay]]


async def cli(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "changebus.schemas",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=ENV,
    )


async def read_until(stream: asyncio.StreamReader, needle: str, got: list[str]) -> None:
    """Read ``stream`` into ``got`` until ``needle`` appears (tqdm writes no newlines)."""
    while needle not in "".join(got):
        chunk = await stream.read(4096)
        assert chunk, f"ended before {needle!r}: {''.join(got)[-2000:]}"
        got.append(chunk.decode(errors="replace"))


async def read_lines(stream: asyncio.StreamReader, n: int) -> list[bytes]:
    return [await stream.readline() for _ in range(n)]


async def test_tail_progress_shows_the_distance_then_closes(make_relay: MakeRelay) -> None:
    async with make_relay(max_windows=3000, capacity_bytes=64 << 20) as relay:
        meta = relay.hosts["syn"].buffer.meta
        events = 3000 * 3  # windows x events_per_window
        proc = await cli("tail", "--relay", relay.url, "--from", "earliest", "--progress")
        assert proc.stdout is not None and proc.stderr is not None
        err: list[str] = []
        try:
            # stdout is not read yet: the tail is stuck behind the relay's head
            await asyncio.wait_for(read_until(proc.stderr, "catching up with the relay", err), 60)
            out_task = asyncio.ensure_future(read_lines(proc.stdout, events))
            await asyncio.wait_for(read_until(proc.stderr, "caught up with the relay", err), 60)
            out = await asyncio.wait_for(out_task, 30)
        finally:
            proc.send_signal(signal.SIGTERM)
        rest = await asyncio.wait_for(proc.stderr.read(), 30)
        assert await proc.wait() == 0
        text = "".join(err) + rest.decode()
        assert "Traceback" not in text
        assert " scn" in text and "%" in text  # tqdm: the SCN distance, done so far
        assert f"caught up with the relay at SCN {meta.last_scn}" in text
        lines = [json.loads(line) for line in out]
        order = [(ev["scn"], ev["seq"]) for ev in lines]
        assert len(lines) == events
        assert order == sorted(set(order)) and order[-1][0] == meta.last_scn


def test_the_bar_follows_the_phases() -> None:
    out = io.StringIO()
    bar = CatchUpProgress(out)
    base = {"windows_fetched": 0, "relay_head_scn": -1, "fetch_position": -1}
    assert not bar.update({**base, "phase": "snapshot", "bootstrap_rows": 500})
    assert not bar.update({**base, "phase": "snapshot", "bootstrap_rows": 1500})
    catchup = {**base, "phase": "catchup", "bootstrap_target_scn": 200}
    assert not bar.update({**catchup, "bootstrap_scn": 100})
    assert not bar.update({**catchup, "bootstrap_scn": 150})
    online = {**base, "phase": "online", "relay_head_scn": 300}
    assert not bar.update({**online, "fetch_position": 200})
    assert bar.update({**online, "fetch_position": 300, "windows_fetched": 42})
    assert bar.update({**online, "fetch_position": 0})  # done for good
    text = out.getvalue()
    assert "bootstrap snapshot" in text and "1.50k rows" in text
    assert "bootstrap catch-up" in text and "catching up with the relay" in text
    assert "caught up with the relay at SCN 300 (42 windows in " in text


TABLES = ("acct", "item")


def create_tables(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for t in TABLES:
            conn.execute(f"CREATE TABLE {t} (id int8 PRIMARY KEY, bal int8)")


def workload(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for i in range(300):
            with conn.transaction():
                conn.execute(f"INSERT INTO {TABLES[i % 2]} VALUES (%s, %s)", (i, i * 7))
                if i % 5 == 0:
                    conn.execute(f"UPDATE {TABLES[i % 2]} SET bal = bal + 1 WHERE id = %s", (i,))
                if i % 11 == 0:
                    conn.execute(f"DELETE FROM {TABLES[(i + 1) % 2]} WHERE id = %s", (i - 1,))


def rows_of(dsn: str) -> dict[str, set[tuple[Any, ...]]]:
    with psycopg.connect(dsn) as conn:
        return {t: set(conn.execute(f"SELECT id, bal FROM {t}").fetchall()) for t in TABLES}


def replica_rows(path: Path) -> dict[str, set[tuple[Any, ...]]]:
    conn = sqlite3.connect(path, timeout=10)
    try:
        return {
            t: set(conn.execute(f'SELECT id, bal FROM "public_{t}"').fetchall()) for t in TABLES
        }
    except sqlite3.OperationalError:
        return {}
    finally:
        conn.close()


@pytest.mark.pg
async def test_replicate_progress_catches_up_and_the_replica_equals_the_source(
    tmp_path: Path, pg_dsn: str
) -> None:
    await asyncio.to_thread(create_tables, pg_dsn)
    cfg = RelayConfig(
        data_dir=tmp_path / "relay",
        http=HttpConfig(port=0),
        partitions=(PartitionConfig("pg", 1, fetcher=FetcherConfig("postgres", {"dsn": pg_dsn})),),
        flush_interval_s=0,
    )
    async with Relay(cfg) as relay:
        host = relay.hosts["pg"]
        await wait_until(lambda: host.state == "streaming", 30, "the fetcher")
        await asyncio.to_thread(workload, pg_dsn)
        db = tmp_path / "r.db"
        proc = await cli(
            "replicate", "--relay", relay.url, "--sqlite", str(db), "--progress",
            "--log-level", "warning",
        )  # fmt: skip
        assert proc.stderr is not None
        err: list[str] = []
        try:
            await asyncio.wait_for(read_until(proc.stderr, "caught up with the relay", err), 60)
            want = await asyncio.to_thread(rows_of, pg_dsn)
            await wait_until(lambda: replica_rows(db) == want, 30, "the replica")
        finally:
            proc.send_signal(signal.SIGTERM)
        rest = await asyncio.wait_for(proc.stderr.read(), 30)
        assert await proc.wait() == 0
        assert "Traceback" not in "".join(err) + rest.decode()


async def test_replicate_into_an_unreachable_postgres_ends_with_one_line() -> None:
    """The target's driver error went out as a traceback with status 1 (not the
    documented statuses; not JSON with --log-format json; review): one line, no secret."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dsn = f"host=127.0.0.1 port={port} dbname=r user=u password=s3cret-pw connect_timeout=3"
    proc = await cli(
        "replicate", "--relay", f"http://127.0.0.1:{port}", "--partition", "p", "--postgres", dsn
    )
    _out, err = await asyncio.wait_for(proc.communicate(), 60)
    text = err.decode()
    assert proc.returncode == 3, text
    assert "Traceback" not in text and "s3cret-pw" not in text
    assert "the replica's database failed" in text
