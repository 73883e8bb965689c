"""Table schemas (names, fingerprints, validation) and the schema registry."""

from __future__ import annotations

import decimal
import io
import itertools
import json
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import fastavro
import pytest
from hypothesis import given, strategies as st

from changebus.schemas import (
    HEADER_SIZE,
    ChangeDecoder,
    Column,
    Op,
    RowEncoder,
    SchemaError,
    SchemaRegistry,
    TableSchema,
    UnknownSchemaError,
    crc32,
    parse_stream,
    pg_avro_type,
)
from changebus.schemas._crc import avro_fingerprint
from changebus.schemas._table import MAX_DECIMAL_PRECISION, MAX_TYPE_DEPTH, field_name


def users(*extra: Column, key: tuple[str, ...] = ("id",)) -> TableSchema:
    return TableSchema(
        "public.users",
        (
            Column("id", "long", nullable=False, source_type="bigint"),
            Column("name", "string"),
            *extra,
        ),
        key=key,
    )


def row_bytes(table: TableSchema, row: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(table.row_schema), row)
    return buf.getvalue()


def read_row(writer: TableSchema, reader: TableSchema, data: bytes) -> dict[str, Any]:
    w = fastavro.parse_schema(writer.row_schema)
    r = fastavro.parse_schema(reader.row_schema)
    record = fastavro.schemaless_reader(io.BytesIO(data), w, r)
    assert isinstance(record, dict)
    return record


# ---- TableSchema --------------------------------------------------------


def test_a_pickled_table_schema_leaves_its_derived_schemas_out() -> None:
    """A Spark task unpickles every table of its query: the Avro schemas a table
    caches (most of its bytes) are made again when used, not pickled."""
    t = users(Column("email", "string", nullable=True))
    assert t.change_schema and t.fingerprint  # (cached on the instance now)
    data = pickle.dumps(t)
    back = pickle.loads(data)
    assert back == t and hash(back) == hash(t) and back.fingerprint == t.fingerprint
    assert back.change_schema == t.change_schema and back.key_schema == t.key_schema
    assert b"change_schema" not in data and b"changebus.row" not in data
    bare = pickle.dumps((t.name, t.columns, t.key, t.version, t.nullable_key))
    assert len(data) < len(bare) + 200


def test_a_table_schema_keeps_its_derived_schemas_only_while_used() -> None:
    """A relay of a source with thousands of tables held every schema version's
    derived Avro schemas (most of an instance's memory) for ever: the constructor
    drops them after validating them, and release_derived drops them after use."""
    t = users(Column("email", "string", nullable=True))
    assert not {"row_schema", "key_schema", "change_schema"} & set(t.__dict__)
    assert t.fingerprint and "fingerprint" in t.__dict__  # (an int, kept)
    assert "row_schema" not in t.__dict__  # (made for the fingerprint only)
    change, key = t.change_schema, t.key_schema
    assert {"row_schema", "key_schema", "change_schema"} <= set(t.__dict__)
    t.release_derived()
    assert not {"row_schema", "key_schema", "change_schema"} & set(t.__dict__)
    assert t.change_schema == change and t.key_schema == key  # made again, equal
    assert t.change_schema is not change


def test_fingerprint_is_stable_and_sensitive() -> None:
    a, b = users(), users()
    assert a.fingerprint == b.fingerprint
    assert a.with_version(3).fingerprint == a.fingerprint  # version is not content
    assert TableSchema.from_json(json.loads(json.dumps(a.to_json()))).fingerprint == a.fingerprint
    assert users(Column("age", "int")).fingerprint != a.fingerprint
    assert users(key=("id", "name")).fingerprint != a.fingerprint
    assert users(key=()).fingerprint != a.fingerprint
    n1 = users(Column("price", pg_avro_type("numeric(10,2)")))
    n2 = users(Column("price", pg_avro_type("numeric(12,4)")))
    assert n1.fingerprint != n2.fingerprint  # logical type attributes count
    e1 = users(Column("mood", pg_avro_type("mood", enum_labels=["a"])))
    e2 = users(Column("mood", pg_avro_type("mood", enum_labels=["a", "b"])))
    assert e1.fingerprint != e2.fingerprint  # custom attributes count
    assert (
        users(Column("age", "int", nullable=False)).fingerprint
        != users(Column("age", "int")).fingerprint
    )
    assert (
        users(Column("age", "int", source_type="int4")).fingerprint
        != users(Column("age", "int")).fingerprint
    )
    renamed = TableSchema("public.people", a.columns, a.key)
    assert renamed.fingerprint != a.fingerprint  # the name counts
    assert 0 <= a.fingerprint < 2**64


