"""Seeding the snapshot store from a Postgres source: online chunks, no long transaction.

:func:`seed_postgres` runs the shared chunk loop (:func:`~._chunks.run_chunked`)
over a :class:`PostgresChunkSource`: one connection (``application_name =
changebus-seed``) that reads each table in short ``REPEATABLE READ, READ
ONLY`` transactions, one per chunk, with ``COPY (SELECT ...) TO STDOUT
(FORMAT binary)`` -- the same binary values pgoutput sends -- turned into
INSERT events by the postgres fetcher's own
:class:`~changebus.fetchers.postgres.Assembler` (same types, same Avro
encoding, the relay's source ids and schema versions, under the fetcher's
column policy: a relay schema showing another policy is refused, so masked
data never leaks through a snapshot). Keyset and single-transaction chunks
go through the table's generated COPY encoder
(:meth:`~changebus.fetchers.postgres.Assembler.copy_encoder`: COPY fields
straight to events, the same bytes); a chunk it hands back, and ``keys``
chunks, go through the Assembler as pgoutput Insert messages. Nothing is written to the source's
tables and no slot is created.

**Readers** (:attr:`~._chunks.ChunkReader.mode`, in :mod:`._seed_pg_readers`):

* ``keyset`` -- ``WHERE (k1, k2) > (last) [AND (where)] ORDER BY k1, k2
  LIMIT n`` on the relay schema's key (primary key or replica identity
  index); the cursor is the last key as text (:mod:`._seed_pg_keys`).
* ``keys`` -- slices of a key list joined to the table; keys the table
  lacks come back as :attr:`~._chunks.Chunk.absent` (their store key: the
  very key bytes the fetcher would write).
* ``single_transaction`` -- the documented fallback for ``REPLICA IDENTITY
  FULL`` tables without a primary key (the key is every column: no usable
  keyset): ONE repeatable-read transaction reads the table in heap-page
  ranges (TID range scans), not resumable, logged as a long transaction.

The checks of a table before it is read, and the choice of its reader, are
:mod:`._seed_pg_tables`'s: a table whose relay key is empty (no primary key,
replica identity default or nothing) is refused, naming the fix.

**The tag (watermark).** Every chunk's rows are written at an SCN ``tag``
such that every change with an SCN <= tag is visible to the chunk's read
(:mod:`._chunks`). WAL order is not visibility order, so the tag is
proven, not assumed. Before a chunk, in autocommit: ``P =
pg_current_wal_insert_lsn()``, then ``N = pg_current_xact_id()`` (a fresh
xid: every xid >= N was assigned after P was read). The chunk's
transaction first reads ``X = pg_snapshot_xmin(pg_current_snapshot())``.
If ``N <= X``, every xid below N had ended when the snapshot was taken. A
commit record before P was inserted before P was read, so its xid was
assigned before N, so it had ended -- it is visible. Hence ``tag =
lsn_to_scn(P) - 1`` (window SCNs are commit LSNs) of the newest sample
with ``N <= X``; older samples stay valid (X only grows), so a few are
kept. No valid sample (a transaction older than every sample still runs)
or a tag below ``request.min_tag`` (or the reader's own minimum, a refill's:
:func:`~._chunks._refill`): the chunk transaction is rolled back
at once, and the reader sleeps (0.05 s doubling to 1 s) and samples again;
after ``request.watermark_wait_s`` it fails, retriably, naming the blocking
backend (pid, state, age; never its query text).

Blocking (psycopg): runs in the seeder's worker thread; chunks go to the
sink it is given (the service's store, or a plain ``write`` callback).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import struct
import threading
import time
from typing import Any

from changebus.fetchers import ColumnPolicy
from changebus.schemas import (
    ChangebusError,
    Op,
    SchemaRegistry,
    SourceConfigError,
    SourceError,
    lsn_to_scn,
    parse_stream,
)

from ._chunks import SnapshotScope, SnapshotSink, WriterSink, run_chunked
from ._seed_pg_keys import (
    copy_data_start,
    copy_rows,
    key_text,
    row_fields,
)
from ._seed_pg_readers import Reader
from ._seed_pg_session import open_session
from ._seed_pg_tables import open_reader
from ._seedtypes import SeedProgress, SeedRequest, SeedWriter

__all__ = ["PostgresChunkSource", "seed_postgres"]

#: Avro logical types (their first word) of date, time and timestamp columns
_TEMPORAL = frozenset({"date", "time", "timestamp", "local"})

log = logging.getLogger("changebus.bootstrap.seed")

#: a table's columns, to notice a DDL during its snapshot
_SHAPE = (
    "SELECT attname::text, atttypid::int, atttypmod::int FROM pg_attribute "
    "WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped AND attgenerated = '' "
    "ORDER BY attnum"
)
#: low-watermark samples kept (the newest valid one gives the tag)
_SAMPLES = 16


def seed_postgres(
    request: SeedRequest,
    write: SeedWriter,
    progress: SeedProgress,
    *,
    stop: threading.Event | None = None,
    sink: SnapshotSink | None = None,
) -> int:
    """Snapshot ``request.todo`` in chunks (module docstring); returns the newest chunk tag.

    Chunks go to ``sink`` (resumable: the service's store) or, without
    one, to ``write(table, events, tag)`` (``write(table, [], first_tag)``
    ends a table); ``progress`` is updated after every chunk; a set
    ``stop`` ends the run between chunks (and while waiting for a
    watermark) with a retriable error. ``request.relay_fetcher`` names the
    cluster the relay reads (its system identifier): a seed source of another
    cluster (a logical replica, a clone) is refused, since commit LSNs, the
    chunks' tags, are a cluster's own.
    """
    opener = functools.partial(PostgresChunkSource, stop=stop)
    return run_chunked(request, opener, sink or WriterSink(write), progress, stop=stop)


def _data_events(data: bytes) -> list[bytes]:
    offsets, headers = parse_stream(data)
    return [
        data[o : o + n]
        for o, n, op in zip(
            offsets.tolist(), headers["total_length"].tolist(), headers["op"].tolist(), strict=True
        )
        if op == int(Op.INSERT)
    ]


def _psycopg_error(what: str, exc: Exception) -> Exception:
    """A psycopg error as a changebus one (connection trouble retriable, the rest not);
    any other exception as it is."""
    import psycopg

    from changebus.fetchers.postgres import pg_error_reason as reason

    if not isinstance(exc, psycopg.Error):
        return exc
    retriable = isinstance(exc, psycopg.OperationalError)
    return SourceError(f"{what}: {reason(exc)}", retriable=retriable)


#: how long a seed statement waits for a lock on the source (then a retriable error)
LOCK_TIMEOUT_S = 10.0


class PostgresChunkSource:
    """The source side of one seed run: a connection, the watermark samples, an Assembler.

    A context manager (the connection closes on exit); :meth:`reader` checks a
    table and gives its reader. Thread-safety: one seeder thread.
    """

    def __init__(self, request: SeedRequest, *, stop: threading.Event | None = None) -> None:
        self.request = request
        self.stop = stop or threading.Event()
        self.registry = SchemaRegistry()
        self.registry.import_entries(list(request.schemas))
        self.policy = request.column_policy or ColumnPolicy()
        self.conn: Any = None
        self.samples: collections.deque[tuple[int, int]] = collections.deque(maxlen=_SAMPLES)
        #: the columns (name, type oid, typmod) each table had when its reader was made
        #: (these three: by :func:`~._seed_pg_tables.open_reader`)
        self.shapes: dict[int, list[tuple[str, int, int]]] = {}
        self.names: dict[int, str] = {}
        #: per table name, the statement taking its ACCESS SHARE lock: the first of each
        #: chunk's transaction, before its snapshot (:meth:`begin_chunk`)
        self.locks: dict[str, Any] = {}
        #: COPY encoders by (table oid, extra fields); rows they encoded, rows the general way
        self.encoders: dict[tuple[int, int], Any] = {}
        self.rows_fast = 0
        self.rows_general = 0

    #: updates may leave columns out (unchanged TOAST values): a seed refills what lacks them
    omits_columns = True

    def key_values(self, table: str, values: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """A store key's values as a ``keys`` scope's (their Postgres text, :func:`key_text`);
        None when a key column's stored value is not the source's (a column policy) or
        has no exact text form."""
        schema = self.registry.latest(table)
        columns = {c.name: c for c in schema.columns}
        texts = []
        for name, value in zip(schema.key, values, strict=True):
            column = columns.get(name)
            if column is None or column.policy:
                return None
            logical = column.type.get("logicalType") if isinstance(column.type, dict) else None
            text = key_text(value, temporal=str(logical or "").partition("-")[0] in _TEMPORAL)
            if text is None:
                return None
            texts.append(text)
        return tuple(texts)

    def marker(self, table: str) -> int | None:
        """An SCN the stream reaches after every change committed so far: a logical
        message (``pg_logical_emit_message``, not transactional, prefix
        ``changebus.seed``, the table's name) written to the WAL, which the relay
        turns into a window of its own; None (and a warning) when the source refuses."""
        from changebus.fetchers.postgres import message_scn

        try:
            row = self.conn.execute(
                "SELECT pg_logical_emit_message(false, 'changebus.seed', %s)::text", (table,)
            ).fetchone()
        except Exception as exc:  # noqa: BLE001 - a standby, a revoked privilege: fall back
            with contextlib.suppress(Exception):
                self.conn.execute("ROLLBACK")
            log.warning(
                "%s: cannot write a marker into the source's WAL (%s): the refill waits for "
                "a quiet stream instead",
                table,
                type(exc).__name__,
            )
            return None
        return message_scn(str(row[0]))

    def __enter__(self) -> PostgresChunkSource:
        from changebus.fetchers.postgres import Assembler, TypeResolver

        self.conn = open_session(self.request, LOCK_TIMEOUT_S)
        try:
            self.resolver = TypeResolver(self.conn)
            self.assembler = Assembler(
                self.request.partition_id,
                self.resolver.resolve,
                self.registry,
                primary_key=self.resolver.primary_key,
                array_dims=self.resolver.array_dims,
                policy=self.policy,
                # a table whose relay version predates the annotations of its composite and
                # range columns (a relay not upgraded yet, or a quiet table) is seeded under
                # that version: the same bytes (it was refused as changed, for ever)
                adopt_annotated=True,
            )
        except BaseException:
            self.__exit__()  # (no __exit__ after a failed __enter__)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    # ---- tables ------------------------------------------------------------

    def reader(self, scope: SnapshotScope, *, min_tag: int = -1) -> Reader:
        """A reader of ``scope`` (:class:`~._chunks.ChunkSource`): each chunk waits for a
        tag at or above ``min_tag`` too (:meth:`begin_chunk`)."""
        try:
            reader = open_reader(self, scope)
            reader.min_tag = min_tag
            return reader
        except Exception as exc:
            err = _psycopg_error(f"cannot read table {scope.table}", exc)
            if err is exc:
                raise
            raise err from None

    # ---- the watermark -------------------------------------------------------

    def begin_chunk(self, table: str, min_tag: int = -1) -> int:
        """Open a chunk's transaction at a proven tag (module docstring); returns the tag.

        Waits (the transaction closed) while no sample is valid or the tag is
        below ``request.min_tag`` or ``min_tag``, at most
        ``request.watermark_wait_s``; then a retriable :class:`SourceError`.
        """
        conn, request = self.conn, self.request
        floor = max(request.min_tag, min_tag)
        deadline = time.monotonic() + request.watermark_wait_s
        delay = 0.05
        while True:
            lsn = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0]
            xid = conn.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()[0]
            self.samples.append((lsn_to_scn(str(lsn)) - 1, int(xid)))
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            lock = self.locks.get(table)
            if lock is not None:
                # the table's lock before the snapshot (as pg_dump takes it): a rewriting
                # ALTER TABLE that committed between the snapshot and the COPY's own lock
                # left the COPY a new file whose rows the snapshot cannot see, an empty
                # chunk read as the table's end (found by review)
                conn.execute(lock)
            row = conn.execute("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint")
            xmin = int(row.fetchone()[0])
            tag = next((t for t, n in reversed(self.samples) if n <= xmin), None)
            if tag is not None and tag >= floor:
                return tag
            conn.execute("ROLLBACK")
            if time.monotonic() >= deadline:
                raise self._blocked(table, xmin, tag, floor)
            if self.stop.wait(delay):
                raise ChangebusError("seeding stopped", retriable=True)
            delay = min(delay * 2, 1.0)

    def _blocked(self, table: str, xmin: int, tag: int | None, floor: int) -> SourceError:
        waited = f"{self.request.watermark_wait_s:g}s (seed.watermark_wait_s)"
        if tag is not None:
            return SourceError(
                f"snapshot of {table}: the source did not pass SCN {floor} "
                f"within {waited}; try again later",
                retriable=True,
            )
        row = self.conn.execute(
            "SELECT pid, state, EXTRACT(epoch FROM now() - xact_start)::float8 "
            "FROM pg_stat_activity WHERE backend_xid::text::bigint = %s",
            (xmin % (1 << 32),),
        ).fetchone()
        if row is not None:
            who = (
                f"backend pid {row[0]} (state {row[1]}, transaction open for "
                f"{float(row[2] or 0):.0f}s)"
            )
        else:
            who = "a transaction without a backend (a prepared transaction? see pg_prepared_xacts)"
        return SourceError(
            f"snapshot of {table}: transaction {xmin} of {who} has been running since before "
            f"the chunk; no consistent watermark after {waited}: try again once it has ended",
            retriable=True,
        )

    def copy_data(self, sql: str, oid: int, params: list[Any] | None = None) -> bytes:
        """Run a COPY; its output (``FORMAT binary``).

        Then, still holding the COPY's table lock (no DDL of the table can
        commit before the transaction ends), checks that the table has the
        columns its reader was made for: a DDL since is a retriable refusal.
        """
        buf = bytearray()
        # the generated SQL doubles every % (see quote()); psycopg merges parameters into a
        # COPY, and reads %% as %, only when there are some
        if not params:
            sql, params = sql.replace("%%", "%"), None
        with self.conn.cursor().copy(sql, params) as copy:
            for block in copy:
                buf += block
        shape = self.conn.execute(_SHAPE, (oid,)).fetchall()
        if [(str(c), int(t), int(m)) for c, t, m in shape] != self.shapes[oid]:
            raise SourceConfigError(
                f"table {self.names[oid]} changed (DDL) during its snapshot: snapshot it "
                "again once the relay has seen the change",
                retriable=True,
            )
        return bytes(buf)

    def copy(
        self, sql: str, oid: int, ncols: int, params: list[Any] | None = None
    ) -> list[tuple[bytes, list[bytes | None]]]:
        """Run a COPY (:meth:`copy_data`); its rows as pgoutput Insert messages and extra
        fields (:func:`copy_rows`)."""
        return copy_rows(self.copy_data(sql, oid, params), oid, ncols)

    def encode_copy(
        self, tag: int, data: bytes, oid: int, ncols: int, extra: int, now: int = 0
    ) -> tuple[list[bytes], list[bytes | None] | None]:
        """INSERT events at SCN ``tag`` of the binary COPY rows in ``data`` (each: the
        table's ``ncols`` columns, then ``extra`` fields), and the last row's extra fields
        (None: no rows). ``now``: the events' timestamp (0: the clock's).

        The table's :class:`~changebus.fetchers.postgres.Assembler` COPY encoder writes
        them straight from the COPY fields; a chunk it cannot encode exactly (it says so)
        goes the general way (:meth:`copy` rows through :meth:`events`): the same bytes.
        """
        from changebus.fetchers.postgres import Fallback

        now = now or time.time_ns()
        pos = copy_data_start(data)
        if data[pos : pos + 2] == b"\xff\xff":
            return [], None
        assembler = self.assembler
        encoder = self.encoders.get((oid, extra))
        if encoder is None:
            encoder = self.encoders[(oid, extra)] = assembler.copy_encoder(oid, extra)
        # the general way's first window of a table holds its SCHEMA_CHANGE first
        announced = assembler.announced(oid)
        try:
            events, end, last, _seq = encoder.rows(data, pos, tag, now, 0 if announced else 1)
            if end != len(data):
                raise ValueError("data after the COPY trailer")
        except (Fallback, IndexError, ValueError, TypeError, KeyError, struct.error):
            rows = copy_rows(data, oid, ncols)
            self.rows_general += len(rows)
            return self.events(tag, [m for m, _x in rows], now), rows[-1][1]
        if not announced:
            assembler.announce_quietly(oid)
        self.rows_fast += len(events)
        return events, row_fields(data, last)[ncols:]

    def events(self, tag: int, messages: list[bytes], now: int = 0) -> list[bytes]:
        """INSERT events of pgoutput Insert ``messages`` at SCN ``tag``, as the fetcher
        encodes (``now``: their timestamp, 0: the clock's)."""
        from changebus.fetchers.postgres import Begin, Commit

        if not messages:
            return []
        assembler = self.assembler
        now = now or time.time_ns()
        assembler.feed(Begin(tag, now, 0))
        feed = assembler.feed_raw
        for msg in messages:
            feed(msg)
        window = assembler.feed(Commit(0, tag, tag, now))
        assert window is not None
        return _data_events(window.data)
