"""The generated change-record reader against fastavro, value for value.

:class:`ChangeDecoder` decodes with a reader generated per schema
(``_avroread``) when rows come back as written. These tests hold it to
fastavro's ``schemaless_reader`` on the same bytes: every Avro type the
Postgres and MySQL type mappers produce, nested and generic Avro types,
images with not-sent columns, and malformed input (which must raise
:class:`CorruptEventError` and nothing else).
"""

from __future__ import annotations

import datetime as dt
import decimal
import io
import time
import uuid
from typing import Any

import fastavro
import pytest
from hypothesis import given, settings, strategies as st

from changebus.schemas import (
    HEADER_SIZE,
    ChangeDecoder,
    Column,
    CorruptEventError,
    Op,
    RowEncoder,
    TableSchema,
    _avroread,
    mysql_avro_type,
    parse_stream,
    pg_avro_type,
)
from changebus.schemas._avrocols import compile_column_reader
from changebus.schemas._avroread import compile_change_reader

PG_TYPES = [
    "smallint",
    "integer",
    "bigint",
    "real",
    "double precision",
    "boolean",
    "text",
    "bytea",
    "date",
    "time",
    "timestamp",
    "timestamptz",
    "uuid",
    "jsonb",
    "numeric(12,2)",
    "numeric(38,10)",
    "numeric",
    "interval",
    "integer[]",
    "text[]",
    "interval[]",
    "inet",
]
MYSQL_TYPES = ["bigint unsigned", "bit(12)", "enum('a','b')", "set('x','y')", "datetime(6)"]


def _column_types() -> list[tuple[str, Any]]:
    out = [(f"pg_{i}", pg_avro_type(t)) for i, t in enumerate(PG_TYPES)]
    out += [(f"my_{i}", mysql_avro_type(t)) for i, t in enumerate(MYSQL_TYPES)]
    return out


TABLE = TableSchema(
    "public.every_type",
    (Column("id", "long", nullable=False), *(Column(n, avro) for n, avro in _column_types())),
    key=("id",),
    version=1,
)

_long = st.integers(-(2**63), 2**63 - 1)
_int = st.integers(-(2**31), 2**31 - 1)


def _value(avro: Any) -> st.SearchStrategy[Any]:
    """Values fastavro can write for ``avro`` (a column's non-null type)."""
    if isinstance(avro, str):
        return {
            "int": _int,
            "long": _long,
            "float": st.floats(width=32, allow_nan=False),
            "double": st.floats(allow_nan=False),
            "boolean": st.booleans(),
            "string": st.text(max_size=300),
            "bytes": st.binary(max_size=300),
        }[avro]
    kind, logical = avro.get("type"), avro.get("logicalType")
    if logical == "date":
        return st.dates()
    if logical == "time-micros":
        return st.times()
    if logical == "timestamp-micros":
        return st.datetimes(timezones=st.just(dt.UTC))
    if logical == "local-timestamp-micros":
        return st.datetimes()
    if logical == "uuid":
        return st.uuids()
    if logical == "decimal":
        p, s = avro["precision"], avro.get("scale", 0)
        top = 10**p - 1  # p digits, built exactly (a Decimal context would round)
        return st.integers(-top, top).map(lambda n: decimal.Decimal(f"{n}E-{s}"))
    if kind == "record":
        return st.fixed_dictionaries({f["name"]: _value(f["type"]) for f in avro["fields"]})
    if kind == "array":
        items = avro["items"]
        if isinstance(items, list):  # ["null", T]
            return st.lists(st.none() | _value(items[1]), max_size=5)
        return st.lists(_value(items), max_size=5)
    return _value(kind)


ROWS = st.fixed_dictionaries(
    {"id": _long, **{c.name: st.none() | _value(c.type) for c in TABLE.columns[1:]}}
)


def _events(table: TableSchema, changes: list[tuple[Any, ...]]) -> bytes:
    return RowEncoder(table, source_id=1).encode_many(changes, 10, 1)


def _payload_spans(data: bytes) -> tuple[list[int], list[int]]:
    offsets, headers = parse_stream(data)
    starts = (offsets + HEADER_SIZE + headers["key_length"]).tolist()
    stops = (offsets + headers["total_length"]).tolist()
    return starts, stops


def _parsed(schema: dict[str, Any]) -> dict[str, Any]:
    parsed = fastavro.parse_schema(schema)
    assert isinstance(parsed, dict)
    return parsed


