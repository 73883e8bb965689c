"""Replicas and key changes: a row moved to a new key keeps the columns the source did not send."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from changebus.client import ChangeEvent, ChangeOp, SqliteReplica, Window
from changebus.schemas import Column, TableSchema

T = TableSchema(
    "app.docs",
    (Column("id", "long", nullable=False), Column("n", "long"), Column("body", "string")),
    ("id",),
    1,
)


def event(scn: int, op: ChangeOp, after: dict[str, Any], before: Any = None, **kw: Any) -> Window:
    e = ChangeEvent(
        scn=scn,
        seq=0,
        op=op,
        table=T.name,
        key={"id": after["id"]},
        after=after,
        before=before,
        schema=T,
        **kw,
    )
    return Window(scn=scn, timestamp_ns=scn, partition="p", events=(e,))


async def test_key_change_with_unsent_columns_moves_the_row(tmp_path: Path) -> None:
    big = "b" * 5000
    windows = [
        event(10, ChangeOp.INSERT, {"id": 1, "n": 1, "body": big}),
        event(20, ChangeOp.INSERT, {"id": 2, "n": 2, "body": "small"}),
        # Postgres: UPDATE docs SET id = 7, n = 3 WHERE id = 1 -- body is TOASTed, not sent
        event(
            30,
            ChangeOp.UPDATE,
            {"id": 7, "n": 3, "body": None},
            {"id": 1, "n": None, "body": None},
            not_sent=("body",),
            before_not_sent=("n", "body"),
        ),
        # a key change with every column sent still deletes the old key
        event(
            40, ChangeOp.UPDATE, {"id": 8, "n": 4, "body": "x"}, {"id": 2, "n": None, "body": None}
        ),
    ]
    db = tmp_path / "r.db"
    replica = SqliteReplica(db)
    try:
        await replica.load()
        for w in windows:
            assert await replica.on_start_window(w) is None
            for e in w.events:
                assert await replica.on_event(e) is None
            assert await replica.on_end_window(w) is None
    finally:
        await replica.close()
    conn = sqlite3.connect(db)
    try:
        rows = sorted(conn.execute('SELECT id, n, body FROM "app_docs"').fetchall())
    finally:
        conn.close()
    assert rows == [(7, 3, big), (8, 4, "x")]
