"""What a seeder is given and what it reports: :class:`SeedRequest`, :class:`SeedProgress`.

Shared by every seeder (:mod:`._seed` for Postgres, :mod:`._seed_mysql`) and
by the service that runs them (:mod:`._seeders` picks one per source kind).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from changebus.fetchers import ColumnPolicy
from changebus.schemas import ConfigError, TableSchema

__all__ = ["SeedProgress", "SeedRequest", "SeedWriter", "table_name_problem"]

#: longest table name a seed accepts (``schema.table``: two identifiers and a dot)
_MAX_TABLE_NAME = 256

#: ``write(table, events, scn)``: merge one chunk of encoded INSERT events of
#: ``table`` into the snapshot at ``scn``; an empty chunk records ``table`` as
#: seeded. Called from the seeder's thread; returns once the chunk is stored.
SeedWriter = Callable[[str, list[bytes], int], None]


def table_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a table to seed (None: it can).

    A table is ``schema.table`` (``database.table``): a dot with a name on
    each side. Names changebus keeps for itself in the seed ledger (the gap
    marker ``*gap*`` and anything else starting with ``*``, which has no
    dot) are reserved; control characters and names over 256 characters are
    refused.
    """
    shown = repr(name[:80]) + ("..." if len(name) > 80 else "")
    if name.startswith("*"):
        return f"table name {shown} is reserved by changebus"
    schema, dot, table = name.partition(".")
    if not dot or not schema or not table:
        return f"table name {shown} is not schema.table"
    if len(name) > _MAX_TABLE_NAME or not name.isprintable():
        return f"table name {shown} is too long or holds control characters"
    return None


@dataclass(frozen=True, slots=True)
class SeedRequest:
    """One seed run: which tables of which source, for which relay partition.

    ``dsn`` -- the source (a libpq DSN, or a ``mysql://`` URL for MySQL;
    secret: left out of the repr and never logged). ``partition_id`` -- the
    relay partition the events belong to. ``tables`` -- ``schema.table``
    (``database.table``) names to copy; ``where`` (an SQL condition) or
    ``keys`` (key value tuples) narrow a one-table request
    (:class:`~._chunks.SnapshotScope`). ``schemas`` -- the relay's schema
    registry as ``(source id, schema)`` pairs, so seeded events carry the
    relay's source ids and versions. ``done`` -- tables already seeded,
    skipped (a seed resumes per table). ``chunk_rows`` -- rows per chunk, one
    store transaction each. ``relay_fetcher`` -- the relay's ``/v1/status``
    fetcher entry of the partition (the MySQL seeder needs its server id and
    SCN base; Postgres ignores it). ``column_policy`` -- the fetcher's
    column policy, applied to the copied rows (None: none; a relay schema
    that shows another policy is refused). ``min_tag`` -- every chunk's tag
    must be at least this SCN (a gap's end: the rows must be newer than what
    was lost); a reader that cannot give such a tag yet waits, at most
    ``watermark_wait_s``. ``max_rows_per_s`` (0: no limit) and
    ``source_time_budget`` (share of wall time spent in source reads, 1: no
    limit) pace the chunks (:class:`~._chunks.Throttle`); ``max_chunk_txn_s``
    (seconds, 0: off) shrinks chunks whose source transaction runs longer
    and ``max_chunk_bytes`` (0: off) those whose rows are wide
    (:class:`~._chunks.ChunkSizer`);
    ``log_every_chunks`` -- a progress line every so many chunks (0: none).
    """

    dsn: str = field(repr=False)
    partition_id: int
    tables: tuple[str, ...]
    schemas: tuple[tuple[int, TableSchema], ...] = ()
    done: frozenset[str] = frozenset()
    chunk_rows: int = 5000
    relay_fetcher: Mapping[str, Any] | None = None
    column_policy: ColumnPolicy | None = None
    where: str = ""
    keys: tuple[tuple[Any, ...], ...] = ()
    min_tag: int = -1
    max_rows_per_s: float = 0.0
    source_time_budget: float = 1.0
    watermark_wait_s: float = 300.0
    log_every_chunks: int = 100
    max_chunk_txn_s: float = 0.0
    max_chunk_bytes: int = 0

    def __post_init__(self) -> None:
        if self.max_chunk_bytes < 0:
            raise ConfigError("seed max_chunk_bytes must not be negative (0: off)")
        if self.chunk_rows <= 0:
            raise ConfigError("seed chunk_rows must be positive")
        if self.max_chunk_txn_s < 0:
            raise ConfigError("seed max_chunk_txn_s must not be negative (0: off)")
        if (self.where or self.keys) and len(self.tables) != 1:
            raise ConfigError("a snapshot with a where condition or keys names exactly one table")
        if self.watermark_wait_s <= 0 or self.log_every_chunks < 0:
            raise ConfigError("seed watermark_wait_s must be positive, log_every_chunks >= 0")

    @property
    def todo(self) -> list[str]:
        """``tables`` not ``done``, in order."""
        return [t for t in self.tables if t not in self.done]


