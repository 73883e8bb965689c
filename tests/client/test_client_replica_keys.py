"""Replicas and key changes: a row moved to a new key keeps the columns the source did not send."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from changebus.client import ChangeEvent, ChangeOp, PostgresReplica, SqliteReplica, Window
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


def sqlite_rows(db: Path, sql: str) -> list[Any]:
    """The rows ``sql`` reads from the SQLite file ``db``."""
    conn = sqlite3.connect(db)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


async def apply(replica: Any, windows: list[Window]) -> None:
    """Hand ``windows`` to ``replica`` as a consumer would (its callbacks, in order)."""
    await replica.load()
    for w in windows:
        assert await replica.on_start_window(w) is None
        for e in w.events:
            assert await replica.on_event(e) is None
        assert await replica.on_end_window(w) is None


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
        await apply(replica, windows)
    finally:
        await replica.close()
    assert sorted(sqlite_rows(db, 'SELECT id, n, body FROM "app_docs"')) == [
        (7, 3, big),
        (8, 4, "x"),
    ]


W = TableSchema(
    "app.log",
    (Column("a", "long"), Column("t", "string")),
    ("a", "t"),
    1,
    nullable_key=True,
)


def whole(scn: int, op: ChangeOp, after: Any, before: Any = None) -> Window:
    image = after if after is not None else before
    e = ChangeEvent(
        scn=scn,
        seq=0,
        op=op,
        table=W.name,
        key=dict(image),
        after=after,
        before=before,
        schema=W,
    )
    return Window(scn=scn, timestamp_ns=scn, partition="p", events=(e,))


async def test_a_table_keyed_by_all_its_columns_keeps_its_nulls(tmp_path: Path) -> None:
    """A Postgres REPLICA IDENTITY FULL table without a primary key: its key is every
    column, any of them NULL. A replica table with that primary key refused the NULLs,
    and ``= NULL`` matched no row to delete or update."""
    windows = [
        whole(10, ChangeOp.INSERT, {"a": 1, "t": None}),
        whole(20, ChangeOp.INSERT, {"a": None, "t": "x"}),
        whole(30, ChangeOp.INSERT, {"a": 3, "t": "y"}),
        whole(40, ChangeOp.UPDATE, {"a": 1, "t": "now"}, {"a": 1, "t": None}),
        whole(50, ChangeOp.DELETE, None, {"a": None, "t": "x"}),
        whole(60, ChangeOp.UPDATE, {"a": None, "t": None}, {"a": 3, "t": "y"}),
    ]
    db = tmp_path / "w.db"
    replica = SqliteReplica(db)
    try:
        await apply(replica, windows)
    finally:
        await replica.close()
    rows = sqlite_rows(db, 'SELECT a, t FROM "app_log"')
    assert sorted(rows, key=repr) == sorted([(1, "now"), (None, None)], key=repr)
    # each change deletes its old row by key: through an index on the key columns, both
    # for a value and for a NULL (a scan of the table per event before)
    for where in ('"a" = 1 AND "t" IS NULL', '"a" IS NULL AND "t" = \'x\''):
        plan = sqlite_rows(db, f'EXPLAIN QUERY PLAN DELETE FROM "app_log" WHERE {where}')
        assert "USING COVERING INDEX cb_key_" in plan[0][3] or "USING INDEX cb_key_" in plan[0][3]


async def test_a_replica_table_of_an_older_version_gets_its_key_index(tmp_path: Path) -> None:
    db = tmp_path / "w.db"
    conn = sqlite3.connect(db)
    conn.execute('CREATE TABLE "app_log" ("a" INTEGER, "t" TEXT)')  # (as older versions made it)
    conn.commit()
    conn.close()
    replica = SqliteReplica(db)
    try:
        await apply(replica, [whole(10, ChangeOp.INSERT, {"a": 1, "t": None})])
    finally:
        await replica.close()
    indexes = sqlite_rows(db, "SELECT name FROM sqlite_master WHERE type = 'index'")
    assert [n for (n,) in indexes if n.startswith("cb_key_")]


@pytest.mark.pg
async def test_a_postgres_replica_of_a_table_keyed_by_all_its_columns(pg_dsn: str) -> None:
    windows = [
        whole(10, ChangeOp.INSERT, {"a": 1, "t": None}),
        whole(20, ChangeOp.INSERT, {"a": None, "t": "x"}),
        whole(40, ChangeOp.UPDATE, {"a": 1, "t": "now"}, {"a": 1, "t": None}),
        whole(50, ChangeOp.DELETE, None, {"a": None, "t": "x"}),
    ]
    replica = PostgresReplica(pg_dsn)
    try:
        await apply(replica, windows)
        rows = await asyncio.to_thread(replica.query, 'SELECT a, t FROM "app"."log"')
        indexes = await asyncio.to_thread(
            replica.query,
            "SELECT indexdef FROM pg_indexes WHERE schemaname = 'app' AND tablename = 'log'",
        )
    finally:
        await replica.close()
    assert [tuple(r) for r in rows] == [(1, "now")]
    # (its text column is left out: a btree refuses values past ~2.7 KB)
    assert [d for (d,) in indexes if "cb_key_" in d and "(a)" in d]


@pytest.mark.pg
async def test_a_postgres_replica_of_a_keyless_table_with_json_and_long_values(
    pg_dsn: str,
) -> None:
    """A table keyed by all its columns, among them json and long text: the replica's
    index over every column refused each row past ~2.7 KB, and json has no = operator,
    so every change failed on every retry until the replica gave up (review)."""
    schema = TableSchema(
        "app.notes",
        (
            Column("a", "long"),
            Column("doc", {"type": "string", "changebus.type": "json"}),
            Column("body", "string"),
        ),
        ("a", "doc", "body"),
        1,
        nullable_key=True,
    )
    long_text = "x" * 20_000 + "".join(chr(0x4E00 + i % 500) for i in range(5_000))

    def change(scn: int, op: ChangeOp, after: Any, before: Any = None) -> Window:
        e = ChangeEvent(
            scn, 0, op, schema.name, dict(after or before), after, before, schema=schema
        )
        return Window(scn=scn, timestamp_ns=scn, partition="p", events=(e,))

    one = {"a": 1, "doc": '{"k": [1, 2]}', "body": long_text}
    two = {"a": 2, "doc": '{"k": 2}', "body": "short"}
    windows = [
        change(10, ChangeOp.INSERT, one),
        change(20, ChangeOp.INSERT, two),
        change(30, ChangeOp.UPDATE, {**one, "body": long_text + "!"}, one),
        change(40, ChangeOp.DELETE, None, two),
    ]
    replica = PostgresReplica(pg_dsn)
    try:
        await apply(replica, windows)
        rows = await asyncio.to_thread(
            replica.query, 'SELECT a, doc::text, body FROM "app"."notes"'
        )
    finally:
        await replica.close()
    assert [tuple(r) for r in rows] == [(1, '{"k": [1, 2]}', long_text + "!")]


async def test_an_older_event_with_an_unsent_key_value_keeps_it(tmp_path: Path) -> None:
    """Events written before fetchers filled an unchanged TOASTed key value from the
    old row name it as not sent (NULL in the key): the replica takes the old row's."""
    e = ChangeEvent(
        scn=20,
        seq=0,
        op=ChangeOp.UPDATE,
        table=W.name,
        key={"a": 2, "t": None},
        after={"a": 2, "t": None},
        before={"a": 1, "t": "big"},
        schema=W,
        not_sent=("t",),
    )
    windows = [whole(10, ChangeOp.INSERT, {"a": 1, "t": "big"}), Window(20, 20, "p", (e,))]
    db = tmp_path / "old.db"
    replica = SqliteReplica(db)
    try:
        await apply(replica, windows)
    finally:
        await replica.close()
    assert sqlite_rows(db, 'SELECT a, t FROM "app_log"') == [(2, "big")]


