"""Schema resolution, replicas (SQLite; PostgreSQL with the pg marker), wire validation units."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from changebus.client import (
    ChangeOp,
    Consumer,
    ConsumerConfig,
    PostgresReplica,
    SqliteReplica,
    Window,
)
from changebus.client._assembler import EventSplitter, WindowAssembler
from changebus.client._backoff import Backoff
from changebus.relay import Relay
from changebus.schemas import (
    Column,
    CorruptEventError,
    EndOfWindow,
    Op,
    TableSchema,
    encode_control,
)

MakeRelay = Callable[..., AbstractAsyncContextManager[Relay]]


def config(url: str, **kw: Any) -> ConsumerConfig:
    return ConsumerConfig(relays=(url,), partition="syn", wait_s=0.3, **kw)


async def take(consumer: Consumer, n: int) -> list[Window]:
    out: list[Window] = []
    async for window in consumer:
        out.append(window)
        if len(out) == n:
            break
    return out


V1 = TableSchema(
    "app.users", (Column("id", "long", nullable=False), Column("name", "string")), ("id",), 1
)
V2 = TableSchema(
    "app.users",
    (Column("id", "long", nullable=False), Column("name", "string"), Column("email", "string")),
    ("id",),
    2,
)


async def test_schema_versions_resolve_to_reader(scripted_relay: Any, window_type: Any) -> None:
    W = window_type
    script = [
        W(10, rows=[(V1, 1, Op.INSERT, {"id": 1, "name": "ann"}, None)], announce=[(1, V1)]),
        W(
            20,
            rows=[(V2, 1, Op.INSERT, {"id": 2, "name": "bob", "email": "b@x"}, None)],
            announce=[(1, V2)],
        ),
        W(30, rows=[(V2, 1, Op.DELETE, None, {"id": 1, "name": None, "email": None})]),
    ]
    async with scripted_relay(script) as relay:
        # as written
        async with Consumer(config(relay.url)) as c:
            w = await take(c, 3)
        assert w[0].events[0].after == {"id": 1, "name": "ann"}
        assert w[1].events[0].after == {"id": 2, "name": "bob", "email": "b@x"}
        assert [e.schema_version for x in w for e in x.events] == [1, 2, 2]
        assert w[1].schema_changes[0].version == 2
        # the newest version for every row (from the middle: schemas fetched from the relay)
        async with Consumer(config(relay.url, resolve_latest=True)) as c:
            w = await take(c, 3)
        assert w[0].events[0].after == {"id": 1, "name": "ann", "email": None}
        assert w[2].events[0].op is ChangeOp.DELETE and w[2].events[0].key == {"id": 1}
        # an application's own reader schema (drops a column)
        reader = TableSchema("app.users", (Column("id", "long", nullable=False),), ("id",))
        async with Consumer(config(relay.url, reader_schemas={"app.users": reader})) as c:
            w = await take(c, 3)
        assert [e.after for x in w for e in x.events] == [{"id": 1}, {"id": 2}, None]
        async with Consumer(config(relay.url, start="10")) as c:
            w = await take(c, 2)
            assert c.stats()["schema_fetches"] == 0  # learned from the SCHEMA_CHANGE in 20
        assert [x.scn for x in w] == [20, 30]


def rebuild(windows: list[Window]) -> dict[str, dict[Any, dict[str, Any]]]:
    """Tables as the events say they are: key -> row."""
    tables: dict[str, dict[Any, dict[str, Any]]] = {}
    for w in windows:
        for e in w.events:
            rows = tables.setdefault(e.table, {})
            key = tuple(e.key.values())
            if e.op is ChangeOp.DELETE:
                rows.pop(key, None)
            elif e.op is ChangeOp.TRUNCATE:
                rows.clear()
            else:
                assert e.after is not None
                rows[key] = dict(e.after)
    return tables


async def run_replica(replica: SqliteReplica | PostgresReplica, url: str, windows: int) -> None:
    """Replicate until the replica holds the checkpoint of SCN 1000 + windows - 1."""
    last = 1000 + windows - 1

    async def watch() -> None:
        while True:
            stored = replica._stored
            if stored is not None and stored.get("syn").window_scn >= last:
                replica.stop()
                return
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait_for(replica.run(config(url)), 20)
    finally:
        watcher.cancel()


SMALL_KEYS: dict[str, Any] = {"keys": 40, "update_ratio": 0.4, "delete_ratio": 0.2}


async def test_sqlite_replica_equals_rows_rebuilt_from_events(
    make_relay: MakeRelay, tmp_path: Path
) -> None:
    db = tmp_path / "replica.db"
    async with make_relay(**SMALL_KEYS) as relay:
        async with Consumer(config(relay.url)) as c:
            expected = rebuild(await take(c, 300))
        assert {e for t in expected.values() for e in t} and any(
            len(t) < 40 for t in expected.values()
        )
        replica = SqliteReplica(db)
        try:
            await run_replica(replica, relay.url, 150)
            # a restart continues from the checkpoint stored with the rows
            replica2 = SqliteReplica(db)
            try:
                await run_replica(replica2, relay.url, 300)
                # nothing applied twice, nothing skipped across the restart
                assert replica.windows_applied >= 150
                assert replica.windows_applied + replica2.windows_applied == 300
            finally:
                await replica2.close()
        finally:
            await replica.close()
    conn = sqlite3.connect(db)
    try:
        for source, rows in expected.items():
            table = source.replace(".", "_")
            got = {
                (r[0],): {"id": r[0], "n": r[1], "payload": r[2]}
                for r in conn.execute(f'SELECT id, n, payload FROM "{table}"')
            }
            assert got == rows
        (ckpt,) = conn.execute("SELECT checkpoint FROM changebus_checkpoints").fetchone()
        assert '"window_scn":1299' in ckpt
    finally:
        conn.close()


async def test_sqlite_replica_replay_after_commit_is_skipped(
    make_relay: MakeRelay, tmp_path: Path
) -> None:
    db = tmp_path / "replica.db"

    class Flaky(SqliteReplica):
        failed = False

        async def on_checkpoint(self, checkpoint: Any) -> Any:
            if not self.failed and checkpoint.get("syn").window_scn == 1010:
                self.failed = True
                raise RuntimeError("checkpoint hook failed after the rows were committed")
            return None

    async with make_relay(max_windows=30, **SMALL_KEYS) as relay:
        replica = Flaky(db)
        try:
            await run_replica(replica, relay.url, 30)
        finally:
            await replica.close()
    assert replica.failed and replica.windows_skipped == 1 and replica.windows_applied == 30


@pytest.mark.pg
async def test_postgres_replica_equals_rows_rebuilt_from_events(
    make_relay: MakeRelay, pg_dsn: str
) -> None:
    async with make_relay(max_windows=120, **SMALL_KEYS) as relay:
        async with Consumer(config(relay.url)) as c:
            expected = rebuild(await take(c, 120))
        replica = PostgresReplica(pg_dsn)
        try:
            await run_replica(replica, relay.url, 120)
            for source, rows in expected.items():
                got = await asyncio.to_thread(
                    replica.query, f'SELECT id, n, payload FROM "synthetic"."{source[10:]}"'
                )
                assert {(r[0],): {"id": r[0], "n": r[1], "payload": r[2]} for r in got} == rows
        finally:
            await replica.close()


# ---- wire validation units ----------------------------------------------------


def _windows(n: int) -> bytes:
    return b"".join(encode_control(EndOfWindow(0), scn, 0, 1) for scn in range(100, 100 + n))


def test_splitter_and_assembler_handle_any_chunking() -> None:
    data = _windows(20)
    rng = np.random.default_rng(1)
    for i in range(40):
        cuts = sorted(rng.integers(0, len(data), 6).tolist())
        splitter, assembler = EventSplitter(), WindowAssembler()
        scns: list[int] = []
        for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True):
            if i % 2:  # split() hands its offsets on: the same windows come out
                scns.extend(w.scn for w in assembler.feed(*splitter.split(data[a:b])))
            else:
                scns.extend(w.scn for w in assembler.feed(splitter.push(data[a:b])))
        assert scns == list(range(100, 120)) and splitter.leftover == 0


def test_assembler_rejects_corruption_and_disorder() -> None:
    data = bytearray(_windows(3))
    data[70] ^= 1
    with pytest.raises(CorruptEventError):
        WindowAssembler().feed(bytes(data))
    with pytest.raises(CorruptEventError, match="SCNs must increase"):
        WindowAssembler(last_scn=101).feed(_windows(3))
    with pytest.raises(CorruptEventError):
        WindowAssembler().feed(_windows(1)[:-1])  # a body that ends early


def test_backoff_grows_with_jitter_and_caps() -> None:
    b = Backoff(0.1, 1.0, 2.0)
    delays = [b.next_delay() for _ in range(8)]
    assert 0.05 <= delays[0] <= 0.1 and all(0.5 <= d <= 1.0 for d in delays[4:])
    b.reset()
    assert b.next_delay() <= 0.1


def test_postgres_replica_stores_json_of_uuid_numeric_date_and_bytes_arrays(pg_dsn: str) -> None:
    """Arrays of uuid, numeric, dates or bytes decode to lists of such values, which the
    replica stores as jsonb: plain json.dumps refused them and the window failed on every
    retry, for good (found by review)."""
    import datetime
    import decimal
    import uuid

    import psycopg

    replica = PostgresReplica(pg_dsn)
    u = uuid.UUID("6ccd780c-baba-1026-9564-5b8c656024db")
    value = [u, decimal.Decimal("1.50"), datetime.date(2026, 11, 29), b"\x00\xff"]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE j (v jsonb)")
        conn.execute("INSERT INTO j VALUES (%s)", (replica._adapt(value),))
        (stored,) = conn.execute("SELECT v FROM j").fetchone() or (None,)
    assert stored[0] == str(u) and stored[2] == "2026-11-29" and len(stored) == 4


def test_a_column_another_replica_added_is_not_added_again(tmp_path: Path) -> None:
    """Two replicas of one database (group members): the second one's column cache was
    stale, so it ran ALTER TABLE ADD COLUMN again and failed on every replay with
    "duplicate column name" (found by review). It reads the database's columns first."""
    from types import SimpleNamespace
    from typing import cast

    from changebus.client import ChangeEvent
    from changebus.schemas import Column, TableSchema

    def of(schema: TableSchema) -> ChangeEvent:  # (what _ensure_table reads of an event)
        return cast(ChangeEvent, SimpleNamespace(schema=schema, table="app.items"))

    v1 = TableSchema(
        "app.items", (Column("id", "long", nullable=False), Column("v", "string")), ("id",), 1
    )
    v2 = TableSchema(
        "app.items",
        (Column("id", "long", nullable=False), Column("v", "string"), Column("w", "string")),
        ("id",),
        2,
    )
    db = tmp_path / "shared.db"
    first, second = SqliteReplica(db), SqliteReplica(db)
    try:
        c1, c2 = first._connection(), second._connection()
        second._ensure_table(c2, of(v1))  # its cache: id, v
        first._ensure_table(c1, of(v2))  # adds w
        second._ensure_table(c2, of(v2))
        columns = [r[1] for r in sqlite3.connect(db).execute("PRAGMA table_info(app_items)")]
        assert columns == ["id", "v", "w"]
    finally:
        first._close()
        second._close()


