"""Every mapped Postgres and MySQL type survives an Avro round trip."""

from __future__ import annotations

import datetime
import decimal
import io
import math
import uuid
from typing import Any

import fastavro
import pytest
from hypothesis import given, settings, strategies as st

from changebus.schemas import (
    INTERVAL_SCHEMA,
    Column,
    TableSchema,
    mysql_avro_type,
    mysql_bit,
    mysql_set,
    mysql_time_micros,
    mysql_unsigned_bigint,
    mysql_uuid,
    pg_avro_type,
    pg_interval,
    pg_numeric_text,
)

UTC = datetime.UTC
ts_naive = st.datetimes(
    min_value=datetime.datetime(1900, 1, 1), max_value=datetime.datetime(2200, 1, 1)
)
ts_aware = ts_naive.map(lambda d: d.replace(tzinfo=UTC))
dec12_2 = st.decimals(min_value=-(10**10) + 1, max_value=10**10 - 1, places=2, allow_nan=False)
text = st.text(max_size=40)

# (type text, extra, value strategy, expected after round trip (None = equal))
PG_CASES: list[tuple[str, Any, st.SearchStrategy[Any]]] = [
    ("smallint", None, st.integers(-(2**15), 2**15 - 1)),
    ("integer", None, st.integers(-(2**31), 2**31 - 1)),
    ("bigint", None, st.integers(-(2**63), 2**63 - 1)),
    ("real", None, st.floats(width=32, allow_nan=False)),
    ("double precision", None, st.floats(allow_nan=False)),
    ("numeric(12,2)", None, dec12_2),
    ("numeric", None, st.decimals(allow_nan=True).map(pg_numeric_text)),
    ("boolean", None, st.booleans()),
    ("text", None, text),
    ("character varying(64)", None, text),
    ("character(3)", None, st.text(min_size=3, max_size=3)),
    ("bytea", None, st.binary(max_size=40)),
    ("date", None, st.dates()),
    ("time without time zone", None, st.times()),
    ("time with time zone", None, st.just("12:34:56+02")),
    ("timestamp without time zone", None, ts_naive),
    ("timestamp(3) with time zone", None, ts_aware),
    (
        "interval",
        None,
        st.builds(
            pg_interval,
            st.integers(-1000, 1000),
            st.integers(-1000, 1000),
            st.integers(-(2**40), 2**40),
        ),
    ),
    ("uuid", None, st.uuids()),
    ("json", None, st.just('{"a": [1, 2]}')),
    ("jsonb", None, st.just('{"a": [1, 2]}')),
    ("mood", ["sad", "ok", "happy"], st.sampled_from(["sad", "ok", "happy"])),
    ("integer[]", None, st.lists(st.none() | st.integers(-(2**31), 2**31 - 1), max_size=5)),
    ("text[]", None, st.lists(st.none() | text, max_size=5)),
    ("inet", None, st.just("192.168.0.1/24")),
    ("money", None, st.just("$1.00")),
]

MYSQL_CASES: list[tuple[str, st.SearchStrategy[Any]]] = [
    ("tinyint(4)", st.integers(-128, 127)),
    ("tinyint(3) unsigned", st.integers(0, 255)),
    ("tinyint(1)", st.integers(-128, 127)),
    ("smallint(6)", st.integers(-(2**15), 2**15 - 1)),
    ("mediumint(8) unsigned", st.integers(0, 2**24 - 1)),
    ("int(11)", st.integers(-(2**31), 2**31 - 1)),
    ("int(10) unsigned", st.integers(0, 2**32 - 1)),
    ("bigint(20)", st.integers(-(2**63), 2**63 - 1)),
    ("bigint(20) unsigned", st.integers(0, 2**64 - 1).map(mysql_unsigned_bigint)),
    ("decimal(12,2)", dec12_2),
    ("float", st.floats(width=32, allow_nan=False)),
    ("double", st.floats(allow_nan=False)),
    ("bit(5)", st.text(alphabet="01", min_size=5, max_size=5).map(mysql_bit)),
    ("enum('a','b''c')", st.sampled_from(["a", "b'c"])),
    ("set('x','y','z')", st.sets(st.sampled_from("xyz")).map(mysql_set)),
    ("json", st.just('{"k": 1}')),
    ("uuid", st.uuids().map(lambda u: mysql_uuid(u.bytes))),
    ("date", st.dates()),
    (
        "time(3)",
        st.timedeltas(
            min_value=datetime.timedelta(hours=-838), max_value=datetime.timedelta(hours=838)
        ).map(mysql_time_micros),
    ),
    ("datetime(6)", ts_naive),
    ("timestamp(6)", ts_aware),
    ("year(4)", st.integers(1901, 2155)),
    ("varchar(64)", text),
    ("longtext", text),
    ("varbinary(10)", st.binary(max_size=10)),
    ("blob", st.binary(max_size=40)),
    ("geometry", st.binary(max_size=40)),
]


