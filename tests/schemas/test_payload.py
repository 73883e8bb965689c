"""Data-event payloads: RowEncoder and ChangeDecoder, including resolution."""

from __future__ import annotations

import datetime
import decimal
import io
from typing import Any

import fastavro
import pytest
from hypothesis import given, strategies as st

from changebus.schemas import (
    HEADER_SIZE,
    ChangeDecoder,
    Column,
    CorruptEventError,
    Op,
    RowEncoder,
    SchemaError,
    SchemaRegistry,
    TableSchema,
    decode_header,
    event_at,
    key_hash,
    parse_stream,
    pg_avro_type,
    verify_event,
)

TABLE = TableSchema(
    "public.items",
    (
        Column("id", "long", nullable=False),
        Column("region", "string", nullable=False),
        Column("price", pg_avro_type("numeric(10,2)")),
        Column("note", "string"),
    ),
    key=("region", "id"),
    version=1,
)

rows = st.fixed_dictionaries(
    {
        "id": st.integers(-(2**63), 2**63 - 1),
        "region": st.text(max_size=10),
        "price": st.none()
        | st.decimals(min_value=-(10**7), max_value=10**7, places=2, allow_nan=False),
        "note": st.none() | st.text(max_size=50),
    }
)


@given(rows, st.none() | rows, st.lists(st.sampled_from(["note", "price"]), unique=True))
def test_round_trip(
    after: dict[str, Any], before: dict[str, Any] | None, not_sent: list[str]
) -> None:
    enc = RowEncoder(TABLE, source_id=3, partition=2)
    data = enc.encode(Op.UPDATE, 99, 4, 123, after, before, after_not_sent=not_sent)
    h = verify_event(data)
    assert (h.source_id, h.partition, h.schema_version, h.schema_id) == (3, 2, 1, TABLE.fingerprint)
    key, payload = event_at(data, 0, h)
    assert h.key_hash == key_hash(bytes(key))
    dec = ChangeDecoder(TABLE)
    change = dec.decode(payload)
    assert change.after == after
    assert change.before == before
    assert change.after_not_sent == tuple(not_sent)
    assert change.before_not_sent == ()
    assert dec.decode_key(key) == {"region": after["region"], "id": after["id"]}


def test_bytes_are_plain_avro_of_the_change_record() -> None:
    enc = RowEncoder(TABLE, source_id=1)
    after = {"id": 1, "region": "eu", "price": decimal.Decimal("9.99"), "note": None}
    before = {"id": 1, "region": "eu", "price": None, "note": None}
    data = enc.encode(Op.UPDATE, 5, 0, 0, after, before, before_not_sent=["price", "note"])
    h = verify_event(data)
    key, payload = event_at(data, 0, h)
    generic = fastavro.schemaless_reader(
        io.BytesIO(bytes(payload)), fastavro.parse_schema(TABLE.change_schema), None
    )
    assert generic == {
        "after": after,
        "before": before,
        "after_not_sent": [],
        "before_not_sent": ["price", "note"],
    }
    kbuf = io.BytesIO()
    fastavro.schemaless_writer(
        kbuf, fastavro.parse_schema(TABLE.key_schema), {"region": "eu", "id": 1}
    )
    assert bytes(key) == kbuf.getvalue()  # the fast key path equals generic Avro


def test_delete_keys_come_from_before_and_truncate_has_none() -> None:
    enc = RowEncoder(TABLE, source_id=1)
    row = {"id": 5, "region": "us", "price": None, "note": None}
    d = enc.encode(Op.DELETE, 1, 0, 0, None, row)
    hd = verify_event(d)
    assert hd.key_length > 0
    t = enc.encode(Op.TRUNCATE, 1, 1, 0, None, None)
    ht = verify_event(t)
    assert ht.key_length == 0
    change = ChangeDecoder(TABLE).decode(event_at(t, 0, ht)[1])
    assert change.after is None and change.before is None


def test_renamed_columns_round_trip() -> None:
    t = TableSchema(
        "s.odd", (Column("my id", "long", nullable=False), Column("x-y", "string")), ("my id",), 1
    )
    enc = RowEncoder(t, source_id=1)
    data = enc.encode(Op.INSERT, 1, 0, 0, {"my id": 7, "x-y": "v"})
    h = verify_event(data)
    key, payload = event_at(data, 0, h)
    dec = ChangeDecoder(t)
    assert dec.decode(payload).after == {"my id": 7, "x-y": "v"}
    assert dec.decode_key(key) == {"my id": 7}


