"""Rows moved to another key, with writers of other keys sharing the tables.

The relay's key filters (and a consumer group's lanes) route an event by the
hash of its key. An update moving a row from key ``k`` to ``k'`` went to the
writer of ``k'`` only, which deleted ``k`` in the shared table at its own
pace: the row ``k`` stayed (the writer of ``k`` inserted it later) or a row
re-inserted under ``k`` since was deleted (the writer of ``k`` had got there
first). Found by review. The fetchers now follow such an update with the old
key's DELETE, which reaches the old key's writer in its own order, and a
writer of shared tables leaves the old key alone.

End to end: Postgres -> relay -> two replicas with disjoint key filters
writing into one database, one after the other, in both orders; the
database must equal the source row by row.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from pathlib import Path
from typing import Any

import psycopg
import pytest
from test_client_replica_keys import apply
from test_e2e_pg import free_port, pg_relay, sync_marker

from changebus.client import ChangeEvent, ChangeOp, ConsumerConfig, SqliteReplica, Window
from changebus.schemas import Column, TableSchema, avro_long, key_hash
from fix_pg import caught_up, wait_until

pytestmark = pytest.mark.pg


def bucket(key: int) -> int:
    """The ``mod:2`` bucket of an ``int`` key (its Avro bytes' hash)."""
    return key_hash(avro_long(key)) % 2


def workload(dsn: str) -> None:
    """Rows moved to a key of the other bucket; half of the old keys come back."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO items SELECT g, 'first' FROM generate_series(1, 30) g")
        for k in range(1, 31):
            new = next(n for n in range(1000 + 100 * k, 1100 + 100 * k) if bucket(n) != bucket(k))
            conn.execute("UPDATE items SET id = %s, v = 'moved' WHERE id = %s", (new, k))
            if k % 2:
                conn.execute("INSERT INTO items VALUES (%s, 'back')", (k,))
            if k % 3 == 0:
                conn.execute("UPDATE items SET v = 'again' WHERE id = %s", (new,))


async def replicate(db: Path, url: str, part: int, end: int) -> None:
    """Run the replica of key bucket ``part`` into ``db`` until it holds SCN ``end``."""
    replica = SqliteReplica(db, consumer_name=f"part{part}")
    config = ConsumerConfig(relays=(url,), partition="pg", wait_s=0.3, filter=f"mod:2:{part}")

    async def watch() -> None:
        await wait_until(
            lambda: replica._stored is not None and replica._stored.get("pg").window_scn >= end
        )
        replica.stop()

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait_for(replica.run(config), 60)
    finally:
        watcher.cancel()
        await replica.close()


async def test_filtered_replicas_follow_rows_moved_between_their_keys_in_either_order(
    pg_dsn: str, tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    async with pg_relay(tmp_path, pg_dsn, port) as relay:
        await caught_up(relay, pg_dsn)  # the relay reads the slot: it sees every change
        await asyncio.to_thread(workload, pg_dsn)
        end = await sync_marker(pg_dsn)
        await caught_up(relay, pg_dsn)
        for order in ((0, 1), (1, 0)):
            db = tmp_path / f"first{order[0]}.db"
            for part in order:
                await replicate(db, url, part, end)
            with sqlite3.connect(db) as target:
                got = sorted(target.execute('SELECT id, v FROM "public_items"').fetchall())
            with psycopg.connect(pg_dsn) as conn:
                want = sorted(conn.execute("SELECT id, v FROM items").fetchall())
            assert len(want) == 45 and set(map(bucket, (k for k, _ in want))) == {0, 1}
            assert got == want, f"writers in order {order}"


T = TableSchema(
    "app.docs",
    (Column("id", "long", nullable=False), Column("n", "long"), Column("body", "string")),
    ("id",),
    1,
)


async def test_a_shared_writer_refuses_a_key_move_without_the_rows_values(tmp_path: Path) -> None:
    """Postgres leaves an unchanged TOASTed value out of an update (REPLICA IDENTITY
    DEFAULT). A writer that owns the whole table moves the old key's row and keeps it;
    a writer of shared tables must not touch the old key's row, so it stops with a
    clear error rather than writing the new key without the value."""
    move = ChangeEvent(
        scn=30,
        seq=0,
        op=ChangeOp.UPDATE,
        table=T.name,
        key={"id": 7},
        after={"id": 7, "n": 3, "body": None},
        before={"id": 1, "n": None, "body": None},
        schema=T,
        not_sent=("body",),
        before_not_sent=("n", "body"),
    )
    replica = SqliteReplica(tmp_path / "r.db")
    replica.shared_tables = True
    try:
        await replica.load()
        w = Window(scn=30, timestamp_ns=30, partition="p", events=(move,))
        assert await replica.on_start_window(w) is None
        assert await replica.on_event(move) is None
        outcome: Any = await replica.on_end_window(w)
    finally:
        await replica.close()
    assert outcome is not None and outcome.name == "FATAL"
    assert replica._stored is None  # nothing was written


async def test_a_shared_writer_leaves_the_old_key_to_its_writer(tmp_path: Path) -> None:
    """The new key's writer upserts the new key only; the old key's DELETE (which
    follows the update in the stream) is the old key's writer's."""
    db = tmp_path / "r.db"
    new_keys = SqliteReplica(db, consumer_name="new")
    new_keys.shared_tables = True
    old_keys = SqliteReplica(db, consumer_name="old")
    old_keys.shared_tables = True

    def w(scn: int, op: ChangeOp, key: int, after: Any, before: Any = None) -> Window:
        e = ChangeEvent(scn, 0, op, T.name, {"id": key}, after, before, schema=T)
        return Window(scn=scn, timestamp_ns=scn, partition="p", events=(e,))

    row1, row7 = {"id": 1, "n": 1, "body": "x"}, {"id": 7, "n": 1, "body": "x"}
    try:
        # the old key's writer is ahead: key 1 came back after the move at 20
        await apply(
            old_keys,
            [
                w(10, ChangeOp.INSERT, 1, row1),
                w(20, ChangeOp.DELETE, 1, None, row1),  # the move's companion
                w(30, ChangeOp.INSERT, 1, {**row1, "body": "back"}),
            ],
        )
        await apply(new_keys, [w(20, ChangeOp.UPDATE, 7, row7, row1)])
    finally:
        await new_keys.close()
        await old_keys.close()
    with sqlite3.connect(db) as conn:
        rows = sorted(conn.execute('SELECT id, body FROM "app_docs"').fetchall())
    assert rows == [(1, "back"), (7, "x")]


def move_windows(unit: str = "") -> list[Window]:
    """Row 1 (a big TOASTed body) inserted, then moved to key 7 without its body (an
    unchanged TOAST value), followed by the old key's DELETE; ``unit``: a group's."""
    big = "b" * 5000
    windows = [
        Window(
            scn=10,
            timestamp_ns=10,
            partition="p",
            events=(
                ChangeEvent(
                    10,
                    0,
                    ChangeOp.INSERT,
                    T.name,
                    {"id": 1},
                    {"id": 1, "n": 1, "body": big},
                    None,
                    schema=T,
                ),
            ),
        ),
        Window(
            scn=20,
            timestamp_ns=20,
            partition="p",
            events=(
                ChangeEvent(
                    20,
                    0,
                    ChangeOp.UPDATE,
                    T.name,
                    {"id": 7},
                    {"id": 7, "n": 3, "body": None},
                    {"id": 1, "n": None, "body": None},
                    schema=T,
                    not_sent=("body",),
                    before_not_sent=("n", "body"),
                ),
                ChangeEvent(
                    20,
                    1,
                    ChangeOp.DELETE,
                    T.name,
                    {"id": 1},
                    None,
                    {"id": 1, "n": None, "body": None},
                    schema=T,
                    before_not_sent=("n", "body"),
                ),
            ),
        ),
    ]
    return [dataclasses.replace(w, unit=unit) for w in windows]


async def test_a_shared_writer_moves_rows_between_keys_of_its_own(tmp_path: Path) -> None:
    """A writer whose filter owns the old key too (a lone ``mod:1:0``, or two keys of
    its own buckets) gets the old key's DELETE as well, in its order: it moves the row
    as a lone replica does, unsent TOASTed values kept, instead of stopping (review)."""
    from changebus.schemas import PartitionFilter

    db = tmp_path / "r.db"
    replica = SqliteReplica(db)
    replica.shared_tables = True
    replica.key_filter = PartitionFilter.parse("mod:1:0")
    try:
        await apply(replica, move_windows())
    finally:
        await replica.close()
    with sqlite3.connect(db) as conn:
        assert conn.execute('SELECT id, n, body FROM "app_docs"').fetchall() == [(7, 3, "b" * 5000)]


@pytest.mark.parametrize("buckets", [1, 2])
async def test_a_group_unit_moves_rows_between_keys_of_its_own_bucket(
    tmp_path: Path, buckets: int
) -> None:
    """A group's unit window whose moved row's old key is of the same bucket holds the
    old key's DELETE too (one transaction): it moves the row, unsent TOASTed values
    kept. The replica did not know the group's bucket count, so every old key counted
    as another unit's: a one-bucket group stopped on such a move (review). Keys 1 and 7
    are in different buckets of two: there the move is refused as before."""
    from changebus.schemas import Unit

    assert bucket(1) != bucket(7)
    unit = Unit("p", bucket(7) % buckets)
    replica = SqliteReplica(tmp_path / "r.db")
    replica.unit_buckets = buckets  # (what run() of a group config sets)
    try:
        await replica.load()
        await replica.claim("g", unit, "m-1")
        windows = move_windows(str(unit))
        outcomes = []
        for w in windows:
            if buckets == 2 and w.scn == 10:
                w = dataclasses.replace(w, unit=str(Unit("p", bucket(1))))
                await replica.claim("g", Unit("p", bucket(1)), "m-1")
            assert await replica.on_start_window(w) is None
            for e in w.events:
                assert await replica.on_event(e) is None
            outcomes.append(await replica.on_end_window(w))
        rows = replica.query('SELECT id, n, body FROM "app_docs"')
    finally:
        await replica.close()
    if buckets == 1:
        assert outcomes == [None, None] and rows == [(7, 3, "b" * 5000)]
    else:
        assert outcomes[1] is not None and outcomes[1].name == "FATAL"
        assert rows == [(1, 1, "b" * 5000)]
