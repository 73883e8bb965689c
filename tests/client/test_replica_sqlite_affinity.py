"""The SQLite replica follows a source column's type change by its affinity.

SQLite converts stored values by the declared affinity: after the source
turned an integer column into text, ``'007'`` was stored as ``7``; a long
that became a double kept ``1.0`` as the integer ``1``. Now such a column
is given the affinity that holds both (the table is copied), rows of every
version keep their values, and the operator's indexes survive.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from changebus.client import ChangeEvent, ChangeOp, SqliteReplica, Window
from changebus.client._sqlite_retype import affinity_join as _affinity_join
from changebus.schemas import Column, TableSchema


def schema(version: int, code: Any, ratio: Any) -> TableSchema:
    cols = (Column("id", "long", nullable=False), Column("code", code), Column("ratio", ratio))
    return TableSchema("app.items", cols, ("id",), version)


V1 = schema(1, "long", "long")
V2 = schema(2, "string", "double")


def window(scn: int, table: TableSchema, row: dict[str, Any]) -> Window:
    event = ChangeEvent(
        scn, 0, ChangeOp.INSERT, table.name, {"id": row["id"]}, row, None, schema=table
    )
    return Window(scn=scn, timestamp_ns=scn, partition="p", events=(event,))


async def deliver(replica: Any, w: Window) -> None:
    assert await replica.on_start_window(w) is None
    for e in w.events:
        assert await replica.on_event(e) is None
    assert await replica.on_end_window(w) is None


def test_the_join_holds_both_and_never_narrows() -> None:
    assert _affinity_join("INTEGER", "REAL") == "REAL" == _affinity_join("REAL", "INTEGER")
    assert _affinity_join("INTEGER", "TEXT") == "TEXT" == _affinity_join("TEXT", "INTEGER")
    assert _affinity_join("REAL", "TEXT") == "TEXT"
    assert _affinity_join("BLOB", "TEXT") == "BLOB" == _affinity_join("TEXT", "BLOB")
    assert _affinity_join("TEXT", "TEXT") == "TEXT"


async def test_a_column_whose_type_changed_keeps_the_new_values_as_sent(tmp_path: Path) -> None:
    path = tmp_path / "r.db"
    replica = SqliteReplica(path)
    try:
        await deliver(replica, window(10, V1, {"id": 1, "code": 5, "ratio": 2}))
        with sqlite3.connect(path) as conn:  # an index of the operator's own
            conn.execute("CREATE INDEX by_code ON app_items (code)")
        await deliver(replica, window(20, V2, {"id": 2, "code": "007", "ratio": 1.0}))
        await deliver(replica, window(30, V2, {"id": 3, "code": "1.50", "ratio": 0.5}))
    finally:
        await replica.close()
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute(
            "SELECT id, code, typeof(code), ratio, typeof(ratio) FROM app_items ORDER BY id"
        ).fetchall()
        types = {r[1]: r[2] for r in conn.execute("PRAGMA table_info(app_items)")}
        indexes = [
            r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")
        ]
        pk = [r[1] for r in conn.execute("PRAGMA table_info(app_items)") if r[5]]
    finally:
        conn.close()
    assert rows == [
        (1, "5", "text", 2.0, "real"),  # (the older row's values, in the new affinities)
        (2, "007", "text", 1.0, "real"),
        (3, "1.50", "text", 0.5, "real"),
    ]
    assert types == {"id": "INTEGER", "code": "TEXT", "ratio": "REAL"}
    assert "by_code" in indexes and pk == ["id"]


async def test_views_generated_columns_and_indexes_of_the_operator_survive(tmp_path: Path) -> None:
    path = tmp_path / "r.db"
    replica = SqliteReplica(path)
    try:
        await deliver(replica, window(10, V1, {"id": 1, "code": 5, "ratio": 2}))
        with sqlite3.connect(path) as conn:
            conn.execute(
                "CREATE VIEW coded AS SELECT id, code FROM app_items WHERE code IS NOT NULL"
            )
            conn.execute(
                "ALTER TABLE app_items ADD COLUMN twice INTEGER GENERATED ALWAYS AS (id * 2) VIRTUAL"
            )
            conn.execute("CREATE UNIQUE INDEX one_ratio ON app_items (ratio)")
        await deliver(replica, window(20, V2, {"id": 2, "code": "007", "ratio": 1.5}))
    finally:
        await replica.close()
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("SELECT id, code, typeof(code) FROM coded ORDER BY id").fetchall() == [
            (1, "5", "text"),
            (2, "007", "text"),
        ]
        assert conn.execute("SELECT twice FROM app_items ORDER BY id").fetchall() == [(2,), (4,)]
        with pytest.raises(sqlite3.IntegrityError):  # the unique index still holds
            conn.execute("INSERT INTO app_items (id, ratio) VALUES (3, 1.5)")
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        conn.close()


async def test_a_key_column_that_became_text_keeps_its_rows_matched(tmp_path: Path) -> None:
    """The key is the table's rowid (a lone INTEGER primary key): the table is copied,
    and the old row's key, converted, still takes the source's updates of it."""
    v1 = TableSchema(
        "app.keyed", (Column("id", "long", nullable=False), Column("v", "long")), ("id",), 1
    )
    v2 = TableSchema(
        "app.keyed", (Column("id", "string", nullable=False), Column("v", "long")), ("id",), 2
    )
    path = tmp_path / "r.db"
    replica = SqliteReplica(path)
    try:
        await deliver(replica, window(10, v1, {"id": 5, "v": 1}))
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE VIEW keyed_view AS SELECT * FROM app_keyed")
        await deliver(replica, window(20, v2, {"id": "5", "v": 2}))  # the same row
        await deliver(replica, window(30, v2, {"id": "007", "v": 3}))
    finally:
        await replica.close()
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT id, typeof(id), v FROM keyed_view ORDER BY id").fetchall()
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        conn.close()
    assert rows == [("007", "text", 3), ("5", "text", 2)]
