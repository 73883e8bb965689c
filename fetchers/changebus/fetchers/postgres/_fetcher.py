"""The Postgres fetcher: pgoutput over the streaming replication protocol.

One thread per fetcher owns two blocking psycopg connections: a replication
connection (``replication=database``) in COPY_BOTH mode, and a regular one
for the catalog (types, primary keys) and for set-up. Windows go to the event
loop through a bounded :class:`ThreadFeed`, so a slow relay slows the stream.

This module is the fetcher itself (the relay's side of it, and the stream
thread's set-up); its parts live beside it:

* :mod:`._config`: the options (:class:`PostgresConfig`);
* :mod:`._setup`: server checks, publication and slot, loss detection (at
  every start);
* :mod:`._stream`: the stream thread's loop (and the SQL mode), over
* :mod:`._readers`: the two readers of the stream (option ``stream_reader``):
  libpq's ``PQgetCopyData``, one message per call, or, on a connection
  without TLS or GSS encryption, the socket itself (:mod:`._wire`: ~1 MiB per
  read, messages handed to the assembler as spans of the chunk). Both fill
  the relay's buffer with the same bytes.

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
import itertools
import threading
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from changebus.schemas import DataLoss, SchemaRegistry, SourceError, lsn_to_scn, scn_to_lsn
from changebus.schemas.config import load_config_dict

from .._base import ResumePoint, Window, window_bytes
from .._threadfeed import ThreadFeed
from ._assembler import Assembler
from ._config import PostgresConfig
from ._setup import connect, reason, set_up
from ._stream import HOLD_S, HOLD_WINDOWS, Ticker, poll_sql, stream
from ._types import TypeResolver
from ._watchdog import Watchdog

__all__ = ["PostgresConfig", "PostgresFetcher"]

#: emitted windows remembered for their acknowledgement, at most (thinned beyond)
MAX_PENDING = 65_536


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
        #: DATA_LOSS windows this fetcher made, by cause (the relay's /metrics)
        self.data_loss_events: Counter[str] = Counter()
        self.stats: dict[str, Any] = {
            "windows": 0,
            "keepalives": 0,
            #: quiet periods past io_timeout_s while the walsender was busy decoding
            "quiet_decoding": 0,
            "heartbeats": 0,
            #: reads of the slot's figures (retained and unconfirmed WAL, its state)
            "slot_stats_reads": 0,
            "retained_wal_bytes": -1,
            "unconfirmed_wal_bytes": -1,
        }
        self._slot_state = ""
        #: where the stream starts when the relay holds nothing yet (:meth:`start`)
        self.start_position = ""
        #: the reader of the current (or last) stream: "socket" or "libpq"
        self.stream_reader = ""
        #: the cluster's system identifier ("": not known): a seed checks it is the same
        self.system_identifier = ""

    # ---- Fetcher protocol -------------------------------------------------

    async def start(self, resume: ResumePoint) -> int:
        """Check the server, create publication and slot when missing.

        Returns the SCN after which the stream is complete: the relay's last
        SCN when it has one, else one before the slot's confirmed position C
        (changes committed before the slot existed are not in the stream; a
        commit record starting exactly at C is). :attr:`start_position` is
        then C, which the relay keeps with its empty buffer: a restart before
        the first window resumes from it and checks the slot against it
        (with the SCN alone, such a commit was dropped as already held, and a
        slot moved meanwhile was not seen: review).
        """
        self._resume = resume
        self.start_position = ""
        plan = await asyncio.to_thread(set_up, self.config, resume, self.name)
        # the stream continues after a gap's DATA_LOSS window, not the relay's old end
        self._resume, self._data_loss = plan.resume, plan.data_loss
        self.system_identifier = plan.system
        if resume.scn >= 0:
            return resume.scn
        if plan.confirmed <= 0:
            return plan.confirmed
        self.start_position = scn_to_lsn(plan.confirmed)
        return plan.confirmed - 1

    def window_feed(self) -> ThreadFeed[Window]:
        """Start streaming; the windows as a queue (see :class:`WindowFeed`)."""
        # windows held back while the stream is busy: it flushes before it waits for data
        self._feed = ThreadFeed(
            self._run,
            maxsize=1024,
            name=f"pg-{self.name}",
            hold_items=HOLD_WINDOWS,
            hold_s=HOLD_S,
            weigh=window_bytes,
        )
        return self._feed

    async def windows(self) -> AsyncIterator[Window]:
        async for window in self.window_feed().items():
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
            "publication": self.config.publication,
            "slot_wal_status": self._slot_state,
            "stream_reader": self.stream_reader,
            "system_identifier": self.system_identifier,
            "acked_lsn": scn_to_lsn(self._acked_end_lsn) if self._acked_end_lsn else "",
            **{k: v for k, v in self.stats.items() if v != -1},
        }

    # ---- the stream thread (the loops: _stream) ----------------------------------

    def _run(self, emit: Callable[[Window], None], stopping: threading.Event) -> None:
        import psycopg

        cfg = self.config
        watchdog = Watchdog(cfg.io_timeout_s, self.name)
        try:
            self._stream_with(watchdog, emit, stopping)
        except psycopg.OperationalError as exc:  # the server went away mid-stream
            watchdog.check()  # or the watchdog cut a connection whose server stopped answering
            raise SourceError(f"lost the Postgres connection: {reason(exc, cfg.dsn)}") from None
        finally:
            watchdog.close()

    def _stream_with(
        self, watchdog: Watchdog, emit: Callable[[Window], None], stopping: threading.Event
    ) -> None:
        cfg = self.config
        conn = connect(cfg.dsn, "cannot connect to Postgres", timeout_s=cfg.io_timeout_s)
        with watchdog.guard(conn) as catalog:
            resolver = TypeResolver(catalog)
            registry = SchemaRegistry()
            known = registry.import_entries(self._resume.schemas)
            assembler = Assembler(
                self.partition_id,
                resolver.resolve,
                registry,
                primary_key=resolver.primary_key,
                key_positions=resolver.key_positions,
                array_dims=resolver.array_dims,
                type_named=resolver.named,
                max_window_bytes=cfg.max_transaction_bytes,
                on_oversized=cfg.on_oversized_transaction,
                known=known,
                policy=cfg.column_rules(),
            )
            assembler.losses = self.data_loss_events
            if self._data_loss is not None:
                lo, hi, why = self._data_loss
                self.data_loss_events["slot_lost"] += 1
                # positioned where the new slot starts: a restart before the next
                # window finds no gap again (at ``hi``, one before, it did)
                loss = DataLoss(lo, hi, why)
                position = self._resume.source_position
                self._emit(assembler.control_window(loss, hi, position), emit)
                self._data_loss = None
            ticker = Ticker(self, catalog)
            if cfg.mode == "sql":
                poll_sql(self, catalog, assembler, emit, stopping, ticker, watchdog)
                return
            repl = connect(
                cfg.dsn,
                "cannot open a replication connection",
                timeout_s=cfg.io_timeout_s,
                replication="database",
            )
            # not `with repl`: its exit would try a COMMIT in COPY_BOTH mode and
            # fail before closing, leaving the server's walsender holding the slot
            try:
                stream(self, repl, assembler, emit, stopping, ticker, watchdog)
            finally:
                repl.close()

    def _emit(self, window: Window, emit: Callable[[Window], None]) -> None:
        with self._lock:
            if len(self._pending) >= MAX_PENDING:
                # acknowledgements held back for long (a relay cluster's fence waits for
                # a follower that is down): every other entry goes, so an acknowledged
                # SCN between two kept ones confirms the older one's end only. Later,
                # never sooner, and bounded (review; it grew by a window's entry)
                self._pending = deque(itertools.islice(self._pending, 1, None, 2))
            self._pending.append((window.scn, lsn_to_scn(window.source_position)))
        emit(window)
        self.stats["windows"] += 1


def _factory(name: str, partition_id: int, options: Mapping[str, Any]) -> PostgresFetcher:
    return PostgresFetcher(name, partition_id, load_config_dict(PostgresConfig, options, "fetcher"))
