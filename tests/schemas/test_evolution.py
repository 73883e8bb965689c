"""Schema evolution: old and new readers read each other's change records.

Change records are written with one version's ``change_schema`` and read
with another's through fastavro's reader-schema resolution (and, once, through
the payload codec); :func:`check_compatible` must agree with what fastavro
can actually resolve.
"""

from __future__ import annotations

import decimal
import io
from typing import Any

import fastavro
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
from changebus.schemas._table import field_name


def table(*cols: Column) -> TableSchema:
    return TableSchema("public.t", (Column("id", "long", nullable=False), *cols), key=("id",))


def write_change(writer: TableSchema, change: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(writer.change_schema), change)
    return buf.getvalue()


def read_change(writer: TableSchema, reader: TableSchema, data: bytes) -> dict[str, Any]:
    record = fastavro.schemaless_reader(
        io.BytesIO(data),
        fastavro.parse_schema(writer.change_schema),
        fastavro.parse_schema(reader.change_schema),
    )
    assert isinstance(record, dict)
    return record


def change(
    after: dict[str, Any] | None, before: dict[str, Any] | None, **kw: Any
) -> dict[str, Any]:
    return {
        "after": after,
        "before": before,
        "after_not_sent": kw.get("after_not_sent", []),
        "before_not_sent": kw.get("before_not_sent", []),
    }


@pytest.fixture
def versions() -> dict[str, TableSchema]:
    reg = SchemaRegistry()
    n, s = Column("n", pg_avro_type("integer")), Column("s", pg_avro_type("text"))
    base = reg.register(table(n, s))
    added = reg.register(table(n, s, Column("extra", pg_avro_type("jsonb"))))
    dropped = reg.register(table(n))
    widened = reg.register(table(Column("n", pg_avro_type("bigint")), s))
    return {"base": base, "added": added, "dropped": dropped, "widened": widened}


def test_add_column(versions: dict[str, TableSchema]) -> None:
    base, added = versions["base"], versions["added"]
    assert added.version == base.version + 1
    old = change({"id": 1, "n": 2, "s": "x"}, {"id": 1, "n": 1, "s": None}, after_not_sent=["s"])
    assert read_change(base, added, write_change(base, old)) == change(
        {"id": 1, "n": 2, "s": "x", "extra": None},
        {"id": 1, "n": 1, "s": None, "extra": None},
        after_not_sent=["s"],
    )
    new = change({"id": 1, "n": 2, "s": "x", "extra": "{}"}, None)
    assert read_change(added, base, write_change(added, new)) == change(
        {"id": 1, "n": 2, "s": "x"}, None
    )
    check_compatible(base, added)
    check_compatible(added, base)


def test_drop_column(versions: dict[str, TableSchema]) -> None:
    base, dropped = versions["base"], versions["dropped"]
    old = change({"id": 1, "n": 2, "s": "x"}, None)
    assert read_change(base, dropped, write_change(base, old))["after"] == {"id": 1, "n": 2}
    new = change(None, {"id": 1, "n": 2}, before_not_sent=["n"])
    assert read_change(dropped, base, write_change(dropped, new)) == change(
        None, {"id": 1, "n": 2, "s": None}, before_not_sent=["n"]
    )
    check_compatible(base, dropped)
    check_compatible(dropped, base)


def test_widen_int4_to_int8(versions: dict[str, TableSchema]) -> None:
    base, widened = versions["base"], versions["widened"]
    old = change({"id": 1, "n": 2**31 - 1, "s": None}, {"id": 1, "n": -(2**31), "s": "y"})
    got = read_change(base, widened, write_change(base, old))
    assert got == old
    check_compatible(base, widened)
    with pytest.raises(IncompatibleSchemaError, match=r"column 'n'.*long cannot be read as int"):
        check_compatible(widened, base)  # narrowing
    big = change({"id": 1, "n": 2**40, "s": None}, None)
    with pytest.raises(fastavro.read.SchemaResolutionError):
        read_change(widened, base, write_change(widened, big))


def test_evolution_through_the_payload_codec(versions: dict[str, TableSchema]) -> None:
    base, added = versions["base"], versions["added"]
    data = RowEncoder(base, source_id=1).encode(Op.INSERT, 1, 0, 0, {"id": 1, "n": 2, "s": "x"})
    h = verify_event(data)
    decoded = ChangeDecoder(base, added).decode(event_at(data, 0, h)[1])
    assert decoded.after == {"id": 1, "n": 2, "s": "x", "extra": None}


def test_widen_array_items() -> None:
    old = table(Column("a", pg_avro_type("integer[]")))
    new = table(Column("a", pg_avro_type("bigint[]")))
    check_compatible(old, new)
    with pytest.raises(IncompatibleSchemaError, match="array items"):
        check_compatible(new, old)
    rec = change({"id": 1, "a": [1, None, 2**31 - 1]}, None)
    assert read_change(old, new, write_change(old, rec)) == rec


