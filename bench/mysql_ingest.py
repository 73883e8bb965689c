"""MySQL/MariaDB ingest: a binlog backlog into the relay buffer against the stock decoder.

Starts a throwaway MariaDB (the test fixture's :class:`EmbeddedMariaDB`), then
writes a backlog into a fresh binlog: ``--rows`` inserts into one table in
``--txn-rows``-row transactions (binlog file 1), then, after a rotation, an
update of every row in transactions of the same size (binlog file 2). Table:
``id bigint PK, a int, b varchar(64), c decimal(12,2), d datetime(6)``
(the one in docs sources-feasibility 2.7), plus ``e int unsigned, f text``
with ``--wide``.

* **stock**: mysql-replication's ``BinLogStreamReader`` (file/position mode,
  non-blocking) reads both files and decodes every rows event (``.rows``):
  the bare decode, no encoding, nothing kept. The baseline.
* **changebus**: an in-process relay with the mysql fetcher
  (``start_at = "earliest"``) drains the same binlog into its buffer:
  framing, its own row decoder, Avro encoding of every event (updates carry
  both images), window assembly, validation and the buffer append. Timed from
  the end of the fetcher's start-up checks (reported apart: server settings,
  binlog list, ``information_schema``) to the last window of each file in the
  buffer; the stock reader's time includes its connection, as this one
  includes the stream's.

The two alternate ``--rounds`` times (the machine is shared: best of each).
Ratios = changebus rows/s / stock rows/s, per phase; goal >= 3.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig

NARROW = "id bigint PRIMARY KEY, a int, b varchar(64), c decimal(12,2), d datetime(6)"
WIDE = NARROW + ", e int unsigned, f text"


def write_backlog(server: EmbeddedMariaDB, rows: int, txn_rows: int, wide: bool) -> list[str]:
    """Inserts into binlog file 1, updates into file 2; returns the two file names."""
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("CREATE DATABASE bench")
            cur.execute(f"CREATE TABLE bench.t ({WIDE if wide else NARROW})")
            cur.execute("USE bench")
            cur.execute("RESET MASTER")  # the binlog holds the backlog only
            extra = ", seq % 100000, REPEAT('f', 40)" if wide else ""
            for start in range(1, rows + 1, txn_rows):
                cur.execute(
                    "INSERT INTO bench.t SELECT seq, seq % 1000, MD5(seq), seq / 100, "
                    f"NOW(6){extra} FROM seq_{start}_to_{min(start + txn_rows - 1, rows)}"
                )
            cur.execute("FLUSH BINARY LOGS")
            for start in range(1, rows + 1, txn_rows):
                cur.execute(
                    "UPDATE bench.t SET a = a + 1, c = c + 1 WHERE id BETWEEN %s AND %s",
                    (start, min(start + txn_rows - 1, rows)),
                )
            cur.execute("SHOW BINARY LOGS")
            files = [str(r[0]) for r in cur.fetchall()]
    finally:
        conn.close()
    return files[:2]


def stock_decode(server: EmbeddedMariaDB, files: list[str]) -> dict[str, tuple[int, float]]:
    """mysql-replication's decode of both files: {file: (row changes, seconds)}."""
    from pymysqlreplication import BinLogStreamReader
    from pymysqlreplication.event import RotateEvent
    from pymysqlreplication.row_event import DeleteRowsEvent, UpdateRowsEvent, WriteRowsEvent

    reader = BinLogStreamReader(
        connection_settings={"host": "127.0.0.1", "port": server.port, "user": "root"},
        server_id=4242,
        blocking=False,
        resume_stream=True,
        log_file=files[0],
        log_pos=4,
        is_mariadb=False,
        only_events=[RotateEvent, WriteRowsEvent, UpdateRowsEvent, DeleteRowsEvent],
        enable_logging=False,
    )
    out: dict[str, tuple[int, float]] = {}
    current = files[0]
    count = 0
    t0 = time.perf_counter()
    try:
        for event in reader:
            if isinstance(event, RotateEvent):
                if event.next_binlog != current:
                    out[current] = (count, time.perf_counter() - t0)
                    current, count, t0 = event.next_binlog, 0, time.perf_counter()
                    if current not in files:
                        break
                continue
            count += len(event.rows)  # the decode
    finally:
        reader.close()
    if current in files and current not in out:
        out[current] = (count, time.perf_counter() - t0)
    return out


