"""Table schemas (names, fingerprints) and the schema registry."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from changebus.schemas import (
    Column,
    SchemaError,
    SchemaRegistry,
    TableSchema,
    UnknownSchemaError,
    pg_avro_type,
)


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


def test_fingerprint_is_stable_and_sensitive() -> None:
    a, b = users(), users()
    assert a.fingerprint == b.fingerprint
    assert a.with_version(3).fingerprint == a.fingerprint  # version is not content
    assert users(Column("age", "int")).fingerprint != a.fingerprint
    assert users(key=("id", "name")).fingerprint != a.fingerprint
    n1 = users(Column("price", pg_avro_type("numeric(10,2)")))
    n2 = users(Column("price", pg_avro_type("numeric(12,4)")))
    assert n1.fingerprint != n2.fingerprint  # logical type attributes count
    assert 0 <= a.fingerprint < 2**64


def test_odd_column_names_are_sanitised() -> None:
    t = TableSchema(
        "public.weird table",
        (
            Column("id", "long"),
            Column("Order Date", "string"),
            Column("Order_Date", "string"),
            Column("1st", "int"),
        ),
        key=("id",),
    )
    fields = t.field_names
    assert fields[0] == "id"
    assert len(set(fields)) == 4
    assert all(f.replace("_", "a").isalnum() and not f[0].isdigit() for f in fields)
    assert t.column_for_field == {fields[1]: "Order Date", fields[3]: "1st"}
    assert t.row_schema["fields"][1]["changebus.column"] == "Order Date"
    assert TableSchema.from_json(t.to_json()) == t


@pytest.mark.parametrize(
    ("columns", "key", "needle"),
    [
        ((), (), "no columns"),
        ((Column("a", "int"), Column("a", "int")), (), "duplicate column"),
        ((Column("a", "int"),), ("b",), "not columns"),
    ],
)
def test_invalid_tables(columns: tuple[Column, ...], key: tuple[str, ...], needle: str) -> None:
    with pytest.raises(SchemaError, match=needle):
        TableSchema("t", columns, key)


def test_versions_follow_time(tmp_path: Path) -> None:
    reg = SchemaRegistry(tmp_path / "schemas.jsonl")
    v1 = reg.register(users())
    assert (v1.version, reg.source_id("public.users")) == (1, 1)
    assert reg.register(users()) == v1  # unchanged: same version
    v2 = reg.register(users(Column("age", "int")))
    assert v2.version == 2
    v3 = reg.register(users())  # back to the first shape: still a new version
    assert v3.version == 3
    assert reg.latest("public.users") == v3
    assert [t.version for t in reg.versions("public.users")] == [1, 2, 3]
    assert reg.by_fingerprint(v2.fingerprint) == v2
    other = reg.register(TableSchema("public.orders", (Column("id", "long"),), ("id",)))
    assert reg.source_id(other.name) == 2
    assert reg.sources() == [(1, "public.users"), (2, "public.orders")]
    reopened = SchemaRegistry(tmp_path / "schemas.jsonl")
    assert reopened.to_json() == reg.to_json()
    assert reopened.get("public.users", 2) == v2
    with pytest.raises(UnknownSchemaError):
        reopened.get("public.users", 4)
    with pytest.raises(UnknownSchemaError):
        reopened.source_id("nope")


def test_torn_last_line_is_dropped_but_damage_elsewhere_is_not(tmp_path: Path) -> None:
    path = tmp_path / "schemas.jsonl"
    reg = SchemaRegistry(path)
    reg.register(users())
    reg.register(users(Column("age", "int")))
    data = path.read_bytes()
    path.write_bytes(data[:-20])  # a crash in the middle of the second append
    reopened = SchemaRegistry(path)
    assert [t.version for t in reopened.versions("public.users")] == [1]
    assert reopened.register(users(Column("age", "int"))).version == 2  # appends cleanly again
    assert [t.version for t in SchemaRegistry(path).versions("public.users")] == [1, 2]
    lines = path.read_bytes().split(b"\n")
    lines[0] = lines[0].replace(b'"name"', b'"nams"', 1)
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(SchemaError, match="damaged at line 1"):
        SchemaRegistry(path)


def test_register_as_mirrors_another_registry(tmp_path: Path) -> None:
    source = SchemaRegistry()
    t1 = source.register(users())
    t2 = source.register(users(Column("age", "int")))
    mirror = SchemaRegistry(tmp_path / "m.jsonl")
    mirror.register_as(t1, 7)
    mirror.register_as(t1, 7)  # idempotent
    mirror.register_as(t2, 7)
    assert mirror.source_id("public.users") == 7
    with pytest.raises(SchemaError, match="already exists"):
        mirror.register_as(users(Column("x", "int")).with_version(2), 7)
    with pytest.raises(SchemaError, match="expected 3"):
        mirror.register_as(users().with_version(5), 7)


def test_concurrent_registration() -> None:
    reg = SchemaRegistry()
    results: list[int] = []

    def work(i: int) -> None:
        for j in range(50):
            t = TableSchema(f"s.t{(i + j) % 5}", (Column("id", "long"),), ("id",))
            results.append(reg.register(t).version)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(results) == {1}
    assert sorted(i for i, _ in reg.sources()) == [1, 2, 3, 4, 5]
