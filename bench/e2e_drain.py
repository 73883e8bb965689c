"""End-to-end backlog drain: Postgres -> relay -> Consumer reading every value, against pg_recvlogical.

A private Postgres (``EmbeddedPostgres``, as ``bench/pg_ingest.py``), two
logical slots created at the same point, then a backlog of ``--rows`` rows
(~2.5 KB, the 10 columns of ``bench/pg_ingest.py``, 100-row transactions).
Baseline: ``pg_recvlogical`` (binary pgoutput to /dev/null) drains one slot
up to the backlog's end LSN (``pg_ingest.recvlogical``). Then a relay process
(the postgres fetcher on the other slot) starts, and a :class:`Consumer` in
this process reads the partition from the earliest window, touching every
value of every event (``after``, ``before``, keys), until it has seen every
row.

Figures: rows/s from the first event received to the last
(``e2e_rows_per_s``) and from the relay's start to the last
(``e2e_with_start_rows_per_s``); CPU seconds per 100k rows of the relay
process and of the consumer (this process); pg_recvlogical's rows/s on the
same backlog. Goal (issue 23): ``e2e_vs_recvlogical_ratio`` >= 0.65 (the
ratio of the first-to-last rate to pg_recvlogical's). Last line: one JSON
object.

Usage: ``python bench/e2e_drain.py [--rows 100000] [--text-bytes 2400]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from _common import cpu_seconds, free_port, start_relay, stop_relay
from changebus.client import Consumer, ConsumerConfig
from changebus.fetchers.postgres import EmbeddedPostgres
from client import relay_toml
from pg_ingest import COLUMNS, make_backlog, recvlogical


def _touch(values: dict[str, Any] | None) -> int:
    """Read every value of a row (what a consumer does with it); returns a count."""
    if values is None:
        return 0
    n = 0
    for value in values.values():
        if value is not None:
            n += 1
    return n


async def consume(url: str, rows: int) -> dict[str, float]:
    """Read ``rows`` rows through a Consumer; times of the first and last event, CPU."""
    cfg = ConsumerConfig(relays=(url,), partition="bench", start="earliest", wait_s=1.0)
    seen = values = 0
    first = last = 0.0
    cpu0 = time.process_time()
    async with Consumer(cfg) as consumer:
        async for window in consumer:
            if not window.events:
                continue
            if not first:
                first = time.perf_counter()
            for event in window.events:
                values += _touch(event.after) + _touch(event.before) + _touch(event.key)
            seen += len(window.events)
            if seen >= rows:
                last = time.perf_counter()
                break
    return {"first": first, "last": last, "cpu_s": time.process_time() - cpu0, "values": values}


def drain(base: Path, server: Any, rows: int, text_bytes: int) -> dict[str, float]:
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute("CREATE DATABASE e2e")
    dsn = server.dsn("e2e")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE t ({COLUMNS})")
        conn.execute("CREATE PUBLICATION pub FOR TABLE t")
        for slot in ("cb_e2e", "recv_e2e"):
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    print(f"writing a backlog of {rows:,} rows ...", flush=True)
    end = make_backlog(dsn, rows, text_bytes)
    end_lsn = f"{end >> 32:X}/{end & 0xFFFFFFFF:X}"
    recv_s = recvlogical(server.bin_dir, server.port, "e2e", "recv_e2e", end_lsn)
    port = free_port()
    config = base / "relay.toml"
    options = {"dsn": dsn, "slot": "cb_e2e", "publication": "pub", "create_slot": False}
    config.write_text(relay_toml(base / "relay", port, "postgres", options))
    t0 = time.perf_counter()
    relay = start_relay(config, port)
    try:
        cpu0 = cpu_seconds(relay.pid)
        got = asyncio.run(consume(f"http://127.0.0.1:{port}", rows))
        relay_cpu = cpu_seconds(relay.pid) - cpu0
    finally:
        stop_relay(relay)
    e2e_s = got["last"] - got["first"]
    per = 100_000 / rows
    return {
        "rows": rows,
        "recvlogical_rows_per_s": round(rows / recv_s),
        "e2e_rows_per_s": round(rows / e2e_s),
        "e2e_with_start_rows_per_s": round(rows / (got["last"] - t0)),
        "e2e_vs_recvlogical_ratio": round(recv_s / e2e_s, 3),
        "relay_cpu_s_per_100k_rows": round(relay_cpu * per, 2),
        "consumer_cpu_s_per_100k_rows": round(got["cpu_s"] * per, 2),
        "values_read": int(got["values"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--text-bytes", type=int, default=2400, help="text bytes per row (~2.5 KB)")
    args = ap.parse_args()
    result: dict[str, Any] = {"load_1min": round(os.getloadavg()[0], 2)}
    base = Path(tempfile.mkdtemp(prefix="changebus-bench-e2e-", dir=os.environ.get("BENCH_TMP")))
    server = EmbeddedPostgres.start(base)
    try:
        result.update(drain(base, server, args.rows, args.text_bytes))
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
    print(
        f"{args.rows:,} rows: Postgres -> relay -> Consumer {result['e2e_rows_per_s']:,} rows/s "
        f"(with the relay's start {result['e2e_with_start_rows_per_s']:,}), pg_recvlogical "
        f"{result['recvlogical_rows_per_s']:,} rows/s (ratio {result['e2e_vs_recvlogical_ratio']:.2f}); "
        f"CPU per 100k rows: relay {result['relay_cpu_s_per_100k_rows']} s, consumer "
        f"{result['consumer_cpu_s_per_100k_rows']} s",
        flush=True,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
