"""XA transactions through the MariaDB fetcher: delivered once, at the XA COMMIT, in commit order.

MariaDB (10.5+) logs an XA transaction's rows at ``XA PREPARE`` (a GTID
event group ending with an XA_PREPARE event, no XID) and ``XA COMMIT`` /
``XA ROLLBACK`` later as a group of its own, possibly after other
transactions. These tests run both against a real server, with restarts and
reconnects between the two halves.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from test_mysql_fetcher import caught_up, execute, relay_config, replay, source_rows, wait_until
from test_mysql_fetcher_ops import kill_binlog_dumps

from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.relay import Relay
from changebus.schemas import DataLoss, Op

pytestmark = pytest.mark.mysql

_TABLE = "CREATE TABLE acct (id int PRIMARY KEY, v varchar(20) NOT NULL)"


def xa(conn: Any, *statements: str) -> None:
    with conn.cursor() as cur:
        for s in statements:
            cur.execute(s)


def prepare(conn: Any, xid: str, *rows: int, started: bool = False) -> None:
    """``XA START`` (unless ``started``) .. ``XA PREPARE`` of ``xid`` inserting ``rows``."""
    if not started:
        xa(conn, f"XA START {xid}")
    xa(
        conn,
        *(f"INSERT INTO acct VALUES ({r}, 'xa {r}')" for r in rows),
        f"XA END {xid}",
        f"XA PREPARE {xid}",
    )


def roll_back_prepared(server: EmbeddedMariaDB) -> None:
    """Roll back what a failed test left prepared (it would block the database's drop)."""
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("XA RECOVER")
            for fmt, glen, blen, data in cur.fetchall():
                raw = data if isinstance(data, bytes) else data.encode()
                g, b = raw[:glen].hex(), raw[glen : glen + blen].hex()
                cur.execute(f"XA ROLLBACK X'{g}',X'{b}',{fmt}")
    finally:
        conn.close()


def inserted_ids(events: list[tuple[Op, Any]]) -> list[int]:
    return [p[1].after["id"] for op, p in events if op == Op.INSERT and p[0].endswith(".acct")]


@pytest.mark.parametrize("decode_workers", [0, 1])
async def test_xa_rows_come_once_at_the_commit_in_commit_order(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str, decode_workers: int
) -> None:
    execute(mysql_server, mysql_db, _TABLE, "CREATE TABLE other (id int PRIMARY KEY)")
    cfg = relay_config(tmp_path, mysql_server, mysql_db, decode_workers=decode_workers)
    conn = mysql_server.connect(mysql_db)
    try:
        async with Relay(cfg) as relay:
            await wait_until(lambda: relay.hosts["my"].state == "streaming")
            prepare(conn, "'a'", 1, 2)
            execute(mysql_server, mysql_db, "INSERT INTO acct VALUES (3, 'plain')")
            xa(conn, "XA COMMIT 'a'")
            # rolled back: nothing of it may arrive; the first change of `other` was in
            # it, so the next one must announce that table
            xa(conn, "XA START 'b'", "INSERT INTO other VALUES (1)")
            prepare(conn, "'b'", 4, started=True)
            xa(conn, "XA ROLLBACK 'b'")
            execute(mysql_server, mysql_db, "INSERT INTO other VALUES (2)")
            xa(  # one phase: a plain commit
                conn,
                "XA START 'c'",
                "INSERT INTO acct VALUES (5, 'one phase')",
                "XA END 'c'",
                "XA COMMIT 'c' ONE PHASE",
            )
            prepare(conn, "0x41,0x42,7", 6)  # a binary gtrid, a bqual and a format id
            execute(mysql_server, mysql_db, "UPDATE acct SET v = 'later' WHERE id = 3")
            xa(conn, "XA COMMIT 0x41,0x42,7")
            await caught_up(relay, mysql_server, mysql_db)
            rows, scns, events = replay(relay, "acct")
            others, _, _ = replay(relay, "other")
    finally:
        conn.close()
        roll_back_prepared(mysql_server)
    assert list(others) == [2]
    assert rows == source_rows(mysql_server, mysql_db, "acct")
    assert sorted(rows) == [1, 2, 3, 5, 6]
    assert inserted_ids(events) == [3, 1, 2, 5, 6]  # commit order, each once
    assert scns == sorted(set(scns))


async def test_a_prepared_xa_transaction_survives_restarts_and_reconnects(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    execute(mysql_server, mysql_db, _TABLE)
    cfg = relay_config(
        tmp_path, mysql_server, mysql_db, reconnect_backoff_s=0.05, binlog_stats_interval_s=0.1
    )
    conn, conn2 = mysql_server.connect(mysql_db), mysql_server.connect(mysql_db)
    try:
        async with Relay(cfg) as relay:
            await wait_until(lambda: relay.hosts["my"].state == "streaming")
            prepare(conn, "'r1'", 10)
            execute(mysql_server, mysql_db, "INSERT INTO acct VALUES (11, 'after prepare')")
            prepare(conn2, "'r2'", 12)
            await caught_up(relay, mysql_server, mysql_db)
            position = relay.hosts["my"].status()["fetcher"]["source_position"]
            assert "xa=" in position  # the restart point stays before the prepared rows
            # ... while the distance still counts from where the stream has read
            await wait_until(
                lambda: relay.hosts["my"].status()["fetcher"]["binlog_distance_bytes"] == 0
            )
        # down between PREPARE and COMMIT: r2 commits while the relay is down
        xa(conn2, "XA COMMIT 'r2'")
        execute(mysql_server, mysql_db, "INSERT INTO acct VALUES (13, 'while down')")
        async with Relay(cfg) as relay:
            await caught_up(relay, mysql_server, mysql_db)
            # a lost stream connection while r1 is still prepared: the fetcher's own reconnect
            await wait_until(lambda: kill_binlog_dumps(mysql_server) > 0)
            xa(conn, "XA COMMIT 'r1'")
            await caught_up(relay, mysql_server, mysql_db)
            status = relay.hosts["my"].status()["fetcher"]
            rows, scns, events = replay(relay, "acct")
    finally:
        conn.close()
        conn2.close()
        roll_back_prepared(mysql_server)
    assert status["reconnects"] >= 1
    assert "xa=" not in status["source_position"]  # nothing prepared is pending any more
    assert rows == source_rows(mysql_server, mysql_db, "acct")
    assert inserted_ids(events) == [11, 12, 13, 10]
    assert scns == sorted(set(scns))


async def test_the_commit_of_a_transaction_prepared_before_the_start_is_a_data_loss(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    execute(mysql_server, mysql_db, _TABLE)
    conn = mysql_server.connect(mysql_db)
    try:
        prepare(conn, "'early'", 20)  # before the relay's first start (start_at = current)
        async with Relay(relay_config(tmp_path, mysql_server, mysql_db)) as relay:
            await wait_until(lambda: relay.hosts["my"].state == "streaming")
            xa(conn, "XA COMMIT 'early'")
            execute(mysql_server, mysql_db, "INSERT INTO acct VALUES (21, 'plain')")
            await caught_up(relay, mysql_server, mysql_db)
            rows, _, events = replay(relay, "acct")
            losses = relay.hosts["my"].status()["fetcher"]
    finally:
        conn.close()
        roll_back_prepared(mysql_server)
    lost = [p for op, p in events if op == Op.DATA_LOSS]
    assert len(lost) == 1 and isinstance(lost[0], DataLoss)
    assert "'early'" in lost[0].reason or "early" in lost[0].reason
    assert sorted(rows) == [21]
    assert losses["windows"] > 0
    await asyncio.sleep(0)


async def test_a_rewind_to_a_prepare_finds_the_table_versions_the_relay_holds(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    """A restart reads again from the oldest pending prepare, past an ALTER TABLE.

    The table layouts it meets there are versions the relay holds; registered
    as new versions (the registry compared with the latest only), later
    events carried a version the relay never had, and the next real change of
    the table was refused by the relay's registry.
    """
    execute(mysql_server, mysql_db, _TABLE, "CREATE TABLE b (id int PRIMARY KEY, x int)")
    cfg = relay_config(tmp_path, mysql_server, mysql_db)
    conn = mysql_server.connect(mysql_db)
    try:
        async with Relay(cfg) as relay:
            await wait_until(lambda: relay.hosts["my"].state == "streaming")
            prepare(conn, "'long'", 30)
            execute(mysql_server, mysql_db, "INSERT INTO b VALUES (1, 1)")  # version 1
            execute(mysql_server, mysql_db, "ALTER TABLE b ADD COLUMN c int")
            execute(mysql_server, mysql_db, "INSERT INTO b VALUES (2, 2, 2)")  # version 2
            await caught_up(relay, mysql_server, mysql_db)
        async with Relay(cfg) as relay:  # rewinds to the prepare, reads b's v1 and v2 again
            await wait_until(lambda: relay.hosts["my"].state == "streaming")
            execute(mysql_server, mysql_db, "INSERT INTO b VALUES (3, 3, 3)")
            execute(mysql_server, mysql_db, "ALTER TABLE b ADD COLUMN d int")
            execute(mysql_server, mysql_db, "INSERT INTO b VALUES (4, 4, 4, 4)")  # version 3
            xa(conn, "XA COMMIT 'long'")
            await caught_up(relay, mysql_server, mysql_db)
            host = relay.hosts["my"]
            versions = [
                [c.name for c in t.columns] for t in host.registry.versions(f"{mysql_db}.b")
            ]
            state = host.state
            rows, scns, _ = replay(relay, "b")
            acct, _, _ = replay(relay, "acct")
    finally:
        conn.close()
        roll_back_prepared(mysql_server)
    assert state == "streaming"
    assert versions == [["id", "x"], ["id", "x", "c"], ["id", "x", "c", "d"]]
    # (rows of older versions lack the columns added since: null in the source)
    columns = ("id", "x", "c", "d")
    assert {k: {c: r.get(c) for c in columns} for k, r in rows.items()} == source_rows(
        mysql_server, mysql_db, "b"
    )
    assert sorted(acct) == [30]
    assert scns == sorted(set(scns))


async def test_prepared_transactions_together_are_bounded_like_one(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    """Each prepared half is kept until its commit; together they may not pass
    ``max_transaction_bytes`` (each one alone could, times as many as are pending).
    Past it, the newest is only counted: its commit is a DATA_LOSS (skip)."""
    execute(mysql_server, mysql_db, "CREATE TABLE acct (id int PRIMARY KEY, v varchar(9000))")
    cfg = relay_config(
        tmp_path,
        mysql_server,
        mysql_db,
        max_transaction_bytes=30_000,
        on_oversized_transaction="skip",
    )
    conn, conn2 = mysql_server.connect(mysql_db), mysql_server.connect(mysql_db)
    try:
        async with Relay(cfg) as relay:
            await wait_until(lambda: relay.hosts["my"].state == "streaming")
            for c, xid, first in ((conn, "'p1'", 40), (conn2, "'p2'", 50)):
                xa(
                    c,
                    f"XA START {xid}",
                    *(
                        f"INSERT INTO acct VALUES ({first + i}, REPEAT('v', 8000))"
                        for i in range(2)
                    ),
                    f"XA END {xid}",
                    f"XA PREPARE {xid}",
                )  # about 16 KB each: under the bound alone, past it together
            execute(mysql_server, mysql_db, "INSERT INTO acct VALUES (60, 'plain')")
            xa(conn2, "XA COMMIT 'p2'")
            xa(conn, "XA COMMIT 'p1'")
            await caught_up(relay, mysql_server, mysql_db)
            rows, scns, events = replay(relay, "acct")
    finally:
        conn.close()
        conn2.close()
        roll_back_prepared(mysql_server)
    lost = [p for op, p in events if op == Op.DATA_LOSS]
    assert len(lost) == 1 and isinstance(lost[0], DataLoss)
    assert "max_transaction_bytes" in lost[0].reason
    assert sorted(rows) == [40, 41, 60]  # p1 whole; p2 a data loss, not half of it
    assert scns == sorted(set(scns))


@pytest.mark.parametrize("on_purged", ["fail", "data_loss"])
async def test_a_purged_prepare_stops_or_becomes_a_data_loss_at_its_commit(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str, on_purged: str
) -> None:
    execute(mysql_server, mysql_db, _TABLE)
    cfg = relay_config(tmp_path, mysql_server, mysql_db, on_binlog_purged=on_purged)
    conn, conn2 = mysql_server.connect(mysql_db), mysql_server.connect(mysql_db)
    try:
        async with Relay(cfg) as relay:
            await wait_until(lambda: relay.hosts["my"].state == "streaming")
            prepare(conn, "'gone'", 70)
            execute(mysql_server, mysql_db, "FLUSH BINARY LOGS")
            prepare(conn2, "'kept'", 73)  # in a file that stays
            execute(mysql_server, mysql_db, "INSERT INTO acct VALUES (71, 'after')")
            await caught_up(relay, mysql_server, mysql_db)
        with mysql_server.connect() as admin, admin.cursor() as cur:
            cur.execute("SHOW MASTER STATUS")
            current = cur.fetchone()[0]
            cur.execute(f"PURGE BINARY LOGS TO '{current}'")
            cur.execute("SHOW BINARY LOGS")
            kept = [r[0] for r in cur.fetchall()]
        async with Relay(cfg) as relay:
            host = relay.hosts["my"]
            if on_purged == "fail":
                await wait_until(lambda: host.state == "failed")
                assert "was purged" in host.last_error and "XA RECOVER" in host.last_error
                rows = None
            else:
                await wait_until(lambda: host.state == "streaming")
                xa(conn, "XA COMMIT 'gone'")
                xa(conn2, "XA COMMIT 'kept'")  # its rows are in a kept file: delivered
                execute(mysql_server, mysql_db, "INSERT INTO acct VALUES (72, 'later')")
                await caught_up(relay, mysql_server, mysql_db)
                rows, _, events = replay(relay, "acct")
    finally:
        conn.close()
        conn2.close()
        roll_back_prepared(mysql_server)
    assert kept == [current]
    if rows is not None:
        lost = [p for op, p in events if op == Op.DATA_LOSS]
        assert len(lost) == 1 and "gone" in lost[0].reason
        assert sorted(rows) == [71, 72, 73]


async def test_a_rewind_does_not_apply_a_ddl_statement_twice(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    """The declared types (uuid is binary(16) in the binlog) are seeded as at the
    relay's last window; a rewind reads the DDL before it again. Applied a second
    time, swapping renames (u -> w, n -> u) gave w the type of n: the next rows of
    the table came with w as an int-declared binary(16), a new schema version."""
    execute(
        mysql_server,
        mysql_db,
        _TABLE,
        "CREATE TABLE b (id int PRIMARY KEY, u uuid, n int)",
    )
    cfg = relay_config(tmp_path, mysql_server, mysql_db)
    conn = mysql_server.connect(mysql_db)
    uid = "6ccd780c-baba-1026-9564-5b8c656024db"
    try:
        async with Relay(cfg) as relay:
            await wait_until(lambda: relay.hosts["my"].state == "streaming")
            prepare(conn, "'ddl'", 80)
            execute(mysql_server, mysql_db, f"INSERT INTO b VALUES (1, '{uid}', 1)")
            execute(
                mysql_server, mysql_db, "ALTER TABLE b RENAME COLUMN u TO w, RENAME COLUMN n TO u"
            )
            execute(mysql_server, mysql_db, f"INSERT INTO b (id, w, u) VALUES (2, '{uid}', 2)")
            await caught_up(relay, mysql_server, mysql_db)
        async with Relay(cfg) as relay:  # rewinds to the prepare, past the ALTER
            await wait_until(lambda: relay.hosts["my"].state == "streaming")
            execute(mysql_server, mysql_db, f"INSERT INTO b (id, w, u) VALUES (3, '{uid}', 3)")
            xa(conn, "XA COMMIT 'ddl'")
            await caught_up(relay, mysql_server, mysql_db)
            types = [
                {c.name: c.source_type for c in t.columns}
                for t in relay.hosts["my"].registry.versions(f"{mysql_db}.b")
            ]
            rows, _, _ = replay(relay, "b")
    finally:
        conn.close()
        roll_back_prepared(mysql_server)
    assert len(types) == 2, types
    assert "uuid" in types[0]["u"] and "uuid" in types[1]["w"], types
    assert str(rows[3]["w"]) == str(rows[2]["w"]) == uid and rows[3]["u"] == 3
