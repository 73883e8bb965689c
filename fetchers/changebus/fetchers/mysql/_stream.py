"""The MySQL fetcher's stream thread: the binlog through mysql-replication, and reconnects.

:func:`run` is the thread's body: it reads the binlog with a blocking
``BinLogStreamReader`` in binlog file/position mode (``resume_stream=True``,
``is_mariadb=False``: the GTID modes of mysql-replication 1.0 ignore
positions or loop on errors) with server heartbeats, hands every event to
the :class:`BinlogAssembler` and every committed window to the feed.
Windows at or below the relay's last SCN are dropped (no duplicates in the
buffer); a transaction that captured nothing becomes a HEARTBEAT window
at most every ``idle_window_interval_s`` (and when the server is idle).

Reconnects are the fetcher's own: a lost connection makes it reopen the
stream at the end of the last window it emitted (up to
``reconnect_attempts`` times, then a retriable :class:`SourceError` goes to the
relay, which restarts the fetcher from its buffer). mysql-replication's own
reconnect (which re-reads from its last *event*, inside a transaction) is
disabled: the connection factory handed to it refuses a second stream
connection. Both of its connections (control and stream) are opened by
:func:`._connect.open_connection`, with the fetcher's TLS settings.

Decode workers (``decode_workers`` > 0): row events are transcoded in
spawned processes (:func:`._workers.start_workers`) while the stream reads on;
committed windows wait in commit order for their rows, and one resolver
thread hands them on (it is then the only thread that emits).

Everything here runs on the fetcher's stream thread (and its resolver);
what it shares with the event loop is described on
:class:`~._fetcher.MySQLFetcher`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from changebus.schemas import DataLoss, Op, SchemaRegistry, SourceConfigError, SourceError

from .._base import Window
from ._assembler import BinlogAssembler, PendingWindow
from ._connect import connection_args, open_connection
from ._position import parse_position, resume_point
from ._setup import reason

if TYPE_CHECKING:
    from ._fetcher import MySQLFetcher

__all__ = ["run"]

log = logging.getLogger("changebus.fetchers.mysql")

#: binlog events that carry changes the replication library cannot read (it skips
#: them): each stops the stream with :func:`_refuse_unread` rather than lose them
_UNREAD: dict[int, str] = {
    0x11: "a LOAD DATA logged as a statement (its rows are not in the binlog)",
    0x12: "a LOAD DATA logged as a statement (its rows are not in the binlog)",
    0x1A: "an INCIDENT event: the server says changes were lost here",
    # (the library filters out the classes not listed, before anything sees them: a
    # session's partial JSON updates vanished without a word; review)
    0x27: "a partial JSON update (MySQL binlog_row_value_options = PARTIAL_JSON)",
    0x28: "a compressed transaction (MySQL binlog_transaction_compression = ON)",
    **dict.fromkeys(range(0xA5, 0xAC), "a compressed event (MariaDB log_bin_compress = ON)"),
}


def _refuse_unread(event_type: int, file: str, end_pos: int) -> None:
    """Stop on an event of :data:`_UNREAD` (others the library does not read hold no
    changes: MySQL's anonymous GTIDs, say)."""
    what = _UNREAD.get(event_type)
    if what is None:
        return
    raise SourceConfigError(
        f"binlog event type {event_type} at {file}:{end_pos} is {what}; the fetcher cannot "
        "capture its changes and stops rather than skip them. Turn it off (log_bin_compress "
        "= OFF, binlog_transaction_compression = OFF, binlog_row_value_options = '', "
        "binlog_format = ROW for every session), then restart the relay and reseed the tables it changed"
    )


#: committed windows waiting for decode workers before the stream waits for them
_MAX_PENDING = 32

#: server errors that retrying cannot fix: access denied (1044, 1045, 1227), 1142/1143
_ACCESS_DENIED = frozenset((1044, 1045, 1142, 1143, 1227))


class _LibraryReconnect(Exception):
    """mysql-replication tried to reconnect by itself: the fetcher reconnects instead."""


def run(fetcher: MySQLFetcher, emit: Callable[[Window], None], stopping: threading.Event) -> None:
    """The stream thread: stream, and reconnect after a lost connection (module docstring)."""
    import pymysql

    cfg = fetcher.config
    registry = SchemaRegistry()
    known = registry.import_entries(fetcher._resume.schemas)
    assembler = BinlogAssembler(
        fetcher.partition_id,
        registry,
        fetcher._declared,
        databases=cfg.databases,
        checksum_bytes=fetcher._checksum,
        tinyint1_as_boolean=cfg.tinyint1_as_boolean,
        max_window_bytes=cfg.max_transaction_bytes,
        on_oversized=cfg.on_oversized_transaction,
        pool=fetcher._pool,
        known=known,
        policy=cfg.column_rules(),
    )
    assembler.server, assembler.scn_base = fetcher._server, fetcher._base
    assembler.losses = fetcher.data_loss_events
    if fetcher._data_loss is not None:
        lo, hi, why, position, cause = fetcher._data_loss
        fetcher.data_loss_events[cause] += 1
        fetcher._emit(assembler.control_window(DataLoss(lo, hi, why), hi, position), emit)
        fetcher._data_loss = None
    failures = 0
    while not stopping.is_set():
        before = fetcher.stats["windows"]
        assembler.replay_until = fetcher._last_scn  # what a rewind reads again
        try:
            _stream(fetcher, assembler, emit, stopping)
            return
        except (
            pymysql.err.OperationalError,
            pymysql.err.InterfaceError,
            _LibraryReconnect,
        ) as exc:
            code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else 0
            if code in _ACCESS_DENIED:
                raise SourceConfigError(
                    f"the MySQL user may not read the binlog: {reason(exc)}; grant it "
                    "REPLICATION SLAVE (and BINLOG MONITOR on MariaDB, REPLICATION CLIENT on "
                    "MySQL, and SELECT)"
                ) from None
            if fetcher.stats["windows"] > before:
                failures = 0
            failures += 1
            if failures > cfg.reconnect_attempts:
                raise SourceError(f"lost the MySQL binlog stream: {reason(exc)}") from None
            fetcher.stats["reconnects"] += 1
            delay = cfg.reconnect_backoff_s * 2 ** min(failures - 1, 30)  # (no float overflow)
            log.warning(
                "partition %s: binlog stream lost (%s); reconnecting from %s:%d in %.1fs",
                fetcher.name,
                reason(exc),
                *fetcher._start,
                delay,
            )
            stopping.wait(delay)


def _open_reader(fetcher: MySQLFetcher) -> Any:
    """A ``BinLogStreamReader`` from the fetcher's start position (one stream connection)."""
    from pymysqlreplication import BinLogStreamReader
    from pymysqlreplication.event import (
        BeginLoadQueryEvent,
        ExecuteLoadQueryEvent,
        GtidEvent,
        HeartbeatLogEvent,
        MariadbGtidEvent,
        NotImplementedEvent,
        QueryEvent,
        RotateEvent,
        XAPrepareEvent,
        XidEvent,
    )
    from pymysqlreplication.row_event import (
        DeleteRowsEvent,
        PartialUpdateRowsEvent,
        TableMapEvent,
        UpdateRowsEvent,
        WriteRowsEvent,
    )

    cfg = fetcher.config
    streams = 0

    def connect(**settings: Any) -> Any:
        nonlocal streams
        if "db" in settings:  # the control connection (PyMySQL deprecates the name)
            settings["database"] = settings.pop("db")
        else:  # the stream connection
            streams += 1
            if streams > 1:
                raise _LibraryReconnect("the server closed the binlog stream")
        # (TLS enforced and its failures non-retriable, as for every connection)
        return open_connection(cfg, **settings)

    file, pos = fetcher._start
    return BinLogStreamReader(
        connection_settings={
            **connection_args(cfg),
            "connect_timeout": cfg.connect_timeout_s,
            "read_timeout": cfg.read_timeout_s,
        },
        server_id=fetcher.server_id,
        blocking=True,
        resume_stream=True,
        log_file=file,
        log_pos=pos,
        is_mariadb=False,
        slave_heartbeat=cfg.heartbeat_interval_s,
        only_events=[
            RotateEvent,
            MariadbGtidEvent,
            GtidEvent,
            QueryEvent,
            TableMapEvent,
            WriteRowsEvent,
            UpdateRowsEvent,
            DeleteRowsEvent,
            XidEvent,
            XAPrepareEvent,
            HeartbeatLogEvent,
            # read to be refused when they carry changes (_refuse_unread)
            NotImplementedEvent,
            BeginLoadQueryEvent,
            ExecuteLoadQueryEvent,
            PartialUpdateRowsEvent,
        ],
        filter_non_implemented_events=False,
        pymysql_wrapper=connect,
        enable_logging=False,
    )


def _stream(
    fetcher: MySQLFetcher,
    assembler: BinlogAssembler,
    emit: Callable[[Window], None],
    stopping: threading.Event,
) -> None:
    """Read events until ``stopping`` (or an error: the caller reconnects)."""
    from pymysqlreplication.event import (
        BeginLoadQueryEvent,
        ExecuteLoadQueryEvent,
        GtidEvent,
        HeartbeatLogEvent,
        MariadbGtidEvent,
        NotImplementedEvent,
        QueryEvent,
        RotateEvent,
        XAPrepareEvent,
        XidEvent,
    )
    from pymysqlreplication.row_event import (
        DeleteRowsEvent,
        PartialUpdateRowsEvent,
        TableMapEvent,
        UpdateRowsEvent,
        WriteRowsEvent,
    )

    ops = {WriteRowsEvent: Op.INSERT, UpdateRowsEvent: Op.UPDATE, DeleteRowsEvent: Op.DELETE}
    #: events read only to stop on them when they hold changes (_refuse_unread)
    refused = (
        NotImplementedEvent,
        BeginLoadQueryEvent,
        ExecuteLoadQueryEvent,
        PartialUpdateRowsEvent,
    )
    cfg = fetcher.config
    last_emit = time.monotonic()
    skipped: list[Window] = []  # the newest HEARTBEAT window not written

    def hand_on(window: Window, empty: bool) -> None:
        nonlocal last_emit
        # where a reconnect resumes: after the last window handed on (or skipped), or
        # at the oldest XA transaction prepared before it and not committed yet
        fields = parse_position(window.source_position)
        fetcher._start = resume_point(fields)
        if fields:  # how far the stream has read (not where a restart goes back to)
            fetcher._read_to = (fields["file"], int(fields["pos"]))
        if window.scn <= fetcher._last_scn:
            return  # the relay holds it already
        if empty and time.monotonic() - last_emit < cfg.idle_window_interval_s:
            skipped[:] = [window]  # nothing captured: a HEARTBEAT window now and then
            return
        skipped.clear()
        last_emit = time.monotonic()
        fetcher._emit(window, emit)
        fetcher.stats["rows"] = assembler.row_count
        dispatch = assembler._dispatch  # (decode workers: how often layouts went along)
        if dispatch is not None:
            fetcher.stats["worker_layouts_sent"] = dispatch.layouts_sent
            fetcher.stats["worker_layout_misses"] = dispatch.misses

    # with decode workers, committed windows wait here in commit order while the
    # stream reads on; one resolver thread waits for their rows and hands them on
    # (it is then the only thread that emits)
    waiting: queue.Queue[tuple[Window | PendingWindow, bool] | str | None]
    waiting = queue.Queue(_MAX_PENDING)

    def idle() -> None:
        # the server is idle: the newest skipped HEARTBEAT window goes out now, so
        # the resume position reaches the binlog's end
        if skipped:
            hand_on(skipped.pop(), False)

    failed: list[BaseException] = []

    def resolve() -> None:
        try:
            while True:
                try:
                    item = waiting.get(timeout=0.2)
                except queue.Empty:
                    if stopping.is_set():  # (the end mark may not have fit: put() gave up)
                        return
                    continue
                if item is None:
                    return
                if isinstance(item, str):
                    idle()
                    continue
                window, empty = item
                if isinstance(window, PendingWindow):
                    window = window.resolve()
                hand_on(window, empty)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the stream thread
            failed.append(exc)

    resolver: threading.Thread | None = None
    if fetcher._pool is not None:
        resolver = threading.Thread(target=resolve, name=f"mysql-{fetcher.name}-resolve")
        resolver.start()

    def put(item: tuple[Window | PendingWindow, bool] | str | None) -> None:
        while resolver is not None and resolver.is_alive():
            try:
                waiting.put(item, timeout=0.2)
                return
            except queue.Full:
                if stopping.is_set():
                    return

    reader = _open_reader(fetcher)
    assembler.reset()  # a reconnect starts at a transaction boundary
    try:
        while not stopping.is_set():
            if failed:
                raise failed[0]
            event = reader.fetchone()
            if event is None:
                continue
            cls = type(event)
            window: Window | PendingWindow | None = None
            op = ops.get(cls)
            if op is not None:
                assembler.rows(event, op)
            elif cls is TableMapEvent:
                assembler.table_map(event)
            elif cls is MariadbGtidEvent:
                start = event.packet.log_pos - event.packet.event_size
                assembler.begin(event.gtid, event.timestamp, event.flags, start)
            elif cls is XidEvent:
                window = assembler.commit(event.packet.log_pos)
            elif cls is QueryEvent:
                window = assembler.query(event, event.packet.log_pos)
            elif cls is GtidEvent:  # MySQL: a BEGIN query follows, unless a DDL/TRUNCATE does
                start = event.packet.log_pos - event.packet.event_size
                assembler.begin_mysql(event.gtid, event.timestamp, start)
            elif cls is XAPrepareEvent:
                key = (event.xid_format_id, event.xid_gtrid, event.xid_bqual)
                window = assembler.xa_prepare(key, event.one_phase, event.packet.log_pos)
            elif cls is RotateEvent:
                assembler.rotate(event.next_binlog)
            elif cls in refused:
                _refuse_unread(event.event_type, assembler.file, event.packet.log_pos)
            elif cls is HeartbeatLogEvent:
                fetcher.stats["heartbeats"] += 1
                if resolver is not None:
                    put("idle")
                else:
                    idle()
            if window is None:
                continue
            if resolver is not None:
                put((window, assembler.last_empty))
            else:
                assert isinstance(window, Window)
                hand_on(window, assembler.last_empty)
    finally:
        reader.close()
        if resolver is not None:
            # hand on what was committed before the stream ended (a reconnect then
            # resumes after it), unless the fetcher is stopping
            put(None)
            resolver.join()
    if failed:
        raise failed[0]