def test_a_key_is_one_key_record_exactly() -> None:
    """Bytes after the key record were ignored (b'\\x02JUNK' decoded as id 1)."""
    table = TableSchema("public.k", (Column("id", "long", nullable=False),), ("id",), 1)
    dec = ChangeDecoder(table)
    assert dec.decode_key(b"\x02") == {"id": 1}
    for key in (b"\x02JUNK", b"\x02\x00"):
        with pytest.raises(CorruptEventError, match=r"'public.k' key: trailing bytes \(\d\)"):
            dec.decode_key(key)
    # the second try, for a date past Python's years
    day = TableSchema("public.d", (Column("d", {"type": "int", "logicalType": "date"}),), ("d",), 1)
    assert ChangeDecoder(day).decode_key(b"\x80\xa4\xe8\x03") == {"d": 4_000_000}
    with pytest.raises(CorruptEventError, match="trailing bytes"):
        ChangeDecoder(day).decode_key(b"\x80\xa4\xe8\x03\x00")


def test_errors() -> None:
    with pytest.raises(SchemaError, match="registered"):
        RowEncoder(TABLE.with_version(0), source_id=1)
    enc = RowEncoder(TABLE, source_id=1)
    with pytest.raises(SchemaError, match="key"):
        enc.encode(Op.INSERT, 1, 0, 0, {"id": 1})
    with pytest.raises(SchemaError):
        enc.encode(Op.INSERT, 1, 0, 0, {"id": 1, "region": "x", "price": "not a decimal"})
    with pytest.raises(CorruptEventError):
        ChangeDecoder(TABLE).decode(b"\x04garbage")
    with pytest.raises(CorruptEventError):
        ChangeDecoder(TABLE).decode(b"\x02\xff")


@given(
    st.lists(st.tuples(rows, st.none() | rows, st.booleans()), min_size=1, max_size=20),
    st.integers(0, 1000),
)
def test_batch_forms_equal_single_forms(
    changes: list[tuple[Any, Any, bool]], first_seq: int
) -> None:
    enc = RowEncoder(TABLE, source_id=3)
    dec = ChangeDecoder(TABLE)
    items: list[tuple[Any, ...]] = [
        (Op.UPDATE if before else Op.INSERT, after, before, ["note"] if flag else [], [])
        for after, before, flag in changes
    ]
    batch = enc.encode_many(items, 77, 5, first_seq=first_seq)
    singles = b"".join(
        enc.encode(op, 77, first_seq + i, 5, a, b, after_not_sent=ans)
        for i, (op, a, b, ans, _) in enumerate(items)
    )
    assert batch == singles
    offsets, headers = parse_stream(batch)
    starts = (offsets + HEADER_SIZE + headers["key_length"]).tolist()
    stops = (offsets + headers["total_length"]).tolist()
    many = dec.decode_many(batch, starts, stops)
    assert many == [dec.decode(batch[a:b]) for a, b in zip(starts, stops, strict=True)]
    assert [m.after for m in many] == [a for a, _, _ in changes]


