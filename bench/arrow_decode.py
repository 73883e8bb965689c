"""Columnar decoding benchmark: change payloads into Arrow vs bare fastavro into dicts.

The same change records (a table of 12 common column types: bigint key,
int, bigint, double, boolean, two texts, timestamptz, timestamp, date,
numeric(12,2), uuid; rows of about 200 B), in batches of 1,000 events, decoded
on one core three ways:

* the baseline: bare fastavro ``schemaless_reader`` with the change record
  schema, each batch's payloads through one BytesIO, into dicts (kept, as a
  consumer keeps them);
* changebus columnar: :class:`~changebus.client.spark.ArrowDecoder` -- the
  generated column reader, then one Arrow array per column and the
  metadata columns: a finished :class:`pyarrow.RecordBatch` per batch, the
  Spark source's layout;
* for reference, the row path it replaces: ``ChangeDecoder.decode_many``
  (generated row reader) into events and :class:`BatchBuilder` into the same
  record batch.

Two workloads: inserts only (``arrow_decode_vs_fastavro_ratio``, goal >= 2)
and a mix (70 % inserts, 20 % updates with before-images, 10 % deletes).
Payload spans are given to every decoder (the envelope is parsed once
beforehand, as the fastavro baseline gets its payloads ready too).
The last line of output is one JSON object with every figure.

Usage: ``python bench/arrow_decode.py [--rows N] [--repeat R]``
"""

from __future__ import annotations

import argparse
import datetime as dt
import decimal
import io
import json
import os
import random
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_ROOT / s) for s in ("schemas", "fetchers", "relay", "bootstrap", "client")]

import fastavro  # noqa: E402
import pyarrow as pa  # noqa: E402

from changebus.client import ChangeEvent, ChangeOp, Window  # noqa: E402
from changebus.client.spark import ArrowDecoder, union_schema  # noqa: E402
from changebus.client.spark._arrow import BatchBuilder  # noqa: E402
from changebus.schemas import (  # noqa: E402
    HEADER_SIZE,
    ChangeDecoder,
    Column,
    Op,
    RowEncoder,
    TableSchema,
    parse_stream,
    pg_avro_type,
)

TYPES = [
    ("i", "integer"),
    ("n", "bigint"),
    ("x", "double precision"),
    ("b", "boolean"),
    ("t1", "text"),
    ("t2", "text"),
    ("ts", "timestamptz"),
    ("lts", "timestamp"),
    ("d", "date"),
    ("amount", "numeric(12,2)"),
    ("u", "uuid"),
]
TS = 1_700_000_000_000_000_000


def make_table() -> TableSchema:
    cols = [Column("id", "long", nullable=False, source_type="bigint")]
    cols += [Column(name, pg_avro_type(t), source_type=t) for name, t in TYPES]
    return TableSchema("public.bench", tuple(cols), key=("id",), version=1)


def make_row(i: int, rnd: random.Random) -> dict[str, Any]:
    return {
        "id": i,
        "i": rnd.randint(-(2**31), 2**31 - 1),
        "n": rnd.getrandbits(40),
        "x": rnd.random() * 1e6,
        "b": rnd.random() < 0.5,
        "t1": "".join(rnd.choices("abcdefghijklmnopqrstuvwxyz", k=40)),
        "t2": None if rnd.random() < 0.3 else "status-" + str(rnd.randint(0, 9)),
        "ts": dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
        + dt.timedelta(microseconds=rnd.getrandbits(40)),
        "lts": dt.datetime(2024, 1, 1) + dt.timedelta(microseconds=rnd.getrandbits(40)),
        "d": dt.date(2000, 1, 1) + dt.timedelta(days=rnd.randint(0, 9000)),
        "amount": decimal.Decimal(rnd.randint(-(10**9), 10**9)).scaleb(-2),
        "u": uuid.UUID(int=rnd.getrandbits(128)),
    }


def make_changes(n: int, mixed: bool, seed: int = 7) -> list[tuple[Any, ...]]:
    rnd = random.Random(seed)
    out: list[tuple[Any, ...]] = []
    for i in range(n):
        row = make_row(i, rnd)
        r = rnd.random() if mixed else 0.0
        if r < 0.7:
            out.append((Op.INSERT, row, None, (), ()))
        elif r < 0.9:
            out.append((Op.UPDATE, row, make_row(i, rnd), (), ()))
        else:
            out.append((Op.DELETE, None, row, (), ()))
    return out


def _key(after: dict[str, Any] | None, before: dict[str, Any] | None) -> dict[str, Any]:
    image = after if after is not None else before
    return {} if image is None else {"id": image["id"]}


def best_rate(fn: Callable[[], int], repeat: int) -> float:
    """Items per second of the fastest of ``repeat`` runs of ``fn`` (returns item count)."""
    best = 0.0
    for _ in range(repeat):
        t0 = time.perf_counter()
        count = fn()
        best = max(best, count / (time.perf_counter() - t0))
    return best