@dataclass
class SeedProgress:
    """What a seed run did (updated while it runs; read by /v1/status).

    ``state``: ``idle``, ``starting``, ``running`` (copying), ``copied`` (a
    seeder's last word: every table copied), then ``done`` once the bootstrap
    service has also recorded the result (a gap in its log repaired), or
    ``failed`` / ``stopped``.

    Thread-safety: written by the seeder's thread only, read by the event
    loop for status (plain values; a reader may see a field one update late).
    """

    state: str = "idle"
    scn: int = -1
    table: str = ""
    tables_done: int = 0
    tables_total: int = 0
    rows: int = 0
    error: str = ""
    started_at: float = 0.0
    #: chunks stored by this run, and chunks of the current table a resume skipped
    chunks: int = 0
    chunks_resumed: int = 0
    #: the current table: how it is read, rows done (resumed ones included), rows it holds (about)
    mode: str = ""
    table_rows: int = 0
    table_estimate: int = -1
    #: rows read by this run (for the rate, from ``started_at``)
    run_rows: int = 0
    #: the longest and the last chunk source transaction of this run, in seconds, as the
    #: reader measured them around BEGIN/COMMIT (-1: none measured; Postgres does not)
    txn_max_s: float = -1.0
    txn_last_s: float = -1.0
    #: rows the next chunk reads at most (``chunk_rows``, or fewer under ``max_chunk_txn_s``)
    chunk_limit: int = 0

    def as_dict(self) -> dict[str, Any]:
        rate = self.rate_rows_s
        eta = self.eta_s
        return {
            "state": self.state,
            "scn": self.scn,
            "table": self.table,
            "tables_done": self.tables_done,
            "tables_total": self.tables_total,
            "rows": self.rows,
            "error": self.error,
            "chunks": self.chunks,
            "chunks_resumed": self.chunks_resumed,
            "mode": self.mode,
            "table_rows": self.table_rows,
            "table_estimate": self.table_estimate,
            "rows_per_s": round(rate, 1),
            "eta_s": None if eta is None else round(eta, 1),
            "source_txn_max_s": round(self.txn_max_s, 4),
            "source_txn_last_s": round(self.txn_last_s, 4),
            "chunk_limit": self.chunk_limit,
        }

    @property
    def rate_rows_s(self) -> float:
        """Rows a second read by this run so far (0: nothing yet)."""
        if self.run_rows <= 0 or self.started_at <= 0:
            return 0.0
        return self.run_rows / max(time.monotonic() - self.started_at, 1e-6)

    @property
    def eta_s(self) -> float | None:
        """Seconds until the current table is done, about (None: unknown)."""
        rate = self.rate_rows_s
        if self.table_estimate < 0 or rate <= 0:
            return None
        return max(self.table_estimate - self.table_rows, 0) / rate

    def rate_text(self) -> str:
        eta = self.eta_s
        return f"{self.rate_rows_s:,.0f} rows/s" + ("" if eta is None else f", ETA {eta:,.0f}s")

    def start_table(self, table: str, mode: str, estimate: int, rows: int, chunks: int) -> None:
        """A table starts (``rows``/``chunks``: what a resumed job had done already)."""
        self.table, self.mode, self.table_estimate = table, mode, estimate
        self.table_rows, self.chunks_resumed = rows, chunks

    def chunk_done(self, rows: int, tag: int, txn_s: float = -1.0) -> None:
        """A chunk of ``rows`` rows at SCN ``tag`` is stored (its source transaction took
        ``txn_s`` seconds; -1: not measured)."""
        if txn_s >= 0:
            self.txn_last_s = txn_s
            self.txn_max_s = max(self.txn_max_s, txn_s)
        self.chunks += 1
        self.rows += rows
        self.run_rows += rows
        self.table_rows += rows
        self.scn = max(self.scn, tag)

    def table_done(self) -> None:
        self.tables_done += 1

    def begin(self, request: SeedRequest) -> list[str]:
        """Mark the run started; returns the tables left to copy (``request.todo``)."""
        todo = request.todo
        self.tables_total = len(request.tables)
        self.tables_done = len(request.tables) - len(todo)
        self.state = "running"
        self.started_at = time.monotonic()
        return todo
