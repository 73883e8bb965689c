"""Client benchmark: decode throughput against bare fastavro, and Postgres commit -> callback.

**Decode.** ``--rows`` rows of 10 columns (~2.5 KB, then ~200 B; the rows of
``bench/codec.py``) encoded as a relay sends them (windows of 10 inserts),
cut into 1 MiB responses and taken through the client's receive path in
this process: event splitting, window assembly with every CRC and order
check, Avro decode, key extraction, :class:`ChangeEvent` and :class:`Window`
objects. Baseline in the same run: bare fastavro ``schemaless_reader`` of
the same payloads (the change records the events carry; one stream per
1,000 payloads, its cheapest form). ``decode_*_ratio`` = client / bare
fastavro (goal >= 0.7). A stricter figure is printed too:
``decode_*_vs_rows_only_ratio`` against fastavro reading just the row
records (no change-record union or not-sent arrays around them). Rates are per
second of CPU time of this process (all three are single-threaded, in-process).
For reference,
``http_*_events_per_s``: a :class:`Consumer` reading the same number of
events (synthetic rows of the same size) from a relay process over HTTP.

**Latency.** A private Postgres, a relay process with the Postgres fetcher,
and in this process a consumer with :class:`AsyncCallbacks`; a writer
process commits 10-row transactions at 1,000 rows/s, each carrying a
transactional logical message with its number. Latency = ``COMMIT`` returned
in the writer -> ``on_end_window`` of that transaction in the consumer
(monotonic clock, shared by the processes). Goal p50 <= 3 ms, p99 <= 10 ms.
Baseline in the same run: the writer's own ``SELECT 1`` round trip to
Postgres (``latency_vs_pg_roundtrip_ratio`` = p50 / round-trip p50).

Last line: one JSON object. Usage: ``python bench/client.py [--rows N] [--seconds S]``
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import multiprocessing as mp
import tempfile
import time
from pathlib import Path
from typing import Any

import fastavro
import numpy as np
import psycopg

from _common import free_port, start_relay, stop_relay
from changebus.client import AsyncCallbacks, Consumer, ConsumerConfig, Window
from changebus.client._assembler import EventSplitter, WindowAssembler
from changebus.client._decode import SchemaCache, decode_window
from changebus.fetchers.postgres import EmbeddedPostgres
from changebus.schemas import EndOfWindow, Op, RowEncoder, TableSchema, encode_control
from codec import make_rows, make_table

EVENTS_PER_WINDOW = 10


def relay_toml(data_dir: Path, port: int, kind: str, options: dict[str, Any]) -> str:
    opts = ", ".join(f"{k} = {json.dumps(v)}" for k, v in options.items())
    return (
        f'data_dir = "{data_dir}"\nflush_interval_s = 0\nlog_level = "warning"\n'
        f'[http]\nport = {port}\n[[partitions]]\nname = "bench"\nid = 1\n'
        f'capacity_bytes = "1GiB"\n[partitions.fetcher]\nkind = "{kind}"\n'
        f"options = {{ {opts} }}\n"
    )


class _Schemas:
    """The client's schema source, answering from the bench's one table."""

    def __init__(self, table: TableSchema) -> None:
        self.table = table

    async def source_names(self) -> dict[int, str]:
        return {1: self.table.name}

    async def source_schemas(self, name: str) -> list[tuple[int, TableSchema]]:
        return [(1, self.table)]


def stream_bytes(table: TableSchema, rows: list[dict[str, Any]]) -> bytes:
    """A relay response's bytes: windows of 10 inserts, each closed by END_OF_WINDOW."""
    encoder = RowEncoder(table, source_id=1)
    out = []
    ts = 1_700_000_000_000_000_000
    for w, i in enumerate(range(0, len(rows), EVENTS_PER_WINDOW)):
        chunk = rows[i : i + EVENTS_PER_WINDOW]
        scn = 1000 + w
        out.append(encoder.encode_many([(Op.INSERT, r, None, (), ()) for r in chunk], scn, ts))
        out.append(encode_control(EndOfWindow(len(chunk), f"bench:{scn}"), scn, len(chunk), ts))
    return b"".join(out)


async def client_decode(data: bytes, table: TableSchema, response_bytes: int) -> int:
    """The client's receive path over in-memory responses: events into ChangeEvents."""
    cache = SchemaCache({}, resolve_latest=False)
    source = _Schemas(table)
    splitter, assembler = EventSplitter(), WindowAssembler()
    events = 0
    for i in range(0, len(data), response_bytes):
        for raw in assembler.feed(*splitter.split(data[i : i + response_bytes])):
            window = await decode_window(raw, "bench", cache, source)
            events += len(window.events)
    return events


