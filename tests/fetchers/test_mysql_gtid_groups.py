"""MySQL's event groups: a GTID event, then BEGIN ... XID, or one DDL/TRUNCATE query.

MySQL's GTID event has no standalone flag (MariaDB's has). Found by review:
the fetcher began every MySQL group as a transaction, so a ``TRUNCATE``
(or DDL) group, which no XID ends, stayed open until the next GTID event
dropped it: the TRUNCATE never reached the relay. There is no MySQL server
on this machine kind, so the groups are MariaDB's binlog events of the same
statements, handed over in MySQL's shape: each GTID event as MySQL's (no
flags), followed by a ``BEGIN`` query when the group is a transaction.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from test_mysql_fetcher import execute
from test_mysql_oversized import binlog_events, feed

from changebus.fetchers.mysql import BinlogAssembler, DeclaredTypes, EmbeddedMariaDB
from changebus.schemas import Op, SchemaRegistry, parse_stream

_FL_STANDALONE = 1


def _as_mysql(assembler: BinlogAssembler, event: Any, db: str) -> Any:
    """Feed ``event`` as MySQL would have logged it; the window it ends, else None."""
    from pymysqlreplication.event import MariadbGtidEvent

    if not isinstance(event, MariadbGtidEvent):
        return feed(assembler, event)
    start = event.packet.log_pos - event.packet.event_size
    assembler.begin_mysql(event.gtid, event.timestamp, start)
    if not event.flags & _FL_STANDALONE:  # MySQL logs the transaction's BEGIN as a query
        begin = SimpleNamespace(query="BEGIN", schema=db, timestamp=event.timestamp)
        assert assembler.query(begin, start + 1) is None
    return None


def _ops(window: Any) -> list[Op]:
    _, headers = parse_stream(window.data)
    return [Op(int(o)) for o in headers["op"].tolist()]


@pytest.mark.mysql
def test_a_mysql_truncate_group_ends_at_its_query(
    mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    execute(mysql_server, mysql_db, "CREATE TABLE g (id int PRIMARY KEY, v int)")
    conn = mysql_server.connect(mysql_db)
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW MASTER STATUS")
            file, pos = cur.fetchone()[:2]
            cur.execute("INSERT INTO g VALUES (1, 1), (2, 2)")
            conn.commit()
            cur.execute("TRUNCATE TABLE g")
            cur.execute("ALTER TABLE g ADD COLUMN w int")
            cur.execute("INSERT INTO g VALUES (3, 3, 3)")
            conn.commit()
    finally:
        conn.close()
    assembler = BinlogAssembler(1, SchemaRegistry(), DeclaredTypes(), databases=(mysql_db,))
    windows = []
    for event in binlog_events(mysql_server, file, int(pos)):
        window = _as_mysql(assembler, event, mysql_db)
        if window is not None:
            windows.append(window)
    skip = (Op.SCHEMA_CHANGE, Op.END_OF_WINDOW, Op.HEARTBEAT)
    data_ops = [[o for o in _ops(w) if o not in skip] for w in windows]
    data_ops = [ops for ops in data_ops if ops]
    assert data_ops == [[Op.INSERT, Op.INSERT], [Op.TRUNCATE], [Op.INSERT]]
    assert not assembler.in_transaction  # the ALTER's group ended at its query too
    scns = [w.scn for w in windows]
    assert scns == sorted(set(scns))
