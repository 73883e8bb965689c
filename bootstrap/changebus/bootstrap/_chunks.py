"""Online chunked snapshots: the loop every source shares (chunks, tags, resume, throttle).

A table is read in **chunks** in key order (keyset pagination: rows after
the last key read, ``ORDER BY`` the key, ``LIMIT chunk_rows``), each in its
own short source transaction, by the source's :class:`ChunkReader`. Writers
go on; nothing is locked; no transaction outlives a chunk.

**Tags (the watermark).** Every chunk comes with a *tag*: an SCN such that
every change with an SCN <= tag is visible in what the chunk read (the
source's read was at least as new as the tag). The chunk's rows are merged
into the snapshot at the tag, and a snapshot row never replaces a newer
state of its key (:data:`~._db.UPSERT_SNAP`). So a row the live stream
changed after the tag is superseded by the stream's version, whether the
applier writes it before or after the chunk lands; a row the stream changed
at or before the tag is in the chunk at its newest state. This is the
DBLog low/high watermark window shrunk to one SCN: the bootstrap store
keeps the newest state per key *by SCN*, so the rows that changed in the
window need not be dropped from the chunk, they lose to the newer log
event by themselves, and the chunk need not be held back until the high
watermark arrives in the stream. How a source finds its tag:

* MariaDB: ``START TRANSACTION WITH CONSISTENT SNAPSHOT`` and the binlog
  position of that snapshot (exact: ``binlog_snapshot_position``).
* Postgres: a read-only low watermark taken before the chunk (the WAL insert
  LSN, then a new transaction id), validated against the chunk's own
  snapshot (its ``xmin``): when every transaction id below the watermark's
  had ended before the chunk's snapshot, every commit before that LSN is
  visible to it. Nothing is written to the source tables (see
  :mod:`._seed`).

**Resume.** The sink stores, in the same store transaction as the chunk's
rows, the table's :class:`JobState` (the reader's cursor after the chunk,
chunk and row counts, the first tag). A seed restarted after a crash (kill
-9 of the bootstrap server) continues after the last chunk stored: at most
the chunk in flight is read again. A keyset cursor is stored with the key
order it belongs to (:attr:`ChunkReader.key_id`); when the table's key has
changed since (a new primary key), the table is read again from its start:
its old key's values compared with the new key's columns would skip rows.

**End of a table.** A whole-table snapshot then *sweeps*: a snapshot row of
the table older than the first tag that no chunk rewrote is a row the
source no longer has (a delete the store missed, e.g. in a gap): it becomes
a tombstone at the first tag. A ``keys`` snapshot tombstones the keys asked
for that the source lacks (:attr:`Chunk.absent`); a ``where`` snapshot
sweeps nothing (the store cannot evaluate SQL).

**Refill.** Then, once the applier has folded the stream up to a marker
the source wrote into its log after the last chunk (Postgres: a logical
message), rows the snapshot holds without some columns (an UPDATE without
Postgres' unchanged TOAST values whose earlier image no chunk brought: a row
moved to a key the snapshot had passed) are read again by key and merged
(:mod:`._refill`), before the table counts as seeded.

**Throttle.** :class:`~._pacing.Throttle` keeps a rows/s budget and a
share of wall time spent in source reads (``source_time_budget``: 0.25 = the
source is busy with the snapshot at most a quarter of the time), sleeping
between chunks; :class:`~._pacing.ChunkSizer` keeps chunk transactions
under ``max_chunk_txn_s``.

Thread-safety: :func:`run_chunked` runs in the seeder's worker thread; it
touches the reader (its own), the sink (which hops to the store's writer
thread) and the :class:`~._seedtypes.SeedProgress` it is given.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from changebus.schemas import ChangebusError, ConfigError, SourceConfigError

from ._pacing import ChunkSizer as ChunkSizer, Throttle
from ._seedtypes import SeedProgress, SeedRequest, SeedWriter

__all__ = [
    "Chunk",
    "ChunkReader",
    "ChunkSource",
    "ChunkSourceFactory",
    "JobState",
    "SnapshotScope",
    "SnapshotSink",
    "Throttle",
    "WriterSink",
    "run_chunked",
]

log = logging.getLogger("changebus.bootstrap.seed")


@dataclass(frozen=True, slots=True)
class SnapshotScope:
    """What of one table a snapshot reads: all of it, the rows ``where`` selects, or ``keys``.

    ``where`` is an SQL condition in the source's dialect, run inside the
    chunk's read-only transaction (an admin's input: the HTTP request that
    carries it needs scope ``admin``). ``keys`` lists key values, one tuple
    per row (one value per key column, JSON values: numbers, strings, null).
    At most one of them is set.
    """

    table: str
    where: str = ""
    keys: tuple[tuple[Any, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.where and self.keys:
            raise ConfigError("a snapshot takes either a where condition or a list of keys")

    @property
    def whole(self) -> bool:
        """The whole table (no ``where``, no ``keys``): the end of it sweeps."""
        return not self.where and not self.keys

    @property
    def kind(self) -> str:
        """``table``, ``where`` or ``keys``: what it reads, in one word (for status)."""
        return "keys" if self.keys else "where" if self.where else "table"

    def as_json(self) -> str:
        return json.dumps(
            {"table": self.table, "where": self.where, "keys": [list(k) for k in self.keys]},
            sort_keys=True,
        )

    @staticmethod
    def kind_of_json(text: str) -> str:
        """``table``, ``where`` or ``keys``: what the scope stored as ``text`` reads.

        Without parsing a key list: one may be a megabyte of JSON, and the
        status page and each snapshot request look at every stored job
        (parsed whole, that held a reader thread or the event loop for
        about half a second a job; review). :meth:`as_json` sorts the keys,
        so an empty key list opens the text.
        """
        if not text.startswith('{"keys": []'):
            return "keys" if text.startswith('{"keys": [') else SnapshotScope.from_json(text).kind
        return "where" if json.loads(text).get("where") else "table"

    @classmethod
    def from_json(cls, text: str) -> SnapshotScope:
        raw = json.loads(text)
        return cls(
            str(raw["table"]),
            str(raw.get("where", "")),
            tuple(tuple(k) for k in raw.get("keys", ())),
        )


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk a reader read in one short source transaction.

    ``events`` -- INSERT events of its rows, encoded with the relay's source
    id and newest schema version, their SCN = ``tag``. ``tag`` -- every
    change with an SCN <= tag is visible in what was read (module
    docstring). ``cursor`` -- the reader's opaque resume point after this
    chunk (JSON text), None when the scope is done. ``absent`` -- (``keys``
    scopes) the store keys (encoded key bytes) asked for that the source
    does not have. ``rows`` -- rows read (``len(events)``, kept apart so a
    reader may count rows it could not encode). ``txn_s`` -- how long the
    chunk's source transaction stayed open, measured by the reader from
    before its BEGIN to after its COMMIT (-1: the reader does not measure).
    """

    events: list[bytes]
    tag: int
    cursor: str | None
    absent: tuple[bytes, ...] = ()
    rows: int = -1
    txn_s: float = -1.0

    @property
    def row_count(self) -> int:
        return len(self.events) if self.rows < 0 else self.rows


