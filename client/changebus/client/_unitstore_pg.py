"""Fenced unit checkpoints of consumer groups in a PostgreSQL table (psycopg 3).

The table and its statements are those of :mod:`._unitsql` (shared with the
replicas in group mode): a claim is one upsert raising the unit's generation,
a commit a conditional ``UPDATE`` on the generation (the token), all commits
of one call in one transaction. The table is created when missing.

One psycopg connection (sync API, autocommit; explicit transactions for
commits) lives in a worker thread of the store and is used only there; it is
opened on first use and again after a connection failure. The DSN may hold a
password: it is never logged, and error messages are scrubbed of it
(:func:`changebus.schemas.config.scrub_exception`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, TypeVar

from changebus.schemas import (
    ChangebusError,
    CommitResult,
    ConfigError,
    StoredUnit,
    TransportError,
    Unit,
    UnitClaim,
    UnitCommit,
    check_group_name,
)
from changebus.schemas.config import scrub_exception

from ._pgsession import IDLE_IN_TRANSACTION_S, connect, session_lost
from ._unitsql import (
    DEFAULT_TABLE,
    POSTGRES_TIME,
    UnitSql,
    checkpoint_text,
    claim_fenced,
    parse_checkpoint,
    stored_unit,
)

__all__ = ["PostgresUnitStore"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_TABLE_RE: Final = re.compile(
    r"(?:([A-Za-z_][A-Za-z0-9_$]{0,62})\.)?([A-Za-z_][A-Za-z0-9_$]{0,62})"
)


class PostgresUnitStore:
    """A :class:`~changebus.schemas.UnitStore` in a PostgreSQL table (module docstring).

    ``table`` may be schema-qualified (``schema.table``; the schema must
    exist). Thread-safety: used from one event loop; the database work is
    serialised on the store's worker thread.
    """

    def __init__(
        self,
        dsn: str,
        *,
        table: str = DEFAULT_TABLE,
        idle_in_transaction_s: float = IDLE_IN_TRANSACTION_S,
    ) -> None:
        """``idle_in_transaction_s``: see :mod:`._pgsession` (a frozen member's locks go)."""
        m = _TABLE_RE.fullmatch(table)
        if m is None:
            raise ConfigError(f"unit store table: {table[:160]!r} is not [schema.]name")
        self.table = table
        self._dsn = dsn
        self._idle_in_transaction_s = idle_in_transaction_s
        quoted = ".".join(f'"{part}"' for part in m.groups() if part)
        self._sql = UnitSql.build(quoted, "%s", POSTGRES_TIME)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="changebus-unitstore")
        self._conn: Any = None  # worker thread only
        self._closed = False

    def __repr__(self) -> str:
        return f"PostgresUnitStore(table={self.table!r})"  # no DSN: it may hold a password

    # ---- UnitStore -----------------------------------------------------------

    async def claim(self, group: str, unit: Unit, owner: str, fence: int = -1) -> UnitClaim:
        """Upsert the unit's row raising its generation; the new generation is the token."""
        check_group_name(group)
        return await self._run(self._claim, group, unit, owner, fence)

    async def commit(self, group: str, commits: Sequence[UnitCommit]) -> CommitResult:
        """Write the checkpoints whose token is the row's generation, in one transaction."""
        check_group_name(group)
        if not commits:
            return CommitResult()
        return await self._run(self._commit, group, list(commits))

    async def read(self, group: str) -> dict[Unit, StoredUnit]:
        """Every stored unit of ``group``."""
        check_group_name(group)
        return await self._run(self._read, group)

    async def close(self) -> None:
        """Close the connection and the worker thread."""
        if self._closed:
            return
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(self._executor, self._close)
        await asyncio.to_thread(self._executor.shutdown, True)

    # ---- worker thread ---------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self._guarded, fn, *args
        )

    def _guarded(self, fn: Callable[..., T], *args: Any) -> T:
        import psycopg  # lazily: only PostgreSQL users need the driver loaded

        try:
            return fn(self._connection(), *args)
        except psycopg.Error as exc:
            text = scrub_exception(exc, (self._dsn,))
            message = f"unit store {self.table}: {text}"
            if session_lost(exc):
                self._close()
                raise TransportError(message) from None
            raise ChangebusError(message, retriable=False) from None

    def _connection(self) -> Any:
        if self._conn is not None and self._conn.closed:
            self._conn = None
        if self._conn is None:
            conn = connect(self._dsn, self._idle_in_transaction_s)
            try:
                _create(conn, self._sql.create)
                _add_fence(conn, self._sql.add_fence)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _claim(self, conn: Any, group: str, unit: Unit, owner: str, fence: int) -> UnitClaim:
        params = (group, str(unit), owner, fence, time.time_ns())
        row = conn.execute(self._sql.claim, params).fetchone()
        if row is None:
            raise claim_fenced(group, unit, owner, fence)
        checkpoint = parse_checkpoint(row[0], f"unit store {self.table} unit {unit}")
        generation = int(row[1])
        log.debug("group %s: unit %s claimed by %s (generation %d)", group, unit, owner, generation)
        return UnitClaim(unit, checkpoint, token=generation, generation=generation)

    def _commit(self, conn: Any, group: str, commits: list[UnitCommit]) -> CommitResult:
        tokens: dict[Unit, int] = {}
        fenced: set[Unit] = set()
        now = time.time_ns()
        with conn.transaction(), conn.cursor() as cur:
            for c in commits:
                text = checkpoint_text(c.checkpoint)
                cur.execute(self._sql.commit, (text, now, group, str(c.unit), c.token))
                if cur.fetchone() is None:
                    fenced.add(c.unit)
                    tokens.pop(c.unit, None)
                else:
                    tokens[c.unit] = c.token
        if fenced:
            log.info("group %s: commits of %d unit(s) fenced", group, len(fenced))
        return CommitResult(tokens=tokens, fenced=frozenset(fenced))

    def _read(self, conn: Any, group: str) -> dict[Unit, StoredUnit]:
        rows = conn.execute(self._sql.read, (group,)).fetchall()
        where = f"unit store {self.table}"
        return {s.unit: s for s in (stored_unit(r, where) for r in rows)}


def _create(conn: Any, sql: str) -> None:
    """Create the table when missing (autocommit), tolerating another session creating it too."""
    from psycopg import errors

    # IF NOT EXISTS races in PostgreSQL: then the other session's table is there
    with contextlib.suppress(errors.DuplicateTable, errors.DuplicateObject, errors.UniqueViolation):
        conn.execute(sql)


def _add_fence(conn: Any, sql: str) -> None:
    """Add the ``fence`` column to a table made by an older version (autocommit)."""
    from psycopg import errors

    with contextlib.suppress(errors.DuplicateColumn):  # (the usual case: it is there)
        conn.execute(sql.replace("ADD COLUMN", "ADD COLUMN IF NOT EXISTS", 1))