def test_fingerprint_is_the_documented_formula() -> None:
    """Fingerprints are part of the wire contract: same content, same number."""
    t = users()
    text = json.dumps(
        {"name": t.name, "row": t.row_schema, "key": list(t.key)},
        sort_keys=True,
        separators=(",", ":"),
    )
    assert t.fingerprint == int(fastavro.schema.fingerprint(text, "CRC-64-AVRO"), 16)
    # and it does not depend on the process (hash seeds, dict order)
    code = (
        "from changebus.schemas import Column, TableSchema\n"
        "t = TableSchema('public.users', (Column('id', 'long', nullable=False,"
        " source_type='bigint'), Column('name', 'string')), key=('id',))\n"
        "print(t.fingerprint)\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert int(out.stdout) == t.fingerprint


@given(st.text(max_size=300))
def test_the_fingerprint_function_is_fastavros(text: str) -> None:
    """changebus computes CRC-64-AVRO itself (fastavro rebuilds its table at every
    call, 0.35-0.75 ms a 10-column schema): the same numbers for any text."""
    assert avro_fingerprint(text) == int(fastavro.schema.fingerprint(text, "CRC-64-AVRO"), 16)


def test_row_key_and_change_schemas() -> None:
    t = users(Column("age", "int"))
    row = t.row_schema
    assert row["type"] == "record"
    assert (row["namespace"], row["name"]) == ("changebus.row", "public__users")
    assert [f["type"] for f in row["fields"]] == [
        ["null", "long"],
        ["null", "string"],
        ["null", "int"],
    ]
    assert all(f["default"] is None for f in row["fields"])
    assert row["fields"][0]["changebus.nullable"] is False
    assert row["fields"][0]["changebus.source_type"] == "bigint"
    assert "changebus.nullable" not in row["fields"][1]
    assert t.key_schema["fields"] == [{"name": "id", "type": "long"}]
    change = {f["name"]: f for f in t.change_schema["fields"]}
    assert change["after"]["type"] == ["null", row]
    assert change["before"]["type"] == ["null", "changebus.row.public__users"]
    assert change["after_not_sent"] == {
        "name": "after_not_sent",
        "type": {"type": "array", "items": "string"},
        "default": [],
    }
    assert change["before_not_sent"]["default"] == []
    # a record name that does not depend on the version
    assert t.with_version(7).row_schema["name"] == users().row_schema["name"]


def test_a_nullable_key_is_a_union_of_the_row_fields_bytes() -> None:
    """``nullable_key``: a table keyed by all its columns, any of them NULL."""
    cols = (Column("a", "int"), Column("t", "string"))
    plain = TableSchema("public.nokey", cols, ("a", "t"))
    t = TableSchema("public.nokey", cols, ("a", "t"), nullable_key=True)
    assert [f["type"] for f in plain.key_schema["fields"]] == ["int", "string"]
    assert [f["type"] for f in t.key_schema["fields"]] == [["null", "int"], ["null", "string"]]
    assert t.fingerprint != plain.fingerprint  # a flag the schema's identity includes
    assert "nullable_key" not in plain.to_json()  # older schemas keep their JSON and fingerprint
    again = TableSchema.from_json(json.loads(json.dumps(t.to_json())))
    assert again == t and again.fingerprint == t.fingerprint
    enc = RowEncoder(t.with_version(1), source_id=1)
    assert enc.key_bytes({"a": None, "t": "x"}) == b"\x00\x02\x02x"
    assert enc.key_bytes({"a": 1, "t": None}) == b"\x02\x02\x00"
    dec = ChangeDecoder(t.with_version(1))
    assert dec.decode_key(b"\x00\x02\x02x") == {"a": None, "t": "x"}
    with pytest.raises(SchemaError):
        TableSchema.from_json({**t.to_json(), "nullable_key": "yes"})


def test_odd_column_names_are_sanitised() -> None:
    t = TableSchema(
        "public.weird table",
        (
            Column("id", "long"),
            Column("Order Date", "string"),
            Column("Order_Date", "string"),
            Column("1st", "int"),
            Column('qu"ote', "int"),
            Column("naïve ☃", "int"),
        ),
        key=("id",),
    )
    fields = t.field_names
    assert fields[0] == "id" and fields[2] == "Order_Date"
    assert len(set(fields)) == len(fields)
    assert all(f.replace("_", "a").isascii() and f.replace("_", "a").isalnum() for f in fields)
    assert not any(f[0].isdigit() for f in fields)
    assert t.column_for_field == {
        fields[1]: "Order Date",
        fields[3]: "1st",
        fields[4]: 'qu"ote',
        fields[5]: "naïve ☃",
    }
    assert t.row_schema["fields"][1]["changebus.column"] == "Order Date"
    assert "changebus.column" not in t.row_schema["fields"][2]
    assert t.record_name == "public__weird_table"
    assert TableSchema.from_json(json.loads(json.dumps(t.to_json()))) == t
    assert users().column_for_field == {}  # the usual case: nothing to rename
    fastavro.parse_schema(t.change_schema)


def test_sanitised_field_names_do_not_move_between_versions() -> None:
    """Adding ``Order_Date`` must not give it the field of ``Order Date``'s data."""
    v1 = TableSchema("s.t", (Column("id", "long"), Column("Order Date", "string")), ("id",))
    v2 = TableSchema(
        "s.t",
        (Column("id", "long"), Column("Order_Date", "string"), Column("Order Date", "string")),
        ("id",),
    )
    assert v1.field_names[1] == v2.field_names[2] == field_name("Order Date")
    data = row_bytes(v1, {"id": 1, field_name("Order Date"): "2024-01-01"})
    got = read_row(v1, v2, data)
    assert got == {"id": 1, "Order_Date": None, field_name("Order Date"): "2024-01-01"}


def test_named_types_are_defined_once() -> None:
    t = TableSchema(
        "public.spans",
        (
            Column("a", pg_avro_type("interval"), nullable=False),
            Column("b", pg_avro_type("interval")),
            Column("c", pg_avro_type("interval[]")),
            Column("d", pg_avro_type("interval")),
        ),
        key=("a", "d"),
    )
    row = t.row_schema
    assert row["fields"][0]["type"][1]["type"] == "record"
    assert row["fields"][1]["type"] == ["null", "changebus.Interval"]
    assert row["fields"][2]["type"][1]["items"] == ["null", "changebus.Interval"]
    value = {"months": 1, "days": -2, "micros": 3}
    record = {"a": value, "b": None, "c": [value, None], "d": value}
    assert read_row(t, t, row_bytes(t, record)) == record
    for schema in (t.change_schema, t.key_schema):
        fastavro.parse_schema(schema)
    assert t.key_schema["fields"][1]["type"] == "changebus.Interval"


def test_union_column_types_are_merged_into_the_nullable_union() -> None:
    t = TableSchema("s.t", (Column("id", "long"), Column("u", ["int", "string"])), ("id",))
    assert t.row_schema["fields"][1]["type"] == ["null", "int", "string"]
    assert read_row(t, t, row_bytes(t, {"id": 1, "u": "x"}))["u"] == "x"


def test_column_types_are_private_copies() -> None:
    avro_type: dict[str, Any] = {"type": "long", "logicalType": "timestamp-micros"}
    col = Column("ts", avro_type)
    avro_type["logicalType"] = "changed later"
    assert col.type == {"type": "long", "logicalType": "timestamp-micros"}
    assert hash(users()) == hash(users())  # usable as a dict key


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: TableSchema("t", ()), "no columns"),
        (lambda: TableSchema("", (Column("a", "int"),)), "name of 1..512"),
        (lambda: TableSchema("t" * 513, (Column("a", "int"),)), "name of 1..512"),
        (
            lambda: TableSchema("t", (Column("a", "int"), Column("a", "int"))),
            r"duplicate column names \['a'\]",
        ),
        (lambda: TableSchema("t", (Column("a", "int"),), ("b",)), "not columns"),
        (lambda: TableSchema("t", (Column("a", "int"),), ("a", "a")), "duplicate key"),
        (lambda: TableSchema("t", (Column("a", "int"),), "a"), "sequence of column names"),  # type: ignore[arg-type]
        (lambda: TableSchema("t", (Column("a", "int"),), version=65536), "version"),
        (lambda: TableSchema("t", (Column("a", "int"),), version=-1), "version"),
        (lambda: TableSchema("t", tuple(Column(f"c{i}", "int") for i in range(65536))), "65535"),
        (lambda: TableSchema("t", (Column("a", "no_such_type"),)), "invalid Avro"),
        (lambda: TableSchema("t", (Column("a", {"type": "array"}),)), "invalid Avro"),
        (lambda: Column("", "int"), "non-empty"),
        (lambda: Column("a", "null"), "must not include null"),
        (lambda: Column("a", ["null", "int"]), "must not include null"),
        (lambda: Column("a", ["int", ["long"]]), "nested union"),
        (lambda: Column("a", {"type": "bytes", "x": object()}), "not JSON"),
    ],
)
def test_invalid_tables(make: Any, needle: str) -> None:
    with pytest.raises(SchemaError, match=needle):
        make()


