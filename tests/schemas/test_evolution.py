"""Schema evolution: old and new readers read each other's events."""

from __future__ import annotations

from typing import Any

import pytest

from changebus.schemas import (
    ChangeDecoder,
    Column,
    IncompatibleSchemaError,
    Op,
    RowEncoder,
    SchemaRegistry,
    TableSchema,
    check_compatible,
    event_at,
    pg_avro_type,
    verify_event,
)


def table(*cols: Column) -> TableSchema:
    return TableSchema("public.t", (Column("id", "long", nullable=False), *cols), key=("id",))


def write_and_read(
    writer: TableSchema, reader: TableSchema, row: dict[str, Any]
) -> dict[str, Any] | None:
    data = RowEncoder(writer, source_id=1).encode(Op.INSERT, 1, 0, 0, row)
    h = verify_event(data)
    return ChangeDecoder(writer, reader).decode(event_at(data, 0, h)[1]).after


@pytest.fixture
def versions() -> dict[str, TableSchema]:
    reg = SchemaRegistry()
    base = reg.register(table(Column("n", pg_avro_type("integer")), Column("s", "string")))
    added = reg.register(
        table(
            Column("n", pg_avro_type("integer")), Column("s", "string"), Column("extra", "string")
        )
    )
    dropped = reg.register(table(Column("n", pg_avro_type("integer"))))
    widened = reg.register(table(Column("n", pg_avro_type("bigint")), Column("s", "string")))
    return {"base": base, "added": added, "dropped": dropped, "widened": widened}


def test_add_column(versions: dict[str, TableSchema]) -> None:
    base, added = versions["base"], versions["added"]
    assert write_and_read(base, added, {"id": 1, "n": 2, "s": "x"}) == {
        "id": 1,
        "n": 2,
        "s": "x",
        "extra": None,
    }
    assert write_and_read(added, base, {"id": 1, "n": 2, "s": "x", "extra": "e"}) == {
        "id": 1,
        "n": 2,
        "s": "x",
    }
    check_compatible(base, added)
    check_compatible(added, base)


def test_drop_column(versions: dict[str, TableSchema]) -> None:
    base, dropped = versions["base"], versions["dropped"]
    assert write_and_read(base, dropped, {"id": 1, "n": 2, "s": "x"}) == {"id": 1, "n": 2}
    assert write_and_read(dropped, base, {"id": 1, "n": 2}) == {"id": 1, "n": 2, "s": None}


def test_widen_int_to_bigint(versions: dict[str, TableSchema]) -> None:
    base, widened = versions["base"], versions["widened"]
    assert write_and_read(base, widened, {"id": 1, "n": 2**31 - 1, "s": None}) == {
        "id": 1,
        "n": 2**31 - 1,
        "s": None,
    }
    check_compatible(base, widened)
    with pytest.raises(IncompatibleSchemaError, match="long cannot be read as int"):
        check_compatible(widened, base)  # narrowing


def test_other_incompatibilities() -> None:
    a = table(Column("p", pg_avro_type("numeric(10,2)")))
    b = table(Column("p", pg_avro_type("numeric(12,2)")))
    with pytest.raises(IncompatibleSchemaError, match="decimal"):
        check_compatible(a, b)
    c = table(Column("p", "boolean"))
    with pytest.raises(IncompatibleSchemaError, match="cannot be read"):
        check_compatible(a, c)
    other = TableSchema("public.other", (Column("id", "long"),), ("id",))
    with pytest.raises(IncompatibleSchemaError, match="another table"):
        check_compatible(a, other)
    check_compatible(table(Column("s", "string")), table(Column("s", "bytes")))