def test_named_types_and_enum_labels_evolve() -> None:
    v1 = table(
        Column("i", pg_avro_type("interval")),
        Column("m", pg_avro_type("mood", enum_labels=["a"])),
    )
    v2 = table(
        Column("i", pg_avro_type("interval")),
        Column("m", pg_avro_type("mood", enum_labels=["a", "b"])),
        Column("j", pg_avro_type("interval[]")),
    )
    check_compatible(v1, v2)
    check_compatible(v2, v1)
    span = {"months": 1, "days": 2, "micros": 3}
    rec = change({"id": 1, "i": span, "m": "a"}, None)
    assert read_change(v1, v2, write_change(v1, rec))["after"] == {
        "id": 1,
        "i": span,
        "m": "a",
        "j": None,
    }


def test_a_moved_field_name_is_rejected() -> None:
    """Only a pathological name clash moves a field; the check must notice."""
    clash = field_name("a b")  # a real column may be named exactly that
    v1 = table(Column("a b", "string"))
    v2 = table(Column(clash, "string"), Column("a b", "string"))
    assert v2.field_names[2] != clash
    with pytest.raises(IncompatibleSchemaError, match="column 'a b'"):
        check_compatible(v1, v2)


def test_other_incompatibilities() -> None:
    a = table(Column("p", pg_avro_type("numeric(10,2)")))
    b = table(Column("p", pg_avro_type("numeric(12,2)")))
    with pytest.raises(IncompatibleSchemaError, match=r"column 'p'.*decimal\(10,2\)"):
        check_compatible(a, b)
    with pytest.raises(IncompatibleSchemaError, match="decimal"):
        check_compatible(table(Column("p", "bytes")), a)
    with pytest.raises(IncompatibleSchemaError, match="cannot be read as boolean"):
        check_compatible(a, table(Column("p", "boolean")))
    other = TableSchema("public.other", (Column("id", "long"),), ("id",))
    with pytest.raises(IncompatibleSchemaError, match="another table"):
        check_compatible(a, other)
    check_compatible(table(Column("s", "string")), table(Column("s", "bytes")))
    check_compatible(table(Column("u", "int")), table(Column("u", ["string", "long"])))
    with pytest.raises(IncompatibleSchemaError, match="string cannot be read as long"):
        check_compatible(table(Column("u", ["int", "string"])), table(Column("u", "long")))


# ---- check_compatible agrees with fastavro --------------------------------

SAMPLES: dict[str, tuple[Any, Any]] = {
    "int": ("int", 5),
    "long": ("long", 5),
    "float": ("float", 1.5),
    "double": ("double", 1.5),
    "string": ("string", "ab"),
    "bytes": ("bytes", b"ab"),
    "boolean": ("boolean", True),
    "date": (pg_avro_type("date"), 5),
    "uuid": (pg_avro_type("uuid"), "9b2f2f7e-0c67-4a38-9f86-1f5b7c1c0a11"),
    "int[]": (pg_avro_type("integer[]"), [1, None]),
    "bigint[]": (pg_avro_type("bigint[]"), [1, None]),
    "text[]": (pg_avro_type("text[]"), ["a"]),
    "interval": (pg_avro_type("interval"), {"months": 1, "days": 2, "micros": 3}),
    "other_record": (
        {"type": "record", "name": "x.Other", "fields": [{"name": "months", "type": "int"}]},
        {"months": 1},
    ),
    "int_or_string": (["int", "string"], (5, "ab")),  # a value per branch
    "map_int": ({"type": "map", "values": "int"}, {"k": 1}),
    "map_long": ({"type": "map", "values": "long"}, {"k": 1}),
    "fixed4": ({"type": "fixed", "name": "x.F", "size": 4}, b"abcd"),
    "fixed8": ({"type": "fixed", "name": "x.F", "size": 8}, b"abcdefgh"),
}


def fastavro_resolves(writer: Any, reader: Any, *values: Any) -> bool:
    """Can fastavro read each of ``values``, written as ``writer``, as ``reader``?"""
    w, r = table(Column("v", writer)), table(Column("v", reader))
    for value in values:
        data = write_change(w, change({"id": 1, "v": value}, None))
        try:
            read_change(w, r, data)
        except fastavro.read.SchemaResolutionError:
            return False
    return True


@pytest.mark.parametrize("writer", list(SAMPLES))
def test_check_compatible_agrees_with_fastavro(writer: str) -> None:
    wtype, value = SAMPLES[writer]
    values = value if writer == "int_or_string" else (value,)
    for reader, (rtype, _) in SAMPLES.items():
        ours = True
        try:
            check_compatible(table(Column("v", wtype)), table(Column("v", rtype)))
        except IncompatibleSchemaError:
            ours = False
        assert ours == fastavro_resolves(wtype, rtype, *values), (writer, reader)


def test_decimal_is_stricter_than_fastavro() -> None:
    """fastavro reads with the writer's scale; Avro (and we) demand equal decimals."""
    a, b = pg_avro_type("numeric(10,2)"), pg_avro_type("numeric(12,2)")
    assert fastavro_resolves(a, b, decimal.Decimal("1.25"))
    with pytest.raises(IncompatibleSchemaError):
        check_compatible(table(Column("v", a)), table(Column("v", b)))
    check_compatible(table(Column("v", a)), table(Column("v", pg_avro_type("numeric(10,2)"))))