def _fastavro_decoder(table: TableSchema) -> ChangeDecoder:
    dec = ChangeDecoder(table)
    dec._fast = None  # the generic path: fastavro's schemaless_reader
    return dec


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same types all the way down (Decimal('1.10') is not '1.1')."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return bool(a.keys() == b.keys()) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, decimal.Decimal):
        return bool(a.as_tuple() == b.as_tuple())
    if isinstance(a, float) and a != a:
        return bool(b != b)
    return bool(a == b)


def test_the_fast_reader_is_used_for_every_mapped_type() -> None:
    assert ChangeDecoder(TABLE)._fast is not None


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(ROWS, st.none() | ROWS), min_size=1, max_size=4))
def test_values_equal_fastavro(pairs: list[tuple[dict[str, Any], dict[str, Any] | None]]) -> None:
    changes = [(Op.UPDATE if before else Op.INSERT, a, before, (), ()) for a, before in pairs]
    data = _events(TABLE, changes)
    starts, stops = _payload_spans(data)
    fast = ChangeDecoder(TABLE).decode_many(data, starts, stops)
    slow = _fastavro_decoder(TABLE).decode_many(data, starts, stops)
    assert _same(fast, slow)
    assert [c.after["id"] for c in fast] == [a["id"] for a, _ in pairs]  # type: ignore[index]


def test_not_sent_columns_deletes_and_truncates() -> None:
    row = {c.name: None for c in TABLE.columns} | {"id": 7, "pg_6": "x" * 200}
    changes = [
        (Op.UPDATE, row, row, ("pg_6", "pg_13"), ("pg_6",)),
        (Op.DELETE, None, row, (), ()),
        (Op.TRUNCATE, None, None, (), ()),
        (Op.INSERT, row, None, (), ()),
    ]
    data = _events(TABLE, changes)
    starts, stops = _payload_spans(data)
    fast = ChangeDecoder(TABLE).decode_many(data, starts, stops)
    assert _same(fast, _fastavro_decoder(TABLE).decode_many(data, starts, stops))
    assert fast[0].after_not_sent == ("pg_6", "pg_13") and fast[0].before_not_sent == ("pg_6",)
    assert fast[1].after is None and fast[1].before == row
    assert fast[2] == (None, None, (), ())


def test_edge_values() -> None:
    row: dict[str, Any] = {c.name: None for c in TABLE.columns}
    row |= {
        "id": -(2**63),
        "pg_0": -(2**31),
        "pg_2": 2**63 - 1,
        "pg_4": float("inf"),
        "pg_6": "é\u2603\U0001f600" * 50,
        "pg_7": bytes(range(256)) * 40,
        "pg_8": dt.date(1, 1, 1),
        "pg_9": dt.time(23, 59, 59, 999999),
        "pg_10": dt.datetime(9999, 12, 31, 23, 59, 59, 999999),
        "pg_11": dt.datetime(1, 1, 1, tzinfo=dt.UTC),
        "pg_12": uuid.UUID(int=2**128 - 1),
        "pg_14": decimal.Decimal("-9999999999.99"),
        "pg_15": decimal.Decimal("0.0000000000"),
        "pg_17": {"months": -(2**31), "days": 2**31 - 1, "micros": -(2**63)},
        "pg_18": [None] * 300 + [1],
        "pg_19": [],
        "my_0": decimal.Decimal(2**64 - 1),
    }
    data = _events(TABLE, [(Op.INSERT, row, None, (), ())])
    starts, stops = _payload_spans(data)
    fast = ChangeDecoder(TABLE).decode_many(data, starts, stops)
    assert _same(fast, _fastavro_decoder(TABLE).decode_many(data, starts, stops))
    assert fast[0].after == row


def test_renamed_fields_come_back_as_column_names() -> None:
    table = TableSchema(
        "db.odd",
        (Column("id", "long", nullable=False), Column("a-b", "string"), Column("1st", "int")),
        key=("id",),
        version=1,
    )
    assert table.column_for_field  # the columns need Avro-safe field names
    row = {"id": 1, "a-b": "x", "1st": 5}
    data = _events(table, [(Op.INSERT, row, None, (), ())])
    starts, stops = _payload_spans(data)
    dec = ChangeDecoder(table)
    assert dec._fast is not None
    assert dec.decode_many(data, starts, stops)[0].after == row


