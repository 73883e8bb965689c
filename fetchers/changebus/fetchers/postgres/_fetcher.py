"""The Postgres fetcher: pgoutput over the streaming replication protocol.

One thread per fetcher owns two blocking psycopg connections: a replication
connection (``replication=database``) in COPY_BOTH mode, and a regular one
for the catalog (types, primary keys) and for set-up. Windows go to the event
loop through a bounded :class:`ThreadFeed`, so a slow relay slows the stream.
The feed holds windows back (up to 256, or 20 ms) and the loop flushes it
before it waits for the server: every wake-up of the event loop, like every
wait on the socket or status message to the server, gives the GIL away, and
winning it back from the relay's busy threads costs far more than the system
call itself. For the same reason a new acknowledgement is reported to the
server at most every 50 ms. Messages reach the
:class:`Assembler` raw (:meth:`Assembler.feed_raw`): row changes are
transcoded from pgoutput binary to Avro without Python values in between.

Protocol (psycopg >= 3.3 has no replication API; the framing is ours):

* server -> client CopyData: ``w`` XLogData (start LSN, end LSN, send time,
  then one pgoutput message) and ``k`` keepalive (end LSN, send time,
  reply-requested flag);
* client -> server: ``r`` standby status update (written, flushed, applied
  LSN, clock, reply flag), sent when asked, after acknowledgements, and at
  least every ``status_interval_s``.

Two readers of that stream (option ``stream_reader``): libpq's
``PQgetCopyData``, one message per call, or, on a connection without TLS or
GSS encryption, the socket itself (:class:`~._wire.CopyBothSocket`: ~1 MiB
per read, messages split in Python and handed to the assembler as spans of
the chunk). Both fill the relay's buffer with the same bytes.

Only what the relay has acknowledged (``acknowledge(scn)``: the window is in
its buffer) is reported as flushed, so the slot never advances past a change
the relay does not hold: a crash anywhere loses nothing. On start the stream
resumes after the relay's last window (its END_OF_WINDOW carries the commit's
end LSN); windows at or below the relay's last SCN that Postgres sends again
are dropped, so the buffer gets no duplicates.

Set-up from the options: the publication and the slot are created when
missing, never dropped. ``wal_level`` other than ``logical``, a missing
privilege or an invalidated slot raise clear, non-retriable
:class:`SourceConfigError`\\ s; a lost connection or a slot held by another
process (often the previous run's walsender, still exiting) is a retriable
:class:`SourceError`: the relay restarts the fetcher with backoff and shows
the reason in ``/v1/status``.
"""

from __future__ import annotations

import asyncio
import logging
import select
import struct
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from changebus.schemas import (
    ConfigError,
    DataLoss,
    SchemaRegistry,
    SourceConfigError,
    SourceError,
    lsn_to_scn,
    scn_to_lsn,
)
from changebus.schemas.config import load_config_dict, secret

from .._base import ResumePoint, Window, window_bytes
from .._threadfeed import ThreadFeed
from ._assembler import HEARTBEAT_PREFIX, Assembler
from ._types import TypeResolver
from ._wire import CopyBothSocket, ServerError

__all__ = ["PostgresConfig", "PostgresFetcher"]

log = logging.getLogger("changebus.fetchers.postgres")

_XLOG = struct.Struct(">QQQ")
_KEEPALIVE = struct.Struct(">QQB")
_STATUS = struct.Struct(">cQQQQB")
_PG_EPOCH_US = 946_684_800_000_000
#: windows held back in the feed while the stream is busy (it flushes before it waits)
_HOLD_WINDOWS = 256
_HOLD_S = 0.02
#: a new acknowledgement is reported at most this often (besides status_interval_s)
_ACK_STATUS_S = 0.05