async def test_a_replayed_key_move_over_newer_state_does_not_stop_the_replica(
    tmp_path: Path,
) -> None:
    await _replayed_key_move(tmp_path, None)


async def _replayed_key_move(tmp_path: Path, pg_dsn: str | None) -> None:
    """A bootstrap's catch-up replays a key move (1 -> 7, body not sent) over a snapshot that
    already holds row 7 (moved) and row 1 (inserted again later): UPDATE ... SET id = 7
    failed on the unique key on every retry and after a restart (found by review). The
    move now yields to the newer row 7, the old key's row goes, and the rest of the log
    brings row 1 back."""
    # the snapshot (position 5): rows at their newest version
    snapshot = [
        event(4, ChangeOp.INSERT, {"id": 7, "n": 3, "body": "seven"}),
        event(5, ChangeOp.INSERT, {"id": 1, "n": 9, "body": "again"}),
    ]
    catchup = [
        event(
            30,
            ChangeOp.UPDATE,
            {"id": 7, "n": 3, "body": None},
            {"id": 1, "n": None, "body": None},
            not_sent=("body",),
            before_not_sent=("n", "body"),
        ),
        event(40, ChangeOp.INSERT, {"id": 1, "n": 9, "body": "again"}),
    ]
    db = tmp_path / "r.db"
    replica = SqliteReplica(db)
    try:
        await apply(replica, snapshot + catchup)
    finally:
        await replica.close()
    rows = sorted(sqlite_rows(db, 'SELECT id, n, body FROM "app_docs"'))
    assert rows == [(1, 9, "again"), (7, 3, "seven")]
    if pg_dsn is not None:  # the same statements on Postgres
        pg = PostgresReplica(pg_dsn)
        try:
            await apply(pg, snapshot + catchup)
            got = await asyncio.to_thread(pg.query, 'SELECT id, n, body FROM "app"."docs"')
        finally:
            await pg.close()
        assert sorted(tuple(r) for r in got) == rows


