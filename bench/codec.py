"""Codec benchmark: changebus event encode/decode against bare fastavro.

For rows of about 2.5 KB and about 200 B (10 columns), measures in one run,
in batches of 1,000 events (a window when encoding, a response of 0.3 to 2.5 MB
when decoding):

* bare fastavro ``schemaless_writer`` / ``schemaless_reader`` of the row
  records, each batch through one BytesIO (the baseline, in its cheapest form);
* changebus ``RowEncoder.encode_many`` (whole events: key, change record,
  header, both CRCs, partition hash) and decoding (``parse_stream``: bulk
  header parse, vectorised structure checks, header and payload CRCs; then
  ``ChangeDecoder.decode_many``) of the same rows;
* for reference, the one-event-at-a-time ``RowEncoder.encode``;
* bulk header parsing alone (``scan_offsets`` + ``headers_at`` +
  ``check_headers``) in headers/s.

Goals: encode and decode ratios >= 0.8; header parse >= 1,000,000/s.
The last line of output is one JSON object with every figure.

Usage: ``python bench/codec.py [--rows N] [--repeat R]``
"""

from __future__ import annotations

import argparse
import io
import json
import random
import string
import sys
import time
from collections.abc import Callable
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_ROOT / s) for s in ("schemas", "fetchers", "relay", "bootstrap", "client")]

import fastavro  # noqa: E402

from changebus.schemas import (  # noqa: E402
    HEADER_SIZE,
    ChangeDecoder,
    Column,
    Op,
    RowEncoder,
    TableSchema,
    check_headers,
    headers_at,
    parse_stream,
    scan_offsets,
)


def make_table() -> TableSchema:
    cols = [Column("id", "long", nullable=False, source_type="bigint")]
    for i in range(1, 10):
        cols.append(
            Column(
                f"c{i}", "string" if i % 2 else "long", source_type="text" if i % 2 else "bigint"
            )
        )
    return TableSchema("public.bench", tuple(cols), key=("id",), version=1)


def make_rows(n: int, row_bytes: int, seed: int = 7) -> list[dict[str, object]]:
    rnd = random.Random(seed)
    text_len = max(1, (row_bytes - 40) // 5)
    alphabet = string.ascii_letters + string.digits
    rows = []
    for i in range(n):
        row: dict[str, object] = {"id": i}
        for c in range(1, 10):
            row[f"c{c}"] = (
                "".join(rnd.choices(alphabet, k=text_len)) if c % 2 else rnd.getrandbits(40)
            )
        rows.append(row)
    return rows


def best_rate(fn: Callable[[], int], repeat: int) -> float:
    """Items per second of the fastest of ``repeat`` runs of ``fn`` (returns item count)."""
    best = 0.0
    for _ in range(repeat):
        t0 = time.perf_counter()
        count = fn()
        dt = time.perf_counter() - t0
        best = max(best, count / dt)
    return best


def bench_size(label: str, row_bytes: int, n: int, repeat: int, batch: int) -> dict[str, float]:
    table = make_table()
    rows = make_rows(n, row_bytes)
    parsed = fastavro.parse_schema(table.row_schema)
    encoder = RowEncoder(table, source_id=1)
    decoder = ChangeDecoder(table)
    chunks = [rows[i : i + batch] for i in range(0, len(rows), batch)]
    changes = [[(Op.INSERT, row, None, (), ()) for row in chunk] for chunk in chunks]
    ts = 1_700_000_000_000_000_000

    # --- baseline: bare fastavro, in its cheapest form (one stream per batch)
    def bare_write() -> int:
        write = fastavro.schemaless_writer
        for chunk in chunks:
            bio = io.BytesIO()
            for row in chunk:
                write(bio, parsed, row)
            bio.getvalue()
        return len(rows)

    bare_streams = []
    for chunk in chunks:
        bio = io.BytesIO()
        for row in chunk:
            fastavro.schemaless_writer(bio, parsed, row)
        bare_streams.append((bio.getvalue(), len(chunk)))

    def bare_read() -> int:
        # keeps what it decodes, as any consumer (and decode_many) does
        read = fastavro.schemaless_reader
        n = 0
        for data, count in bare_streams:
            bio = io.BytesIO(data)
            out = [read(bio, parsed, None) for _ in range(count)]
            n += len(out)
        return n

    # --- changebus: whole events (header, key, hash, both CRCs, change record)
    def cb_encode() -> int:
        seq = 0
        for batch_changes in changes:
            encoder.encode_many(batch_changes, 1000, ts, first_seq=seq)
            seq += len(batch_changes)
        return len(rows)

    streams = [encoder.encode_many(c, 1000, ts) for c in changes]

    def cb_decode() -> int:
        count = 0
        for stream in streams:
            offsets, headers = parse_stream(stream)  # every header and payload CRC checked
            starts = offsets + HEADER_SIZE + headers["key_length"]
            stops = offsets + headers["total_length"]
            count += len(decoder.decode_many(stream, starts.tolist(), stops.tolist()))
        return count

    def cb_encode_single() -> int:
        enc = encoder.encode
        for i, row in enumerate(rows):
            enc(Op.INSERT, 1000, i, ts, row)
        return len(rows)

    whole = b"".join(streams)

    def header_parse() -> int:
        offsets = scan_offsets(whole)
        headers = headers_at(whole, offsets)
        check_headers(whole, offsets, headers)
        return len(headers)

    figures = {
        f"{label}_row_bytes": float(len(encoder.encode(Op.INSERT, 1, 0, ts, rows[0]))),
        f"{label}_bare_encode_per_s": best_rate(bare_write, repeat),
        f"{label}_encode_per_s": best_rate(cb_encode, repeat),
        f"{label}_bare_decode_per_s": best_rate(bare_read, repeat),
        f"{label}_decode_per_s": best_rate(cb_decode, repeat),
        f"{label}_encode_single_per_s": best_rate(cb_encode_single, repeat),
        f"{label}_header_parse_per_s": best_rate(header_parse, repeat),
    }
    figures[f"{label}_encode_ratio"] = (
        figures[f"{label}_encode_per_s"] / figures[f"{label}_bare_encode_per_s"]
    )
    figures[f"{label}_decode_ratio"] = (
        figures[f"{label}_decode_per_s"] / figures[f"{label}_bare_decode_per_s"]
    )
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1000, help="events per window / response")
    args = ap.parse_args()
    result: dict[str, float] = {}
    for label, size in (("large", 2500), ("small", 200)):
        figs = bench_size(label, size, args.rows, args.repeat, args.batch)
        result.update(figs)
        print(
            f"{label:5s} events of {figs[f'{label}_row_bytes']:.0f} B: "
            f"encode {figs[f'{label}_encode_per_s']:,.0f}/s "
            f"(bare fastavro {figs[f'{label}_bare_encode_per_s']:,.0f}/s, "
            f"ratio {figs[f'{label}_encode_ratio']:.2f}); "
            f"decode {figs[f'{label}_decode_per_s']:,.0f}/s "
            f"(bare {figs[f'{label}_bare_decode_per_s']:,.0f}/s, "
            f"ratio {figs[f'{label}_decode_ratio']:.2f}); "
            f"header parse {figs[f'{label}_header_parse_per_s']:,.0f}/s"
        )
    result["header_parse_per_s"] = min(
        result["large_header_parse_per_s"], result["small_header_parse_per_s"]
    )
    print(json.dumps({k: round(v, 3) for k, v in result.items()}))


if __name__ == "__main__":
    main()