@dataclass(frozen=True)
class PostgresConfig:
    """Options of the ``postgres`` fetcher kind (seconds for durations)."""

    dsn: str = secret()
    slot: str = "changebus"
    publication: str = "changebus"
    #: tables for a new publication ("schema.table"); empty = FOR ALL TABLES
    tables: tuple[str, ...] = ()
    create_slot: bool = True
    create_publication: bool = True
    #: "stream" (replication protocol) or "sql" (peek + advance, no replication connection)
    mode: str = "stream"
    status_interval_s: float = 1.0
    #: emit a heartbeat message after this long without a window (0 = never)
    heartbeat_interval_s: float = 10.0
    #: how often the slot's retained WAL is read for /v1/status and /metrics
    slot_stats_interval_s: float = 5.0
    #: a transaction whose events pass this size is refused or skipped (0 = no limit)
    max_transaction_bytes: int = 128 << 20
    #: "fail" (stop with a clear error) or "skip" (a DATA_LOSS event replaces it)
    on_oversized_transaction: str = "fail"
    #: an invalidated or vanished slot: "recreate" (after a DATA_LOSS event) or "fail"
    on_slot_lost: str = "recreate"
    #: SQL mode: changes asked per peek, and the pause when nothing is new
    sql_batch_changes: int = 20_000
    sql_poll_interval_s: float = 0.05
    #: how the stream is read: "socket" (straight from the connection's socket),
    #: "libpq" (one PQgetCopyData per message) or "auto" (socket unless TLS/GSS)
    stream_reader: str = "auto"
    #: bytes asked per read of the socket reader
    socket_read_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if not self.dsn:
            raise ConfigError("the postgres fetcher needs options.dsn")
        choices = {
            "mode": ("stream", "sql"),
            "on_oversized_transaction": ("fail", "skip"),
            "on_slot_lost": ("recreate", "fail"),
            "stream_reader": ("auto", "libpq", "socket"),
        }
        for option, allowed in choices.items():
            if getattr(self, option) not in allowed:
                raise ConfigError(
                    f"fetcher option {option} must be one of {', '.join(allowed)}, "
                    f"not {getattr(self, option)!r}"
                )
        for option in ("status_interval_s", "sql_poll_interval_s"):
            if getattr(self, option) <= 0:
                raise ConfigError(f"fetcher option {option} must be positive")
        for option in ("heartbeat_interval_s", "slot_stats_interval_s", "max_transaction_bytes"):
            if getattr(self, option) < 0:
                raise ConfigError(f"fetcher option {option} must not be negative")
        if self.sql_batch_changes < 1:
            raise ConfigError("fetcher option sql_batch_changes must be at least 1")
        if self.socket_read_bytes < 1:
            raise ConfigError("fetcher option socket_read_bytes must be at least 1")
        for name in (self.slot, self.publication):
            if not name.replace("_", "").isalnum() or not name.islower():
                raise ConfigError(
                    f"slot and publication names must be lower-case [a-z0-9_], got {name!r}"
                )


def _now_pg_us() -> int:
    return time.time_ns() // 1000 - _PG_EPOCH_US


