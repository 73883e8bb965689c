"""An oversized transaction with decode workers holds bounded memory (a real server's binlog).

The assembler is fed the events of a real MariaDB binlog (the same
mysql-replication reader the fetcher uses) with a decode worker pool: once a
transaction passes ``max_transaction_bytes`` it must keep no more of its
events or worker futures, however many rows events follow.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from test_mysql_fetcher import execute

from changebus.fetchers.mysql import BinlogAssembler, DeclaredTypes, EmbeddedMariaDB
from changebus.fetchers.mysql._workers import start_workers
from changebus.schemas import (
    DataLoss,
    Op,
    SchemaRegistry,
    decode_control,
    event_at,
    parse_stream,
    verify_event,
)

pytestmark = pytest.mark.mysql

STATEMENTS = 400


def _connect(**settings: Any) -> Any:
    import pymysql

    if "db" in settings:  # PyMySQL deprecates the name mysql-replication uses
        settings["database"] = settings.pop("db")
    return pymysql.connect(**settings)


def binlog_events(server: EmbeddedMariaDB, file: str, pos: int) -> Iterator[Any]:
    from pymysqlreplication import BinLogStreamReader
    from pymysqlreplication.event import MariadbGtidEvent, QueryEvent, RotateEvent, XidEvent
    from pymysqlreplication.row_event import (
        DeleteRowsEvent,
        TableMapEvent,
        UpdateRowsEvent,
        WriteRowsEvent,
    )

    reader = BinLogStreamReader(
        connection_settings={"host": "127.0.0.1", "port": server.port, "user": "root"},
        server_id=4242,
        blocking=False,
        resume_stream=True,
        log_file=file,
        log_pos=pos,
        pymysql_wrapper=_connect,
        only_events=[
            RotateEvent,
            MariadbGtidEvent,
            QueryEvent,
            TableMapEvent,
            WriteRowsEvent,
            UpdateRowsEvent,
            DeleteRowsEvent,
            XidEvent,
        ],
    )
    try:
        yield from reader
    finally:
        reader.close()


def feed(assembler: BinlogAssembler, event: Any) -> Any:
    """Hand one binlog event to ``assembler`` as the fetcher's stream does; the window
    (or pending window) it ends, else None."""
    from pymysqlreplication.event import MariadbGtidEvent, QueryEvent, RotateEvent, XidEvent
    from pymysqlreplication.row_event import (
        DeleteRowsEvent,
        TableMapEvent,
        UpdateRowsEvent,
        WriteRowsEvent,
    )

    if isinstance(event, RotateEvent):
        assembler.rotate(event.next_binlog)
    elif isinstance(event, MariadbGtidEvent):
        start = event.packet.log_pos - event.packet.event_size
        assembler.begin(event.gtid, event.timestamp, event.flags, start)
    elif isinstance(event, TableMapEvent):
        assembler.table_map(event)
    elif isinstance(event, WriteRowsEvent):
        assembler.rows(event, Op.INSERT)
    elif isinstance(event, UpdateRowsEvent):
        assembler.rows(event, Op.UPDATE)
    elif isinstance(event, DeleteRowsEvent):
        assembler.rows(event, Op.DELETE)
    elif isinstance(event, XidEvent):
        return assembler.commit(event.packet.log_pos)
    elif isinstance(event, QueryEvent):
        return assembler.query(event, event.packet.log_pos)
    return None


@pytest.mark.parametrize("workers", [0, 1])
def test_an_oversized_transaction_keeps_no_events_or_futures(
    mysql_server: EmbeddedMariaDB, mysql_db: str, workers: int
) -> None:
    execute(mysql_server, mysql_db, "CREATE TABLE big (id int PRIMARY KEY, v varchar(500))")
    conn = mysql_server.connect(mysql_db)
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW MASTER STATUS")
            file, pos = cur.fetchone()[:2]
            cur.execute("BEGIN")
            for i in range(STATEMENTS):  # one rows event each
                cur.execute("INSERT INTO big VALUES (%s, REPEAT('x', 400))", (i,))
            cur.execute("COMMIT")
    finally:
        conn.close()
    pool = start_workers(workers, "oversized") if workers else None
    try:
        assembler = BinlogAssembler(
            1,
            SchemaRegistry(),
            DeclaredTypes(),
            databases=(mysql_db,),
            max_window_bytes=8192,  # about 10 rows events (twice their size with workers)
            on_oversized="skip",
            pool=pool,
        )
        peak, windows = 0, []
        for event in binlog_events(mysql_server, file, int(pos)):
            window = feed(assembler, event)
            peak = max(peak, assembler.held_parts)
            if window is not None:
                windows.append(window if not hasattr(window, "resolve") else window.resolve())
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    # held: at most what fit under the limit before the transaction passed it (each
    # rows event is over 400 bytes), not one part per rows event of the transaction
    assert peak <= 8192 // 400 + 2, peak
    last = windows[-1]
    offsets, _ = parse_stream(last.data)
    h = verify_event(last.data, int(offsets[0]))
    assert h.op == Op.DATA_LOSS
    loss = decode_control(h.op, event_at(last.data, int(offsets[0]), h)[1])
    assert isinstance(loss, DataLoss) and f"has {STATEMENTS} changes" in loss.reason
    assert assembler.row_count == STATEMENTS