class ChunkReader(Protocol):
    """Reads one table (one :class:`SnapshotScope`) chunk by chunk. Blocking; one thread.

    ``mode`` -- ``keyset`` (key-ordered chunks), ``keys`` (a key list, in
    slices) or ``single_transaction`` (the documented fallback for a table
    without a usable unique key: one transaction, not resumable).
    ``estimate_rows`` -- rows the scope holds, about (-1: unknown), for
    progress and ETA. ``key_id`` -- what orders a ``keyset`` reader's
    cursors (its key columns and their types; "" for other modes): a stored
    cursor of another key order is not resumed (:func:`run_chunked`).
    :meth:`read` reads up to ``limit`` rows after ``cursor`` (None: from the
    start) in one source transaction.
    """

    mode: str
    estimate_rows: int
    key_id: str

    def read(self, cursor: str | None, limit: int) -> Chunk: ...


class ChunkSource(Protocol):
    """The source connections of one seed run; a context manager; gives a reader per table.

    :meth:`reader` checks the table against the relay's schemas (present,
    same columns, same column policy) and raises
    :class:`~changebus.schemas.SourceConfigError` naming what is wrong (a
    table without a key: a refusal naming the fix).
    """

    def __enter__(self) -> ChunkSource: ...

    def __exit__(self, *exc: object) -> None: ...

    def reader(self, scope: SnapshotScope, *, min_tag: int = -1) -> ChunkReader:
        """A reader of ``scope`` whose chunks' tags are at least ``min_tag`` (and
        ``request.min_tag``): it waits for such a tag like for the latter."""
        ...

    #: whether the source's UPDATEs may leave columns out that a read by key brings
    #: (Postgres' unchanged TOAST values): the end of a table refills rows lacking them
    omits_columns: bool

    def key_values(self, table: str, values: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """A key as the store decodes it (its Avro values) as the values of a ``keys``
        scope (None: a key type without such a form)."""
        ...

    def marker(self, table: str) -> int | None:
        """An SCN the stream reaches after every change committed so far (a marker the
        source writes into its log); None: the source cannot write one."""
        ...


#: opens the source of a seed run (``PostgresChunkSource``, ``MySQLChunkSource``)
ChunkSourceFactory = Callable[[SeedRequest], ChunkSource]


@dataclass(frozen=True, slots=True)
class JobState:
    """A table's snapshot in progress, as stored with each chunk (``cb_snapjob``).

    ``scope`` -- :meth:`SnapshotScope.as_json` of what is read (a stored job
    for another scope is not resumed: it starts again). ``cursor`` -- where
    the next chunk starts (None: the start). ``chunks`` / ``rows`` -- done
    so far; ``first_tag`` / ``last_tag`` -- SCN tags of the first and the
    newest chunk (-1: none yet).
    """

    table: str
    scope: str
    cursor: str | None = None
    chunks: int = 0
    rows: int = 0
    first_tag: int = -1
    last_tag: int = -1

    def after(self, chunk: Chunk, cursor: str | None = None) -> JobState:
        """The state once ``chunk`` is stored (``cursor``: as stored, default the chunk's)."""
        return replace(
            self,
            cursor=chunk.cursor if cursor is None else cursor,
            chunks=self.chunks + 1,
            rows=self.rows + chunk.row_count,
            first_tag=chunk.tag if self.first_tag < 0 else min(self.first_tag, chunk.tag),
            last_tag=max(self.last_tag, chunk.tag),
        )


class SnapshotSink(Protocol):
    """Where chunks go (the store, through its writer thread). Blocking; called from the seeder.

    :meth:`resume` -- the stored job of ``table`` (None: none, or one for
    another scope). :meth:`chunk` -- merge ``chunk`` and store ``job`` (the
    state after it) in one store transaction. :meth:`unfilled` -- once the
    applier has folded the stream up to ``upto`` (not ``exact``: or the
    stream is quiet), the keys (store key, values, the SCN they were
    listed at) of the table's rows that lack columns; :meth:`refill` merges
    their re-read and forgets the ``skipped`` keys (:mod:`._refill`). :meth:`finish` -- the table is
    done: sweep (whole-table scopes), record it seeded, drop the job.
    """

    def resume(self, scope: SnapshotScope) -> JobState | None: ...

    def chunk(self, scope: SnapshotScope, job: JobState, chunk: Chunk) -> None: ...

    def unfilled(
        self, scope: SnapshotScope, upto: int, stop: threading.Event, *, exact: bool
    ) -> list[tuple[bytes, tuple[Any, ...], int]]: ...

    def refill(self, scope: SnapshotScope, chunk: Chunk, skipped: list[bytes]) -> None: ...

    def finish(self, scope: SnapshotScope, job: JobState, stop: threading.Event) -> None: ...


@dataclass
class WriterSink:
    """A sink over a plain :data:`~._seedtypes.SeedWriter` callback (no resume, no sweep).

    Each chunk's events go to ``write(table, events, tag)``; the end of a
    table is ``write(table, [], first_tag)``. Used by the public
    ``seed_postgres`` / ``seed_mysql`` functions.
    """

    write: SeedWriter

    def resume(self, scope: SnapshotScope) -> JobState | None:
        return None

    def chunk(self, scope: SnapshotScope, job: JobState, chunk: Chunk) -> None:
        if chunk.events:
            self.write(scope.table, chunk.events, chunk.tag)

    def unfilled(
        self, scope: SnapshotScope, upto: int, stop: threading.Event, *, exact: bool
    ) -> list[tuple[bytes, tuple[Any, ...], int]]:
        return []  # (no store: nothing to refill)

    def refill(self, scope: SnapshotScope, chunk: Chunk, skipped: list[bytes]) -> None:
        if chunk.events:
            self.write(scope.table, chunk.events, chunk.tag)

    def finish(self, scope: SnapshotScope, job: JobState, stop: threading.Event) -> None:
        self.write(scope.table, [], max(job.first_tag, 0))


def run_chunked(
    request: SeedRequest,
    open_source: ChunkSourceFactory,
    sink: SnapshotSink,
    progress: SeedProgress,
    *,
    stop: threading.Event | None = None,
) -> int:
    """Snapshot ``request.todo`` table by table, chunk by chunk; returns the newest tag.

    Resumes each table from the job ``sink`` stored (same scope), paces
    chunks with ``request``'s throttle, sizes them by ``request.max_chunk_txn_s``
    (:class:`ChunkSizer`), updates ``progress`` after every
    chunk and logs every ``request.log_every_chunks`` chunks. A set
    ``stop`` ends the run between chunks with a retriable error.
    """
    todo = progress.begin(request)
    if not todo:
        progress.state = "copied"
        return progress.scn
    throttle = Throttle(request.max_rows_per_s, request.source_time_budget)
    sizer = ChunkSizer(request.chunk_rows, request.max_chunk_txn_s, request.max_chunk_bytes)
    progress.chunk_limit = sizer.limit
    stop = stop or threading.Event()
    try:
        return _run_tables(request, open_source, sink, progress, todo, (throttle, sizer), stop)
    finally:
        # a sink that stores chunks behind the reader (StoreSink): none left in flight
        flush: Callable[[], None] | None = getattr(sink, "flush", None)
        if flush is not None:
            with contextlib.suppress(Exception):  # a write's error was raised by its sink call
                flush()


def _run_tables(
    request: SeedRequest,
    open_source: ChunkSourceFactory,
    sink: SnapshotSink,
    progress: SeedProgress,
    todo: list[str],
    pacing: tuple[Throttle, ChunkSizer],
    stop: threading.Event,
) -> int:
    """:func:`run_chunked`'s loop over the tables."""
    throttle, sizer = pacing
    with open_source(request) as source:
        for name in todo:
            scope = SnapshotScope(name, request.where, request.keys)
            if stop.is_set():
                raise ChangebusError("seeding stopped", retriable=True)
            try:
                reader = source.reader(scope)
            except SourceConfigError as exc:
                if not (exc.details.get("gone") and scope.whole):
                    raise
                # dropped at the source since the stream brought it: nothing to copy, and a
                # seed that failed on it left a gap open for good (found by review). Its
                # rows stay as the stream left them: a DROP TABLE is no change event, and
                # consumers that follow the stream keep them too
                log.warning("%s: %s; recorded as seeded, its rows left as they are", name, exc)
                progress.start_table(name, "gone", 0, 0, 0)
                sink.finish(scope, JobState(name, scope.as_json(), first_tag=request.min_tag), stop)
                progress.table_done()
                continue
            stored = sink.resume(scope)
            if stored is not None and 0 <= stored.first_tag < request.min_tag:
                # chunks read before the gap to repair: they may miss its changes
                log.info("%s: a stored snapshot older than the gap is started again", name)
                stored = None
            # one transaction for the whole table: nothing to resume (its counts restart)
            single = reader.mode == "single_transaction"
            if single:
                stored = None
            key, cursor = _unwrap(stored.cursor if stored is not None else None)
            if stored is not None and cursor is not None and key != reader.key_id:
                # the key changed since (a new primary key, another collation): the
                # stored cursor would be compared with other columns and skip rows
                # (found by review); a cursor stored without its key_id may be one
                log.warning(
                    "%s: the stored snapshot's cursor is for %s, the table is now read by"
                    " %s: it starts again",
                    name,
                    key or "a key an older version did not record",
                    reader.key_id,
                )
                stored, cursor = None, None
            job = stored or JobState(name, scope.as_json())
            progress.chunk_limit = sizer.start_table()
            progress.start_table(name, reader.mode, reader.estimate_rows, job.rows, job.chunks)
            if stored is not None and stored.chunks:
                log.info(
                    "%s: resuming the snapshot after chunk %d (%d rows done)",
                    name,
                    stored.chunks,
                    stored.rows,
                )
            while cursor is not None or job.chunks == 0:
                if stop.is_set():
                    raise ChangebusError("seeding stopped", retriable=True)
                started = time.monotonic()
                chunk = reader.read(cursor, sizer.limit)
                busy = time.monotonic() - started
                if stop.is_set():  # (a gap recorded meanwhile: this chunk must not be stored)
                    raise ChangebusError("seeding stopped", retriable=True)
                if chunk.cursor is not None and chunk.cursor == cursor:
                    raise SourceConfigError(
                        f"snapshot of {name}: a chunk ended where it started, so the read "
                        "would never end (does the where condition hold an OR outside its "
                        "parentheses?)"
                    )
                cursor = chunk.cursor
                job = job.after(chunk, _wrap(reader.key_id, cursor))
                sink.chunk(scope, job, chunk)
                progress.chunk_done(chunk.row_count, chunk.tag, chunk.txn_s)
                progress.chunk_limit = sizer.after(
                    chunk.row_count, chunk.txn_s, sum(map(len, chunk.events))
                )
                if request.log_every_chunks and job.chunks % request.log_every_chunks == 0:
                    log.info(
                        "%s: %d chunks, %d rows (%s)",
                        name,
                        job.chunks,
                        job.rows,
                        progress.rate_text(),
                    )
                # (a pause inside the single transaction would only hold it open longer)
                wait = 0.0 if single else throttle.pause(chunk.row_count, busy)
                if wait > 0 and stop.wait(wait):
                    raise ChangebusError("seeding stopped", retriable=True)
            if stop.is_set():  # (not recorded as seeded: a gap may have come meanwhile)
                raise ChangebusError("seeding stopped", retriable=True)
            if scope.whole and not single and source.omits_columns:
                mode, progress.mode = progress.mode, "refill"  # (for /v1/status meanwhile)
                try:
                    _refill(source, sink, scope, (job.last_tag, sizer.rows), stop)
                finally:
                    progress.mode = mode
            sink.finish(scope, job, stop)
            progress.table_done()
            log.info("seeded %s: %d rows in %d chunks", name, job.rows, job.chunks)
    progress.state = "copied"
    progress.table = ""
    return progress.scn


#: the head of a stored cursor (not JSON: an older version refuses it, never misreads it)
_KEYED = "keyed:"


def _wrap(key: str, cursor: str | None) -> str | None:
    """A reader's cursor as stored: with what it means (``key``: the reader's key_id)."""
    if cursor is None:
        return None
    return _KEYED + json.dumps([key, cursor], separators=(",", ":"))


def _unwrap(stored: str | None) -> tuple[str | None, str | None]:
    """``(key_id, reader's cursor)`` of a stored cursor; key_id None: stored by an older
    version, which did not say (its cursor may be of another mode or key order)."""
    if stored is None or not stored.startswith(_KEYED):
        return None, stored
    try:
        key, cursor = json.loads(stored[len(_KEYED) :])
    except ValueError:
        return None, stored
    if not isinstance(key, str) or not isinstance(cursor, str):
        return None, stored
    return key, cursor


#: listings of rows lacking columns one refill reads at most (each up to 10,000 keys)
_REFILL_ROUNDS = 50


def _refill(
    source: ChunkSource,
    sink: SnapshotSink,
    scope: SnapshotScope,
    at: tuple[int, int],
    stop: threading.Event,
) -> None:
    """Read again, by key, the rows of ``scope.table`` the snapshot holds without some
    columns (:mod:`._refill`); ``at``: the snapshot's newest tag and the chunk size.

    Before each listing, the source writes a marker into its log and the
    store's applier must pass it (without one: the newest tag, or a quiet
    stream). Each re-read waits for a tag at or above the newest SCN its
    rows were listed at: a lower one (a Postgres tag is a lower bound of
    the read's snapshot, an older sample's when a transaction was in
    flight) cannot complete an UPDATE folded after it, and the next listing
    held the same rows, read as "nothing changes", for good (review). A key
    without a ``keys`` form is logged and forgotten; a read the source
    refuses for good is logged and ends the refill (the table is seeded,
    those rows lacking columns); a retriable error ends the seed run (it
    resumes here).
    """
    tag, limit = at
    previous: dict[bytes, int] = {}
    for _ in range(_REFILL_ROUNDS):
        marker = source.marker(scope.table)
        found = sink.unfilled(
            scope, tag if marker is None else marker, stop, exact=marker is not None
        )
        if not found:
            return
        wanted = {key: source.key_values(scope.table, values) for key, values, _scn in found}
        listed = {key: scn for key, _values, scn in found}
        skipped = [key for key, k in wanted.items() if k is None]
        if skipped:
            log.warning(
                "%s: %d row(s) lack columns the source left out, and their key has no form "
                "to read them again by (a column policy, a special value): they stay so",
                scope.table,
                len(skipped),
            )
        if listed == previous:  # (read already at a tag at or above each, nothing changed)
            log.warning(
                "%s: %d row(s) still lack columns after reading them again",
                scope.table,
                len(wanted),
            )
            return
        previous = listed
        keys = tuple(k for k in wanted.values() if k is not None)
        log.info("%s: reading %d row(s) again that lack columns", scope.table, len(keys))
        try:
            reader = (
                source.reader(SnapshotScope(scope.table, keys=keys), min_tag=max(listed.values()))
                if keys
                else None
            )
            cursor: str | None = None
            while reader is not None:
                if stop.is_set():
                    raise ChangebusError("seeding stopped", retriable=True)
                chunk = reader.read(cursor, limit)
                # only keys asked for become tombstones (a key whose text cast back to
                # another value must not delete that one)
                absent = tuple(k for k in chunk.absent if k in wanted)
                sink.refill(scope, replace(chunk, absent=absent), skipped)
                skipped = []
                tag = max(tag, chunk.tag)
                if chunk.cursor is None:
                    break
                cursor = chunk.cursor
            if skipped:
                sink.refill(scope, Chunk([], tag, None), skipped)
        except ChangebusError as exc:
            if exc.retriable:
                raise
            log.warning("%s: rows lacking columns could not be read again: %s", scope.table, exc)
            return
    log.warning(
        "%s: rows still lack columns after %d re-reads (they keep changing)",
        scope.table,
        _REFILL_ROUNDS,
    )