class PostgresFetcher:
    """Streams a Postgres database's changes as windows (see the module docstring).

    Thread-safety: ``start``/``acknowledge``/``close``/``status`` run on the
    event loop; the stream thread reads ``_acked_end_lsn`` and writes
    ``stats``; ``_pending`` (emitted, not yet acknowledged windows) is shared
    under ``_lock``.
    """

    def __init__(self, name: str, partition_id: int, config: PostgresConfig) -> None:
        self.name = name
        self.partition_id = partition_id
        self.config = config
        self._resume = ResumePoint()
        self._feed: ThreadFeed[Window] | None = None
        self._acked_end_lsn = 0  # written by the loop thread, read by the stream thread
        self._pending: deque[tuple[int, int]] = deque()  # (scn, end lsn) of emitted windows
        self._lock = threading.Lock()
        #: (from_scn, to_scn, reason) to announce before the stream: the slot was lost
        self._data_loss: tuple[int, int, str] | None = None
        self.stats: dict[str, Any] = {
            "windows": 0,
            "keepalives": 0,
            "heartbeats": 0,
            "retained_wal_bytes": -1,
            "unconfirmed_wal_bytes": -1,
        }
        self._slot_state = ""
        #: the reader of the current (or last) stream: "socket" or "libpq"
        self.stream_reader = ""

    # ---- Fetcher protocol -------------------------------------------------

    async def start(self, resume: ResumePoint) -> int:
        """Check the server, create publication and slot when missing.

        Returns the SCN after which the stream is complete: the relay's last
        SCN when it has one, else the slot's confirmed position (changes
        committed before the slot existed are not in the stream).
        """
        self._resume = resume
        position = await asyncio.to_thread(self._setup)
        return resume.scn if resume.scn >= 0 else position

    def _setup(self) -> int:
        import psycopg

        try:
            with psycopg.connect(self.config.dsn, autocommit=True) as catalog:
                self._prepare(catalog)
                row = catalog.execute(
                    "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                    (self.config.slot,),
                ).fetchone()
        except psycopg.OperationalError as exc:
            raise SourceError(f"cannot connect to Postgres: {_reason(exc)}") from None
        return lsn_to_scn(row[0]) if row and row[0] else -1

    async def windows(self) -> AsyncIterator[Window]:
        # windows held back while the stream is busy: it flushes before it waits for data
        self._feed = ThreadFeed(
            self._run,
            maxsize=1024,
            name=f"pg-{self.name}",
            hold_items=_HOLD_WINDOWS,
            hold_s=_HOLD_S,
            weigh=window_bytes,
        )
        async for window in self._feed.items():
            yield window

    async def acknowledge(self, scn: int) -> None:
        with self._lock:
            while self._pending and self._pending[0][0] <= scn:
                _, end = self._pending.popleft()
                self._acked_end_lsn = max(self._acked_end_lsn, end)

    async def close(self) -> None:
        if self._feed is not None:
            await self._feed.close()

    def status(self) -> dict[str, Any]:
        return {
            "kind": "postgres",
            "mode": self.config.mode,
            "slot": self.config.slot,
            "slot_wal_status": self._slot_state,
            "stream_reader": self.stream_reader,
            "acked_lsn": scn_to_lsn(self._acked_end_lsn) if self._acked_end_lsn else "",
            **{k: v for k, v in self.stats.items() if v != -1},
        }

    # ---- the stream thread -----------------------------------------------------

    def _run(self, emit: Callable[[Window], None], stopping: threading.Event) -> None:
        import psycopg

        cfg = self.config
        try:
            catalog = psycopg.connect(cfg.dsn, autocommit=True)
        except psycopg.OperationalError as exc:
            raise SourceError(f"cannot connect to Postgres: {_reason(exc)}") from None
        with catalog:
            resolver = TypeResolver(catalog)
            registry = SchemaRegistry()
            registry.import_entries(self._resume.schemas)
            assembler = Assembler(
                self.partition_id,
                resolver.resolve,
                registry,
                primary_key=resolver.primary_key,
                array_dims=resolver.array_dims,
                max_window_bytes=cfg.max_transaction_bytes,
                on_oversized=cfg.on_oversized_transaction,
            )
            if self._data_loss is not None:
                lo, hi, reason = self._data_loss
                self._emit(assembler.control_window(DataLoss(lo, hi, reason), hi), emit)
                self._data_loss = None
            ticker = _Ticker(self, catalog)
            try:
                if cfg.mode == "sql":
                    self._poll_sql(catalog, assembler, emit, stopping, ticker)
                    return
                try:
                    repl = psycopg.connect(cfg.dsn, autocommit=True, replication="database")
                except psycopg.OperationalError as exc:
                    raise SourceError(
                        f"cannot open a replication connection: {_reason(exc)}"
                    ) from None
                # not `with repl`: its exit would try a COMMIT in COPY_BOTH mode and
                # fail before closing, leaving the server's walsender holding the slot
                try:
                    self._stream(repl, assembler, emit, stopping, ticker)
                finally:
                    repl.close()
            except psycopg.OperationalError as exc:  # the server went away mid-stream
                raise SourceError(f"lost the Postgres connection: {_reason(exc)}") from None

    def _emit(self, window: Window, emit: Callable[[Window], None]) -> None:
        with self._lock:
            self._pending.append((window.scn, lsn_to_scn(window.source_position)))
        emit(window)
        self.stats["windows"] += 1

    def _prepare(self, catalog: Any) -> None:
        import psycopg
        from psycopg import sql

        cfg = self.config
        level = catalog.execute("SHOW wal_level").fetchone()[0]
        if level != "logical":
            raise SourceConfigError(
                f"Postgres wal_level is {level!r}; set wal_level = logical and restart it"
            )
        try:
            exists = catalog.execute(
                "SELECT 1 FROM pg_publication WHERE pubname = %s", (cfg.publication,)
            ).fetchone()
            if exists is None:
                if not cfg.create_publication:
                    raise SourceConfigError(f"publication {cfg.publication!r} does not exist")
                if cfg.tables:
                    tables = sql.SQL(", ").join(
                        sql.Identifier(*t.split(".", 1)) for t in cfg.tables
                    )
                    catalog.execute(
                        sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
                            sql.Identifier(cfg.publication), tables
                        )
                    )
                else:
                    catalog.execute(
                        sql.SQL("CREATE PUBLICATION {} FOR ALL TABLES").format(
                            sql.Identifier(cfg.publication)
                        )
                    )
                log.info("created publication %s", cfg.publication)
            slot = catalog.execute(
                "SELECT plugin, active, active_pid, wal_status FROM pg_replication_slots "
                "WHERE slot_name = %s",
                (cfg.slot,),
            ).fetchone()
            lost = ""
            if slot is not None:
                plugin, active, pid, wal_status = slot
                if plugin != "pgoutput":
                    raise SourceConfigError(
                        f"slot {cfg.slot!r} uses plugin {plugin!r}, not pgoutput"
                    )
                if active:  # often the previous run's walsender, still exiting: retriable
                    raise SourceError(f"slot {cfg.slot!r} is in use by another process (pid {pid})")
                if wal_status == "lost":
                    lost = f"slot {cfg.slot!r} was invalidated (the WAL it needed was removed)"
            elif self._resume.scn >= 0:
                lost = f"slot {cfg.slot!r} vanished (dropped while the relay held its changes)"
            if lost:
                if cfg.on_slot_lost == "fail":
                    raise SourceConfigError(
                        f"{lost}: changes are lost; set on_slot_lost = 'recreate' to go on "
                        "after a data-loss event"
                    )
                if slot is not None:
                    catalog.execute("SELECT pg_drop_replication_slot(%s)", (cfg.slot,))
                slot = None
            if slot is None:
                if not cfg.create_slot:
                    raise SourceConfigError(f"replication slot {cfg.slot!r} does not exist")
                catalog.execute(
                    "SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (cfg.slot,)
                )
                log.info("created replication slot %s", cfg.slot)
            row = catalog.execute(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                (cfg.slot,),
            ).fetchone()
            self._check_gap(lost, lsn_to_scn(row[0]))
        except psycopg.errors.InsufficientPrivilege as exc:
            raise SourceConfigError(
                f"the Postgres user lacks a privilege: {exc.diag.message_primary}"
            ) from None

    def _check_gap(self, lost: str, confirmed: int) -> None:
        """Plan a DATA_LOSS window when the slot starts after the relay's last window.

        The fetcher confirms only what the relay holds, so a slot confirmed
        beyond the end of the relay's last window (``resume.source_position``)
        means changes in between were consumed elsewhere or are gone with a lost
        slot. Checked at every start, so a relay restarted before announcing
        the loss announces it then.
        """
        self._data_loss = None
        resume = self._resume
        if resume.scn < 0 or resume.source_position.count("/") != 1:
            return  # the relay holds nothing from this slot yet
        if confirmed <= lsn_to_scn(resume.source_position):
            return
        what = lost or (
            f"slot {self.config.slot!r} was confirmed beyond the relay's last window "
            "(recreated, or used by another consumer)"
        )
        self._announce_loss(what, confirmed)

    def _announce_loss(self, what: str, new_start: int) -> None:
        """Plan the DATA_LOSS window for changes between the relay's end and a new slot."""
        last = self._resume.scn
        hi = max(new_start - 1, last + 1)
        reason = (
            f"{what}; a new slot streams from {scn_to_lsn(new_start)}: changes committed "
            f"after SCN {last} and before it are missing"
        )
        log.error("partition %s: %s", self.name, reason)
        self._data_loss = (last + 1, hi, reason)
        # the stream continues after the new slot's start, not the relay's old end
        self._resume = ResumePoint(hi, scn_to_lsn(new_start), self._resume.schemas)

    def _stream(
        self,
        repl: Any,
        assembler: Assembler,
        emit: Callable[[Window], None],
        stopping: threading.Event,
        ticker: _Ticker,
    ) -> None:
        import psycopg

        cfg = self.config
        resume = self._resume
        start_lsn = "0/0"
        if resume.source_position.count("/") == 1:
            start_lsn = resume.source_position
        command = (
            f"START_REPLICATION SLOT {cfg.slot} LOGICAL {start_lsn} "
            f"(proto_version '1', publication_names '{cfg.publication}', binary 'true', messages 'true')"
        )
        pgconn = repl.pgconn
        plain = not pgconn.ssl_in_use and not pgconn.used_gssapi
        if cfg.stream_reader == "socket" and not plain:
            raise SourceConfigError(
                "fetcher option stream_reader = 'socket' needs a connection without "
                "TLS or GSS encryption; use 'auto' or 'libpq'"
            )
        if cfg.stream_reader != "libpq" and plain:
            self.stream_reader = "socket"
            self._stream_socket(pgconn, command, assembler, emit, stopping, ticker)
            return
        self.stream_reader = "libpq"
        try:
            repl.execute(command)
        except psycopg.errors.ObjectInUse as exc:
            raise SourceError(
                f"slot {cfg.slot!r} is in use by another process: {exc.diag.message_primary}"
            ) from None
        except psycopg.Error as exc:
            raise SourceError(f"START_REPLICATION failed: {_reason(exc)}") from None
        sock = pgconn.socket

        def send(msg: bytes) -> None:
            pgconn.put_copy_data(msg)
            pgconn.flush()

        written = 0
        feed = self._feed
        duties = _StreamDuties(self, send)
        while not stopping.is_set():
            now = time.monotonic()
            duties.tick(now, written)
            nbytes, data = pgconn.get_copy_data(1)
            if nbytes == 0:
                # what the socket holds already, without a wait (select lets go of the
                # GIL, and winning it back from busy relay threads takes long)
                pgconn.consume_input()
                nbytes, data = pgconn.get_copy_data(1)
            if nbytes == 0:
                if feed is not None:
                    feed.flush()
                ticker.tick(now, idle=not assembler.in_transaction)
                ready, _, _ = select.select([sock], [], [], min(cfg.status_interval_s, 0.2))
                if ready:
                    pgconn.consume_input()
                continue
            if nbytes < 0:
                message = pgconn.get_error_message().decode(errors="replace").strip()
                raise SourceError(f"replication stream ended: {message}")
            kind = data[:1]
            if kind == b"w":
                _start, end, _send = _XLOG.unpack_from(data, 1)
                written = max(written, end)
                window = assembler.feed_raw(data, 25)
                if window is not None:
                    if window.scn <= resume.scn:
                        continue  # the relay holds it already (resent after a restart)
                    self._emit(window, emit)
                    ticker.activity(now)
            elif kind == b"k":
                end, _send, reply = _KEEPALIVE.unpack_from(data, 1)
                written = max(written, end)
                self.stats["keepalives"] += 1
                if reply:
                    duties.reply(written)

    def _stream_socket(
        self,
        pgconn: Any,
        command: str,
        assembler: Assembler,
        emit: Callable[[Window], None],
        stopping: threading.Event,
        ticker: _Ticker,
    ) -> None:
        """The stream loop of ``_stream`` with the socket reader (see ``_wire``).

        The same work as the libpq loop, but per chunk of the socket (up to
        ``socket_read_bytes``): the feed and the status update are looked at
        once per chunk, then every CopyData message in it is handled.
        """
        cfg = self.config
        resume = self._resume
        wire = CopyBothSocket(pgconn.socket, cfg.socket_read_bytes)
        try:
            wire.start(command)
        except ServerError as exc:
            if exc.sqlstate == "55006":  # object_in_use
                raise SourceError(
                    f"slot {cfg.slot!r} is in use by another process: {exc.message}"
                ) from None
            raise SourceError(f"START_REPLICATION failed: {exc.message}") from None
        except (OSError, TimeoutError) as exc:
            raise SourceError(f"lost the Postgres connection: {exc}") from None
        written = 0
        feed = self._feed
        duties = _StreamDuties(self, wire.send_copy_data)
        xlog = _XLOG.unpack_from
        try:
            while not stopping.is_set():
                now = time.monotonic()
                duties.tick(now, written)
                buf, spans = wire.read()
                if not spans:
                    if feed is not None:
                        feed.flush()
                    ticker.tick(now, idle=not assembler.in_transaction)
                    wire.wait(min(cfg.status_interval_s, 0.2))
                    continue
                for start, end in spans:
                    kind = buf[start]
                    if kind == 0x77:  # 'w' XLogData
                        lsn = xlog(buf, start + 1)[1]
                        if lsn > written:
                            written = lsn
                        window = assembler.feed_raw(buf, start + 25, end)
                        if window is not None and window.scn > resume.scn:
                            self._emit(window, emit)
                            ticker.activity(now)
                    elif kind == 0x6B:  # 'k' keepalive
                        lsn, _send, reply = _KEEPALIVE.unpack_from(buf, start + 1)
                        written = max(written, lsn)
                        self.stats["keepalives"] += 1
                        if reply:
                            duties.reply(written)
        except ServerError as exc:
            raise SourceError(f"replication stream ended: {exc.text}") from None
        except OSError as exc:  # ConnectionError included
            raise SourceError(f"lost the Postgres connection: {exc}") from None

    def _poll_sql(
        self,
        catalog: Any,
        assembler: Assembler,
        emit: Callable[[Window], None],
        stopping: threading.Event,
        ticker: _Ticker,
    ) -> None:
        """The SQL-interface mode: peek a batch, emit new windows, advance to what is acked.

        Peeking does not consume: the slot moves only by
        ``pg_replication_slot_advance`` to the end of acknowledged windows, so
        a crash re-reads (and drops, by SCN) what the relay already holds.
        """
        cfg = self.config
        emitted = self._resume.scn
        emitted_end = 0
        advanced = 0
        peek = (
            "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, %s, "
            "'proto_version', '1', 'publication_names', %s, 'binary', 'true', "
            "'messages', 'true')"
        )
        while not stopping.is_set():
            # wait (briefly) for the relay to take what was emitted: peeking
            # again before the slot advances would decode the same changes twice
            deadline = time.monotonic() + 1.0
            while (
                self._acked_end_lsn < emitted_end
                and time.monotonic() < deadline
                and not stopping.is_set()
            ):
                stopping.wait(0.001)
            acked = self._acked_end_lsn
            if acked > advanced:
                catalog.execute(
                    "SELECT pg_replication_slot_advance(%s, %s::pg_lsn)",
                    (cfg.slot, scn_to_lsn(acked)),
                )
                advanced = acked
            rows = catalog.execute(peek, (cfg.slot, cfg.sql_batch_changes, cfg.publication))
            fresh = 0
            for (data,) in rows:
                window = assembler.feed_raw(data)
                if window is not None and window.scn > emitted:
                    self._emit(window, emit)
                    emitted = window.scn
                    emitted_end = lsn_to_scn(window.source_position)
                    fresh += 1
            if self._feed is not None:
                self._feed.flush()  # the acks waited for above need the loop to see them
            now = time.monotonic()
            if fresh:
                ticker.activity(now)
            else:
                ticker.tick(now, idle=True)
                stopping.wait(cfg.sql_poll_interval_s)

    def _send_status(self, send: Callable[[bytes], None], written: int, flushed: int) -> None:
        send(_STATUS.pack(b"r", written, flushed, flushed, _now_pg_us(), 0))


