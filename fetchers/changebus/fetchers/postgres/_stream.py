"""The Postgres fetcher's stream thread: one loop over the replication stream, and SQL mode.

:func:`stream` starts the stream on the replication connection and handles
its messages, whichever reader (:mod:`._readers`) brings them: the reader
hands over a batch of CopyData messages per read; the loop looks at the
feed and the status update once per batch, then handles every message in
it. Messages reach the :class:`Assembler` raw (:meth:`Assembler.feed_raw`):
row changes are transcoded from pgoutput binary to Avro without Python
values in between.

Protocol (psycopg >= 3.3 has no replication API; the framing is ours):

* server -> client CopyData: ``w`` XLogData (start LSN, end LSN, send time,
  then one pgoutput message) and ``k`` keepalive (end LSN, send time,
  reply-requested flag);
* client -> server: ``r`` standby status update (written, flushed, applied
  LSN, clock, reply flag), sent when asked, after acknowledgements, and at
  least every ``status_interval_s``.

The feed holds windows back (up to ``HOLD_WINDOWS``, or ``HOLD_S``) and the
loop flushes it before it waits for the server: every wake-up of the event
loop, like every wait on the socket or status message to the server, gives
the GIL away, and winning it back from the relay's busy threads costs far
more than the system call itself. For the same reason a new acknowledgement
is reported to the server at most every ``_ACK_STATUS_S``.

:func:`poll_sql` is the SQL-interface mode (``mode = "sql"``): peek and
advance through the catalog connection, no replication connection.

Everything here runs on the fetcher's stream thread; what it shares with
the event loop is described on :class:`~._fetcher.PostgresFetcher`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from changebus.schemas import SourceError, lsn_to_scn, scn_to_lsn

from .._base import Window
from ._assembler import HEARTBEAT_PREFIX, Assembler
from ._readers import reader_kind, start_reader
from ._setup import connect
from ._watchdog import Watchdog, received_within
from ._wire import ServerError

if TYPE_CHECKING:
    from ._config import PostgresConfig
    from ._fetcher import PostgresFetcher

__all__ = ["HOLD_S", "HOLD_WINDOWS", "Ticker", "poll_sql", "stream"]

log = logging.getLogger("changebus.fetchers.postgres")

_XLOG = struct.Struct(">QQQ")
_KEEPALIVE = struct.Struct(">QQB")
_STATUS = struct.Struct(">cQQQQB")
_PG_EPOCH_US = 946_684_800_000_000
#: windows held back in the feed while the stream is busy (it flushes before it waits)
HOLD_WINDOWS = 256
HOLD_S = 0.02
#: a new acknowledgement is reported at most this often (besides status_interval_s)
_ACK_STATUS_S = 0.05
#: SQL mode: peek rows (pgoutput messages) fetched from the server at a time
PEEK_CHUNK_ROWS = 256


def stream(
    fetcher: PostgresFetcher,
    repl: Any,
    assembler: Assembler,
    emit: Callable[[Window], None],
    stopping: threading.Event,
    ticker: Ticker,
    watchdog: Watchdog,
) -> None:
    """Stream from the slot on ``repl`` (a replication connection) until ``stopping``.

    Resumes after the relay's last window (its END_OF_WINDOW carries the
    commit's end LSN); windows at or below the relay's last SCN that
    Postgres sends again are dropped. A stream silent for ``io_timeout_s``
    although asked for keepalives (:class:`_StreamDuties`) is a retriable
    :class:`SourceError`; ``watchdog`` bounds START_REPLICATION's answer.
    """
    cfg = fetcher.config
    resume = fetcher._resume
    start_lsn = "0/0"
    if resume.source_position.count("/") == 1:
        start_lsn = resume.source_position
    command = (
        f"START_REPLICATION SLOT {cfg.slot} LOGICAL {start_lsn} "
        f"(proto_version '1', publication_names '{cfg.publication}', binary 'true', messages 'true')"
    )
    which = reader_kind(cfg, repl.pgconn)
    fetcher.stream_reader = which
    watchdog.arm(id(repl), repl.pgconn.socket, "START_REPLICATION")
    try:
        reader = start_reader(which, repl, cfg, command)
    except SourceError:
        watchdog.check()
        raise
    finally:
        watchdog.disarm(id(repl))
    written = 0
    feed = fetcher._feed
    stats = fetcher.stats
    walsender = repl.info.backend_pid

    def decoding() -> bool:
        # a walsender replaying a big transaction (one of tables outside the publication
        # sends nothing at all) answers no keepalive request until it is done: busy on
        # the CPU or reading WAL or its spill files, it is alive. Waiting for WAL, for
        # the client or not there at all, it would have answered: the path is broken
        row = ticker.catalog.execute(
            "SELECT state, wait_event_type FROM pg_stat_activity WHERE pid = %s",
            (walsender,),
            timeout_s=max(cfg.io_timeout_s / 2, 0.5),  # (a frozen path: cut soon after all)
        ).fetchone()
        return row is not None and row[0] == "active" and row[1] in (None, "IO")

    duties = _StreamDuties(fetcher, reader.send_copy_data, decoding)
    if feed is not None:
        # blocked handing a window to a busy relay, the loop sends no status update: the
        # walsender ends the connection after wal_sender_timeout (60 s) without one
        feed.on_wait = lambda: duties.keepalive(time.monotonic(), written)
    read = reader.read
    xlog = _XLOG.unpack_from
    stats_every = cfg.slot_stats_interval_s or math.inf
    try:
        while not stopping.is_set():
            now = time.monotonic()
            duties.tick(now, written)
            batch = read()
            if batch:
                duties.last_rx = now
                if now - ticker.last_stats >= stats_every:
                    # (a backlog keeps every read busy: the slot's figures are read
                    # meanwhile too, when an operator watches them most)
                    ticker.tick(now, idle=False)
            else:
                if feed is not None:
                    feed.flush()
                ticker.tick(now, idle=not assembler.in_transaction)
                reader.wait(min(cfg.status_interval_s, 0.2))
                continue
            for buf, start, end in batch:
                kind = buf[start]
                if kind == 0x77:  # 'w' XLogData
                    lsn = xlog(buf, start + 1)[1]
                    if lsn > written:
                        written = lsn
                    window = assembler.feed_raw(buf, start + 25, end)
                    if window is not None and window.scn > resume.scn:
                        fetcher._emit(window, emit)
                        ticker.activity(now)
                elif kind == 0x6B:  # 'k' keepalive
                    lsn, _send, reply = _KEEPALIVE.unpack_from(buf, start + 1)
                    written = max(written, lsn)
                    stats["keepalives"] += 1
                    if reply:
                        duties.reply(written)
    except ServerError as exc:
        raise SourceError(f"replication stream ended: {exc.text}") from None
    except OSError as exc:  # ConnectionError included
        raise SourceError(f"lost the Postgres connection: {exc}") from None


def poll_sql(
    fetcher: PostgresFetcher,
    catalog: Any,
    assembler: Assembler,
    emit: Callable[[Window], None],
    stopping: threading.Event,
    ticker: Ticker,
    watchdog: Watchdog,
) -> None:
    """The SQL-interface mode: peek a batch, emit new windows, advance to what is acked.

    Peeking does not consume: the slot moves only by
    ``pg_replication_slot_advance`` to the end of acknowledged windows, so
    a crash re-reads (and drops, by SCN) what the relay already holds.

    The peek runs on a connection of its own and its rows are streamed
    (``PEEK_CHUNK_ROWS`` at a time): a peek answers with whole transactions,
    and one of a million rows must not be held at once before the assembler
    can see it (and drop it, past ``max_transaction_bytes``). The catalog
    connection stays free for the type lookups the assembler makes mid-peek.
    """
    cfg = fetcher.config
    emitted = fetcher._resume.scn
    emitted_end = 0
    advanced = 0
    # changes a peek asks for: doubled while whole peeks hold only windows the relay has
    # (a slot behind it by more than one peek, after a restart before the last advance):
    # such a peek emitted nothing, so nothing was acknowledged, the slot never moved,
    # and every peek read the same changes again, for good (review)
    batch = cfg.sql_batch_changes
    peek = (
        "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, %s, "
        "'proto_version', '1', 'publication_names', %s, 'binary', 'true', "
        "'messages', 'true')"
    )
    with connect(cfg.dsn, "cannot connect to Postgres", timeout_s=cfg.io_timeout_s) as conn:
        peeker = watchdog.guard(conn)
        # the peek decodes a whole transaction before it answers, and the slot's advance
        # decodes what it passes: a big one takes long, which the watchdog asks the
        # server about instead of cutting it (and reading it again, for ever)
        still_active = _activity_probe(cfg, conn.info.backend_pid, conn.pgconn.socket)
        advancing = _activity_probe(cfg, catalog.conn.info.backend_pid, catalog.conn.pgconn.socket)

        while not stopping.is_set():
            # wait (briefly) for the relay to take what was emitted: peeking
            # again before the slot advances would decode the same changes twice
            deadline = time.monotonic() + 1.0
            while (
                fetcher._acked_end_lsn < emitted_end
                and time.monotonic() < deadline
                and not stopping.is_set()
            ):
                stopping.wait(0.001)
            acked = fetcher._acked_end_lsn
            if acked > advanced:
                catalog.execute(
                    "SELECT pg_replication_slot_advance(%s, %s::pg_lsn)",
                    (cfg.slot, scn_to_lsn(acked)),
                    probe=advancing,
                )
                advanced = acked
            # every peek starts at the slot's confirmed position: what it reads up to
            # the last window emitted is read again (the relay holds it)
            assembler.replay_until = emitted
            fresh = peeked = 0
            rows = peeker.stream(
                peek,
                (cfg.slot, batch, cfg.publication),
                size=PEEK_CHUNK_ROWS,
                probe=still_active,
            )
            with contextlib.closing(rows):
                for (data,) in rows:
                    peeked += 1
                    window = assembler.feed_raw(data)
                    if window is not None and window.scn > emitted:
                        fetcher._emit(window, emit)
                        emitted = window.scn
                        emitted_end = lsn_to_scn(window.source_position)
                        fresh += 1
                    if stopping.is_set():
                        break
            if fetcher._feed is not None:
                fetcher._feed.flush()  # the acks waited for above need the loop to see them
            if fresh or stopping.is_set():
                batch = cfg.sql_batch_changes
            elif peeked >= batch:  # (a peek ends at a transaction's end past the count)
                batch = min(batch * 2, _MAX_PEEK_CHANGES)
            now = time.monotonic()
            if fresh:
                ticker.activity(now)
                ticker.tick(now, idle=False)  # (the slot's figures, when due)
            else:
                ticker.tick(now, idle=True)
                stopping.wait(cfg.sql_poll_interval_s)


#: the most changes one peek asks for (its argument is an int4)
_MAX_PEEK_CHANGES = 2**31 - 1


def _activity_probe(cfg: PostgresConfig, pid: int, sock: int) -> Callable[[], bool]:
    """A watchdog probe: is backend ``pid`` still working on its query (asked on a
    connection of its own)?"""

    def active() -> bool:
        with connect(cfg.dsn, "cannot connect to Postgres", timeout_s=cfg.io_timeout_s) as probe:
            row = probe.execute(
                "SELECT state, wait_event FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()
        if row is None or row[0] != "active":
            return False
        # a backend writing its answer waits on ClientWrite: progress while its bytes
        # arrive here, none when the path died (TCP would retry for many minutes)
        return row[1] != "ClientWrite" or received_within(sock, cfg.io_timeout_s)

    return active


def _send_status(
    send: Callable[[bytes], None], written: int, flushed: int, reply: bool = False
) -> None:
    send(_STATUS.pack(b"r", written, flushed, flushed, _now_pg_us(), 1 if reply else 0))


def _now_pg_us() -> int:
    return time.time_ns() // 1000 - _PG_EPOCH_US


class _StreamDuties:
    """What the stream loop does on every turn (once per batch the reader hands over).

    Wakes the event loop for windows the :class:`ThreadFeed` holds (they wait
    at most ``HOLD_S``) and sends standby status updates: every
    ``status_interval_s``, and soon (``_ACK_STATUS_S``) after the relay
    acknowledged more, or at once when the server asks for a reply. Owned by
    the stream thread.

    Liveness: ``last_rx`` is when the server last sent anything (the stream
    loop sets it when a read returned data). A status update sent while the
    server has been quiet for ``status_interval_s`` asks for a reply, which a
    live walsender sends at once; a request left unanswered for
    ``io_timeout_s`` (a frozen server, a half-open path) raises a retriable
    :class:`SourceError`. Only an unanswered request counts, so time the
    loop spent blocked elsewhere (handing windows to a busy relay) never
    looks like a silent server.
    """

    def __init__(
        self,
        fetcher: PostgresFetcher,
        send: Callable[[bytes], None],
        decoding: Callable[[], bool] | None = None,
    ) -> None:
        self._fetcher = fetcher
        self._send = send
        self._decoding = decoding
        self._interval = fetcher.config.status_interval_s
        self._timeout = fetcher.config.io_timeout_s
        self._last_status = 0.0
        self._sent_flush = -1
        self._last_wake = 0.0
        self.last_rx = time.monotonic()
        #: when the oldest unanswered request for a reply went out (0: none)
        self._asked = 0.0

    def tick(self, now: float, written: int) -> None:
        feed = self._fetcher._feed
        if feed is not None and now - self._last_wake >= HOLD_S:
            feed.flush()
            self._last_wake = now
        flush = self._fetcher._acked_end_lsn
        if now - self._last_status >= self._interval or (
            flush != self._sent_flush and now - self._last_status >= _ACK_STATUS_S
        ):
            if self.last_rx >= self._asked:
                self._asked = 0.0  # answered (or nothing asked)
            elif self._timeout and now - self._asked >= self._timeout:
                if self._decoding is not None and self._decoding():
                    log.info(
                        "the walsender has been decoding for %.0f s without a word (a big"
                        " transaction): waiting for it",
                        now - self._asked,
                    )
                    self._fetcher.stats["quiet_decoding"] += 1
                    self._asked = now
                else:
                    raise SourceError(
                        f"Postgres did not answer on the replication stream for "
                        f"{now - self._asked:.0f} s although asked for a keepalive (a frozen"
                        " server or a broken network path): reconnecting"
                    )
            ask = now - self.last_rx >= self._interval
            _send_status(self._send, max(written, flush), flush, reply=ask)
            if ask and not self._asked:
                self._asked = now
            self._last_status, self._sent_flush = now, flush

    def keepalive(self, now: float, written: int) -> None:
        """A status update every ``status_interval_s`` while the loop cannot read (it is
        blocked handing a window over): it asks for no reply, whose answer would wait
        unread and look like a silent server."""
        if now - self._last_status >= self._interval:
            flush = self._fetcher._acked_end_lsn
            _send_status(self._send, max(written, flush), flush)
            self._last_status, self._sent_flush = now, flush

    def reply(self, written: int) -> None:
        """Answer a keepalive that asks for a reply."""
        flush = self._fetcher._acked_end_lsn
        _send_status(self._send, max(written, flush), flush)
        self._last_status = time.monotonic()


class Ticker:
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
            stats["slot_stats_reads"] += 1
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
