"""What the assembler makes of transactions that end otherwise than by a commit.

A table's SCHEMA_CHANGE goes out with the first window that is sent, whatever
was read before.

The assembler marks a table version announced when it puts its SCHEMA_CHANGE
into the open transaction. A transaction thrown away after that -- the
stream reconnecting in its middle (read again from its start), a GTID event
replacing a group the binlog never ended, a window read again that the relay
holds already -- kept the mark: the window sent later lacked the
SCHEMA_CHANGE, and consumers failed on an unknown schema version (found by
review). Fed the events of a real MariaDB binlog.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_mysql_fetcher import execute
from test_mysql_oversized import binlog_events, feed

from changebus.fetchers.mysql import BinlogAssembler, DeclaredTypes, EmbeddedMariaDB
from changebus.fetchers.mysql._workers import start_workers
from changebus.schemas import (
    ChangeDecoder,
    Op,
    SchemaRegistry,
    decode_header,
    event_at,
    key_hash,
    parse_stream,
)

pytestmark = pytest.mark.mysql


def binlog_of(server: EmbeddedMariaDB, db: str, *statements: str) -> list[Any]:
    """The binlog events ``statements`` write, run in one session (then committed)."""
    conn = server.connect(db)
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW MASTER STATUS")
            file, pos = cur.fetchone()[:2]
            for statement in statements:
                cur.execute(statement)
        conn.commit()
    finally:
        conn.close()
    return list(binlog_events(server, file, int(pos)))


def _events(server: EmbeddedMariaDB, db: str) -> list[Any]:
    """The binlog events of one transaction inserting a row into a new table."""
    execute(server, db, "CREATE TABLE t (id int PRIMARY KEY, v varchar(20))")
    return binlog_of(server, db, "INSERT INTO t VALUES (1, 'a')")


def _feed(assembler: BinlogAssembler, events: list[Any], upto: str = "") -> list[Any]:
    """Feed ``events`` (until the first of class ``upto``); the windows made."""
    windows = []
    for event in events:
        if type(event).__name__ == upto:
            break
        window = feed(assembler, event)
        if window is not None:
            windows.append(window)
    return windows


def _ops(window: Any) -> list[Op]:
    _offsets, headers = parse_stream(window.data)
    return [Op(int(o)) for o in headers["op"].tolist()]


@pytest.mark.parametrize("how", ["reconnect", "gtid", "replayed"])
def test_a_transaction_thrown_away_does_not_keep_its_announcement(
    mysql_server: EmbeddedMariaDB, mysql_db: str, how: str
) -> None:
    events = _events(mysql_server, mysql_db)
    registry = SchemaRegistry()
    assembler = BinlogAssembler(1, registry, DeclaredTypes(), databases=(mysql_db,))
    if how == "replayed":
        (first,) = _feed(assembler, events)  # sent by the fetcher's first run
        assert Op.SCHEMA_CHANGE in _ops(first)
        # restarted: the relay holds that window already, it is read again and dropped
        assembler = BinlogAssembler(1, registry, DeclaredTypes(), databases=(mysql_db,))
        assembler.replay_until = first.scn
        assert len(_feed(assembler, events)) == 1  # (the caller drops it)
        assembler.replay_until = -1
        (window,) = _feed(assembler, events)  # a later window of the table
    else:
        # read up to the rows, then the connection drops (or a GTID event comes)
        assert _feed(assembler, events, upto="XidEvent") == []
        if how == "reconnect":
            assembler.reset()
        (window,) = _feed(assembler, events)
    assert _ops(window)[:2] == [Op.SCHEMA_CHANGE, Op.INSERT]


def test_rows_rolled_back_to_a_savepoint_are_not_sent(
    mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    """A part of a transaction rolled back to a savepoint stays in the binlog, followed
    by ``ROLLBACK TO``, when it also changed a non-transactional table (whose changes
    persisted; ROW format logs those as groups of their own). The assembler ignored
    the ROLLBACK TO and sent the rolled-back rows as committed (found while testing
    a review's finding)."""
    execute(
        mysql_server,
        mysql_db,
        "CREATE TABLE m (id int PRIMARY KEY) ENGINE=MyISAM",
        "CREATE TABLE i (id int PRIMARY KEY) ENGINE=InnoDB",
        "CREATE TRIGGER i_to_m AFTER INSERT ON i FOR EACH ROW INSERT INTO m VALUES (NEW.id)",
    )
    events = binlog_of(
        mysql_server,
        mysql_db,
        "BEGIN",
        "INSERT INTO i VALUES (1)",
        "ROLLBACK",
        "BEGIN",
        "INSERT INTO i VALUES (2)",
        "SAVEPOINT `s``1`",
        "INSERT INTO i VALUES (3)",
        "ROLLBACK TO SAVEPOINT `s``1`",
        "COMMIT",
    )
    conn = mysql_server.connect(mysql_db)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT id FROM i")
            assert [r[0] for r in cur.fetchall()] == [2]  # (3 was rolled back)
    finally:
        conn.close()
    assert any("ROLLBACK TO" in str(getattr(e, "query", "")) for e in events)
    assembler = BinlogAssembler(1, SchemaRegistry(), DeclaredTypes(), databases=(mysql_db,))
    windows = _feed(assembler, events)
    # the trigger's MyISAM rows 1, 2, 3 (they persisted), then the transaction: row 2 only
    assert [_ops(w).count(Op.INSERT) for w in windows] == [1, 1, 1, 1]
    assert assembler.row_count == 4


@pytest.mark.parametrize("workers", [0, 1])
def test_an_update_changing_the_key_is_followed_by_the_old_keys_delete(
    mysql_server: EmbeddedMariaDB, mysql_db: str, workers: int
) -> None:
    """Key filters (the relay's, a consumer group's) route an event by its key's hash:
    an update moving a row to another key reached only the new key's reader, and the
    old key's row stayed with its reader, or was deleted there out of order (found by
    review). The old key's DELETE now follows the update, routed by the old key."""
    execute(mysql_server, mysql_db, "CREATE TABLE k (id int PRIMARY KEY, v varchar(20))")
    events = binlog_of(
        mysql_server,
        mysql_db,
        "BEGIN",
        "INSERT INTO k VALUES (1, 'a'), (2, 'b')",
        "UPDATE k SET id = 7 WHERE id = 1",
        "UPDATE k SET v = 'c' WHERE id = 2",
        "COMMIT",
    )
    pool = start_workers(workers, "keys") if workers else None
    try:
        assembler = BinlogAssembler(
            1, SchemaRegistry(), DeclaredTypes(), databases=(mysql_db,), pool=pool
        )
        (made,) = _feed(assembler, events)
        window = made.resolve() if hasattr(made, "resolve") else made
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    offsets, headers = parse_stream(window.data)
    table = assembler.registry.latest(f"{mysql_db}.k")
    dec = ChangeDecoder(table)
    seen = []
    for off, h in zip(offsets.tolist(), headers, strict=True):
        op = Op(int(h["op"]))
        if op.is_control:
            continue
        key, payload = event_at(window.data, off, decode_header(window.data, off))
        assert int(h["key_hash"]) == key_hash(bytes(key))
        change = dec.decode(bytes(payload))
        seen.append((op, dec.decode_key(bytes(key))["id"], change.after, change.before))
    assert seen == [
        (Op.INSERT, 1, {"id": 1, "v": "a"}, None),
        (Op.INSERT, 2, {"id": 2, "v": "b"}, None),
        (Op.UPDATE, 7, {"id": 7, "v": "a"}, {"id": 1, "v": "a"}),
        (Op.DELETE, 1, None, {"id": 1, "v": "a"}),  # routed by the old key
        (Op.UPDATE, 2, {"id": 2, "v": "c"}, {"id": 2, "v": "b"}),  # same key: nothing more
    ]
    assert assembler.row_count == 5


def test_more_tables_than_the_layout_cache_holds_are_not_compiled_again(
    mysql_server: EmbeddedMariaDB, mysql_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past 4,096 layouts the cache was cleared whole, and a server cycling through more
    tables rebuilt and recompiled a table's layout at every TABLE_MAP (3.4 ms each). Each
    table's last layout is kept beside the cache; each version is announced once."""
    from changebus.fetchers.mysql import _tablemap

    monkeypatch.setattr(_tablemap, "_CACHED_LAYOUTS", 4)
    names = [f"c{i}" for i in range(12)]
    execute(
        mysql_server, mysql_db, *(f"CREATE TABLE {n} (id int PRIMARY KEY, v int)" for n in names)
    )
    events = binlog_of(
        mysql_server,
        mysql_db,
        *(f"INSERT INTO {n} VALUES ({r}, {r})" for r in range(3) for n in names),
    )
    compiled = 0
    real = _tablemap.compile_transcoder  # type: ignore[attr-defined]

    def counting(layout: Any) -> Any:
        nonlocal compiled
        compiled += 1
        return real(layout)

    monkeypatch.setattr(_tablemap, "compile_transcoder", counting)
    assembler = BinlogAssembler(1, SchemaRegistry(), DeclaredTypes(), databases=(mysql_db,))
    windows = _feed(assembler, events)
    assert compiled == len(names)  # once per table, not per TABLE_MAP (36 of them)
    ops = [op for w in windows for op in _ops(w)]
    assert ops.count(Op.SCHEMA_CHANGE) == len(names) and ops.count(Op.INSERT) == 36
