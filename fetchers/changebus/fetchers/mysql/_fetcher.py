"""The MySQL / MariaDB fetcher: the binlog through mysql-replication.

One thread per fetcher runs a blocking ``BinLogStreamReader`` in binlog
file/position mode (``resume_stream=True``, ``is_mariadb=False``: the GTID
modes of mysql-replication 1.0 ignore positions or loop on errors) with
server heartbeats, and hands windows to the event loop through a bounded
:class:`ThreadFeed`, so a slow relay slows the stream.

Positions: every window's END_OF_WINDOW carries
``gtid=D-S-N;file=NAME;pos=P;server=ID[;base=B]`` (where the next
transaction starts, on which server, and the SCN base); on start the stream
resumes from the relay's last window's position. Windows at or below the
relay's last SCN are dropped (no duplicates in the buffer).

Failover (MariaDB): when the relay's last window came from another server
(its ``server`` differs from this server's ``@@server_id``), the fetcher
finds that window's GTID in this server's binlog (:mod:`._failover`) and
goes on right after it, with a new SCN base so that SCNs keep increasing
(``base = relay's last SCN - (file_number << 32 | end position)`` of that
transaction here: the transaction keeps its SCN on the new server). A GTID
this server does not hold is refused (divergent history). On the same
server, a GTID that is not where the relay saw it means the binlog was
rewritten (``RESET MASTER``): refused too.

Reconnects are the fetcher's own: a lost connection makes it reopen the
stream at the end of the last window it emitted (up to
``reconnect_attempts`` times, then a retriable :class:`SourceError` goes to the
relay, which restarts the fetcher from its buffer). mysql-replication's own
reconnect (which re-reads from its last *event*, inside a transaction) is
disabled: the connection factory handed to it refuses a second stream
connection.

Checks at start, each a clear non-retriable :class:`SourceConfigError` naming
the setting: binary logging on, ``binlog_format=ROW``,
``binlog_row_image=FULL``, ``binlog_row_metadata=FULL``. A resume position in
a purged binlog file becomes a DATA_LOSS window (or a failure with
``on_binlog_purged = "fail"``), never a silent jump.

Thread-safety: ``start``/``acknowledge``/``close``/``status`` run on the
event loop; the stream thread writes ``stats`` and the position fields (plain
values, read for status only).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import queue
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from changebus.schemas import (
    DataLoss,
    Op,
    SchemaRegistry,
    SourceConfigError,
    SourceError,
    binlog_file_number,
    binlog_to_scn,
    scn_to_binlog,
)
from changebus.schemas.config import load_config_dict

from .._base import ResumePoint, Window, window_bytes
from .._threadfeed import ThreadFeed
from ._assembler import BinlogAssembler, PendingWindow, format_position, parse_position
from ._config import SYSTEM_DATABASES, MySQLConfig
from ._ddl import DeclaredTypes
from ._failover import gtid_parts, locate_gtid

__all__ = ["MySQLFetcher"]

log = logging.getLogger("changebus.fetchers.mysql")

_REQUIRED = (
    ("binlog_format", "ROW"),
    ("binlog_row_image", "FULL"),
    ("binlog_row_metadata", "FULL"),
)


#: committed windows waiting for decode workers before the stream waits for them
_MAX_PENDING = 32

#: server errors that retrying cannot fix: access denied (1044, 1045, 1227), 1142/1143
_ACCESS_DENIED = frozenset((1044, 1045, 1142, 1143, 1227))

_JSON_VALID = re.compile(r"json_valid\(`((?:[^`]|``)+)`\)", re.I)


class _LibraryReconnect(Exception):
    """mysql-replication tried to reconnect by itself: the fetcher reconnects instead."""


class MySQLFetcher:
    """Streams a MySQL/MariaDB server's binlog as windows (see the module docstring)."""

    def __init__(self, name: str, partition_id: int, config: MySQLConfig) -> None:
        self.name = name
        self.partition_id = partition_id
        self.config = config
        self.server_id = config.server_id_for(name, partition_id)
        self._resume = ResumePoint()
        self._feed: ThreadFeed[Window] | None = None
        self._start: tuple[str, int] = ("", 0)  # (file, pos) the stream starts at
        self._server = 0  # the server's @@server_id
        self._base = 0  # SCN = base + (file_number << 32 | pos): see the module docstring
        self._last_scn = -1
        self._checksum = 4
        self._data_loss: tuple[int, int, str, str] | None = None  # lo, hi, reason, position
        self._declared = DeclaredTypes()
        self._pool: ProcessPoolExecutor | None = None
        self.position = ""  # source_position of the last emitted window
        self.stats: dict[str, Any] = {
            "windows": 0,
            "rows": 0,
            "heartbeats": 0,
            "reconnects": 0,
            "acked_scn": -1,
        }

    # ---- Fetcher protocol -------------------------------------------------

    async def start(self, resume: ResumePoint) -> int:
        """Check the server, plan the start position; returns the SCN the stream is complete from."""
        self._resume = resume
        self._last_scn = resume.scn
        return await asyncio.to_thread(self._setup)

    async def windows(self) -> AsyncIterator[Window]:
        self._feed = ThreadFeed(
            self._run, maxsize=1024, name=f"mysql-{self.name}", weigh=window_bytes
        )
        async for window in self._feed.items():
            yield window

    async def acknowledge(self, scn: int) -> None:
        # the binlog is kept by the server's own retention; nothing to release
        self.stats["acked_scn"] = max(self.stats["acked_scn"], scn)

    async def close(self) -> None:
        if self._feed is not None:
            await self._feed.close()
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True)

    def status(self) -> dict[str, Any]:
        return {
            "kind": "mysql",
            "server_id": self.server_id,
            "source_position": self.position,
            "decode_workers": 0 if self._pool is None else self.config.decode_workers,
            "mysql_server_id": self._server,
            "scn_base": self._base,
            **self.stats,
        }

    # ---- set-up (a worker thread) -------------------------------------------

    def _connect(self, **extra: Any) -> Any:
        import pymysql

        cfg = self.config
        try:
            return pymysql.connect(
                host=cfg.host,
                port=cfg.port,
                user=cfg.user,
                password=cfg.password,
                connect_timeout=cfg.connect_timeout_s,
                autocommit=True,
                charset="utf8mb4",
                **extra,
            )
        except pymysql.err.OperationalError as exc:
            code = exc.args[0] if exc.args else 0
            if code in (1044, 1045, 1049):  # access denied, unknown database
                raise SourceConfigError(f"cannot log in to MySQL: {_reason(exc)}") from None
            raise SourceError(f"cannot connect to MySQL: {_reason(exc)}") from None

    def _setup(self) -> int:
        import pymysql

        conn = self._connect()
        try:
            with conn.cursor() as cur:
                self._check_settings(cur)
                cur.execute("SELECT @@binlog_checksum, @@server_id")
                row = cur.fetchone()
                self._checksum = 0 if row is None or str(row[0]).upper() == "NONE" else 4
                self._server = 0 if row is None else int(row[1])
                try:
                    cur.execute("SHOW BINARY LOGS")
                    logs = [str(r[0]) for r in cur.fetchall()]
                    cur.execute("SHOW MASTER STATUS")
                    status = cur.fetchone()
                except pymysql.err.OperationalError as exc:
                    raise SourceConfigError(
                        f"the MySQL user lacks a privilege: {_reason(exc)} (grant REPLICATION "
                        "SLAVE, BINLOG MONITOR (REPLICATION CLIENT on MySQL) and SELECT)"
                    ) from None
                if status is None or not logs:
                    raise SourceConfigError("binary logging is off: start the server with log_bin")
                current = (str(status[0]), int(status[1]))
                start_scn = self._plan_start(cur, logs, current)
                self._verify_start(cur)
                self._seed_declared(cur)
        except pymysql.err.OperationalError as exc:
            raise SourceError(f"lost the MySQL connection: {_reason(exc)}") from None
        finally:
            conn.close()
        if self.config.decode_workers and self._pool is None:
            self._pool = _start_workers(self.config.decode_workers, self.name)
        return start_scn

    def _check_settings(self, cur: Any) -> None:
        cur.execute(
            "SHOW GLOBAL VARIABLES WHERE Variable_name IN "
            "('log_bin', 'binlog_format', 'binlog_row_image', 'binlog_row_metadata')"
        )
        values = {str(k).lower(): str(v).upper() for k, v in cur.fetchall()}
        if values.get("log_bin") not in ("ON", "1"):
            raise SourceConfigError(
                "binary logging is off (log_bin = OFF): start the server with --log-bin"
            )
        for name, wanted in _REQUIRED:
            have = values.get(name)
            if have != wanted:
                raise SourceConfigError(
                    f"MySQL setting {name} is {have or 'unsupported'!s}, not {wanted}: set "
                    f"{name} = {wanted} (SET GLOBAL {name} = '{wanted}' and in the server's "
                    "config file); the fetcher cannot decode rows otherwise"
                )

    def _plan_start(self, cur: Any, logs: list[str], current: tuple[str, int]) -> int:
        """Where the stream starts; plans a DATA_LOSS window for a purged resume file."""
        resume = self._resume
        self._data_loss = None
        self._base = 0
        pos = parse_position(resume.source_position) if resume.scn >= 0 else {}
        if pos:
            self._base = int(pos.get("base", "0"))
            if self._other_server(pos):
                return self._fail_over(cur, logs, current, pos)
        if resume.scn >= 0 and not pos:
            # no window yet (the relay recorded only where the stream started):
            # the SCN itself is the binlog position
            number, offset = scn_to_binlog(resume.scn)
            base = logs[-1].rsplit(".", 1)[0]
            names = {binlog_file_number(f): f for f in logs}
            pos = {"file": names.get(number, f"{base}.{number:06d}"), "pos": str(offset)}
        if pos:
            file, offset = pos["file"], int(pos["pos"])
            if file in logs:
                self._start = (file, offset)
                return resume.scn
            oldest = logs[0]
            new_scn = self._base + binlog_to_scn(binlog_file_number(oldest), 4)
            reason = (
                f"binlog file {file} was purged (the oldest kept is {oldest}): changes "
                f"committed after SCN {resume.scn} and before {oldest} are missing"
            )
            if new_scn <= resume.scn:
                raise SourceConfigError(
                    f"binlog file {file} is not on this server and its binlogs are older than "
                    "the relay's last window (another server? see docs/mysql.md, failover)"
                )
            if self.config.on_binlog_purged == "fail":
                raise SourceConfigError(
                    f"{reason}; set on_binlog_purged = 'data_loss' to go on after a data-loss event"
                )
            log.error("partition %s: %s", self.name, reason)
            where = format_position("", oldest, 4, self._server, self._base).partition(";")[2]
            self._data_loss = (resume.scn + 1, new_scn, reason, where)
            self._start = (oldest, 4)
            return resume.scn
        if self.config.start_at == "earliest":
            self._start = (logs[0], 4)
        else:
            self._start = current
        return binlog_to_scn(binlog_file_number(self._start[0]), self._start[1])

    def _other_server(self, pos: Mapping[str, str]) -> bool:
        """Whether the relay's last window was read from another server than this one.

        Positions name their server (``server=ID``); older ones do not, and
        then the GTID's originating server stands in for it (a relay reading a
        primary sees its own GTIDs; an old position with a MySQL GTID,
        ``uuid:N``, is taken as this server's).
        """
        if "server" in pos:
            return int(pos["server"]) != self._server
        parts = gtid_parts(pos.get("gtid", ""))
        return parts is not None and parts[1] != self._server

    def _fail_over(
        self, cur: Any, logs: list[str], current: tuple[str, int], pos: Mapping[str, str]
    ) -> int:
        """Resume after the relay's last window on another server, found by its GTID."""
        import pymysql

        resume = self._resume
        gtid = pos.get("gtid", "")
        origin = pos.get("server") or "unknown"
        where = f"{pos['file']}:{pos['pos']} of server id {origin}"
        if not gtid:
            return self._diverged(
                current,
                f"the relay's last window ended at {where}, this is server id {self._server}, "
                "and that window has no GTID to find its place here",
            )
        try:
            found = locate_gtid(cur, logs, gtid)
            cur.execute("SELECT @@gtid_binlog_state")
            row = cur.fetchone()
        except pymysql.err.MySQLError:
            found, row = None, None  # MySQL: no Gtid_list events, no gtid_binlog_state
        if found is None:
            return self._diverged(
                current,
                f"the relay's last transaction (GTID {gtid}, ending at {where}) is not in "
                f"this server's binlog (server id {self._server}): its history diverged from "
                "the old server's, or it purged that part of its binlog",
            )
        parts = gtid_parts(gtid)
        state = "" if row is None or row[0] is None else str(row[0])
        domains = {p[0] for g in state.split(",") if (p := gtid_parts(g)) is not None}
        if parts is not None and domains - {parts[0]}:
            # transactions of other domains may lie on either side of this one here and
            # on the old server: the position after it is not the same cut on both
            return self._diverged(
                current,
                f"this server's binlog holds more than one GTID domain "
                f"({', '.join(str(d) for d in sorted(domains))}): resuming after GTID {gtid} "
                "by position is exact only with one domain",
            )
        file, end = found
        self._start = (file, end)
        self._base = resume.scn - binlog_to_scn(binlog_file_number(file), end)
        log.warning(
            "partition %s: the relay's last window came from server id %s; its transaction "
            "%s ends at %s:%d on this server (id %d): going on from there, SCN base %d",
            self.name,
            origin,
            gtid,
            file,
            end,
            self._server,
            self._base,
        )
        return resume.scn

    def _diverged(self, current: tuple[str, int], reason: str) -> int:
        """No exact place on this server: refuse, or a DATA_LOSS window and the binlog's end."""
        if self.config.on_divergent_server == "fail":
            raise SourceConfigError(
                f"{reason}. Resuming anywhere would skip or repeat transactions; see "
                "docs/mysql.md, Failover (on_divergent_server = 'data_loss' goes on from this "
                "server's binlog end after a data-loss event)"
            )
        resume = self._resume
        hi = resume.scn + 1
        self._start = current
        self._base = hi - binlog_to_scn(binlog_file_number(current[0]), current[1])
        log.error(
            "partition %s: %s; going on from %s:%d after a data-loss event",
            self.name,
            reason,
            *current,
        )
        where = format_position("", current[0], current[1], self._server, self._base)
        self._data_loss = (
            resume.scn + 1,
            hi,
            f"{reason}: changes from here on up to the switch to this server may be missing",
            where.partition(";")[2],
        )
        return resume.scn

    def _verify_start(self, cur: Any) -> None:
        """Refuse a resume position that this server's binlog does not hold.

        The relay's last window names its GTID and where it ended (file and
        position; after :meth:`_fail_over`, where it ends on this server). On
        the server that wrote the position, ``BINLOG_GTID_POS(file, pos)``
        (MariaDB) is the GTID state right after that window, so it lists the
        window's GTID. Anything else means the binlog was rewritten under the
        same file names (``RESET MASTER``; GTIDs may then be reused by other
        transactions, so they are not searched for): reading on would decode
        garbage or skip or repeat transactions, so the fetcher stops instead.
        MySQL has no such function; there the check is skipped.
        """
        import pymysql

        pos = parse_position(self._resume.source_position) if self._resume.scn >= 0 else {}
        gtid = pos.get("gtid", "")
        if not gtid or self._data_loss is not None or not pos:
            return
        file, offset = self._start
        try:
            cur.execute("SELECT BINLOG_GTID_POS(%s, %s)", (file, offset))
            row = cur.fetchone()
        except pymysql.err.MySQLError:
            return  # MySQL: no BINLOG_GTID_POS
        state = "" if row is None or row[0] is None else str(row[0])
        if gtid not in {g.strip() for g in state.split(",")}:
            raise SourceConfigError(
                f"the relay's last transaction (GTID {gtid}, ending at {file}:{offset}) is not "
                f"in this server's binlog there (GTID state at that point: {state or 'none'}): "
                "its binlog was reset (RESET MASTER) or rewritten. Resuming "
                "by file and offset would skip or repeat transactions; see docs/mysql.md, "
                "Failover, for the way back"
            )

    def _seed_declared(self, cur: Any) -> None:
        """Declared types: the relay's registry first, information_schema for the rest."""
        import pymysql

        registry = SchemaRegistry()
        registry.import_entries(self._resume.schemas)
        for _sid, name in registry.sources():
            latest = registry.latest(name)
            db, _, table = name.partition(".")
            self._declared.set(db, table, {c.name: c.source_type for c in latest.columns})
        cur.execute(
            "SELECT TABLE_SCHEMA, TABLE_NAME, COLUMN_NAME, COLUMN_TYPE "
            "FROM information_schema.COLUMNS ORDER BY TABLE_SCHEMA, TABLE_NAME, ORDINAL_POSITION"
        )
        tables: dict[tuple[str, str], dict[str, str]] = {}
        wanted = {d.lower() for d in self.config.databases}
        for db, table, column, ctype in cur.fetchall():
            if db.lower() in SYSTEM_DATABASES or (wanted and db.lower() not in wanted):
                continue
            tables.setdefault((db, table), {})[column] = str(ctype)
        # MariaDB's JSON is LONGTEXT with a json_valid() check constraint
        try:
            cur.execute(
                "SELECT CONSTRAINT_SCHEMA, TABLE_NAME, CHECK_CLAUSE "
                "FROM information_schema.CHECK_CONSTRAINTS WHERE CHECK_CLAUSE LIKE 'json_valid(%'"
            )
            for db, table, clause in cur.fetchall():
                m = _JSON_VALID.fullmatch(str(clause).strip())
                cols = tables.get((db, table))
                if m and cols is not None and m.group(1) in cols:
                    cols[m.group(1)] = "json"
        except pymysql.err.MySQLError:
            pass  # MySQL < 8.0.16 has no CHECK_CONSTRAINTS (and a real JSON type)
        for (db, table), cols in tables.items():
            if not self._declared.known(db, table):
                self._declared.set(db, table, cols)

    # ---- the stream thread ---------------------------------------------------------

    def _run(self, emit: Callable[[Window], None], stopping: threading.Event) -> None:
        import pymysql

        cfg = self.config
        registry = SchemaRegistry()
        registry.import_entries(self._resume.schemas)
        assembler = BinlogAssembler(
            self.partition_id,
            registry,
            self._declared,
            databases=cfg.databases,
            checksum_bytes=self._checksum,
            tinyint1_as_boolean=cfg.tinyint1_as_boolean,
            max_window_bytes=cfg.max_transaction_bytes,
            on_oversized=cfg.on_oversized_transaction,
            pool=self._pool,
        )
        assembler.server, assembler.scn_base = self._server, self._base
        if self._data_loss is not None:
            lo, hi, reason, position = self._data_loss
            self._emit(assembler.control_window(DataLoss(lo, hi, reason), hi, position), emit)
            self._data_loss = None
        failures = 0
        while not stopping.is_set():
            before = self.stats["windows"]
            try:
                self._stream(assembler, emit, stopping)
                return
            except (
                pymysql.err.OperationalError,
                pymysql.err.InterfaceError,
                _LibraryReconnect,
            ) as exc:
                code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else 0
                if code in _ACCESS_DENIED:
                    raise SourceConfigError(
                        f"the MySQL user may not read the binlog: {_reason(exc)}; grant it "
                        "REPLICATION SLAVE (and BINLOG MONITOR on MariaDB, REPLICATION CLIENT on "
                        "MySQL, and SELECT)"
                    ) from None
                if self.stats["windows"] > before:
                    failures = 0
                failures += 1
                if failures > cfg.reconnect_attempts:
                    raise SourceError(f"lost the MySQL binlog stream: {_reason(exc)}") from None
                self.stats["reconnects"] += 1
                delay = cfg.reconnect_backoff_s * 2 ** (failures - 1)
                log.warning(
                    "partition %s: binlog stream lost (%s); reconnecting from %s:%d in %.1fs",
                    self.name,
                    _reason(exc),
                    *self._start,
                    delay,
                )
                stopping.wait(delay)

    def _reader(self) -> Any:
        from pymysqlreplication import BinLogStreamReader
        from pymysqlreplication.event import (
            GtidEvent,
            HeartbeatLogEvent,
            MariadbGtidEvent,
            QueryEvent,
            RotateEvent,
            XidEvent,
        )
        from pymysqlreplication.row_event import (
            DeleteRowsEvent,
            TableMapEvent,
            UpdateRowsEvent,
            WriteRowsEvent,
        )

        cfg = self.config
        streams = 0

        def connect(**settings: Any) -> Any:
            nonlocal streams
            import pymysql

            if "db" in settings:  # the control connection (PyMySQL deprecates the name)
                settings["database"] = settings.pop("db")
            else:  # the stream connection
                streams += 1
                if streams > 1:
                    raise _LibraryReconnect("the server closed the binlog stream")
            return pymysql.connect(**settings)

        file, pos = self._start
        return BinLogStreamReader(
            connection_settings={
                "host": cfg.host,
                "port": cfg.port,
                "user": cfg.user,
                "password": cfg.password,
                "connect_timeout": cfg.connect_timeout_s,
                "read_timeout": max(10.0, cfg.heartbeat_interval_s * 5),
            },
            server_id=self.server_id,
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
                HeartbeatLogEvent,
            ],
            pymysql_wrapper=connect,
            enable_logging=False,
        )

    def _stream(
        self, assembler: BinlogAssembler, emit: Callable[[Window], None], stopping: threading.Event
    ) -> None:
        from pymysqlreplication.event import (
            GtidEvent,
            HeartbeatLogEvent,
            MariadbGtidEvent,
            QueryEvent,
            RotateEvent,
            XidEvent,
        )
        from pymysqlreplication.row_event import (
            DeleteRowsEvent,
            TableMapEvent,
            UpdateRowsEvent,
            WriteRowsEvent,
        )

        ops = {WriteRowsEvent: Op.INSERT, UpdateRowsEvent: Op.UPDATE, DeleteRowsEvent: Op.DELETE}
        cfg = self.config
        last_emit = time.monotonic()
        skipped: list[Window] = []  # the newest HEARTBEAT window not written

        def hand_on(window: Window, empty: bool) -> None:
            nonlocal last_emit
            # where a reconnect resumes: after the last window handed on (or skipped)
            pos = parse_position(window.source_position)
            self._start = (pos["file"], int(pos["pos"]))
            if window.scn <= self._last_scn:
                return  # the relay holds it already
            if empty and time.monotonic() - last_emit < cfg.idle_window_interval_s:
                skipped[:] = [window]  # nothing captured: a HEARTBEAT window now and then
                return
            skipped.clear()
            last_emit = time.monotonic()
            self._emit(window, emit)
            self.stats["rows"] = assembler.row_count

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
                while (item := waiting.get()) is not None:
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
        if self._pool is not None:
            resolver = threading.Thread(target=resolve, name=f"mysql-{self.name}-resolve")
            resolver.start()

        def put(item: tuple[Window | PendingWindow, bool] | str | None) -> None:
            while resolver is not None and resolver.is_alive():
                try:
                    waiting.put(item, timeout=0.2)
                    return
                except queue.Full:
                    if stopping.is_set():
                        return

        reader = self._reader()
        assembler._txn = None  # a reconnect starts at a transaction boundary
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
                    assembler.begin(event.gtid, event.timestamp, event.flags)
                elif cls is XidEvent:
                    window = assembler.commit(event.packet.log_pos)
                elif cls is QueryEvent:
                    window = assembler.query(event, event.packet.log_pos)
                elif cls is GtidEvent:  # MySQL: a BEGIN query follows
                    assembler.begin(event.gtid, event.timestamp, 0)
                elif cls is RotateEvent:
                    assembler.rotate(event.next_binlog)
                elif cls is HeartbeatLogEvent:
                    self.stats["heartbeats"] += 1
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

    def _emit(self, window: Window, emit: Callable[[Window], None]) -> None:
        emit(window)
        self._last_scn = window.scn
        self.position = window.source_position
        self.stats["windows"] += 1


def _start_workers(workers: int, name: str) -> ProcessPoolExecutor:
    """Decode worker processes (spawned: the relay has threads), started and warmed up
    here so that their start-up (imports) is not in the stream's way."""
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        for future in [pool.submit(_warm_up) for _ in range(workers)]:
            future.result(timeout=120)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    log.info("partition %s: %d decode worker processes", name, workers)
    return pool


def _warm_up() -> int:
    from . import _assembler

    return len(_assembler.__all__)


def _reason(exc: BaseException) -> str:
    """An error's message without connection details (never a password)."""
    args: tuple[Any, ...] = tuple(getattr(exc, "args", ()))
    if len(args) >= 2 and isinstance(args[1], str):
        return f"{args[1]} ({args[0]})"
    return str(exc) or exc.__class__.__name__


def _factory(name: str, partition_id: int, options: Mapping[str, Any]) -> MySQLFetcher:
    return MySQLFetcher(name, partition_id, load_config_dict(MySQLConfig, options, "fetcher"))
