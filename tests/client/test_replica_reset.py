"""A replica resets itself only when it can trust the list of tables it wrote.

``Replica.reset`` empties the tables its consumer name wrote and forgets its
checkpoint. It refuses (ConfigError, nothing deleted) when that list may be
incomplete -- a replica started before the list existed -- or when another
consumer name writes the same tables (their rows would go too).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from changebus.client import ChangeEvent, ChangeOp, SqliteReplica, Window
from changebus.schemas import Column, ConfigError, TableSchema

T = TableSchema(
    "app.items", (Column("id", "long", nullable=False), Column("v", "string")), ("id",), 1
)


async def put(replica: SqliteReplica, scn: int, key: int) -> None:
    row = {"id": key, "v": f"v{key}"}
    event = ChangeEvent(scn, 0, ChangeOp.INSERT, T.name, {"id": key}, row, None, schema=T)
    w = Window(scn=scn, timestamp_ns=scn, partition="p", events=(event,))
    assert await replica.on_start_window(w) is None
    assert await replica.on_event(event) is None
    assert await replica.on_end_window(w) is None


def keys(replica: SqliteReplica) -> list[int]:
    return sorted(k for (k,) in replica.query('SELECT id FROM "app_items"'))


async def test_a_reset_empties_the_consumers_tables_and_forgets_its_checkpoint(
    tmp_path: Path,
) -> None:
    a = SqliteReplica(tmp_path / "r.db", consumer_name="a")
    try:
        assert await a.load() is None  # from nothing: the ledger is complete
        await put(a, 10, 1)
        await put(a, 11, 2)
        assert keys(a) == [1, 2] and a.checkpoint is not None
        assert await a.reset() == ["app_items"]
        assert keys(a) == [] and await a.load() is None  # (the stored checkpoint is gone)
    finally:
        await a.close()


async def test_a_reset_refuses_an_incomplete_list_or_shared_tables(tmp_path: Path) -> None:
    a = SqliteReplica(tmp_path / "r.db", consumer_name="a")
    b = SqliteReplica(tmp_path / "r.db", consumer_name="b")
    try:
        await a.load()
        await put(a, 10, 1)
        # as if "a" had started before the replica listed its tables
        a.query("DELETE FROM changebus_checkpoints_tables WHERE tbl = ''")
        with pytest.raises(ConfigError, match="reset it by hand"):
            await a.reset()
        assert keys(a) == [1] and (await a.load()) is not None
        a.query("INSERT INTO changebus_checkpoints_tables VALUES ('a', '')")
        # another consumer name writes the same table: its rows are not all a's
        await b.load()
        await put(b, 12, 2)
        with pytest.raises(ConfigError, match="shares tables with other consumers \\('b'\\)"):
            await a.reset()
        assert keys(a) == [1, 2]
    finally:
        await a.close()
        await b.close()