@pytest.mark.pg
async def test_a_replayed_key_move_on_postgres(tmp_path: Path, pg_dsn: str) -> None:
    await _replayed_key_move(tmp_path, pg_dsn)


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("pg", marks=pytest.mark.pg)])
async def test_a_source_key_change_stops_the_replica_with_a_clear_error(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    """The source's primary key changed (a table without one got one, or another column
    became the key): every upsert failed in the database (``ON CONFLICT`` names no
    constraint), was rolled back and retried until the replica gave up, with the
    database's words only (review). The window is refused at once, naming the fix."""
    from changebus.client import CallbackResult

    keyed = TableSchema("app.log", (Column("a", "long"), Column("t", "string")), ("a",), 2)
    replica: Any = (
        SqliteReplica(tmp_path / "w.db")
        if kind == "sqlite"
        else PostgresReplica(request.getfixturevalue("pg_dsn"))
    )
    try:
        await apply(replica, [whole(10, ChangeOp.INSERT, {"a": 1, "t": "x"})])  # (keyless)
        e = ChangeEvent(
            20, 0, ChangeOp.INSERT, keyed.name, {"a": 2}, {"a": 2, "t": "y"}, None, schema=keyed
        )
        w = Window(scn=20, timestamp_ns=20, partition="p", events=(e,))
        assert await replica.on_start_window(w) is None
        assert await replica.on_event(e) is None
        assert await replica.on_end_window(w) is CallbackResult.FATAL
    finally:
        await replica.close()
    assert "its primary key is none, the key of source 'app.log' is now (a)" in caplog.text


@pytest.mark.pg
async def test_a_nul_byte_in_text_stops_a_postgres_replica_with_a_clear_error(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """MySQL text may hold NUL bytes, which PostgreSQL text cannot: psycopg refused the
    value and the window was retried until the replica gave up (review)."""
    from changebus.client import CallbackResult

    replica = PostgresReplica(pg_dsn)
    try:
        await apply(replica, [event(10, ChangeOp.INSERT, {"id": 1, "n": 1, "body": "fine"})])
        w = event(20, ChangeOp.INSERT, {"id": 2, "n": 2, "body": "a\x00b"})
        assert await replica.on_start_window(w) is None
        for e in w.events:
            assert await replica.on_event(e) is None
        assert await replica.on_end_window(w) is CallbackResult.FATAL
    finally:
        await replica.close()
    assert "holds a NUL byte" in caplog.text
