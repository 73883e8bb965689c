"""Postgres ingest: backlog drain against pg_recvlogical, and commit -> relay latency.

Starts a throwaway Postgres 15 (the test fixture's recipe), then:

* **backlog**: two slots are created at the same point, then a backlog of
  ``--rows`` rows (10 columns; ~2.5 KB and ~200 B rows, in 100-row
  transactions) is written. ``pg_recvlogical`` (shipped with Postgres) drains
  one slot to /dev/null in binary pgoutput mode up to the backlog's end LSN:
  the baseline. A relay with the postgres fetcher drains the other slot into
  its buffer (decoding every value and encoding every event). Ratio =
  changebus rows/s / pg_recvlogical rows/s; goal >= 0.5.
* **latency**: 1,000 rows/s in 10-row transactions, each carrying a
  transactional logical message with its number; from ``COMMIT`` returned in
  the client to the window published in the relay's buffer. Goal p50 <= 2 ms,
  p99 <= 8 ms.
* **durability = "fsync"** (docs/operations.md, "Durability"): each backlog
  is drained a second time, by a third slot created at the same point, into
  a relay whose partition syncs before it acknowledges, timed until the sync
  covering the last window completed (``fsync_rows_per_s``; ratio to the
  page-cache drain of the large-row backlog: ``fsync_vs_page_cache_ratio``,
  goal >= 0.7), and the latency run is repeated with it:
  ``fsync_commit_to_buffer_p99_ms`` (goal <= 10 ms) and
  ``fsync_commit_to_synced_p99_ms`` (``COMMIT`` -> the sync that covers the
  window completed, taken when the syncer wakes the event loop; reported).

``--reader`` sets the fetcher's ``stream_reader`` option (``auto``, ``socket``,
``libpq``); the fetcher thread's CPU time per row (from /proc) is printed
with each backlog, as it moves far less than rates on a shared machine.

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psycopg

from changebus.fetchers.postgres import EmbeddedPostgres
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import HEADER_SIZE, Op, decode_control, lsn_to_scn

COLUMNS = "id int8 PRIMARY KEY, a int4, b int8, c text, d text, e text, f numeric(12,2), g timestamptz, h bool, i text"


def make_backlog(dsn: str, rows: int, text_bytes: int) -> int:
    """Insert the backlog in 100-row transactions; returns the end LSN as an SCN."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for start in range(0, rows, 100):
            conn.execute(
                "INSERT INTO t SELECT g, g %% 1000, g * 7, repeat(md5(g::text), %s), repeat('y', %s), "
                "repeat('z', %s), g / 100.0, now(), g %% 2 = 0, 'const' "
                "FROM generate_series(%s::int8, %s::int8) AS g",
                (
                    max(1, text_bytes // 32),
                    text_bytes // 3,
                    text_bytes // 3,
                    start + 1,
                    min(start + 100, rows),
                ),
            )
        end = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert end is not None
    return lsn_to_scn(end[0])


def recvlogical(bin_dir: Path, port: int, dbname: str, slot: str, end_lsn: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [
            str(bin_dir / "pg_recvlogical"),
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
            "-U",
            "postgres",
            "-d",
            dbname,
            "--slot",
            slot,
            "--start",
            "--endpos",
            end_lsn,
            "-f",
            "/dev/null",
            "--no-loop",
            "-o",
            "proto_version=1",
            "-o",
            "publication_names=pub",
            "-o",
            "binary=true",
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return time.perf_counter() - t0


def backlog(
    base: Path, server: Any, rows: int, text_bytes: int, label: str, reader: str
) -> dict[str, float]:
    db = f"b_{label}"
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {db}")
    dsn = server.dsn(db)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE t ({COLUMNS})")
        conn.execute("CREATE PUBLICATION pub FOR TABLE t")
        for slot in (f"cb_{label}", f"recv_{label}", f"cbf_{label}"):
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    print(f"{label}: writing a backlog of {rows:,} rows ...", flush=True)
    end = make_backlog(dsn, rows, text_bytes)
    with psycopg.connect(dsn) as conn:
        size = conn.execute("SELECT pg_total_relation_size('t')").fetchone()
    recv_s = recvlogical(
        server.bin_dir, server.port, db, f"recv_{label}", f"{end >> 32:X}/{end & 0xFFFFFFFF:X}"
    )
    cb_s, fetcher_cpu_s = asyncio.run(relay_drain_until(base, dsn, rows, f"cb_{label}", reader))
    fsync_s, _ = asyncio.run(
        relay_drain_until(base, dsn, rows, f"cbf_{label}", reader, durability="fsync")
    )
    return {
        f"{label}_rows": rows,
        f"{label}_table_mb": round((size[0] if size else 0) / 1e6, 1),
        f"{label}_recvlogical_rows_per_s": round(rows / recv_s),
        f"{label}_changebus_rows_per_s": round(rows / cb_s),
        f"{label}_vs_recvlogical_ratio": round(recv_s / cb_s, 3),
        f"{label}_fetcher_thread_cpu_us_per_row": round(fetcher_cpu_s / rows * 1e6, 2),
        f"{label}_fsync_rows_per_s": round(rows / fsync_s),
        f"{label}_fsync_vs_page_cache_ratio": round(cb_s / fsync_s, 3),
    }


async def relay_drain_until(
    tmp: Path, dsn: str, rows: int, slot: str, reader: str, durability: str = "page_cache"
) -> tuple[float, float]:
    """Time until the relay's buffer holds every backlog row, and the fetcher thread's CPU time.

    With ``durability = "fsync"``: until the sync covering the last window completed.
    """
    cfg = RelayConfig(
        data_dir=tmp / f"relay-{rows}-{time.monotonic_ns()}",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "pg",
                1,
                capacity_bytes=256 << 20,
                durability=durability,  # type: ignore[arg-type]
                fetcher=FetcherConfig(
                    "postgres",
                    {
                        "dsn": dsn,
                        "slot": slot,
                        "publication": "pub",
                        "create_slot": False,
                        "stream_reader": reader,
                    },
                ),
            ),
        ),
        flush_interval_s=0,
    )
    t0 = time.perf_counter()
    async with Relay(cfg) as relay:
        host = relay.hosts["pg"]
        buf, syncer = host.buffer, host.syncer
        windows = rows // 100
        while buf.stats["windows_appended"] < windows or (
            syncer is not None and syncer.synced_scn < buf.meta.last_scn
        ):
            if time.perf_counter() - t0 > 600:
                raise TimeoutError("the relay did not drain the backlog")
            await asyncio.sleep(0.005)
        elapsed = time.perf_counter() - t0
        return elapsed, thread_cpu_s("pg-pg")


def thread_cpu_s(name: str) -> float:
    """User + system CPU seconds of this process's thread ``name`` (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    for thread in threading.enumerate():
        if thread.name == name and thread.native_id is not None:
            stat = Path(f"/proc/self/task/{thread.native_id}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / tick
    return float("nan")


async def latency(
    base: Path, server: Any, seconds: float, reader: str, durability: str = "page_cache"
) -> dict[str, float]:
    """Commit -> buffer latencies (and, with ``fsync``, commit -> synced: keys ``fsync_...``)."""
    db = f"lat_{durability}"
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {db}")
    dsn = server.dsn(db)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE t ({COLUMNS})")
    cfg = RelayConfig(
        data_dir=base / f"relay-lat-{durability}",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "pg",
                1,
                capacity_bytes=64 << 20,
                durability=durability,  # type: ignore[arg-type]
                fetcher=FetcherConfig(
                    "postgres",
                    {
                        "dsn": dsn,
                        "slot": f"changebus_{durability}",  # slot names are per server
                        "status_interval_s": 0.5,
                        "stream_reader": reader,
                    },
                ),
            ),
        ),
        flush_interval_s=0,
    )
    published: dict[int, int] = {}
    committed: dict[int, int] = {}
    scn_of: dict[int, int] = {}
    synced: list[tuple[int, int]] = []  # (synced_scn, when), in order
    async with Relay(cfg) as relay:
        host = relay.hosts["pg"]
        while host.state != "streaming":  # noqa: ASYNC110 - a benchmark's start-up poll
            await asyncio.sleep(0.05)
        buf = host.buffer
        original = buf.on_publish

        def on_publish() -> None:
            now = time.perf_counter_ns()
            m = buf.meta
            rec = buf._events.at(m.tail_event - 2)  # the MESSAGE event before END_OF_WINDOW
            if int(rec["op"]) == Op.MESSAGE:
                start = int(rec["pos"]) % buf.capacity
                payload = bytes(buf._ring[start + HEADER_SIZE : start + int(rec["length"])])
                msg = decode_control(Op.MESSAGE, payload)
                published[int(msg.content)] = now  # type: ignore[union-attr]
                scn_of[int(msg.content)] = int(rec["scn"])  # type: ignore[union-attr]
            if original is not None:
                original()

        buf.on_publish = on_publish
        syncer = host.syncer
        if syncer is not None:  # the syncer thread wakes the loop after each sync
            wake = syncer._wake

            def on_synced() -> None:
                synced.append((syncer.synced_scn, time.perf_counter_ns()))
                wake()

            syncer._wake = on_synced  # type: ignore[method-assign]

        def writer() -> None:
            with psycopg.connect(dsn, autocommit=True) as conn:
                n = 0
                next_at = time.perf_counter()
                stop = next_at + seconds
                while time.perf_counter() < stop:
                    with conn.transaction():
                        conn.execute(
                            "INSERT INTO t SELECT g, 1, 2, 'c', 'd', 'e', 1.5, now(), true, 'i' "
                            "FROM generate_series(%s::int8, %s::int8) AS g",
                            (n * 10, n * 10 + 9),
                        )
                        conn.execute("SELECT pg_logical_emit_message(true, 'bench', %s)", (str(n),))
                    committed[n] = time.perf_counter_ns()
                    n += 1
                    next_at += 0.01  # 100 transactions of 10 rows per second
                    time.sleep(max(0.0, next_at - time.perf_counter()))

        await asyncio.to_thread(writer)
        await asyncio.sleep(0.5)
    lat = np.array(
        [(published[n] - committed[n]) / 1e6 for n in committed if n in published and n > 50]
    )
    if durability == "page_cache":
        return {
            "latency_p50_ms": round(float(np.percentile(lat, 50)), 3),
            "latency_p99_ms": round(float(np.percentile(lat, 99)), 3),
            "latency_samples": int(lat.size),
            "latency_transactions": len(committed),
        }
    sync_scns = np.array([scn for scn, _ in synced], dtype=np.int64)
    sync_at = [when for _, when in synced]
    to_synced = []
    for n in committed:
        if n > 50 and n in scn_of:
            i = int(np.searchsorted(sync_scns, scn_of[n]))  # the first sync covering it
            if i < len(sync_at):
                to_synced.append((sync_at[i] - committed[n]) / 1e6)
    durable = np.array(to_synced)
    return {
        "fsync_commit_to_buffer_p50_ms": round(float(np.percentile(lat, 50)), 3),
        "fsync_commit_to_buffer_p99_ms": round(float(np.percentile(lat, 99)), 3),
        "fsync_commit_to_synced_p50_ms": round(float(np.percentile(durable, 50)), 3),
        "fsync_commit_to_synced_p99_ms": round(float(np.percentile(durable, 99)), 3),
        "fsync_latency_samples": int(durable.size),
        "fsync_syncs": syncer.syncs if syncer is not None else 0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument(
        "--reader",
        choices=("auto", "libpq", "socket"),
        default="auto",
        help="the postgres fetcher's stream_reader option",
    )
    args = ap.parse_args()
    # the relay daemon's GIL switch interval (changebus relay sets it from its config)
    sys.setswitchinterval(RelayConfig.gil_switch_interval_s)
    result: dict[str, Any] = {"reader": args.reader}
    base = Path(tempfile.mkdtemp(prefix="changebus-bench-pg-"))
    server = EmbeddedPostgres.start(base)
    try:
        for label, text_bytes in (("large", 2400), ("small", 120)):
            figs = backlog(base, server, args.rows, text_bytes, label, args.reader)
            result.update(figs)
            print(
                f"{label} rows: changebus {figs[f'{label}_changebus_rows_per_s']:,} rows/s, "
                f"pg_recvlogical {figs[f'{label}_recvlogical_rows_per_s']:,} rows/s "
                f"(ratio {figs[f'{label}_vs_recvlogical_ratio']:.2f}); fetcher thread "
                f"{figs[f'{label}_fetcher_thread_cpu_us_per_row']} us of CPU per row",
                flush=True,
            )
        result["fsync_rows_per_s"] = result["large_fsync_rows_per_s"]
        result["fsync_vs_page_cache_ratio"] = result["large_fsync_vs_page_cache_ratio"]
        print(
            f"durability fsync: large rows {result['large_fsync_rows_per_s']:,} rows/s "
            f"(ratio {result['large_fsync_vs_page_cache_ratio']:.2f}), small rows "
            f"{result['small_fsync_rows_per_s']:,} rows/s "
            f"(ratio {result['small_fsync_vs_page_cache_ratio']:.2f}) to page_cache",
            flush=True,
        )
        lat = asyncio.run(latency(base, server, args.seconds, args.reader))
        result.update(lat)
        print(
            f"latency at 1,000 rows/s in 10-row transactions: p50 {lat['latency_p50_ms']} ms, "
            f"p99 {lat['latency_p99_ms']} ms over {lat['latency_samples']} transactions",
            flush=True,
        )
        fs = asyncio.run(latency(base, server, args.seconds, args.reader, "fsync"))
        result.update(fs)
        print(
            f"with durability fsync: commit -> buffer p99 {fs['fsync_commit_to_buffer_p99_ms']} ms,"
            f" commit -> synced p50 {fs['fsync_commit_to_synced_p50_ms']} ms, p99 "
            f"{fs['fsync_commit_to_synced_p99_ms']} ms ({fs['fsync_syncs']} syncs)",
            flush=True,
        )
    finally:
        server.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
