"""The Postgres fetcher: pgoutput over the streaming replication protocol.

One thread per fetcher owns two blocking psycopg connections: a replication
connection (``replication=database``) in COPY_BOTH mode, and a regular one
for the catalog (types, primary keys) and for set-up. Windows go to the event
loop through a bounded :class:`ThreadFeed`, so a slow relay slows the stream.

Protocol (psycopg >= 3.3 has no replication API; the framing is ours):

* server -> client CopyData: ``w`` XLogData (start LSN, end LSN, send time,
  then one pgoutput message) and ``k`` keepalive (end LSN, send time,
  reply-requested flag);
* client -> server: ``r`` standby status update (written, flushed, applied
  LSN, clock, reply flag), sent when asked, after acknowledgements, and at
  least every ``status_interval_s``.

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

from changebus.schemas import ConfigError, SourceConfigError, SourceError, lsn_to_scn, scn_to_lsn
from changebus.schemas.config import load_config_dict, secret

from .._base import ResumePoint, Window, register_fetcher
from .._threadfeed import ThreadFeed
from ._assembler import Assembler
from ._pgoutput import parse_message
from ._types import TypeResolver

__all__ = ["PostgresConfig", "PostgresFetcher"]

log = logging.getLogger("changebus.fetchers.postgres")

_XLOG = struct.Struct(">QQQ")
_KEEPALIVE = struct.Struct(">QQB")
_STATUS = struct.Struct(">cQQQQB")
_PG_EPOCH_US = 946_684_800_000_000


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
    status_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.dsn:
            raise ConfigError("the postgres fetcher needs options.dsn")
        for name in (self.slot, self.publication):
            if not name.replace("_", "").isalnum() or not name.islower():
                raise ConfigError(
                    f"slot and publication names must be lower-case [a-z0-9_], got {name!r}"
                )


def _now_pg_us() -> int:
    return time.time_ns() // 1000 - _PG_EPOCH_US


class PostgresFetcher:
    """Streams a Postgres database's changes as windows (see the module docstring)."""

    def __init__(self, name: str, partition_id: int, config: PostgresConfig) -> None:
        self.name = name
        self.partition_id = partition_id
        self.config = config
        self._resume = ResumePoint()
        self._feed: ThreadFeed[Window] | None = None
        self._acked_end_lsn = 0  # written by the loop thread, read by the stream thread
        self._pending: deque[tuple[int, int]] = deque()  # (scn, end lsn) of emitted windows
        self._lock = threading.Lock()
        self.stats: dict[str, Any] = {"windows": 0, "keepalives": 0, "retained_wal_bytes": -1}

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
            raise SourceError(f"cannot connect to Postgres: {exc.__class__.__name__}") from None
        return lsn_to_scn(row[0]) if row and row[0] else -1

    async def windows(self) -> AsyncIterator[Window]:
        self._feed = ThreadFeed(self._run, maxsize=1024, name=f"pg-{self.name}")
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
            "slot": self.config.slot,
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
            raise SourceError(f"cannot connect to Postgres: {exc.__class__.__name__}") from None
        with catalog:
            resolver = TypeResolver(catalog)
            assembler = Assembler(
                self.partition_id, resolver.resolve, primary_key=resolver.primary_key
            )
            try:
                repl = psycopg.connect(cfg.dsn, autocommit=True, replication="database")
            except psycopg.OperationalError as exc:
                raise SourceError(
                    f"cannot open a replication connection: {exc.__class__.__name__}"
                ) from None
            # not `with repl`: its exit would try a COMMIT in COPY_BOTH mode and
            # fail before closing, leaving the server's walsender holding the slot
            try:
                self._stream(repl, catalog, assembler, emit, stopping)
            finally:
                repl.close()

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
                "SELECT plugin, active, active_pid, wal_status FROM pg_replication_slots WHERE slot_name = %s",
                (cfg.slot,),
            ).fetchone()
            if slot is None:
                if not cfg.create_slot:
                    raise SourceConfigError(f"replication slot {cfg.slot!r} does not exist")
                catalog.execute(
                    "SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (cfg.slot,)
                )
                log.info("created replication slot %s", cfg.slot)
            else:
                plugin, active, pid, wal_status = slot
                if plugin != "pgoutput":
                    raise SourceConfigError(
                        f"slot {cfg.slot!r} uses plugin {plugin!r}, not pgoutput"
                    )
                if active:  # often the previous run's walsender, still exiting: retriable
                    raise SourceError(f"slot {cfg.slot!r} is in use by another process (pid {pid})")
                if wal_status == "lost":
                    raise SourceConfigError(
                        f"slot {cfg.slot!r} was invalidated (WAL removed): changes are lost"
                    )
        except psycopg.errors.InsufficientPrivilege as exc:
            raise SourceConfigError(
                f"the Postgres user lacks a privilege: {exc.diag.message_primary}"
            ) from None

    def _stream(
        self,
        repl: Any,
        catalog: Any,
        assembler: Assembler,
        emit: Callable[[Window], None],
        stopping: threading.Event,
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
        try:
            repl.execute(command)
        except psycopg.errors.ObjectInUse as exc:
            raise SourceError(
                f"slot {cfg.slot!r} is in use by another process: {exc.diag.message_primary}"
            ) from None
        except psycopg.Error as exc:
            raise SourceError(f"START_REPLICATION failed: {exc.__class__.__name__}") from None
        pgconn = repl.pgconn
        sock = pgconn.socket
        last_status = 0.0
        written = 0
        sent_flush = -1
        while not stopping.is_set():
            now = time.monotonic()
            flush = self._acked_end_lsn
            if now - last_status >= cfg.status_interval_s or flush != sent_flush:
                self._send_status(pgconn, max(written, flush), flush)
                last_status, sent_flush = now, flush
            nbytes, data = pgconn.get_copy_data(1)
            if nbytes == 0:
                ready, _, _ = select.select([sock], [], [], min(cfg.status_interval_s, 0.2))
                if ready:
                    pgconn.consume_input()
                continue
            if nbytes < 0:
                raise SourceError(
                    f"replication stream ended: {pgconn.get_error_message().decode(errors='replace').strip()}"
                )
            kind = data[:1]
            if kind == b"w":
                _start, end, _send = _XLOG.unpack_from(data, 1)
                written = max(written, end)
                window = assembler.feed(parse_message(memoryview(data)[25:]))
                if window is not None:
                    if window.scn <= resume.scn:
                        continue  # the relay holds it already (resent after a restart)
                    with self._lock:
                        self._pending.append((window.scn, lsn_to_scn(window.source_position)))
                    emit(window)
                    self.stats["windows"] += 1
            elif kind == b"k":
                end, _send, reply = _KEEPALIVE.unpack_from(data, 1)
                written = max(written, end)
                self.stats["keepalives"] += 1
                if reply:
                    self._send_status(
                        pgconn, max(written, self._acked_end_lsn), self._acked_end_lsn
                    )
                    last_status = time.monotonic()

    def _send_status(self, pgconn: Any, written: int, flushed: int) -> None:
        msg = _STATUS.pack(b"r", written, flushed, flushed, _now_pg_us(), 0)
        pgconn.put_copy_data(msg)
        pgconn.flush()


def _factory(name: str, partition_id: int, options: Mapping[str, Any]) -> PostgresFetcher:
    return PostgresFetcher(name, partition_id, load_config_dict(PostgresConfig, options, "fetcher"))


register_fetcher("postgres", _factory)