def avro_streams(table: TableSchema, rows: list[dict[str, Any]], *, payloads: bool) -> list[bytes]:
    """The rows as Avro, 1,000 to a stream: the event payloads (change records)
    when ``payloads``, else the bare row records."""
    schema = table.change_schema if payloads else table.row_schema
    parsed = fastavro.parse_schema(schema)
    streams = []
    for i in range(0, len(rows), 1000):
        bio = io.BytesIO()
        for row in rows[i : i + 1000]:
            value: dict[str, Any] = row
            if payloads:
                value = {"after": row, "before": None, "after_not_sent": [], "before_not_sent": []}
            fastavro.schemaless_writer(bio, parsed, value)
        streams.append(bio.getvalue())
    return streams


def bare_read(streams: list[bytes], schema: dict[str, Any], n: int) -> int:
    parsed = fastavro.parse_schema(schema)
    kept: list[Any] = []
    read = fastavro.schemaless_reader
    for data in streams:
        bio = io.BytesIO(data)
        kept.extend(read(bio, parsed) for _ in range(min(1000, n - len(kept))))
    return len(kept)


def decode_case(label: str, row_bytes: int, n: int, repeat: int) -> dict[str, float]:
    """Best of ``repeat`` rounds; the three readers alternate within each round.

    Rates are per second of this process's CPU time: all three are single-threaded
    work in this process, and on a shared machine wall-clock rates swing 2x with
    whatever else runs.
    """
    table = make_table()
    rows = make_rows(n, row_bytes)
    data = stream_bytes(table, rows)
    payloads = avro_streams(table, rows, payloads=True)
    bare_rows = avro_streams(table, rows, payloads=False)
    best_client = best_bare = best_rows = 0.0
    for _ in range(repeat):
        t0 = time.process_time()
        assert asyncio.run(client_decode(data, table, 1 << 20)) == n
        best_client = max(best_client, n / (time.process_time() - t0))
        t0 = time.process_time()
        assert bare_read(payloads, table.change_schema, n) == n
        best_bare = max(best_bare, n / (time.process_time() - t0))
        t0 = time.process_time()
        assert bare_read(bare_rows, table.row_schema, n) == n
        best_rows = max(best_rows, n / (time.process_time() - t0))
    return {
        f"decode_{label}_client_events_per_s": round(best_client),
        f"decode_{label}_bare_fastavro_events_per_s": round(best_bare),
        f"decode_{label}_ratio": round(best_client / best_bare, 3),
        f"decode_{label}_bare_fastavro_rows_only_per_s": round(best_rows),
        f"decode_{label}_vs_rows_only_ratio": round(best_client / best_rows, 3),
    }


async def consume(url: str, windows: int) -> float:
    cfg = ConsumerConfig(relays=(url,), partition="bench", wait_s=1.0, queue_bytes=64 << 20)
    events = seen = 0
    async with Consumer(cfg) as consumer:
        t0 = time.perf_counter()
        async for window in consumer:
            events += len(window.events)
            seen += 1
            if seen == windows:
                break
        return events / (time.perf_counter() - t0)


def over_http(row_bytes: int, windows: int) -> float:
    """Events/s of a Consumer reading a relay process (synthetic rows) over HTTP."""
    with tempfile.TemporaryDirectory(prefix="changebus-bench-client-") as tmp:
        port = free_port()
        config = Path(tmp) / "relay.toml"
        options = {
            "windows_per_s": 0,
            "max_windows": windows,
            "events_per_window": EVENTS_PER_WINDOW,
            "row_bytes": row_bytes,
            "tables": 2,
        }
        config.write_text(relay_toml(Path(tmp) / "data", port, "synthetic", options))
        relay = start_relay(config, port)
        try:
            return asyncio.run(consume(f"http://127.0.0.1:{port}", windows))
        finally:
            stop_relay(relay)


# ---- latency ---------------------------------------------------------------------