_EMPTY = {"type": "record", "name": "Empty", "fields": []}
_NULLS = {"type": "record", "name": "Nulls", "fields": [{"name": "n", "type": "null"}]}


@pytest.mark.parametrize(
    ("avro", "needle"),
    [
        ({"type": "array", "items": "null"}, "array items"),
        ({"type": "array", "items": {"type": "null"}}, "array items"),
        ({"type": "array", "items": ["null"]}, None),  # a union: its branch byte
        ({"type": "array", "items": _EMPTY}, "array items"),
        ({"type": "array", "items": _NULLS}, "array items"),
        ({"type": "array", "items": {"type": "array", "items": "null"}}, "array items"),
        ({"type": "map", "values": "null"}, "map values"),
        ({"type": "array", "items": {"type": "fixed", "name": "F", "size": 0}}, "fixed size 0"),
        ({"type": "fixed", "name": "F", "size": 0}, "fixed size 0"),
        ({"type": "fixed", "name": "F", "size": -1}, "fixed size -1"),
        ({"type": "fixed", "name": "F", "size": 2.5}, "fixed size 2.5"),
        ({"type": "fixed", "name": "F", "size": True}, "fixed size True"),
        ({"type": "fixed", "name": "F", "size": "3"}, "fixed size '3'"),
        ({"type": "array", "items": ["null", "long"]}, None),
        ({"type": "array", "items": {"type": "fixed", "name": "F", "size": 1}}, None),
        (_NULLS, None),  # a column of zero bytes is no loop
    ],
)
def test_types_whose_items_take_no_bytes_are_refused(avro: Any, needle: str | None) -> None:
    """A count of 20,000,000 ``null`` items is 4 bytes: such types are refused."""
    if needle is None:
        TableSchema("t", (Column("id", "long"), Column("a", avro)), ("id",))
        return
    with pytest.raises(SchemaError, match=f"column 'a': {needle}"):
        TableSchema("t", (Column("id", "long"), Column("a", avro)), ("id",))