def test_dates_outside_pythons_range_decode_to_their_avro_ints() -> None:
    """A BC date or a year-10000 timestamp: the Avro int, not an error; the rest as usual."""
    date = {"type": "int", "logicalType": "date"}
    ts = {"type": "long", "logicalType": "timestamp-micros"}
    lts = {"type": "long", "logicalType": "local-timestamp-micros"}
    writer = SchemaRegistry().register(
        TableSchema(
            "s.d",
            (
                Column("k", date, nullable=False),
                Column("d", date),
                Column("ts", ts),
                Column("lts", lts),
                Column("arr", {"type": "array", "items": ["null", ts]}),
            ),
            ("k",),
        )
    )
    bc, y10k = -800_000, 253_402_300_800_000_001  # 0221 BC; 10000-01-01T00:00:00.000001
    after = {"k": bc, "d": bc, "ts": y10k, "lts": -y10k, "arr": [0, None, y10k]}
    before: dict[str, Any] = {"k": 0, "d": 1, "ts": None, "lts": 0, "arr": []}
    event = RowEncoder(writer, source_id=1).encode(Op.UPDATE, 9, 0, 0, after, before)
    h = decode_header(event)
    key = event[HEADER_SIZE : HEADER_SIZE + h.key_length]
    payload = event[HEADER_SIZE + h.key_length :]
    epoch = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
    want_before: dict[str, Any] = {
        "k": datetime.date(1970, 1, 1),
        "d": datetime.date(1970, 1, 2),
        "ts": None,
        "lts": datetime.datetime(1970, 1, 1),
        "arr": [],
    }
    decoder = ChangeDecoder(writer)
    change = decoder.decode(payload)
    assert change.after == {"k": bc, "d": bc, "ts": y10k, "lts": -y10k, "arr": [epoch, None, y10k]}
    assert change.before == want_before
    assert decoder.decode_key(key) == {"k": bc}
    # with a reader schema (one more column): resolution still applies
    reader = TableSchema("s.d", (*writer.columns, Column("extra", "long")), ("k",), version=2)
    resolved = ChangeDecoder(writer, reader).decode_many(payload, [0], [len(payload)])[0]
    assert resolved.after == {**change.after, "extra": None}
    assert resolved.before == {**want_before, "extra": None}


def test_time_of_24_00_decodes_to_its_avro_int() -> None:
    """Postgres' ``time '24:00'`` is 86400000000 µs since midnight: that int, not an error
    (``datetime.time`` stops at 23:59:59.999999); other times as ``datetime.time``."""
    tm = {"type": "long", "logicalType": "time-micros"}
    writer = SchemaRegistry().register(
        TableSchema(
            "s.t",
            (
                Column("k", tm, nullable=False),
                Column("t", tm),
                Column("arr", {"type": "array", "items": ["null", tm]}),
            ),
            ("k",),
        )
    )
    day = 86_400_000_000
    after = {"k": day, "t": day - 1, "arr": [day, None, 0]}
    before: dict[str, Any] = {"k": 0, "t": None, "arr": [45_296_000_007]}
    event = RowEncoder(writer, source_id=1).encode(Op.UPDATE, 9, 0, 0, after, before)
    h = decode_header(event)
    key = event[HEADER_SIZE : HEADER_SIZE + h.key_length]
    payload = event[HEADER_SIZE + h.key_length :]
    decoder = ChangeDecoder(writer)
    change = decoder.decode(payload)
    assert change.after == {
        "k": day,
        "t": datetime.time(23, 59, 59, 999_999),
        "arr": [day, None, datetime.time(0, 0)],
    }
    assert change.before == {
        "k": datetime.time(0, 0),
        "t": None,
        "arr": [datetime.time(12, 34, 56, 7)],
    }
    assert decoder.decode_key(key) == {"k": day}


def test_the_out_of_range_fallback_converts_with_the_writers_logical_types() -> None:
    """A row with one date outside Python's range is read the plain way; its other values
    were then converted with the *reader's* logical types (fastavro uses the writer's):
    a date column read as a timestamp became microseconds since 1970 in those rows only,
    a date in the others (review)."""
    date = {"type": "int", "logicalType": "date"}
    lts = {"type": "long", "logicalType": "local-timestamp-micros"}
    v1 = TableSchema(
        "s.f",
        (Column("k", "long", nullable=False), Column("d", date), Column("e", date)),
        ("k",),
        1,
    )
    v2 = TableSchema(
        "s.f", (Column("k", "long", nullable=False), Column("d", lts), Column("e", date)), ("k",), 2
    )
    from changebus.schemas import check_compatible

    check_compatible(v1, v2)
    enc = RowEncoder(v1, source_id=1)
    decoder = ChangeDecoder(v1, v2)
    rows = []
    for e in (18262, 3_000_000):  # in range; past year 9999 (the plain way)
        event = enc.encode(Op.INSERT, 9, 0, 0, {"k": 1, "d": 18262, "e": e}, None)
        h = decode_header(event)
        change = decoder.decode(event[HEADER_SIZE + h.key_length :])
        assert change.after is not None
        rows.append(change.after)
    assert [r["d"] for r in rows] == [datetime.date(2020, 1, 1)] * 2  # as fastavro gives it
    assert rows[1]["e"] == 3_000_000  # (out of range: the Avro int)