def writer(dsn: str, seconds: float, out: Any) -> None:
    """Commit 10-row transactions at 100/s; send {n: commit-returned ns} and round trips."""
    committed: dict[int, int] = {}
    rtts: list[float] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        n = 0
        next_at = time.perf_counter()
        stop = next_at + seconds
        while time.perf_counter() < stop:
            with conn.transaction():
                conn.execute(
                    "INSERT INTO t SELECT g, 'row ' || g, now() FROM generate_series(%s::int8, %s::int8) g",
                    (n * 10, n * 10 + 9),
                )
                conn.execute("SELECT pg_logical_emit_message(true, 'bench', %s)", (str(n),))
            committed[n] = time.perf_counter_ns()
            if n % 10 == 5:
                t0 = time.perf_counter_ns()
                conn.execute("SELECT 1")
                rtts.append((time.perf_counter_ns() - t0) / 1e6)
            n += 1
            next_at += 0.01
            time.sleep(max(0.0, next_at - time.perf_counter()))
    out.put((committed, rtts))


class Receipts(AsyncCallbacks):
    def __init__(self) -> None:
        self.received: dict[int, int] = {}

    async def on_end_window(self, window: Window) -> None:
        now = time.perf_counter_ns()
        for msg in window.messages:
            if msg.prefix == "bench":
                self.received[int(msg.content)] = now


async def latency_run(url: str, dsn: str, seconds: float) -> dict[str, float]:
    cfg = ConsumerConfig(relays=(url,), partition="bench", wait_s=1.0, start="latest")
    receipts = Receipts()
    async with Consumer(cfg) as consumer:
        runner = asyncio.create_task(consumer.run(receipts))
        await asyncio.sleep(1.0)  # connected and waiting
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=writer, args=(dsn, seconds, queue))
        proc.start()
        committed, rtts = await asyncio.to_thread(queue.get)
        await asyncio.to_thread(proc.join)
        await asyncio.sleep(0.5)
        consumer.stop()
        await runner
    lat = np.array(
        [(receipts.received[n] - t) / 1e6 for n, t in committed.items() if n in receipts.received]
    )
    lat = lat[50:]  # warm-up
    rtt = float(np.percentile(rtts, 50))
    p50 = float(np.percentile(lat, 50))
    return {
        "latency_p50_ms": round(p50, 3),
        "latency_p99_ms": round(float(np.percentile(lat, 99)), 3),
        "latency_samples": int(lat.size),
        "latency_missing": len(committed) - len(receipts.received),
        "pg_roundtrip_p50_ms": round(rtt, 3),
        "latency_vs_pg_roundtrip_ratio": round(p50 / rtt, 2),
    }


def latency_case(seconds: float) -> dict[str, float]:
    base = Path(tempfile.mkdtemp(prefix="changebus-bench-client-pg-"))
    base.chmod(0o755)
    server = EmbeddedPostgres.start(base / "pg")
    relay = None
    try:
        dsn = server.dsn()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (id int8 PRIMARY KEY, name text, at timestamptz)")
        port = free_port()
        config = base / "relay.toml"
        options = {"dsn": dsn, "status_interval_s": 0.5}
        config.write_text(relay_toml(base / "relay", port, "postgres", options))
        relay = start_relay(config, port)
        return asyncio.run(latency_run(f"http://127.0.0.1:{port}", dsn, seconds))
    finally:
        if relay is not None:
            stop_relay(relay)
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=8.0)
    args = ap.parse_args()
    result: dict[str, float] = {}
    for label, row_bytes in (("large", 2500), ("small", 200)):
        figs = decode_case(label, row_bytes, args.rows, args.repeat)
        result.update(figs)
        print(
            f"decode ~{row_bytes} B rows: client {figs[f'decode_{label}_client_events_per_s']:,}"
            f" events/s, bare fastavro on the same payloads"
            f" {figs[f'decode_{label}_bare_fastavro_events_per_s']:,}"
            f" events/s (ratio {figs[f'decode_{label}_ratio']:.2f}); bare fastavro on the"
            f" row records alone {figs[f'decode_{label}_bare_fastavro_rows_only_per_s']:,}/s"
            f" (ratio {figs[f'decode_{label}_vs_rows_only_ratio']:.2f})",
            flush=True,
        )
        rate = round(over_http(row_bytes, args.rows // EVENTS_PER_WINDOW))
        result[f"http_{label}_events_per_s"] = rate
        print(f"  the same through a relay process over HTTP: {rate:,} events/s", flush=True)
    lat = latency_case(args.seconds)
    result.update(lat)
    print(
        f"Postgres commit -> callback at 1,000 rows/s: p50 {lat['latency_p50_ms']} ms, "
        f"p99 {lat['latency_p99_ms']} ms over {lat['latency_samples']} transactions "
        f"(Postgres SELECT 1 round trip p50 {lat['pg_roundtrip_p50_ms']} ms)",
        flush=True,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
