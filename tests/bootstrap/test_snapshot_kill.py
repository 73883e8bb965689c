"""kill -9 of a bootstrap daemon in the middle of a chunked snapshot (issue 20).

A bootstrap daemon subprocess (a real Postgres source, a relay with the postgres
fetcher, writers running) is killed with SIGKILL in the middle of a table and
restarted on the same store: it must continue after the last stored chunk by
itself, and its snapshot must equal the source row by row.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from _common import free_port
from changebus.relay import Relay
from snap_pg import (
    ENV,
    assert_same,
    create_source,
    relay_config,
    relay_has,
    source_rows,
    store_rows,
    sync_marker,
    touch,
    writer,
)
from waiting import wait_until

pytestmark = [pytest.mark.pg, pytest.mark.usefixtures("no_blocking")]

# ---- kill -9 of a bootstrap daemon in the middle of a table -------------------------------

BIG = 30_250  # 61 chunks of 500 (the last one short: the reader knows it is the end)
BIG_CHUNK = 500


def start_daemon(config: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "changebus.schemas", "bootstrap", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=ENV,
        )


async def http_json(url: str) -> Any:
    try:
        async with aiohttp.ClientSession() as s, s.get(url) as r:
            return await r.json() if r.status == 200 else None
    except aiohttp.ClientError:
        return None


def stored_job(store: Path) -> tuple[int, int] | None:
    """(chunks, rows) of the stored job of public.big (None: none)."""
    conn = sqlite3.connect(store, timeout=10)
    try:
        row = conn.execute(
            "SELECT chunks, nrows FROM cb_snapjob WHERE part = 'pg' AND name = 'public.big'"
        ).fetchone()
    finally:
        conn.close()
    return None if row is None else (int(row[0]), int(row[1]))


async def test_kill_9_mid_table_resumes_after_the_last_chunk(tmp_path: Path, pg_dsn: str) -> None:
    await asyncio.to_thread(create_source, pg_dsn, BIG)
    async with Relay(relay_config(tmp_path, pg_dsn)) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming", 60)
        await asyncio.to_thread(touch, pg_dsn)
        await relay_has(relay, await asyncio.to_thread(sync_marker, pg_dsn))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        store = tmp_path / "boot" / "b.db"
        common = (
            f'relays = ["{relay.url}"]\ndata_dir = "{tmp_path / "boot"}"\n'
            f'[store]\npath = "{store}"\n[http]\nport = {port}\n'
            f'[seed]\ndsn = "{pg_dsn}"\ntables = ["public.big"]\nchunk_rows = {BIG_CHUNK}\n'
            "max_rows_per_s = 3000\nlog_every_chunks = 10\n"
            "max_chunk_bytes = 0\n"  # (chunks of chunk_rows each: counted below)
        )
        first, second = tmp_path / "first.toml", tmp_path / "second.toml"
        first.write_text(common + "on_start = true\n")
        second.write_text(common)  # no seed.on_start: only the stored job makes it go on
        log = tmp_path / "bootstrap.log"
        stop = threading.Event()
        writes = asyncio.ensure_future(asyncio.to_thread(writer, pg_dsn, stop, BIG, 5))
        proc = start_daemon(first, log)
        try:
            seen: dict[str, Any] = {}

            async def five_chunks() -> bool:
                st = await http_json(f"{url}/v1/status")
                seed = st["partitions"][0]["seed"] if st else {}
                seen.update(seed)
                return any(j["chunks"] >= 5 for j in seed.get("jobs", ()))

            for _ in range(2400):
                if await five_chunks() or seen.get("state") in ("done", "failed"):
                    break
                await asyncio.sleep(0.05)
            assert any(j["chunks"] >= 5 for j in seen.get("jobs", ())), (
                seen,
                log.read_text()[-3000:],
            )
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            job = await asyncio.to_thread(stored_job, store)
            assert job is not None, "the job row must survive the kill"
            stored_chunks, stored_rows = job
            table_chunks = math.ceil(BIG / BIG_CHUNK)
            assert 5 <= stored_chunks < table_chunks  # killed in the middle of the table
            assert stored_rows == stored_chunks * BIG_CHUNK
            proc = start_daemon(second, log)
            done: dict[str, Any] = {}

            async def resumed_and_done() -> bool:
                st = await http_json(f"{url}/v1/status")
                if not st:
                    return False
                done.clear()
                done.update(st["partitions"][0]["seed"])
                return done.get("state") in ("done", "failed", "stopped")

            for _ in range(2400):
                if await resumed_and_done():
                    break
                await asyncio.sleep(0.05)
            assert done.get("state") == "done", (done, log.read_text()[-3000:])
            # it went on after the last stored chunk: at most the two chunks in flight (one
            # being stored, the next being read: the sink is pipelined) were read again
            why = (stored_chunks, done)
            assert done["chunks_resumed"] == stored_chunks, why
            assert stored_chunks + done["chunks"] <= table_chunks + 2, why
            assert done["chunks"] >= table_chunks - stored_chunks - 2, why  # (writers delete)
            # the writers delete while it runs (more rows the slower the machine): most of the
            # table, not just its tail; the row-by-row comparison below is the exact check
            assert done["table_rows"] >= BIG * 9 // 10, why
            assert "resumes after chunk" in log.read_text()
            async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
                text = await r.text()
            resumed = [
                ln
                for ln in text.splitlines()
                if ln.startswith("changebus_bootstrap_snapshot_chunks_resumed{")
            ]
            assert resumed and float(resumed[0].split()[-1]) == stored_chunks
            # the snapshot equals the source row by row once the applier caught up
            stop.set()
            await writes
            marker = await asyncio.to_thread(sync_marker, pg_dsn)

            async def applied() -> bool:
                st = await http_json(f"{url}/v1/bootstrap/status?partition=pg")
                return bool(st and st["applier_scn"] >= marker)

            for _ in range(2400):
                if await applied():
                    break
                await asyncio.sleep(0.05)
            assert await applied(), log.read_text()[-3000:]
            got = await asyncio.to_thread(store_rows, store, "pg", "public.big")
            assert_same(got, await asyncio.to_thread(source_rows, pg_dsn))
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
        finally:
            stop.set()
            await writes
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