def _decimal(precision: Any, scale: Any = 0) -> dict[str, Any]:
    return {"type": "bytes", "logicalType": "decimal", "precision": precision, "scale": scale}


@pytest.mark.parametrize(
    ("avro", "needle"),
    [
        (_decimal(0), "decimal precision 0 is not"),
        (_decimal(10**20), "decimal precision 100000000000000000000 is not"),
        # (10**9 turned the length check off: a 200 KB value took seconds to parse)
        (_decimal(10**9), "decimal precision 1000000000 is not an int of 1 to 2000"),
        (_decimal(2001), "decimal precision 2001 is not"),
        (_decimal(True), "decimal precision True is not"),
        (_decimal("5"), "decimal precision '5' is not"),
        ({"type": "bytes", "logicalType": "decimal"}, "decimal precision None is not"),
        (_decimal(5, -1), "decimal scale -1 is not"),
        (_decimal(5, 6), "decimal scale 6 is not"),
        (_decimal(5, None), "decimal scale None is not"),
        (_decimal(5, True), "decimal scale True is not"),
        ({**_decimal(0), "type": "fixed", "name": "F", "size": 4}, "decimal precision 0 is not"),
        ({"type": "array", "items": ["null", _decimal(0)]}, "decimal precision 0 is not"),
    ],
)
def test_decimals_need_a_precision_python_can_take(avro: Any, needle: str) -> None:
    """Precision 0 or 10**20 made building a decoder raise ValueError / OverflowError."""
    with pytest.raises(SchemaError, match=f"column 'd': {needle}"):
        Column("d", avro)


