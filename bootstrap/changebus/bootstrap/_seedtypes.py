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
    (``database.table``) names to copy. ``schemas`` -- the relay's schema
    registry as ``(source id, schema)`` pairs, so seeded events carry the
    relay's source ids and versions. ``done`` -- tables already seeded,
    skipped (a seed resumes per table). ``chunk_rows`` -- rows per chunk, one
    store transaction each. ``relay_fetcher`` -- the relay's ``/v1/status``
    fetcher entry of the partition (the MySQL seeder needs its server id and
    SCN base; Postgres ignores it). ``column_policy`` -- the fetcher's
    column policy, applied to the copied rows (None: none; a relay schema
    that shows another policy is refused).
    """

    dsn: str = field(repr=False)
    partition_id: int
    tables: tuple[str, ...]
    schemas: tuple[tuple[int, TableSchema], ...] = ()
    done: frozenset[str] = frozenset()
    chunk_rows: int = 5000
    relay_fetcher: Mapping[str, Any] | None = None
    column_policy: ColumnPolicy | None = None

    def __post_init__(self) -> None:
        if self.chunk_rows <= 0:
            raise ConfigError("seed chunk_rows must be positive")

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

    def as_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "scn": self.scn,
            "table": self.table,
            "tables_done": self.tables_done,
            "tables_total": self.tables_total,
            "rows": self.rows,
            "error": self.error,
        }

    def begin(self, request: SeedRequest) -> list[str]:
        """Mark the run started; returns the tables left to copy (``request.todo``)."""
        todo = request.todo
        self.tables_total = len(request.tables)
        self.tables_done = len(request.tables) - len(todo)
        self.state = "running"
        self.started_at = time.monotonic()
        return todo