def test_a_failed_commit_does_not_leave_the_sqlite_transaction_open(tmp_path: Path) -> None:
    """COMMIT ran outside the rollback's reach: one that failed (busy, disk full, a
    deferred constraint) left the transaction open, and every later BEGIN failed until
    the process restarted (review)."""
    from changebus.client import SqliteReplica

    replica = SqliteReplica(tmp_path / "r.db")
    conn = replica._connect()
    try:
        conn.execute("PRAGMA foreign_keys=ON")
        conn.execute("CREATE TABLE p (id INTEGER PRIMARY KEY)")
        conn.execute(
            "CREATE TABLE c (id INTEGER PRIMARY KEY,"
            " p INTEGER REFERENCES p(id) DEFERRABLE INITIALLY DEFERRED)"
        )
        with pytest.raises(sqlite3.IntegrityError), replica._transaction(conn):
            conn.execute("INSERT INTO c VALUES (1, 99)")  # fails at COMMIT
        assert not conn.in_transaction
        with replica._transaction(conn):  # the next window's transaction begins
            conn.execute("INSERT INTO p VALUES (1)")
        assert conn.execute("SELECT id FROM p").fetchall() == [(1,)]
        assert conn.execute("SELECT id FROM c").fetchall() == []
    finally:
        conn.close()