class _StreamDuties:
    """What a stream loop does on every turn, whichever reader it uses.

    Wakes the event loop for windows the :class:`ThreadFeed` holds (they wait
    at most ``_HOLD_S``) and sends standby status updates: every
    ``status_interval_s``, and soon (``_ACK_STATUS_S``) after the relay
    acknowledged more, or at once when the server asks for a reply. Owned by
    the stream thread.
    """

    def __init__(self, fetcher: PostgresFetcher, send: Callable[[bytes], None]) -> None:
        self._fetcher = fetcher
        self._send = send
        self._interval = fetcher.config.status_interval_s
        self._last_status = 0.0
        self._sent_flush = -1
        self._last_wake = 0.0

    def tick(self, now: float, written: int) -> None:
        feed = self._fetcher._feed
        if feed is not None and now - self._last_wake >= _HOLD_S:
            feed.flush()
            self._last_wake = now
        flush = self._fetcher._acked_end_lsn
        if now - self._last_status >= self._interval or (
            flush != self._sent_flush and now - self._last_status >= _ACK_STATUS_S
        ):
            self._fetcher._send_status(self._send, max(written, flush), flush)
            self._last_status, self._sent_flush = now, flush

    def reply(self, written: int) -> None:
        """Answer a keepalive that asks for a reply."""
        flush = self._fetcher._acked_end_lsn
        self._fetcher._send_status(self._send, max(written, flush), flush)
        self._last_status = time.monotonic()