def test_generic_avro_types() -> None:
    """Maps, enums, fixed and unions of several branches (not produced by the mappers)."""
    schema = {
        "type": "record",
        "name": "g",
        "fields": [
            {"name": "m", "type": {"type": "map", "values": ["null", "long", "string"]}},
            {"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A", "B", "C"]}},
            {"name": "f", "type": {"type": "fixed", "name": "F", "size": 3}},
            {"name": "e2", "type": ["null", "E"]},
            {"name": "d", "type": {"type": "fixed", "name": "D", "size": 8,
                                   "logicalType": "decimal", "precision": 18, "scale": 3}},
        ],
    }  # fmt: skip
    parsed = fastavro.parse_schema(schema)
    reader = compile_change_reader(_parsed(schema), {}, tuple)
    assert reader is not None
    values = [
        {"m": {"a": 1, "b": None, "c": "x"}, "e": "C", "f": b"abc", "e2": "B",
         "d": decimal.Decimal("-12.345")},
        {"m": {}, "e": "A", "f": b"\x00\x01\x02", "e2": None, "d": decimal.Decimal("0.000")},
    ]  # fmt: skip
    bio = io.BytesIO()
    starts, stops = [], []
    for v in values:
        starts.append(bio.tell())
        bio.write(b"\x02")
        fastavro.schemaless_writer(bio, parsed, v)
        bio.write(b"\x00\x00\x00")
        stops.append(bio.tell())
    got = reader(bio.getvalue(), starts, stops)
    assert _same([g[0] for g in got], values)
    # arrays and maps written in blocks with byte sizes (what other writers may do)
    # (count -1 = 0x01, then the block's byte size 4 = 0x08, then the entry)
    m = b"\x01\x08" + b"\x02a" + b"\x02\x02" + b"\x00"
    blocked = b"\x02" + m + b"\x00" + b"ABC" + b"\x00" + bytes(7) + b"\x01" + b"\x00\x00\x00"
    got = reader(blocked, [0], [len(blocked)])
    assert _same(got[0][0], {"m": {"a": 1}, "e": "A", "f": b"ABC", "e2": None,
                             "d": decimal.Decimal("0.001")})  # fmt: skip


def test_recursive_types_fall_back_to_fastavro() -> None:
    schema = {
        "type": "record",
        "name": "node",
        "fields": [{"name": "next", "type": ["null", "node"]}],
    }
    assert compile_change_reader(_parsed(schema), {}, tuple) is None


def _nullable_arrays(levels: int) -> Any:
    t: Any = "long"
    for _ in range(levels):
        t = {"type": "array", "items": ["null", t]}
    return t


@pytest.mark.parametrize("levels", [8, 9, 10, 15])
def test_deeply_nested_types_fall_back_to_fastavro(levels: int) -> None:
    """Ten arrays of nullables deep, compile() raised SyntaxError ("too many statically
    nested blocks") out of ChangeDecoder; nested deeper than the generated code can
    be, a schema is read by fastavro."""
    table = TableSchema(
        "public.nested",
        (Column("id", "long", nullable=False), Column("a", _nullable_arrays(levels))),
        key=("id",),
        version=1,
    )
    value: Any = [1, None]
    for _ in range(levels - 1):
        value = [value, None, []]
    row = {"id": 1, "a": value}
    data = _events(table, [(Op.INSERT, row, None, (), ())])
    starts, stops = _payload_spans(data)
    dec = ChangeDecoder(table)
    assert (dec._fast is not None) == (levels <= 8)
    assert dec.decode_many(data, starts, stops)[0].after == row
    after: list[list[Any]] = [[], []]
    dec.decode_columns(data, starts, stops, after, [[], []])
    assert after == [[1], [value]]
    assert (dec._columnar is not None) == (levels <= 8)


def test_records_nested_past_pythons_indentation_fall_back_to_fastavro() -> None:
    t: Any = "long"
    for i in range(120):  # (deeper than a table schema may nest: the generator's own guard)
        t = {"type": "record", "name": f"R{i}", "fields": [{"name": "f", "type": ["null", t]}]}
    schema = {"type": "record", "name": "r", "fields": [{"name": "a", "type": t}]}
    assert compile_change_reader(_parsed(schema), {}, tuple) is None
    assert compile_column_reader(_parsed(schema)) is None