async def test_replicators_of_one_consumer_name_keep_each_others_partitions(
    tmp_path: Path,
) -> None:
    """Two replicators with the same consumer name (``replicate`` defaults it to
    "default") writing one database, each its own partition: each commit wrote the
    whole checkpoint row and erased the other's position (review)."""
    from changebus.client import ChangeEvent

    table = TableSchema("app.t", (Column("id", "long", nullable=False),), ("id",), 1)

    def window(partition: str, scn: int, key: int) -> Window:
        event = ChangeEvent(
            scn, 0, ChangeOp.INSERT, table.name, {"id": key}, {"id": key}, None, schema=table
        )
        return Window(scn=scn, timestamp_ns=scn, partition=partition, events=(event,))

    db = tmp_path / "shared.db"

    async def restart_and_apply(steps: list[tuple[int, Window]]) -> dict[str, int]:
        """Two replicators (0, 1) load, apply ``steps`` in order, close; the stored SCNs."""
        replicas = (SqliteReplica(db), SqliteReplica(db))
        try:
            for r in replicas:
                await r.load()
            for i, w in steps:
                assert await replicas[i].on_start_window(w) is None
                for e in w.events:
                    assert await replicas[i].on_event(e) is None
                assert await replicas[i].on_end_window(w) is None
        finally:
            for r in replicas:
                await r.close()
        fresh = SqliteReplica(db)
        try:
            stored = await fresh.load()
        finally:
            await fresh.close()
        assert stored is not None
        return {n: pc.window_scn for n, pc in stored.partitions.items()}

    steps = [(0, window("pa", 10, 1)), (1, window("pb", 20, 2)), (0, window("pa", 30, 3))]
    assert await restart_and_apply(steps) == {"pa": 30, "pb": 20}
    # both restart: each loads the other's position too, and must not write it back
    # stale (B's pb=40 was set back to 20 by A's next commit; review)
    steps = [(1, window("pb", 40, 4)), (0, window("pa", 50, 5))]
    assert await restart_and_apply(steps) == {"pa": 50, "pb": 40}