async def changebus_drain(
    server: EmbeddedMariaDB, base: Path, windows: list[int], decode_workers: int = 0
) -> tuple[list[float], dict[str, Any]]:
    """Seconds from the relay's start until its buffer holds ``windows[i]`` windows."""
    cfg = RelayConfig(
        data_dir=base / f"relay-{time.monotonic_ns()}",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "my",
                1,
                capacity_bytes=512 << 20,
                fetcher=FetcherConfig(
                    "mysql",
                    server.options(
                        databases=["bench"], start_at="earliest", decode_workers=decode_workers
                    ),
                ),
            ),
        ),
        flush_interval_s=0,
    )
    t_start = time.perf_counter()
    marks: list[float] = []
    async with Relay(cfg) as relay:
        host = relay.hosts["my"]
        buf = host.buffer
        while host.state != "streaming":
            if time.perf_counter() - t_start > 60 or host.state == "failed":
                raise RuntimeError(f"the fetcher did not start: {host.last_error}")
            await asyncio.sleep(0.002)
        # the clock starts once the fetcher's start-up checks are done (the stock
        # reader's clock includes its connection, as this one includes the stream's)
        t0 = time.perf_counter()
        marks.append(t0 - t_start)
        for target in windows:
            while buf.stats["windows_appended"] < target:
                if time.perf_counter() - t0 > 900 or host.state == "failed":
                    raise RuntimeError(f"the relay did not drain the backlog: {host.last_error}")
                await asyncio.sleep(0.002)
            marks.append(time.perf_counter() - t0)
        stats = dict(buf.stats)
    return marks, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--txn-rows", type=int, default=1_000)
    ap.add_argument("--wide", action="store_true", help="7 columns instead of 5")
    ap.add_argument("--rounds", type=int, default=2, help="alternating runs; best of each")
    ap.add_argument(
        "--decode-workers", type=int, default=0, help="the fetcher's decode_workers option"
    )
    args = ap.parse_args()
    # the relay daemon's GIL switch interval (changebus relay sets it from its config)
    sys.setswitchinterval(RelayConfig.gil_switch_interval_s)
    base = Path(tempfile.mkdtemp(prefix="changebus-bench-mysql-"))
    server = EmbeddedMariaDB.start(base)
    result: dict[str, Any] = {
        "rows": args.rows,
        "txn_rows": args.txn_rows,
        "wide": args.wide,
        "rounds": args.rounds,
        "decode_workers": args.decode_workers,
    }
    try:
        print(f"writing a backlog of {args.rows:,} inserts and {args.rows:,} updates ...")
        files = write_backlog(server, args.rows, args.txn_rows, args.wide)
        txns = -(-args.rows // args.txn_rows)
        # alternate the two, best of --rounds each: the machine is shared and noisy
        best: dict[str, float] = {}
        for _ in range(args.rounds):
            for file, (n, stock_s) in stock_decode(server, files).items():
                assert n == args.rows, (file, n)
                best[f"stock {file}"] = min(best.get(f"stock {file}", 1e9), stock_s)
            marks, stats = asyncio.run(
                changebus_drain(server, base, [txns, 2 * txns], args.decode_workers)
            )
            best["changebus start"] = min(best.get("changebus start", 1e9), marks[0])
            best["changebus insert"] = min(best.get("changebus insert", 1e9), marks[1])
            best["changebus update"] = min(best.get("changebus update", 1e9), marks[2] - marks[1])
        phases = {"insert": files[0], "update": files[1]}
        for phase, file in phases.items():
            stock_s, seconds = best[f"stock {file}"], best[f"changebus {phase}"]
            n = args.rows
            result[f"{phase}_stock_rows_per_s"] = round(n / stock_s)
            result[f"{phase}_changebus_rows_per_s"] = round(args.rows / seconds)
            result[f"{phase}_vs_stock_ratio"] = round(stock_s / seconds, 2)
            print(
                f"{phase}s: changebus {result[f'{phase}_changebus_rows_per_s']:,} rows/s into the "
                f"relay buffer, stock decode {result[f'{phase}_stock_rows_per_s']:,} rows/s "
                f"(ratio {result[f'{phase}_vs_stock_ratio']:.2f}, goal >= 3)",
                flush=True,
            )
        result["changebus_start_s"] = round(best["changebus start"], 3)
        print(
            f"relay start to streaming (server checks, information_schema): "
            f"{result['changebus_start_s']} s, not in the rates above",
            flush=True,
        )
        result["events_appended"] = int(stats["events_appended"])
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