def test_what_python_refuses_to_compile_is_left_to_fastavro(monkeypatch: Any) -> None:
    """Past the generator's own limits: compile()'s SyntaxError, decimal.Context's
    ValueError and OverflowError make no reader (they were raised out of ChangeDecoder)."""
    monkeypatch.setattr(_avroread, "_MAX_NESTED_BLOCKS", 100)
    deep = {"type": "record", "name": "r", "fields": [{"name": "a", "type": _nullable_arrays(12)}]}
    assert compile_change_reader(_parsed(deep), {}, tuple) is None
    assert compile_column_reader(_parsed(deep)) is None
    for precision in (0, 10**20):  # (refused in table schemas)
        dec = {"type": "bytes", "logicalType": "decimal", "precision": precision, "scale": 0}
        schema = {"type": "record", "name": "r", "fields": [{"name": "d", "type": dec}]}
        parsed = _parsed({**schema, "fields": [{"name": "d", "type": "bytes"}]})
        parsed["fields"][0]["type"] = dec  # (fastavro refuses precision 0 itself)
        assert compile_change_reader(parsed, {}, tuple) is None
        assert compile_column_reader(parsed) is None


def test_array_items_of_zero_bytes_fall_back_to_fastavro() -> None:
    for items in ("null", {"type": "record", "name": "E", "fields": []}):
        schema = {
            "type": "record",
            "name": "r",
            "fields": [{"name": "a", "type": {"type": "array", "items": items}}],
        }
        assert compile_change_reader(_parsed(schema), {}, tuple) is None


def _varint(n: int) -> bytes:
    z = (n << 1) ^ (n >> 63)
    out = bytearray()
    while z >= 0x80:
        out.append(z & 0x7F | 0x80)
        z >>= 7
    return bytes(out + bytes([z]))


def test_a_block_counting_more_items_than_bytes_left_is_corrupt() -> None:
    """Refused at the count, before any item is read (the bytes past the record are
    valid longs: the reader went on there, and made a list of their number)."""
    table = TableSchema(
        "public.arrays",
        (Column("id", "long", nullable=False), Column("a", {"type": "array", "items": "long"})),
        key=("id",),
    )
    dec = ChangeDecoder(table)

    def payload(count: int) -> bytes:  # after: id 1, a: the count, then 1, 2, 3 and the end
        return b"\x02\x02\x02\x02" + _varint(count) + b"\x02\x04\x06\x00" + b"\x00\x00\x00"

    assert dec.decode(payload(3)).after == {"id": 1, "a": [1, 2, 3]}
    for count in (100, 2**40, -100):  # (a negative count: a block with its byte size)
        data = payload(count)
        if count < 0:
            data = data.replace(b"\x02\x04\x06", b"\x06\x02\x04\x06")
        body = data + b"\x02" * 1000  # more longs, past the record's end
        for decode in (dec.decode_many, _columns(dec)):
            with pytest.raises(CorruptEventError, match=f"a block of {abs(count)} items in the"):
                decode(body, [0], [len(data)])


def _columns(dec: ChangeDecoder) -> Any:
    def decode(buf: bytes, starts: list[int], stops: list[int]) -> Any:
        names = dec.columns
        return dec.decode_columns(buf, starts, stops, [[] for _ in names], [[] for _ in names])

    return decode


_DEC = {"logicalType": "decimal", "precision": 10, "scale": 2}
DECIMALS = TableSchema(
    "public.decimals",
    (
        Column("id", "long", nullable=False),
        Column("d", {"type": "bytes", **_DEC}),
        Column("f", {"type": "fixed", "name": "F", "size": 16, **_DEC}),
        Column("day", {"type": "int", "logicalType": "date"}),
    ),
    key=("id",),
    version=1,
)


def _decimals(d: bytes, f: bytes = bytes(16), day: int = 0) -> bytes:
    """A change record of DECIMALS with these unscaled bytes (and day)."""
    return (
        b"\x02\x02\x02"
        + (b"\x02" + _varint(len(d)) + d)
        + (b"\x02" + f)
        + (b"\x02" + _varint(day))
        + b"\x00\x00\x00"
    )


def _decoders() -> list[Any]:
    """Every path a record can take: generated rows, generated columns, fastavro."""
    dec = ChangeDecoder(DECIMALS)
    return [dec.decode_many, _columns(dec), _fastavro_decoder(DECIMALS).decode_many]