async def test_a_nan_double_is_kept_in_sqlite(tmp_path: Path) -> None:
    """SQLite stores a float NaN as NULL: a Postgres source's float8 'NaN' turned NULL in
    the replica (review). Infinities are REAL values and stay so."""
    import math

    from changebus.client import ChangeEvent

    table = TableSchema(
        "app.f", (Column("id", "long", nullable=False), Column("v", "double")), ("id",), 1
    )
    db = tmp_path / "f.db"
    replica = SqliteReplica(db)
    try:
        await replica.load()
        events = tuple(
            ChangeEvent(
                10, i, ChangeOp.INSERT, table.name, {"id": i}, {"id": i, "v": v}, None, schema=table
            )
            for i, v in enumerate((math.nan, math.inf, -math.inf, 1.5))
        )
        w = Window(scn=10, timestamp_ns=10, partition="p", events=events)
        assert await replica.on_start_window(w) is None
        for e in w.events:
            assert await replica.on_event(e) is None
        assert await replica.on_end_window(w) is None
    finally:
        await replica.close()
    with sqlite3.connect(db) as conn:
        rows = conn.execute('SELECT id, v FROM "app_f" ORDER BY id').fetchall()
    assert rows == [(0, "NaN"), (1, math.inf), (2, -math.inf), (3, 1.5)]