def test_the_widest_decimal_a_source_has_is_accepted() -> None:
    # Postgres' numeric(1000, -1000)
    columns = (Column("id", "long"), Column("d", _decimal(MAX_DECIMAL_PRECISION, 2)))
    table = TableSchema("t", columns, ("id",), version=1)
    row = {"id": 1, "d": decimal.Decimal("-1.25")}
    data = RowEncoder(table, source_id=1).encode(Op.INSERT, 5, 0, 0, row)
    offsets, headers = parse_stream(data)
    start = int(offsets[0]) + HEADER_SIZE + int(headers["key_length"][0])
    assert ChangeDecoder(table).decode(data[start:]).after == row


def _nested(levels: int) -> Any:
    t: Any = "long"
    for _ in range(levels):
        t = {"type": "array", "items": t}
    return t


def test_types_nest_only_so_deep() -> None:
    Column("a", _nested(MAX_TYPE_DEPTH))
    with pytest.raises(SchemaError, match="column 'a': type nested more than 32 levels deep"):
        Column("a", _nested(MAX_TYPE_DEPTH + 1))
    with pytest.raises(SchemaError, match="column 'a': type nested too deeply"):
        Column("a", _nested(5000))  # past what json.dumps takes (it raised RecursionError)


def test_items_of_a_named_type_defined_in_another_column_are_checked() -> None:
    with pytest.raises(SchemaError, match="column 'b': array items"):
        TableSchema(
            "t",
            (Column("a", _EMPTY), Column("b", {"type": "array", "items": "changebus.row.Empty"})),
        )


@pytest.mark.parametrize(
    "data",
    [
        {},
        {"name": "t", "columns": [{"name": "a"}]},
        {"name": "t", "columns": [{"name": "a", "type": "int", "nullable": "no"}]},
        {"name": "t", "columns": [{"name": "a", "type": "int"}], "key": "a"},
        {"name": "t", "columns": [{"name": "a", "type": "int"}], "version": "1"},
        {"name": "t", "columns": "a"},
        [],
    ],
)
def test_bad_json_is_a_schema_error(data: Any) -> None:
    with pytest.raises(SchemaError):
        TableSchema.from_json(data)


# ---- SchemaRegistry -----------------------------------------------------


def test_versions_follow_time(tmp_path: Path) -> None:
    reg = SchemaRegistry(tmp_path / "schemas.jsonl")
    v1 = reg.register(users())
    assert (v1.version, reg.source_id("public.users")) == (1, 1)
    assert reg.register(users()) is v1  # unchanged: the same version
    assert reg.register(users().with_version(9)) is v1  # the given version is ignored
    v2 = reg.register(users(Column("age", "int")))
    assert v2.version == 2
    v3 = reg.register(users())  # back to the first shape: still a new version
    assert v3.version == 3 and v3.fingerprint == v1.fingerprint
    assert reg.latest("public.users") == v3
    assert [t.version for t in reg.versions("public.users")] == [1, 2, 3]
    assert reg.by_fingerprint(v2.fingerprint) == v2
    assert reg.by_fingerprint(v1.fingerprint) == v1  # the earliest of equal versions
    other = reg.register(TableSchema("public.orders", (Column("id", "long"),), ("id",)))
    assert reg.source_id(other.name) == 2
    assert reg.name_for_id(2) == "public.orders"
    assert reg.sources() == [(1, "public.users"), (2, "public.orders")]

    reopened = SchemaRegistry(tmp_path / "schemas.jsonl")
    assert reopened.to_json() == reg.to_json()
    assert reopened.get("public.users", 2) == v2
    assert reopened.register(users()).version == 3  # the latest survives a restart
    assert reopened.register(TableSchema("x.y", (Column("id", "long"),))).version == 1
    assert reopened.source_id("x.y") == 3