@pytest.mark.parametrize(
    ("d", "f", "day"),
    [
        (b"\x7f" + b"\x11" * 200_000, bytes(16), 0),  # 8 s in Decimal() before
        (b"\x80" + b"\x11" * 200_000, bytes(16), 0),
        (b"\x00\x80" + bytes(4), bytes(16), 0),  # 2**39: 6 bytes, where 10 digits take 5
        (b"\xff\x7f" + b"\xff" * 4, bytes(16), 0),  # -(2**39) - 1
        (b"\x01", b"\x00" * 10 + b"\x01" + bytes(5), 0),  # the fixed: 2**40
        (b"\x01", b"\x7f" + b"\xff" * 15, 0),
        (b"\x7f" + b"\x11" * 200_000, bytes(16), 10**7),  # a date past 9999 first: plain path
    ],
    ids=["200KB", "200KB-negative", "6-bytes", "6-bytes-negative", "fixed", "fixed-max", "plain"],
)
def test_decimals_longer_than_their_precision_are_corrupt(d: bytes, f: bytes, day: int) -> None:
    data = _decimals(d, f, day)
    for decode in _decoders():
        started = time.process_time()
        with pytest.raises(CorruptEventError, match=r"a decimal of \d+ bytes, more than its"):
            decode(data, [0], [len(data)])
        assert time.process_time() - started < 0.5


@pytest.mark.parametrize(
    ("d", "f"),
    [
        (b"\x00\x7f" + b"\xff" * 4, bytes(16)),  # 2**39 - 1: 5 bytes, padded with a sign byte
        (b"\xff" * 30 + b"\x85", b"\xff" * 15 + b"\x85"),  # -123: padded
        (b"\x7f" + b"\xff" * 4, b"\xff" * 11 + b"\x80" + bytes(4)),  # 5 bytes, past 10 digits
        (b"", bytes(16)),  # (0)
    ],
    ids=["padded", "padded-negative", "rounded", "empty"],
)
def test_decimals_within_their_bytes_read_as_fastavro_reads_them(d: bytes, f: bytes) -> None:
    data = _decimals(d, f)
    bio = io.BytesIO(data[1:])
    expected = fastavro.schemaless_reader(bio, _parsed(DECIMALS.row_schema), None)
    assert isinstance(expected, dict)
    for decode in _decoders():
        got = decode(data, [0], [len(data)])
        if isinstance(got, tuple):  # the columns
            assert got[0] == [1]
            continue
        assert _same(got[0].after, expected)
    after: list[list[Any]] = [[] for _ in DECIMALS.columns]
    ChangeDecoder(DECIMALS).decode_columns(data, [0], [len(data)], after, [[]] * 4)
    assert _same([c[0] for c in after[:3]], [1, expected["d"], expected["f"]])


def test_decimal_keys_longer_than_their_precision_are_corrupt() -> None:
    table = TableSchema("public.k", (Column("d", {"type": "bytes", **_DEC}),), ("d",), 1)
    dec = ChangeDecoder(table)
    assert dec.decode_key(b"\x04\x04\xd2") == {"d": decimal.Decimal("12.34")}
    big = b"\x7f" + b"\x11" * 200_000
    started = time.process_time()
    with pytest.raises(CorruptEventError, match="a decimal of 200001 bytes, more than its"):
        dec.decode_key(_varint(len(big)) + big)
    assert time.process_time() - started < 0.5


@settings(max_examples=300, deadline=None)
@given(ROWS, st.data())
def test_malformed_payloads_raise_corrupt_event_error(row: dict[str, Any], data: Any) -> None:
    good = _events(TABLE, [(Op.INSERT, row, None, (), ())])
    starts, stops = _payload_spans(good)
    body = bytearray(good)
    cut = data.draw(st.integers(starts[0], stops[0] - 1))
    how = data.draw(st.sampled_from(["truncate", "flip", "garbage"]))
    if how == "truncate":
        stop = cut
        del body[cut:]
    else:
        stop = stops[0]
        if how == "flip":
            body[cut] ^= data.draw(st.integers(1, 255))
        else:
            body[cut:stop] = data.draw(st.binary(min_size=stop - cut, max_size=stop - cut))
    dec = ChangeDecoder(TABLE)
    try:
        got = dec.decode_many(bytes(body), starts, [stop])
    except CorruptEventError:
        return
    # garbage that happens to be valid Avro must read as fastavro reads it
    assert _same(got, _fastavro_decoder(TABLE).decode_many(bytes(body), starts, [stop]))


