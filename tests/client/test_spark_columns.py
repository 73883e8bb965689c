"""Columnar decoding into Arrow against the row path, value for value.

The row path is what the Spark source has always done: a consumer's
:func:`decode_window` (generated row reader, a dict per image, events) fed to
:class:`BatchBuilder`. :class:`ArrowDecoder` decodes the same event bytes
column-wise; the record batches must be equal (``RecordBatch.equals``: same
schema, same values, same nulls) for every type of the type tests
(``tests/schemas/test_avroread.py``: every Avro type the Postgres and MySQL
mappers produce), for inserts, updates with and without before-images,
deletes with and without, truncates, not-sent values, several tables and
schema versions, reader-schema resolution, and the row-reader fallback.
No servers: these are pure decoding tests (well under a second each).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import importlib
import sys
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st

from changebus.client import Consumer, ConsumerConfig, Window
from changebus.client._assembler import RawWindow
from changebus.client._decode import SchemaCache, decode_window
from changebus.client.spark._arrow import BatchBuilder, union_schema
from changebus.client.spark._columns import ArrowDecoder, arrow_batches
from changebus.schemas import (
    HEADER_SIZE,
    ChangeDecoder,
    Column,
    ConfigError,
    CorruptEventError,
    Op,
    RowEncoder,
    TableSchema,
    encode_event,
    parse_stream,
)

# the type tests' table and row strategy (tests/schemas/test_avroread.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "schemas"))
_types: Any = importlib.import_module("test_avroread")
TABLE: TableSchema = _types.TABLE
ROWS: st.SearchStrategy[dict[str, Any]] = _types.ROWS

MakeRelay = Callable[..., AbstractAsyncContextManager[Any]]
PARTITION = "pg"
TS = 1_700_000_000_123_456_789


class _NoRelay:
    async def source_names(self) -> dict[int, str]:
        raise AssertionError("every schema is known")

    async def source_schemas(self, name: str) -> list[tuple[int, TableSchema]]:
        raise AssertionError("every schema is known")


def _stream(windows: list[tuple[int, TableSchema, list[tuple[Any, ...]]]]) -> bytes:
    """Events of ``(source_id, table, changes)`` runs, back to back, one SCN each."""
    return b"".join(
        RowEncoder(t, source_id=sid).encode_many(changes, 100 + n, TS, first_seq=3 * n)
        for n, (sid, t, changes) in enumerate(windows)
    )


def _both(
    data: bytes,
    writers: Mapping[int, TableSchema],
    schema: pa.Schema,
    *,
    readers: Mapping[str, TableSchema] | None = None,
    include_preimage: bool = True,
    no_columnar: bool = False,
) -> tuple[pa.RecordBatch, pa.RecordBatch]:
    """(row path, columnar path) of the events ``data`` (one raw window per SCN)."""
    offsets, headers = parse_stream(data)
    cache = SchemaCache(readers)
    for sid, t in writers.items():
        cache.add(sid, t)
    rows = BatchBuilder(schema, include_preimage=include_preimage)
    cols = ArrowDecoder(schema, include_preimage=include_preimage)

    def decoder_for(sid: int, version: int) -> Any:
        dec = cache.decoder(sid, writers[sid])
        if no_columnar:
            dec._columnar_tried = True  # as if the generator could not handle the schema
        return dec

    scns = headers["scn"]
    for scn in sorted(set(scns.tolist())):
        sel = scns == scn
        offs = offsets[sel]
        start = int(offs[0])
        end = int(offs[-1]) + int(headers["total_length"][sel][-1])
        raw = RawWindow(scn, TS, data[start:end], offs - start, headers[sel])
        window = asyncio.run(decode_window(raw, PARTITION, cache, _NoRelay()))
        rows.add_window(window)
        cols.add_events(
            raw.body, raw.offsets, raw.headers, decoder_for, PARTITION,
            timestamps_ns=[TS] * len(offs),
        )  # fmt: skip
    return rows.flush(), cols.flush()


def _equal(a: pa.RecordBatch, b: pa.RecordBatch) -> None:
    assert a.schema == b.schema
    for name in a.schema.names:
        assert a.column(name).equals(b.column(name)), (name, a.column(name), b.column(name))
    assert a.equals(b)


_SCHEMA = union_schema([TABLE])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([Op.INSERT, Op.UPDATE, Op.DELETE, Op.TRUNCATE]),
            ROWS,
            st.none() | ROWS,
        ),
        min_size=1,
        max_size=6,
    ),
    st.booleans(),
)
def test_every_type_equals_the_row_path(
    changes: list[tuple[Op, dict[str, Any], dict[str, Any] | None]], preimage: bool
) -> None:
    encoded: list[tuple[Any, ...]] = []
    for op, row, before in changes:
        if op is Op.INSERT:
            encoded.append((op, row, None, (), ()))
        elif op is Op.UPDATE:
            encoded.append((op, row, before, (), ()))
        elif op is Op.DELETE:
            encoded.append((op, None, before if before is not None else row, (), ()))
        else:
            encoded.append((op, None, None, (), ()))
    half = len(encoded) // 2
    data = _stream([(1, TABLE, encoded[:half]), (1, TABLE, encoded[half:])] if half else
                   [(1, TABLE, encoded)])  # fmt: skip
    rows, cols = _both(data, {1: TABLE}, _SCHEMA, include_preimage=preimage)
    assert rows.num_rows >= len(encoded)
    _equal(rows, cols)


def test_not_sent_deletes_by_key_truncates_and_the_fallback() -> None:
    row = {c.name: None for c in TABLE.columns} | {"id": 7, "pg_6": "old", "pg_1": 5}
    new = row | {"pg_6": None, "pg_1": 6}
    changes: list[tuple[Any, ...]] = [
        (Op.UPDATE, new, row, ("pg_6", "pg_13", "no_such"), ()),  # pg_6 from the before-image
        (Op.UPDATE, new, row, ("pg_6",), ("pg_6",)),  # not in the before-image either: null
        (Op.UPDATE, new, None, ("pg_6",), ()),  # no before-image: null
        (Op.DELETE, None, row, (), ()),
        (Op.TRUNCATE, None, None, (), ()),
        (Op.INSERT, row, None, (), ()),
    ]
    data = _stream([(1, TABLE, changes)])
    for preimage in (True, False):
        for fallback in (False, True):
            rows, cols = _both(
                data, {1: TABLE}, _SCHEMA, include_preimage=preimage, no_columnar=fallback
            )
            _equal(rows, cols)
    rows, _ = _both(data, {1: TABLE}, _SCHEMA)
    post = [r for r in rows.to_pylist() if r["_change_type"] == "update_postimage"]
    assert [r["pg_6"] for r in post] == ["old", None, None]
    assert [r["pg_1"] for r in post] == [6, 6, 6]


def test_a_lone_update_takes_its_unsent_value_from_the_before_image() -> None:
    """Without deletes or truncates the columnar path takes the post-images as they
    are; the values Postgres did not send (unchanged TOAST) were left null there
    while the row path took them from the before-image (``includePreimage=false``
    too: a MERGE sink then overwrote the stored value with null)."""
    row = {c.name: None for c in TABLE.columns} | {"id": 7, "pg_6": "old", "pg_1": 5}
    new = row | {"pg_6": None, "pg_1": 6}
    data = _stream([(1, TABLE, [(Op.UPDATE, new, row, ("pg_6",), ())])])
    for preimage in (True, False):
        for fallback in (False, True):
            rows, cols = _both(
                data, {1: TABLE}, _SCHEMA, include_preimage=preimage, no_columnar=fallback
            )
            _equal(rows, cols)
            post = [r for r in cols.to_pylist() if r["_change_type"] == "update_postimage"]
            assert [r["pg_6"] for r in post] == ["old"], (preimage, fallback)


def test_delete_without_before_image_is_its_key() -> None:
    t = TableSchema(
        "public.k",
        (Column("a", "long", nullable=False), Column("b", "string", nullable=False),
         Column("v", "string")),
        key=("a", "b"),
        version=1,
    )  # fmt: skip
    enc = RowEncoder(t, source_id=4)
    key_row = {"a": 1, "b": "x", "v": "gone"}
    head = enc.encode_many([(Op.INSERT, key_row, None, (), ())], 50, TS)
    # an event with key bytes but no image in its payload (a source without
    # before-images): encode a delete from the key, then drop the image
    delete = enc.encode(Op.DELETE, 51, 0, TS, None, key_row)
    _offsets, headers = parse_stream(delete)
    assert headers["key_length"][0] > 0
    klen = int(headers["key_length"][0])
    key = delete[HEADER_SIZE : HEADER_SIZE + klen]
    payload = b"\x00\x00\x00\x00"  # no after, no before, no not-sent lists
    h = headers[0]
    bare = encode_event(
        Op.DELETE,
        51,
        0,
        TS,
        key,
        payload,
        source_id=4,
        schema_version=1,
        schema_id=int(h["schema_id"]),
        key_hash=int(h["key_hash"]),
    )
    schema = union_schema([t])
    rows, cols = _both(head + bare, {4: t}, schema)
    _equal(rows, cols)
    assert rows.to_pylist()[-1] | {"_commit_timestamp": None} == {
        "a": 1, "b": "x", "v": None, "_change_type": "delete", "_commit_scn": 51,
        "_commit_timestamp": None, "_txn_seq": 0, "_source": "public.k", "_partition": PARTITION,
    }  # fmt: skip


def test_several_tables_versions_and_reader_resolution() -> None:
    v1 = TableSchema(
        "public.t",
        (Column("id", "long", nullable=False), Column("gone", "string"),
         Column("ts", {"type": "long", "logicalType": "timestamp-micros"})),
        key=("id",),
        version=1,
    )  # fmt: skip
    v2 = TableSchema(
        "public.t",
        (Column("id", "long", nullable=False),
         Column("ts", {"type": "long", "logicalType": "timestamp-micros"}),
         Column("added", "int")),
        key=("id",),
        version=2,
    )  # fmt: skip
    other = TableSchema(
        "public.o",
        (Column("id", "int", nullable=False), Column("d", {"type": "int", "logicalType": "date"})),
        key=("id",),
        version=1,
    )  # fmt: skip
    when = dt.datetime(2024, 2, 3, 4, 5, 6, 7, tzinfo=dt.UTC)
    data = _stream(
        [
            (1, v1, [(Op.INSERT, {"id": 1, "gone": "g", "ts": when}, None, (), ())]),
            (2, other, [(Op.INSERT, {"id": 2, "d": dt.date(1999, 1, 2)}, None, (), ())]),
            (1, v1, [(Op.UPDATE, {"id": 1, "gone": None, "ts": None},
                      {"id": 1, "gone": "g", "ts": when}, (), ())]),
        ]
    )  # fmt: skip
    # read as v2: "gone" dropped, "added" null; "id" widens int -> long across tables
    schema = union_schema([v2, other])
    rows, cols = _both(data, {1: v1, 2: other}, schema, readers={"public.t": v2})
    _equal(rows, cols)
    assert cols.column("added").null_count == cols.num_rows
    assert cols.column("ts").to_pylist()[0] == when
    assert cols.column("d").to_pylist()[1] == dt.date(1999, 1, 2)
    assert cols.column("_source").to_pylist() == ["public.t", "public.o", "public.t", "public.t"]


def test_a_window_of_many_tables_is_padded_once_and_kept_in_order(monkeypatch: Any) -> None:
    """One window holding rows of twelve tables, interleaved: the columnar pass per table
    read the whole body padded, a copy each (a transaction over a thousand tables took a
    minute). The body is padded once; the rows come in the events' order, as the row
    path gives them."""
    from changebus.client.spark import _columns, _vecread

    tables = [
        TableSchema(
            f"public.t{i}",
            (Column("id", "long", nullable=False), Column(f"v{i % 3}", "string")),
            key=("id",),
            version=1,
        )
        for i in range(12)
    ]
    changes = [
        RowEncoder(tables[n % 12], source_id=n % 12 + 1).encode(
            Op.INSERT, 100, n, TS, {"id": n, f"v{n % 12 % 3}": f"x{n}"}
        )
        for n in range(60)
    ]
    data = b"".join(changes)
    padded = 0
    real = _vecread.padded_bytes

    def counting(buf: bytes) -> Any:
        nonlocal padded
        padded += 1
        return real(buf)

    monkeypatch.setattr(_columns, "padded_bytes", counting)
    monkeypatch.setattr(_vecread, "padded_bytes", counting)
    rows, cols = _both(data, {i + 1: t for i, t in enumerate(tables)}, union_schema(tables))
    _equal(rows, cols)
    assert cols.column("id").to_pylist() == list(range(60))
    assert padded == 1


def test_a_narrower_schema_and_an_empty_flush() -> None:
    schema = pa.schema([f for f in _SCHEMA if f.name in ("pg_6", "id", "_commit_scn")])
    row = {c.name: None for c in TABLE.columns} | {"id": 3, "pg_6": "x"}
    data = _stream([(1, TABLE, [(Op.INSERT, row, None, (), ())])])
    rows, cols = _both(data, {1: TABLE}, schema)
    _equal(rows, cols)
    empty = ArrowDecoder(schema).flush()
    assert empty.num_rows == 0 and empty.schema == schema


async def test_a_columnar_consumer_against_a_row_consumer_on_a_real_relay(
    make_relay: MakeRelay,
) -> None:
    """``arrow_batches`` of a columnar consumer equals the row path of a row consumer."""
    async with make_relay(max_windows=120, tables=2) as relay:
        common: dict[str, Any] = {
            "relays": (relay.url,),
            "partition": "syn",
            "wait_s": 0.3,
            "auto_commit": False,
        }
        last = relay.hosts["syn"].buffer.meta.last_scn
        windows: list[Window] = []
        async with Consumer(ConsumerConfig(**common)) as rows:
            async for w in rows:
                windows.append(w)
                if w.scn == last:
                    break
        tables = {e.table: e.schema for w in windows for e in w.events if e.schema is not None}
        assert len(tables) == 2
        schema = union_schema(tables.values())
        builder = BatchBuilder(schema)
        for w in windows:
            builder.add_window(w)
        expected = builder.flush()
        consumer = Consumer(ConsumerConfig(**common, columnar=True))
        async with consumer:
            got: list[pa.RecordBatch] = []
            async for batch in arrow_batches(consumer, schema, max_rows=100, linger_s=0.2):
                got.append(batch)
                await consumer.commit()
                if batch.column("_commit_scn").to_pylist()[-1] == last:
                    break
            assert consumer.committed.partitions["syn"].window_scn == windows[-1].scn
        assert len(got) > 1
        _equal(expected, pa.concat_batches(got))


class _CountingDecoder:
    """Stands for ArrowDecoder: a window is one row, a batch the list of its SCNs."""

    def __init__(self, schema: Any, include_preimage: bool = True) -> None:
        self.scns: list[int] = []

    @property
    def rows(self) -> int:
        return len(self.scns)

    def add_window(self, window: Window) -> None:
        self.scns.append(window.scn)

    def flush(self) -> list[int]:
        out, self.scns = self.scns, []
        return out


async def test_a_commit_after_a_batch_never_covers_a_window_read_ahead(
    monkeypatch: Any,
) -> None:
    """``arrow_batches`` reads the next window while the application works on a batch:
    ``Consumer.commit`` after the batch persisted the position past that window,
    whose rows were only in the next batch, not handed out yet; a crash lost them
    (found by review). A commit now covers the batches handed out, no more."""
    from changebus.client import MemoryCheckpointPersister
    from changebus.client._position import PositionTracker
    from changebus.client._queue import WindowQueue
    from changebus.client.spark import _columns
    from changebus.schemas import Checkpoint

    monkeypatch.setattr(_columns, "ArrowDecoder", _CountingDecoder)
    persister = MemoryCheckpointPersister()
    consumer = Consumer(
        ConsumerConfig(relays=("http://relay:1",), partition="p", auto_commit=False),
        persister=persister,
    )
    consumer._queue = WindowQueue(100, 1 << 20)
    consumer._position = PositionTracker(Checkpoint({}), persister)
    consumer._task = asyncio.get_running_loop().create_future()  # type: ignore[assignment]

    def window(scn: int) -> Window:  # (empty windows: the counting decoder counts windows)
        return Window(scn=scn, timestamp_ns=0, partition="p")

    await consumer._queue.put(window(10))
    batches: Any = arrow_batches(consumer, pa.schema([]), linger_s=0.05)
    try:
        first = await anext(batches)  # the linger ran out: [10]
        await consumer._queue.put(window(20))  # a window comes while the batch is written
        await asyncio.sleep(0.01)
        await consumer.commit()
        saved = persister.checkpoint
        assert saved is not None
        assert first == [10] and saved.get("p").window_scn == 10
        second = await anext(batches)
        await consumer.commit()
        saved = persister.checkpoint
        assert saved is not None
        assert second == [20] and saved.get("p").window_scn == 20
    finally:
        await batches.aclose()


def test_decimals_wider_than_spark_holds_come_as_positional_text() -> None:
    """Decimals over 38 digits are strings; str() wrote a numeric(40,10) zero as "0E-10"
    and 5e-10 as "5E-10", where an unconstrained numeric's text reads "0.0000000000"
    (review)."""
    import decimal

    import pyarrow as pa

    from changebus.client.spark._arrow import arrow_converter

    conv = arrow_converter(pa.string())
    assert conv is not None
    assert conv(decimal.Decimal(0).scaleb(-10)) == "0.0000000000"
    assert conv(decimal.Decimal(5).scaleb(-10)) == "0.0000000005"
    assert conv(decimal.Decimal("1E+40")) == "1" + "0" * 40
    assert conv(decimal.Decimal("-12.50")) == "-12.50"


def test_a_record_cut_short_is_a_corrupt_event_on_the_vector_path() -> None:
    """A payload that ends inside its record (a valid CRC over bad bytes) read past the
    buffer's padding: numpy's IndexError, where the row path says CorruptEventError
    (review)."""
    cols = [("id", "long")] + [(f"c{i}", "int") for i in range(30)]
    table = TableSchema(
        name="public.t", columns=tuple(Column(n, t) for n, t in cols), key=("id",), version=1
    )
    body = encode_event(
        Op.INSERT,
        10,
        0,
        0,
        b"\x02",
        b"\x02",
        source_id=1,
        schema_id=table.fingerprint,
        schema_version=1,
    )
    offsets, headers = parse_stream(body)
    change = ChangeDecoder(table)
    decoder = ArrowDecoder(union_schema([table]))
    with pytest.raises(CorruptEventError):
        decoder.add_events(body, offsets, headers, lambda _s, _v: change, "p0")


def test_maps_whose_values_arrow_does_not_take_as_they_are() -> None:
    """Map values of time, uuid or union types: the converter had no case for maps, so
    ``pa.array`` refused them and every task of the query failed (review)."""
    import uuid as uuidlib

    cases: list[tuple[Any, Any, Any]] = [
        (
            {"type": "map", "values": {"type": "long", "logicalType": "time-micros"}},
            {"x": dt.time(1, 2, 3)},
            {"x": 3_723_000_000},  # (times are microseconds of the day)
        ),
        (
            {"type": "map", "values": {"type": "string", "logicalType": "uuid"}},
            {"x": str(uuidlib.UUID(int=7))},
            {"x": str(uuidlib.UUID(int=7))},
        ),
        ({"type": "map", "values": ["null", "int", "string"]}, {"x": 5, "y": None}, None),
    ]
    for avro, value, want in cases:
        cols = [("id", "long"), ("m", avro)]
        table = TableSchema(
            name="public.t", columns=tuple(Column(n, t) for n, t in cols), key=("id",), version=1
        )
        enc = RowEncoder(table, source_id=1)
        body = enc.encode(Op.INSERT, 10, 0, 0, {"id": 1, "m": value})
        offsets, headers = parse_stream(body)
        change = ChangeDecoder(table)
        decoder = ArrowDecoder(union_schema([table]))

        def decoder_of(_s: int, _v: int, c: ChangeDecoder = change) -> ChangeDecoder:
            return c

        decoder.add_events(body, offsets, headers, decoder_of, "p0")
        batch = decoder.flush()
        got = dict(batch.column("m").to_pylist()[0])
        if want is not None:
            assert got == want
        else:  # (a union of several types: text)
            assert got["y"] is None and got["x"] is not None


def test_wide_windows_are_decoded_and_batched_by_their_bytes_too() -> None:
    """Relay windows waited for 16,384 events before they were decoded, and a Spark batch
    for 65,536 rows, whatever their size: rows of 64 KB made 4 GB batches, past Arrow's
    2 GiB string columns, and the task failed on every retry (review). Bytes count too."""
    from changebus.client import RawEvents
    from changebus.client.spark._options import SourceOptions

    table = TableSchema(
        "public.wide",
        (Column("id", "long", nullable=False), Column("doc", "string")),
        key=("id",),
        version=1,
    )
    enc = RowEncoder(table, source_id=1)
    change = ChangeDecoder(table)
    decoder = ArrowDecoder(union_schema([table]), drain_bytes=1 << 20)
    drained: list[int] = []
    real = decoder._drain

    def drain() -> None:
        drained.append(decoder._pending_events)
        real()

    decoder._drain = drain  # type: ignore[method-assign]
    doc = "x" * (100 << 10)
    for i in range(25):  # 25 windows of one ~100 KB row: a drain each ~1 MiB
        body = enc.encode(Op.INSERT, 10 + i, 0, TS, {"id": i, "doc": doc})
        offsets, headers = parse_stream(body)
        raw = RawEvents(body, offsets, headers, {(1, 1): change})
        decoder.add_window(
            Window(scn=10 + i, timestamp_ns=TS, partition="p", raw_events=raw, nbytes=len(body))
        )
    assert drained and max(drained) <= 11, drained
    batch = decoder.flush()
    assert batch.num_rows == 25 and batch.column("id").to_pylist() == list(range(25))
    # the read loop's own bound: the option, parsed and checked
    opts = SourceOptions.parse({"relays": "http://127.0.0.1:1", "arrowBatchBytes": "2097152"})
    assert opts.arrow_batch_bytes == 2 << 20
    with pytest.raises(ConfigError, match=r"(?i)arrowbatchbytes"):
        SourceOptions.parse({"relays": "http://127.0.0.1:1", "arrowBatchBytes": "1000"})