def bench(label: str, n: int, batch: int, repeat: int, mixed: bool) -> dict[str, float]:
    table = make_table()
    schema = union_schema([table])
    encoder = RowEncoder(table, source_id=1)
    decoder = ChangeDecoder(table)
    change_schema = fastavro.parse_schema(table.change_schema)
    changes = make_changes(n, mixed)
    batches = []
    for i in range(0, n, batch):
        stream = encoder.encode_many(changes[i : i + batch], 1000 + i, TS, first_seq=0)
        offsets, headers = parse_stream(stream)
        starts = (offsets + HEADER_SIZE + headers["key_length"]).tolist()
        stops = (offsets + headers["total_length"]).tolist()
        kstarts = (offsets + HEADER_SIZE).tolist()
        meta = {
            "ops": headers["op"].tolist(),
            "seqs": headers["seq"].tolist(),
            "scns": headers["scn"].tolist(),
        }
        payloads = b"".join(stream[a:b] for a, b in zip(starts, stops, strict=True))
        batches.append((stream, starts, stops, kstarts, meta, payloads, len(starts)))

    def fastavro_dicts() -> int:
        read = fastavro.schemaless_reader
        count = 0
        for *_, payloads, k in batches:
            bio = io.BytesIO(payloads)
            out = [read(bio, change_schema, None) for _ in range(k)]
            count += len(out)
        return count

    def arrow_columnar() -> int:
        count = 0
        for stream, starts, stops, kstarts, meta, _, k in batches:
            dec = ArrowDecoder(schema)
            dec.add(
                decoder,
                stream,
                starts,
                stops,
                timestamps_ns=[TS] * k,
                partitions=["pg"] * k,
                key_starts=kstarts,
                **meta,
            )
            rb = dec.flush()
            count += k
            assert rb.num_columns == len(schema)
        return count

    def row_path() -> int:
        count = 0
        ops = {int(Op.INSERT): ChangeOp.INSERT, int(Op.UPDATE): ChangeOp.UPDATE,
               int(Op.DELETE): ChangeOp.DELETE}  # fmt: skip
        for stream, starts, stops, _, meta, _, k in batches:
            rows = decoder.decode_many(stream, starts, stops)
            events = tuple(
                ChangeEvent(scn, seq, ops[op], table.name, _key(a, b), a, b, a_ns, b_ns, TS)
                for (a, b, a_ns, b_ns), op, seq, scn in zip(
                    rows, meta["ops"], meta["seqs"], meta["scns"], strict=True
                )
            )
            builder = BatchBuilder(schema)
            builder.add_window(Window(meta["scns"][0], TS, "pg", events))
            rb = builder.flush()
            count += k
            assert rb.num_columns == len(schema)
        return count

    # the two Arrow paths give the same batch
    stream, starts, stops, kstarts, meta, _, k = batches[0]
    check = ArrowDecoder(schema)
    check.add(decoder, stream, starts, stops, timestamps_ns=[TS] * k, partitions=["pg"] * k,
              key_starts=kstarts, **meta)  # fmt: skip
    columnar = check.flush()
    rows = decoder.decode_many(stream, starts, stops)
    ops = {int(Op.INSERT): ChangeOp.INSERT, int(Op.UPDATE): ChangeOp.UPDATE,
           int(Op.DELETE): ChangeOp.DELETE}  # fmt: skip
    builder = BatchBuilder(schema)
    builder.add_window(Window(meta["scns"][0], TS, "pg", tuple(
        ChangeEvent(scn, seq, ops[op], table.name, _key(a, b), a, b, a_ns, b_ns, TS)
        for (a, b, a_ns, b_ns), op, seq, scn in zip(
            rows, meta["ops"], meta["seqs"], meta["scns"], strict=True
        )
    )))  # fmt: skip
    assert builder.flush().equals(columnar), "columnar and row path differ"
    fastavro_rate = best_rate(fastavro_dicts, repeat)
    arrow_rate = best_rate(arrow_columnar, repeat)
    row_rate = best_rate(row_path, repeat)
    out = {
        f"{label}_fastavro_dicts_rows_per_s": round(fastavro_rate),
        f"{label}_arrow_columnar_rows_per_s": round(arrow_rate),
        f"{label}_row_path_to_arrow_rows_per_s": round(row_rate),
        f"{label}_arrow_vs_fastavro_ratio": round(arrow_rate / fastavro_rate, 3),
        f"{label}_arrow_vs_row_path_ratio": round(arrow_rate / row_rate, 3),
    }
    print(
        f"{label:8s} fastavro->dicts {fastavro_rate:>10,.0f}/s  columnar->Arrow"
        f" {arrow_rate:>10,.0f}/s  row path->Arrow {row_rate:>10,.0f}/s"
        f"  columnar/fastavro {arrow_rate / fastavro_rate:.2f}x",
        flush=True,
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    result: dict[str, Any] = {"rows": args.rows, "batch": args.batch}
    result |= bench("inserts", args.rows, args.batch, args.repeat, mixed=False)
    result |= bench("mixed", args.rows, args.batch, args.repeat, mixed=True)
    result["arrow_decode_vs_fastavro_ratio"] = result["inserts_arrow_vs_fastavro_ratio"]
    result["goal_arrow_decode_vs_fastavro_ratio"] = 2.0
    result["load_average_1min"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