@pytest.mark.parametrize(
    "payload",
    [
        b"\x04",  # union branch 2 of {null, Row}
        b"\x02",  # a row that is not there
        b"\x00\x00\x00\x00\x00",  # bytes after the record
        b"\x00\x00\x01",  # a negative array count without its block size
        b"\x02" + b"\xff" * 9 + b"\x02",  # an id of 65 bits (fastavro would drop the top bit)
    ],
)
def test_structure_errors(payload: bytes) -> None:
    with pytest.raises(CorruptEventError):
        ChangeDecoder(TABLE).decode_many(payload, [0], [len(payload)])


def _versions() -> tuple[TableSchema, TableSchema, TableSchema]:
    v1 = TableSchema(
        "public.evolving",
        (
            Column("id", "long", nullable=False),
            Column("gone", "string"),
            Column("span", pg_avro_type("interval")),
            Column("n", "int"),
        ),
        key=("id",),
        version=1,
    )
    v2 = TableSchema(  # "gone" dropped, "new" added
        "public.evolving",
        (
            Column("id", "long", nullable=False),
            Column("span", pg_avro_type("interval")),
            Column("n", "int"),
            Column("new", pg_avro_type("timestamptz")),
        ),
        key=("id",),
        version=2,
    )
    v3 = TableSchema(  # n: int -> long (a promotion: left to fastavro)
        "public.evolving",
        (
            Column("id", "long", nullable=False),
            Column("span", pg_avro_type("interval")),
            Column("n", "long"),
        ),
        key=("id",),
        version=3,
    )
    return v1, v2, v3


def test_added_and_dropped_columns_are_resolved_by_the_generated_reader() -> None:
    v1, v2, v3 = _versions()
    rows = [
        {"id": 1, "gone": "x", "span": {"months": 1, "days": 2, "micros": 3}, "n": 4},
        {"id": 2, "gone": None, "span": None, "n": None},
    ]
    data = _events(
        v1, [(Op.UPDATE, rows[0], rows[1], ("n",), ()), (Op.DELETE, None, rows[1], (), ())]
    )
    starts, stops = _payload_spans(data)
    fast = ChangeDecoder(v1, v2)
    assert fast._fast is not None
    slow = ChangeDecoder(v1, v2)
    slow._fast = None
    got = fast.decode_many(data, starts, stops)
    assert _same(got, slow.decode_many(data, starts, stops))
    assert got[0].after == {
        "id": 1,
        "span": {"months": 1, "days": 2, "micros": 3},
        "n": 4,
        "new": None,
    }
    assert list(got[0].after) == ["id", "span", "n", "new"]
    promoted = ChangeDecoder(v1, v3)
    assert promoted._fast is None  # int -> long: fastavro resolves it
    assert promoted.decode_many(data, starts, stops)[1].before == {"id": 2, "span": None, "n": None}


def test_the_column_reader_refuses_a_uuid_the_row_reader_refuses() -> None:
    """Any 36 lowercase characters passed the column reader as a uuid, where decode()
    refused them: the two paths disagreed on one payload (review)."""
    table = TableSchema(
        "public.u",
        (
            Column("id", "long", nullable=False),
            Column("u", {"type": "string", "logicalType": "uuid"}),
        ),
        ("id",),
        1,
    )
    good = uuid.UUID("b97ed2f1-743f-4b1e-9f6d-1234567890ab")
    data = RowEncoder(table, source_id=1).encode(Op.INSERT, 5, 0, 0, {"id": 1, "u": good})
    offsets, headers = parse_stream(data)
    start = int(offsets[0]) + HEADER_SIZE + int(headers["key_length"][0])
    record = data[start:]
    dec = ChangeDecoder(table)
    after: list[list[Any]] = [[], []]
    dec.decode_columns(record, [0], [len(record)], after, [[], []])
    assert after[1] == [str(good)]
    bad = record.replace(str(good).encode(), b"b97ed2f\x02-743f-4b1e-9f6d-1234567890ab")
    assert bad != record
    with pytest.raises(CorruptEventError):
        dec.decode(bad)
    with pytest.raises(CorruptEventError):
        ChangeDecoder(table).decode_columns(bad, [0], [len(bad)], [[], []], [[], []])