def round_trip(avro_type: Any, value: Any) -> Any:
    table = TableSchema(
        "t.types", (Column("id", "long", nullable=False), Column("v", avro_type)), key=("id",)
    )
    schema = fastavro.parse_schema(table.row_schema)
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, schema, {"id": 1, "v": value})
    buf.seek(0)
    record = fastavro.schemaless_reader(buf, schema, None)
    assert isinstance(record, dict)
    return record["v"]


def same(expected: Any, got: Any) -> bool:
    if isinstance(expected, float):
        return got == expected or (math.isinf(expected) and got == expected)
    if isinstance(expected, uuid.UUID) or isinstance(got, uuid.UUID):
        return str(expected) == str(got)
    if isinstance(expected, decimal.Decimal):
        return decimal.Decimal(got) == expected
    return bool(got == expected)


@pytest.mark.parametrize(("pg_type", "labels", "values"), PG_CASES, ids=[c[0] for c in PG_CASES])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_postgres_types(
    pg_type: str, labels: Any, values: st.SearchStrategy[Any], data: st.DataObject
) -> None:
    value = data.draw(values)
    avro_type = pg_avro_type(pg_type, enum_labels=labels)
    assert same(value, round_trip(avro_type, value)), (pg_type, value)
    assert same(None, round_trip(avro_type, None))  # NULL is always allowed


@pytest.mark.parametrize(("mysql_type", "values"), MYSQL_CASES, ids=[c[0] for c in MYSQL_CASES])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_mysql_types(mysql_type: str, values: st.SearchStrategy[Any], data: st.DataObject) -> None:
    value = data.draw(values)
    assert same(value, round_trip(mysql_avro_type(mysql_type), value)), (mysql_type, value)


def d(avro_type: Any) -> dict[str, Any]:
    assert isinstance(avro_type, dict)
    return avro_type


def test_mapping_details() -> None:
    assert pg_avro_type("numeric(12,2)") == {
        "type": "bytes",
        "logicalType": "decimal",
        "precision": 12,
        "scale": 2,
    }
    assert d(pg_avro_type("numeric"))["changebus.type"] == "numeric"
    assert pg_avro_type("interval") == INTERVAL_SCHEMA
    assert d(pg_avro_type("timestamp(3) with time zone"))["logicalType"] == "timestamp-micros"
    assert pg_avro_type("integer[]") == {"type": "array", "items": ["null", "int"]}
    assert pg_avro_type("tsvector") == {"type": "string", "changebus.type": "tsvector"}
    assert mysql_avro_type("int(10) unsigned") == "long"
    assert mysql_avro_type("tinyint(1)", tinyint1_as_boolean=True) == "boolean"
    assert d(mysql_avro_type("bigint(20) unsigned"))["precision"] == 20
    assert d(mysql_avro_type("enum('a','b''c')"))["changebus.symbols"] == ["a", "b'c"]
    assert mysql_avro_type("mystery") == {"type": "string", "changebus.type": "mystery"}
    assert pg_numeric_text(decimal.Decimal("NaN")) == "NaN"
    assert pg_numeric_text(decimal.Decimal("-Infinity")) == "-Infinity"
    assert mysql_bit(b"\x01\x02") == 258
    assert mysql_time_micros(datetime.timedelta(hours=-1)) == -3_600_000_000
