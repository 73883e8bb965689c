"""DDL and TRUNCATE of a session running with ``sql_mode`` ANSI_QUOTES.

Under ANSI_QUOTES, ``"name"`` quotes a name, not a string. The fetcher's DDL
reader took it for a string (review): ``TRUNCATE TABLE "t"`` was not seen as a
TRUNCATE, so consumers kept the rows, and ``ALTER TABLE "t" ADD "c" ...`` left
the declared types behind. The binlog's query event carries the session's
sql_mode; the reader follows it.
"""

from __future__ import annotations

import pytest
from test_mysql_fetcher import execute
from test_mysql_oversized import binlog_events, feed

from changebus.fetchers.mysql import BinlogAssembler, DeclaredTypes, EmbeddedMariaDB
from changebus.schemas import Op, SchemaRegistry, parse_stream


@pytest.mark.mysql
def test_an_ansi_quotes_truncate_and_alter_are_followed(
    mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    execute(mysql_server, mysql_db, "CREATE TABLE aq (id int PRIMARY KEY, v int)")
    conn = mysql_server.connect(mysql_db)
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW MASTER STATUS")
            file, pos = cur.fetchone()[:2]
            cur.execute("INSERT INTO aq VALUES (1, 1)")
            conn.commit()
            cur.execute("SET SESSION sql_mode = 'ANSI_QUOTES'")
            cur.execute('TRUNCATE TABLE "aq"')
            cur.execute('ALTER TABLE "aq" ADD COLUMN "w" int unsigned')
            cur.execute("SET SESSION sql_mode = DEFAULT")
            # a string in double quotes again (not a name) after the mode is back
            cur.execute('ALTER TABLE aq ADD COLUMN x varchar(8) DEFAULT "a"')
    finally:
        conn.close()
    declared = DeclaredTypes()
    declared.set(mysql_db, "aq", {"id": "int", "v": "int"})  # (read at the fetcher's start)
    assembler = BinlogAssembler(1, SchemaRegistry(), declared, databases=(mysql_db,))
    ops: list[Op] = []
    for event in binlog_events(mysql_server, file, int(pos)):
        window = feed(assembler, event)
        if window is not None:
            _, headers = parse_stream(window.data)
            ops += [Op(int(o)) for o in headers["op"].tolist()]
    assert ops.count(Op.TRUNCATE) == 1
    assert ops.index(Op.INSERT) < ops.index(Op.TRUNCATE)
    types = declared.get(mysql_db, "aq") or {}
    assert types.get("w") == "int unsigned" and types.get("x") == "varchar(8)"


@pytest.mark.mysql
def test_an_ansi_quotes_savepoint_rollback_keeps_the_rows_before_it(
    mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    """``ROLLBACK TO "s1"`` did not read as a ROLLBACK TO: it passed for a whole ROLLBACK
    and the transaction's rows before the savepoint were dropped (review)."""
    execute(
        mysql_server,
        mysql_db,
        "CREATE TABLE sp (id int PRIMARY KEY) ENGINE=InnoDB",
        "CREATE TABLE sp_log (id int PRIMARY KEY) ENGINE=MyISAM",  # (the binlog keeps the rollback)
    )
    conn = mysql_server.connect(mysql_db)
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW MASTER STATUS")
            file, pos = cur.fetchone()[:2]
            cur.execute("SET SESSION sql_mode = 'ANSI_QUOTES'")
            cur.execute("BEGIN")
            cur.execute("INSERT INTO sp VALUES (1)")
            cur.execute('SAVEPOINT "s1"')
            cur.execute("INSERT INTO sp VALUES (2)")
            cur.execute("INSERT INTO sp_log VALUES (2)")
            cur.execute('ROLLBACK TO "s1"')
            cur.execute("INSERT INTO sp VALUES (3)")
            cur.execute("COMMIT")
            cur.execute("SELECT id FROM sp ORDER BY id")
            source = [r[0] for r in cur.fetchall()]
    finally:
        conn.close()
    assert source == [1, 3]
    assembler = BinlogAssembler(1, SchemaRegistry(), DeclaredTypes(), databases=(mysql_db,))
    inserts: list[int] = []  # per window
    queries = []
    for event in binlog_events(mysql_server, file, int(pos)):
        if type(event).__name__ == "QueryEvent":
            queries.append(str(event.query))
        window = feed(assembler, event)
        if window is not None:
            _, headers = parse_stream(window.data)
            inserts.append(int((headers["op"] == int(Op.INSERT)).sum()))
    assert any('ROLLBACK TO "s1"' in q for q in queries), queries  # (the case this is about)
    # sp_log's row (MyISAM: a group of its own), then sp's rows 1 and 3 (2 was rolled back)
    assert sorted(i for i in inserts if i) == [1, 2]
    assert not assembler.in_transaction


def test_a_rollback_to_whose_name_is_not_read_stops_rather_than_drops_the_transaction() -> None:
    from changebus.fetchers.mysql._statements import rollback_to_name, savepoint_name
    from changebus.schemas import SourceConfigError

    assert savepoint_name('SAVEPOINT "a ""b"') == 'a "b'
    assert rollback_to_name("ROLLBACK WORK TO SAVEPOINT `x``y`") == "x`y"
    assert rollback_to_name("ROLLBACK") is None
    with pytest.raises(SourceConfigError, match="would be lost"):
        rollback_to_name("ROLLBACK TO @odd")