def test_unknown_lookups(tmp_path: Path) -> None:
    reg = SchemaRegistry()
    reg.register(users())
    for call in (
        lambda: reg.get("public.users", 2),
        lambda: reg.get("public.users", 0),
        lambda: reg.get("nope", 1),
        lambda: reg.latest("nope"),
        lambda: reg.versions("nope"),
        lambda: reg.source_id("nope"),
        lambda: reg.name_for_id(99),
        lambda: reg.by_fingerprint(123),
    ):
        with pytest.raises(UnknownSchemaError):
            call()
    assert SchemaRegistry(tmp_path / "missing.jsonl").sources() == []


def lines(path: Path) -> list[bytes]:
    return path.read_bytes().split(b"\n")


def test_torn_last_line_is_ignored_then_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "schemas.jsonl"
    reg = SchemaRegistry(path)
    reg.register(users())
    reg.register(users(Column("age", "int")))
    whole = path.read_bytes()
    path.write_bytes(whole[:-20])  # a crash in the middle of the second append
    reopened = SchemaRegistry(path)
    assert [t.version for t in reopened.versions("public.users")] == [1]
    assert path.read_bytes() == whole[:-20]  # opening never modifies the file
    assert reopened.register(users(Column("height", "int"))).version == 2
    assert path.read_bytes().count(b"\n") == 2  # the torn tail was replaced
    again = SchemaRegistry(path)
    assert [c.name for c in again.latest("public.users").columns] == ["id", "name", "height"]


def test_unterminated_last_line_does_not_count(tmp_path: Path) -> None:
    path = tmp_path / "schemas.jsonl"
    reg = SchemaRegistry(path)
    reg.register(users())
    reg.register(users(Column("age", "int")))
    path.write_bytes(path.read_bytes()[:-1])  # complete entry, newline not written
    reopened = SchemaRegistry(path)
    assert [t.version for t in reopened.versions("public.users")] == [1]
    reopened.register(TableSchema("a.b", (Column("id", "long"),)))
    final = SchemaRegistry(path)
    assert [t.version for t in final.versions("public.users")] == [1]
    assert final.latest("a.b").version == 1
    assert all(json.loads(x) for x in lines(path)[:-1]) and lines(path)[-1] == b""


def test_corrupt_but_terminated_last_line_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "schemas.jsonl"
    reg = SchemaRegistry(path)
    reg.register(users())
    reg.register(users(Column("age", "int")))
    data = lines(path)
    data[1] = b"\x00" * len(data[1])  # blocks allocated, contents never written
    path.write_bytes(b"\n".join(data))
    assert [t.version for t in SchemaRegistry(path).versions("public.users")] == [1]


@pytest.mark.parametrize(
    "damage",
    [
        lambda line: line.replace(b'"name"', b'"nams"', 1),  # valid JSON, CRC mismatch
        lambda line: line[:-5],  # not JSON
        lambda line: b"",  # an empty line
    ],
)
def test_damage_in_the_middle_is_an_error(tmp_path: Path, damage: Any) -> None:
    path = tmp_path / "schemas.jsonl"
    reg = SchemaRegistry(path)
    reg.register(users())
    reg.register(users(Column("age", "int")))
    reg.register(users(Column("age", "long")))
    data = lines(path)
    data[1] = damage(data[1])
    path.write_bytes(b"\n".join(data))
    with pytest.raises(SchemaError, match="damaged at line 2"):
        SchemaRegistry(path)


