"""What storing a seeded row costs the bootstrap store, against writing its bytes to a file
(issue 20: why ``snapshot_vs_copy_ratio`` >= 0.5 needs another store layout).

``bench/snapshot.py`` measures the whole seed. This takes the store alone:
``--rows`` INSERT events of the benchmark table's shape (~540 B: bigint key,
int, bigint, two ~200-character texts, float, timestamp, int), encoded once
with the schemas' :class:`~changebus.schemas.RowEncoder`, then written in
chunks of ``--chunk-rows`` four ways, each into a fresh directory:

* ``store``: the real SQLite store, :meth:`Store.snapshot_chunk` per chunk
  (one transaction each: the rows and the job row), as the seeder's writer
  thread does;
* ``blob_keys``: the floor of a store that keeps each chunk as one blob and
  indexes only the keys (``(part, source_id, key) -> chunk``, WITHOUT ROWID),
  with the same SQLite settings (keys sorted per chunk, as the store sorts);
* ``blob``: the same blobs without the key index (what is left of SQLite's
  cost when nothing is stored per row);
* baseline ``file``: the chunk's bytes appended to a file, fsync per chunk.

Figures: CPU and wall microseconds per row of each, and the ratios against
the file. At COPY's 400-600k rows/s on this machine, a ratio of 0.5 leaves
3.3-5 µs a row for everything the seed does (read, encode, store) on two
cores shared with Postgres. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sqlite3
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from changebus.bootstrap._chunks import JobState
from changebus.bootstrap._store import Store
from changebus.schemas import (
    HEADER_SIZE,
    Column,
    Op,
    RowEncoder,
    SchemaRegistry,
    TableSchema,
    headers_at,
    scan_offsets,
)

TABLE = TableSchema(
    "public.t",
    (
        Column("id", "long", nullable=False, source_type="bigint"),
        Column("a", "int", nullable=False, source_type="integer"),
        Column("b", "long", source_type="bigint"),
        Column("c", "string", source_type="text"),
        Column("d", "string", source_type="text"),
        Column("f", "double", source_type="double precision"),
        Column("g", {"type": "long", "logicalType": "timestamp-micros"}, source_type="timestamptz"),
        Column("h", "int", source_type="integer"),
    ),
    key=("id",),
)


def chunks(rows: int, per: int) -> list[tuple[int, list[bytes]]]:
    """``(tag, events)`` of every chunk, encoded before any timing starts."""
    table = SchemaRegistry().register(TABLE)
    enc = RowEncoder(table, source_id=1, partition=1)
    start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    out = []
    for first in range(0, rows, per):
        tag = 1_000_000 + first
        events = [
            enc.encode(
                Op.INSERT,
                tag,
                0,
                0,
                {
                    "id": i,
                    "a": i % 1000,
                    "b": i * 7,
                    "c": f"{i:032x}" * 7,
                    "d": f"{i + 1:032x}" * 6,
                    "f": i / 3,
                    "g": start + dt.timedelta(seconds=i),
                    "h": i % 97,
                },
            )
            for i in range(first, min(first + per, rows))
        ]
        out.append((tag, events))
    return out


def timed(
    write: Callable[[int, list[bytes]], None], data: list[tuple[int, list[bytes]]]
) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    for tag, events in data:
        write(tag, events)
    return time.process_time() - cpu, time.perf_counter() - wall


def store_way(base: Path, data: list[tuple[int, list[bytes]]]) -> tuple[float, float]:
    store = Store.sqlite(base / "store.db")
    job = JobState("public.t", '{"table": "public.t"}')

    def write(tag: int, events: list[bytes]) -> None:
        nonlocal job
        job = JobState(
            job.table, job.scope, str(tag), job.chunks + 1, job.rows + len(events), tag, tag
        )
        store.snapshot_chunk("pg", job, events, tag)

    try:
        return timed(write, data)
    finally:
        store.close()


def blob_way(base: Path, data: list[tuple[int, list[bytes]]]) -> tuple[float, float]:
    return blob_keys_way(base, data, index_keys=False)


def blob_keys_way(
    base: Path, data: list[tuple[int, list[bytes]]], *, index_keys: bool = True
) -> tuple[float, float]:
    conn = sqlite3.connect(base / "blob.db", isolation_level=None)
    for pragma in (
        "journal_mode=WAL",
        "synchronous=NORMAL",
        "cache_size=-65536",
        "wal_autocheckpoint=10000",
    ):
        conn.execute(f"PRAGMA {pragma}")
    conn.execute(
        "CREATE TABLE seg (id INTEGER PRIMARY KEY, tag INTEGER NOT NULL, data BLOB NOT NULL)"
    )
    conn.execute(
        "CREATE TABLE segkey (part TEXT NOT NULL, source_id INTEGER NOT NULL, key BLOB NOT NULL, "
        "seg INTEGER NOT NULL, PRIMARY KEY (part, source_id, key)) WITHOUT ROWID"
    )
    per = 500

    def upsert_keys(n: int) -> str:
        values = ", ".join(f"(?1, 1, ?{j + 3}, ?2)" for j in range(n))
        return f"INSERT INTO segkey VALUES {values} ON CONFLICT DO UPDATE SET seg = excluded.seg"

    full = upsert_keys(per)

    def write(tag: int, events: list[bytes]) -> None:
        blob = b"".join(events)
        conn.execute("BEGIN")
        seg = conn.execute("INSERT INTO seg (tag, data) VALUES (?, ?)", (tag, blob)).lastrowid
        if not index_keys:
            conn.execute("COMMIT")
            return
        # the keys, found in the blob as the store finds events (one vectorised header scan)
        offsets = scan_offsets(blob)
        lengths = headers_at(blob, offsets)["key_length"].tolist()
        starts = (offsets + HEADER_SIZE).tolist()
        keys = sorted(blob[at : at + n] for at, n in zip(starts, lengths, strict=True))
        for i in range(0, len(keys), per):
            batch = keys[i : i + per]
            sql = full if len(batch) == per else upsert_keys(len(batch))
            conn.execute(sql, ["pg", seg, *batch])
        conn.execute("COMMIT")

    try:
        return timed(write, data)
    finally:
        conn.close()


def file_way(base: Path, data: list[tuple[int, list[bytes]]]) -> tuple[float, float]:
    with open(base / "raw.bin", "wb") as f:

        def write(_tag: int, events: list[bytes]) -> None:
            f.write(b"".join(events))
            f.flush()
            os.fsync(f.fileno())

        return timed(write, data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=300_000)
    ap.add_argument("--chunk-rows", type=int, default=5000)
    args = ap.parse_args()
    data = chunks(args.rows, args.chunk_rows)
    size = sum(len(e) for _t, evs in data for e in evs) / args.rows
    print(f"{args.rows:,} events of {size:.0f} B in chunks of {args.chunk_rows:,}")
    result: dict[str, float] = {"rows": args.rows, "event_bytes": round(size)}
    ways = {"file": file_way, "store": store_way, "blob_keys": blob_keys_way, "blob": blob_way}
    for name, way in ways.items():
        with tempfile.TemporaryDirectory(prefix="changebus-bench-store-") as tmp:
            cpu, wall = way(Path(tmp), data)
        result[f"{name}_cpu_us_per_row"] = round(cpu * 1e6 / args.rows, 2)
        result[f"{name}_wall_us_per_row"] = round(wall * 1e6 / args.rows, 2)
        print(
            f"  {name:10} {cpu * 1e6 / args.rows:6.2f} CPU µs/row  {wall * 1e6 / args.rows:6.2f} wall µs/row"
        )
    for name in ("store", "blob_keys", "blob"):
        result[f"{name}_vs_file_cpu_ratio"] = round(
            result[f"{name}_cpu_us_per_row"] / max(result["file_cpu_us_per_row"], 1e-9), 1
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
