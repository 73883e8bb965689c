"""A TRUNCATE in tables that several writers share empties them once, for all of them.

The units of a consumer group (and replicas with key filters) write their
own keys of one table, each at its own pace, and every one of them receives
the table's TRUNCATE (it has no key). Each unit ran ``DELETE FROM table``
on it: the slowest unit's TRUNCATE deleted the rows the faster units had
written after it (found by review). Now the first writer to reach a
TRUNCATE applies it and records its SCN; the others drop their changes of
the table it made dead, and do not run it again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from changebus.client import (
    ChangeEvent,
    ChangeOp,
    PostgresReplica,
    Replica,
    SqliteReplica,
    Window,
)
from changebus.schemas import Column, TableSchema, Unit

G = "shared"
UA, UB = Unit("orders", 3), Unit("orders", 17)
T = TableSchema(
    "app.items", (Column("id", "long", nullable=False), Column("v", "string")), ("id",), 1
)

Op = tuple[str, int | None]  # ("put", key) or ("truncate", None)


def window(scn: int, ops: list[Op], unit: Unit | None) -> Window:
    events = []
    for seq, (what, key) in enumerate(ops):
        if what == "truncate":
            events.append(
                ChangeEvent(scn, seq, ChangeOp.TRUNCATE, T.name, {}, None, None, schema=T)
            )
        else:
            row = {"id": key, "v": f"v{key}@{scn}"}
            events.append(
                ChangeEvent(scn, seq, ChangeOp.INSERT, T.name, {"id": key}, row, None, schema=T)
            )
    return Window(
        scn=scn,
        timestamp_ns=scn,
        partition="orders",
        events=tuple(events),
        unit=str(unit) if unit is not None else "",
    )


async def deliver(replica: Replica, w: Window) -> Any:
    assert await replica.on_start_window(w) is None
    for e in w.events:
        assert await replica.on_event(e) is None
    return await replica.on_end_window(w)


def keys_of(replica: Replica) -> list[int]:
    table = replica._qualified(replica.table_for(T.name))
    return sorted(int(k) for (k,) in replica.query(f"SELECT id FROM {table}"))


MakeReplica = Callable[[str], Replica]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.pg)])
async def make(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[MakeReplica]:
    """Replicas (writers) over one database: SQLite file or a fresh Postgres database."""
    made: list[Replica] = []
    dsn = request.getfixturevalue("pg_dsn") if request.param == "postgres" else ""

    def new(name: str) -> Replica:
        replica: Replica = (
            PostgresReplica(dsn, consumer_name=name)
            if dsn
            else SqliteReplica(tmp_path / "r.db", consumer_name=name)
        )
        made.append(replica)
        return replica

    yield new
    for replica in made:
        await replica.close()


@pytest.mark.parametrize("grouped", [True, False], ids=["units", "filters"])
async def test_the_slowest_writers_truncate_deletes_nothing_written_after_it(
    make: MakeReplica, grouped: bool
) -> None:
    a, b = make("a"), make("b")
    if grouped:
        await a.claim(G, UA, "m-a")  # type: ignore[attr-defined]
        await b.claim(G, UB, "m-b")  # type: ignore[attr-defined]
    else:  # consumers with disjoint key filters writing into one database
        a.shared_tables = b.shared_tables = True
    ua, ub = (UA, UB) if grouped else (None, None)
    assert await deliver(a, window(10, [("put", 1)], ua)) is None
    assert await deliver(b, window(10, [("put", 2)], ub)) is None
    # a is ahead: the TRUNCATE at 50 (after a row of its own, before another), then 60
    assert await deliver(a, window(50, [("put", 9), ("truncate", None), ("put", 3)], ua)) is None
    assert await deliver(a, window(60, [("put", 5)], ua)) is None
    assert keys_of(a) == [3, 5]
    # b catches up: its changes before the TRUNCATE are dead, and its TRUNCATE must not
    # delete what a wrote after it
    assert await deliver(b, window(40, [("put", 6)], ub)) is None
    assert keys_of(b) == [3, 5]
    assert await deliver(b, window(50, [("put", 8), ("truncate", None), ("put", 4)], ub)) is None
    assert await deliver(b, window(70, [("put", 7)], ub)) is None
    assert keys_of(b) == [3, 4, 5, 7]
    # a later TRUNCATE, reached by b first this time, empties the table again once
    assert await deliver(b, window(80, [("truncate", None), ("put", 11)], ub)) is None
    assert await deliver(a, window(75, [("put", 12)], ua)) is None
    assert await deliver(a, window(80, [("truncate", None), ("put", 13)], ua)) is None
    assert keys_of(a) == [11, 13]
    assert a.windows_applied == 5 and b.windows_applied == 5


@pytest.mark.pg
async def test_a_truncate_waits_for_a_writer_applying_an_older_window(pg_dsn: str) -> None:
    """The two orders are both right only if they are two: a writer reading the record
    (no TRUNCATE yet) while another commits the TRUNCATE would write its dead rows after
    it. The record row is locked (FOR SHARE by every window, FOR UPDATE by a truncating
    one), so the TRUNCATE waits for the older window's transaction."""
    a = PostgresReplica(pg_dsn, consumer_name="a")
    try:
        await a.claim(G, UA, "m-a")
        assert await deliver(a, window(10, [("put", 1)], UA)) is None
        table = f"{a.checkpoint_table}_truncations"
        with psycopg.connect(pg_dsn) as other:  # another unit, in the middle of a window
            other.execute(f'SELECT scn FROM "{table}" WHERE tbl = %s FOR SHARE', ("app.items",))
            truncating = asyncio.ensure_future(
                deliver(a, window(50, [("truncate", None), ("put", 3)], UA))
            )
            await asyncio.sleep(0.5)
            assert not truncating.done()
            other.execute('INSERT INTO "app"."items" VALUES (2, %s)', ("older",))
            other.commit()  # its row is older than the TRUNCATE: the TRUNCATE deletes it
        assert await asyncio.wait_for(truncating, 10) is None
        assert keys_of(a) == [3]
    finally:
        with contextlib.suppress(Exception):
            await a.close()


async def test_a_writer_bootstrapping_from_nothing_records_the_truncate(make: MakeReplica) -> None:
    """A writer from nothing gets the snapshot's rows (all after the TRUNCATE) and, being
    filtered, the TRUNCATE first (the bootstrap server sends it): it records it, so that
    a writer still before it does not empty the table again when it gets there."""
    a, b = make("a"), make("b")
    await a.claim(G, UA, "m-a")  # type: ignore[attr-defined]
    await b.claim(G, UB, "m-b")  # type: ignore[attr-defined]
    assert await deliver(b, window(10, [("put", 2)], UB)) is None
    # a bootstraps: the TRUNCATE (at 50, seq 1), then a row last changed at 55
    truncate = ChangeEvent(50, 1, ChangeOp.TRUNCATE, T.name, {}, None, None, schema=T)
    row = {"id": 20, "v": "snap"}
    snap_row = ChangeEvent(55, 0, ChangeOp.INSERT, T.name, {"id": 20}, row, None, schema=T)
    snapshot = Window(
        scn=60,
        timestamp_ns=60,
        partition="orders",
        events=(truncate, snap_row),
        unit=str(UA),
        phase="snapshot",
    )
    assert await deliver(a, snapshot) is None
    assert keys_of(a) == [20]  # b's row 2 was older than the TRUNCATE
    # b reaches the TRUNCATE: applied already; its row after it stays, and a's too
    assert await deliver(b, window(50, [("put", 8), ("truncate", None), ("put", 4)], UB)) is None
    assert keys_of(b) == [4, 20]