class _Ticker:
    """Periodic work of the stream thread: idle heartbeats and slot figures.

    A heartbeat is a non-transactional logical message (prefix
    ``changebus.heartbeat``) written through the catalog connection when no
    window went out for ``heartbeat_interval_s``: it comes back through the
    slot as a HEARTBEAT window, which the relay stores and acknowledges, so the
    slot advances and WAL does not pile up on an idle database (or one whose
    writes all go to tables outside the publication).
    """

    def __init__(self, fetcher: PostgresFetcher, catalog: Any) -> None:
        self.fetcher = fetcher
        self.catalog = catalog
        now = time.monotonic()
        self.last_activity = now
        self.last_stats = 0.0

    def activity(self, now: float) -> None:
        self.last_activity = now

    def tick(self, now: float, *, idle: bool) -> None:
        cfg = self.fetcher.config
        stats = self.fetcher.stats
        if (
            idle
            and cfg.heartbeat_interval_s
            and now - self.last_activity >= cfg.heartbeat_interval_s
        ):
            self.catalog.execute(
                "SELECT pg_logical_emit_message(false, %s, '')", (HEARTBEAT_PREFIX,)
            )
            stats["heartbeats"] += 1
            self.last_activity = now
        if cfg.slot_stats_interval_s and now - self.last_stats >= cfg.slot_stats_interval_s:
            self.last_stats = now
            row = self.catalog.execute(
                "SELECT (pg_current_wal_lsn() - restart_lsn)::int8, "
                "(pg_current_wal_lsn() - confirmed_flush_lsn)::int8, wal_status "
                "FROM pg_replication_slots WHERE slot_name = %s",
                (cfg.slot,),
            ).fetchone()
            if row is None:
                raise SourceError(f"replication slot {cfg.slot!r} vanished while streaming")
            stats["retained_wal_bytes"] = row[0] if row[0] is not None else -1
            stats["unconfirmed_wal_bytes"] = row[1] if row[1] is not None else -1
            state = row[2] or ""
            if state != self.fetcher._slot_state and state in ("unreserved", "lost"):
                log.warning(
                    "partition %s: slot %s is %s: max_slot_wal_keep_size is about to drop "
                    "WAL it needs",
                    self.fetcher.name,
                    cfg.slot,
                    state,
                )
            self.fetcher._slot_state = state


def _reason(exc: BaseException) -> str:
    """An error's first line without connection details (no DSN, no password)."""
    diag = getattr(exc, "diag", None)
    primary = getattr(diag, "message_primary", None) if diag is not None else None
    return str(primary) if primary else exc.__class__.__name__


def _factory(name: str, partition_id: int, options: Mapping[str, Any]) -> PostgresFetcher:
    return PostgresFetcher(name, partition_id, load_config_dict(PostgresConfig, options, "fetcher"))
