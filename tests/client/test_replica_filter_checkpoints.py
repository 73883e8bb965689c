"""Replicators of one consumer name with different key filters keep their own positions.

``replicate --filter mod:2:0`` and ``--filter mod:2:1`` into one database
with the default ``--consumer-name`` shared one checkpoint row: the one ahead
wrote its position (each merges only the partitions it advanced), and the
other, restarted, loaded it and skipped the windows in between as applied;
its changes to its own keys there were lost for good (review). A filter's
checkpoint now has a row of its own; a row stored under the name alone by an
older version is still loaded.
"""

from __future__ import annotations

from pathlib import Path

from test_replica_widen import deliver

from changebus.client import ChangeEvent, ChangeOp, SqliteReplica, Window
from changebus.schemas import Checkpoint, Column, PartitionFilter, TableSchema

T = TableSchema(
    "app.items", (Column("id", "long", nullable=False), Column("v", "string")), ("id",), 1
)


def window(scn: int, key: int) -> Window:
    row = {"id": key, "v": f"v{scn}"}
    event = ChangeEvent(scn, 0, ChangeOp.INSERT, T.name, {"id": key}, row, None, schema=T)
    return Window(scn=scn, timestamp_ns=scn, partition="p", events=(event,))


def filtered(path: Path, text: str) -> SqliteReplica:
    replica = SqliteReplica(path)  # (the default consumer name, as replicate's)
    replica.shared_tables = True
    replica.key_filter = PartitionFilter.parse(text)
    return replica


async def test_two_filters_of_one_name_keep_their_own_positions(tmp_path: Path) -> None:
    db = tmp_path / "replica.db"
    a, b = filtered(db, "mod:2:0"), filtered(db, "mod:2:1")
    try:
        assert await a.load() is None and await b.load() is None
        await deliver(b, window(50, 1))
        await deliver(a, window(100, 2))  # A is ahead
    finally:
        await a.close()
        await b.close()
    again = filtered(db, "mod:2:1")  # B restarts
    try:
        loaded = await again.load()
        assert loaded is not None
        assert loaded.partitions["p"].window_scn == 50  # was 100: 51..100 skipped
        assert again.windows_skipped == 0
    finally:
        await again.close()


async def test_a_checkpoint_stored_under_the_name_alone_is_loaded(tmp_path: Path) -> None:
    db = tmp_path / "replica.db"
    old = SqliteReplica(db)  # an older version: the row under the consumer name
    try:
        await old.load()
        await deliver(old, window(70, 1))
    finally:
        await old.close()
    newer = filtered(db, "mod:2:1")
    try:
        loaded = await newer.load()
        assert isinstance(loaded, Checkpoint) and loaded.partitions["p"].window_scn == 70
        await deliver(newer, window(80, 3))
    finally:
        await newer.close()
    newer = filtered(db, "mod:2:1")
    try:
        loaded = await newer.load()
        assert loaded is not None and loaded.partitions["p"].window_scn == 80
    finally:
        await newer.close()