def test_a_crc_valid_entry_with_a_version_gap_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "schemas.jsonl"
    SchemaRegistry(path).register(users())
    bad_entry = {"source_id": 1, "schema": users().with_version(3).to_json()}
    text = json.dumps(bad_entry, sort_keys=True, separators=(",", ":"))
    line = json.dumps({"crc": crc32(text.encode()), "entry": bad_entry})
    first = path.read_bytes()
    path.write_bytes(first + line.encode() + b"\n" + first)  # the bad entry is not last
    with pytest.raises(SchemaError, match=r"line 2.*expected 2"):
        SchemaRegistry(path)


def test_register_as_mirrors_another_registry(tmp_path: Path) -> None:
    source = SchemaRegistry()
    t1 = source.register(users())
    t2 = source.register(users(Column("age", "int")))
    mirror = SchemaRegistry(tmp_path / "m.jsonl")
    assert mirror.register_as(t1, 7) == t1
    assert mirror.register_as(t1, 7) == t1  # idempotent
    mirror.register_as(t2, 7)
    assert mirror.source_id("public.users") == 7
    with pytest.raises(SchemaError, match="already exists"):
        mirror.register_as(users(Column("x", "int")).with_version(2), 7)
    with pytest.raises(SchemaError, match="expected 3"):
        mirror.register_as(users().with_version(5), 7)
    with pytest.raises(SchemaError, match="source id 7, not 8"):
        mirror.register_as(t1, 8)
    with pytest.raises(SchemaError, match="already names"):
        mirror.register_as(TableSchema("x.y", (Column("a", "int"),), version=1), 7)
    with pytest.raises(SchemaError, match=r"not in 1\.\.65535"):
        mirror.register_as(TableSchema("x.y", (Column("a", "int"),), version=1), 0)
    assert SchemaRegistry(tmp_path / "m.jsonl").to_json() == mirror.to_json()


def test_import_entries_from_json(tmp_path: Path) -> None:
    server = SchemaRegistry()
    server.register(users())
    server.register(TableSchema("a.b", (Column("id", "long"),), ("id",)))
    server.register(users(Column("age", "int")))
    served = json.loads(json.dumps(server.to_json()))  # as fetched over HTTP
    client = SchemaRegistry(tmp_path / "client.jsonl")
    imported = client.import_entries(reversed(served))
    assert [(t.name, t.version) for t in imported] == [
        ("a.b", 1),
        ("public.users", 1),
        ("public.users", 2),
    ]
    assert client.to_json() == server.to_json()
    assert client.sources() == server.sources()
    assert client.import_entries([(1, server.get("public.users", 1))])[0].version == 1
    with pytest.raises(SchemaError, match="bad schema entry"):
        client.import_entries([{"schema": {}}])
    # a source id must be an int as JSON sent it (true was 1, 3.9 was 3, "7" was 7: the
    # table filed under another id; 1e400 raised OverflowError), an entry an object
    entry = served[0]
    for bad in (True, 3.9, "7", float("inf"), 10**400, 0, 70000, None):
        with pytest.raises(SchemaError, match="source_id"):
            client.import_entries([{**entry, "source_id": bad}])
    for junk in (["a", "b"], 5, "x"):
        with pytest.raises(SchemaError, match="bad schema entry"):
            client.import_entries([junk])  # type: ignore[list-item]


def test_concurrent_registration(tmp_path: Path) -> None:
    path = tmp_path / "schemas.jsonl"
    reg = SchemaRegistry(path)
    results: dict[str, list[int]] = {}
    lock = threading.Lock()
    start = threading.Barrier(8)

    def work(i: int) -> None:
        start.wait()
        for j in range(40):
            name = f"s.t{(i + j) % 5}"
            extra = (Column(f"c{j % 3}", "int"),) if j % 2 else ()
            t = reg.register(TableSchema(name, (Column("id", "long"), *extra), ("id",)))
            with lock:
                results.setdefault(name, []).append(t.version)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(i for i, _ in reg.sources()) == [1, 2, 3, 4, 5]
    for name in results:
        versions = reg.versions(name)
        assert [t.version for t in versions] == list(range(1, len(versions) + 1))
        # consecutive versions always differ in content
        assert all(a.fingerprint != b.fingerprint for a, b in itertools.pairwise(versions))
        assert set(results[name]) <= {t.version for t in versions}
    assert SchemaRegistry(path).to_json() == reg.to_json()


