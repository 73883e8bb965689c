"""Column types that differ only in annotations (changebus.kind / changebus.bound).

A version adding them (the first a Postgres fetcher registers for a table with
composite or range columns after the upgrade that records them) holds the
same values in the same bytes; every other difference counts (review).
"""

from __future__ import annotations

from typing import Any

from changebus.schemas import (
    HEADER_SIZE,
    Column,
    Op,
    RowEncoder,
    TableSchema,
    bare_type,
    check_compatible,
    same_but_annotations,
    same_column_type,
)

_RANGE = {"type": "string", "changebus.type": "int4range"}
_NOTED = {**_RANGE, "changebus.kind": "range", "changebus.bound": "integer"}


def _table(r: Any, version: int = 1, **col: Any) -> TableSchema:
    cols = (
        Column("id", "long", False, "bigint"),
        Column("r", r, source_type="int4range", **col),
        Column("rs", {"type": "array", "items": ["null", r]}, source_type="int4range[]"),
    )
    return TableSchema("public.t", cols, ("id",), version)


def test_annotations_alone_change_nothing_else_does() -> None:
    assert bare_type(_NOTED) == _RANGE and _NOTED["changebus.kind"] == "range"  # (a copy)
    assert same_column_type(_RANGE, _NOTED)
    assert same_column_type(
        {"type": "array", "items": ["null", _NOTED]}, {"type": "array", "items": ["null", _RANGE]}
    )
    assert not same_column_type(_RANGE, {**_RANGE, "changebus.type": "int8range"})
    assert not same_column_type(_RANGE, "string")  # (changebus.type: a replica's column type)
    enum = {"type": "string", "changebus.type": "enum", "changebus.symbols": ["a", "b"]}
    assert not same_column_type(enum, {**enum, "changebus.symbols": ["a", "b", "c"]})
    assert not same_column_type(
        {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2},
        {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2},
    )

    old, new = _table(_RANGE), _table(_NOTED, 2)
    assert old.fingerprint != new.fingerprint
    assert same_but_annotations(old, new) and same_but_annotations(new, old)
    check_compatible(old, new)
    check_compatible(new, old)
    row = {"id": 1, "r": "[1,2)", "rs": ["empty", None]}
    events = [RowEncoder(t, source_id=1).encode(Op.INSERT, 5, 0, 0, row) for t in (old, new)]
    assert events[0][HEADER_SIZE:] == events[1][HEADER_SIZE:]  # (key and payload)
    assert not same_but_annotations(old, _table(_NOTED, 2, policy="truncate:3"))
    assert not same_but_annotations(old, _table(_NOTED, 2, nullable=False))
    assert not same_but_annotations(old, _table({**_NOTED, "changebus.type": "int8range"}, 2))
    other = TableSchema("public.t", new.columns, ("id", "r"), 2)
    assert not same_but_annotations(old, other)