def test_find_returns_the_newest_version_with_that_content(tmp_path: Path) -> None:
    """A fetcher reading again what the relay holds finds its versions by content."""
    reg = SchemaRegistry(tmp_path / "r.jsonl")
    a = users()
    b = users(Column("age", "int"))
    assert reg.find(a) is None
    assert [reg.register(t).version for t in (a, b, a)] == [1, 2, 3]  # back to a: new
    found = reg.find(a)
    assert found is not None and found.version == 3
    found = reg.find(b)
    assert found is not None and found.version == 2
    assert reg.find(users(Column("other", "int"))) is None
    assert [t.version for t in reg.versions(a.name)] == [1, 2, 3]  # find registers nothing


def test_a_key_past_what_an_event_holds_is_a_clear_error() -> None:
    """An event's key has at most 65,535 bytes (a u16 in its header)."""
    cols = (Column("a", "int"), Column("t", "string"))
    wide = "x" * 70_000
    whole = RowEncoder(TableSchema("public.w", cols, ("a", "t"), 1, True), source_id=1)
    with pytest.raises(SchemaError, match="keyed by all its columns"):
        whole.encode(Op.INSERT, 5, 0, 0, {"a": 1, "t": wide})
    one = RowEncoder(TableSchema("public.w", cols, ("t",), 1), source_id=1)
    with pytest.raises(SchemaError, match="a key of 70003 bytes"):
        one.encode(Op.INSERT, 5, 0, 0, {"a": 1, "t": wide})
    assert len(one.encode(Op.INSERT, 5, 0, 0, {"a": 1, "t": "y" * 60_000})) > 120_000
    # every framing path: a run of changes, and an event framed from its encoded parts
    with pytest.raises(SchemaError, match="a key of 70003 bytes"):
        one.encode_many([(Op.INSERT, {"a": 1, "t": wide}, None, (), ())], 5, 0)
    key = one.key_bytes({"t": wide})
    with pytest.raises(SchemaError, match="a key of 70003 bytes"):
        one.frame(Op.INSERT, 5, 0, 0, key, key + b"\x00")


def test_a_new_tables_id_needs_no_walk_of_the_others() -> None:
    """Each new table's id was the highest id plus one, found by walking every id: a first
    start with ten thousand tables was quadratic. The highest id is kept instead."""

    class Walked(dict):  # type: ignore[type-arg]
        walks = 0

        def __iter__(self) -> Any:
            Walked.walks += 1
            return super().__iter__()

    reg = SchemaRegistry()
    reg._names = Walked()
    for i in range(200):
        t = reg.register(TableSchema(f"s.t{i}", (Column("id", "long", nullable=False),), ("id",)))
        assert reg.source_id(t.name) == i + 1
    assert Walked.walks == 0


def test_lookups_do_not_wait_for_a_registrations_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registration held the one lock across its file append and fsync, and the relay's
    HTTP handlers took that lock on the event loop: a DDL stalled every partition for as
    long as the disk took (review). Lookups wait for the maps only."""
    registry = SchemaRegistry(tmp_path / "schemas.jsonl")
    first = registry.register(users())
    syncing, release = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        syncing.set()
        assert release.wait(10)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    done: list[TableSchema] = []
    writer = threading.Thread(
        target=lambda: done.append(registry.register(users(Column("email", "string"))))
    )
    writer.start()
    try:
        assert syncing.wait(10)
        # the new version is not visible before it is on disk; every lookup answers now
        assert registry.latest("public.users") == first
        assert registry.sources() == [(1, "public.users")]
        assert len(registry.to_json()) == 1
    finally:
        release.set()
        writer.join(10)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert done and done[0].version == 2
    assert registry.latest("public.users") == done[0]
    assert SchemaRegistry(tmp_path / "schemas.jsonl").latest("public.users") == done[0]
