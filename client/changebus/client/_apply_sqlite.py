"""The SQLite replica (stdlib :mod:`sqlite3`); see :mod:`._apply` for the semantics.

Column types follow SQLite's affinities: integers and booleans INTEGER,
floating point REAL, bytes BLOB, everything else TEXT (decimals as their
exact text, dates and times in ISO 8601, UUIDs as text, records, arrays and
JSON columns as JSON text). Target tables are named after the source with
``.`` replaced by ``_`` unless ``table_names`` says otherwise.

The connection is opened in the replica's worker thread (sqlite3 objects
stay in the thread that made them) in autocommit mode; each window is one
``BEGIN IMMEDIATE`` ... ``COMMIT``.
"""

from __future__ import annotations

import contextlib
import datetime
import decimal
import logging
import os
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from changebus.schemas import ChangebusError, Column, TableSchema, TransportError

from ._apply_units import UnitReplica
from ._json import json_text
from ._sqlite_retype import AFFINITIES, affinity_join, retype
from ._unitsql import DEFAULT_TABLE

__all__ = ["SqliteReplica"]

log = logging.getLogger(__name__)

_INTEGER = frozenset({"int", "long", "boolean"})
_REAL = frozenset({"float", "double"})
#: how long a new connection retries switching to WAL while other connections hold locks
_LOCKED_WAIT_S = 5.0


class SqliteReplica(UnitReplica):
    """Applies a change stream to a SQLite database file (see :mod:`._apply`)."""

    placeholder = "?"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        consumer_name: str = "default",
        table_names: Mapping[str, str] | Callable[[str], str] | None = None,
        checkpoint_table: str = "changebus_checkpoints",
        unit_table: str = DEFAULT_TABLE,
    ) -> None:
        super().__init__(
            consumer_name=consumer_name,
            table_names=table_names,
            checkpoint_table=checkpoint_table,
            unit_table=unit_table,
        )
        self.path = os.fspath(path)

    def __repr__(self) -> str:
        return f"SqliteReplica({self.path!r}, consumer_name={self.consumer_name!r})"

    def _store_error(self, exc: Exception) -> ChangebusError | None:
        if isinstance(exc, sqlite3.OperationalError):  # e.g. locked by another writer too long
            return TransportError(f"replica {self.path}: unit table {self.unit_table}: {exc}")
        return None

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None)
        deadline = time.monotonic() + _LOCKED_WAIT_S
        while True:  # the busy handler does not cover a journal mode change racing another one
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    conn.close()
                    raise
                time.sleep(0.01)
        conn.execute("PRAGMA synchronous=FULL")
        return conn

    @contextlib.contextmanager
    def _transaction(self, conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
            conn.execute("COMMIT")
        except BaseException:
            # (a COMMIT that failed, busy or out of space, left the transaction open: every
            # later BEGIN failed until a restart; found by review)
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _execute(
        self, conn: sqlite3.Connection, sql: str, params: Sequence[Any] = ()
    ) -> list[tuple[Any, ...]]:
        return conn.execute(sql, params).fetchall()

    def _executemany(self, conn: sqlite3.Connection, sql: str, rows: list[list[Any]]) -> None:
        conn.executemany(sql, rows)

    def _table_key(self, table: str) -> str:
        return table.encode().lower().decode()  # (SQLite's names ignore ASCII case)

    def _primary_key(self, conn: sqlite3.Connection, table: str) -> tuple[str, ...] | None:
        rows = conn.execute(f"PRAGMA table_info({self._quote(table)})").fetchall()
        return tuple(str(r[1]) for r in sorted(rows, key=lambda r: r[5]) if r[5])

    def _existing_columns(self, conn: sqlite3.Connection, table: str) -> set[str] | None:
        rows = conn.execute(f"PRAGMA table_info({self._quote(table)})").fetchall()
        return {str(r[1]) for r in rows} if rows else None

    def _widen_columns(self, conn: sqlite3.Connection, table: str, schema: TableSchema) -> None:
        """Change the columns whose affinity no longer holds ``schema``'s values.

        SQLite converts what it stores by the column's declared affinity: after
        the source turned an integer column into text, ``'007'`` was stored as
        ``7``, and a decimal's ``'1.50'`` became the REAL ``1.5``. The column
        gets the join of both affinities (:func:`~._sqlite_retype.affinity_join`:
        INTEGER and REAL give REAL, anything with TEXT gives TEXT, BLOB stays
        BLOB) and its values are converted (:func:`~._sqlite_retype.retype`), in
        one transaction (another replica doing the same at once finds it done).
        It never narrows a column, as the Postgres replica does not.
        """
        want = {self._kept_name(c.name): self._column_type(c) for c in schema.columns}
        if not self._short_columns(conn, table, want):
            return
        with self._transaction(conn):
            info = conn.execute(f"PRAGMA table_info({self._quote(table)})").fetchall()
            changed = self._short_columns(conn, table, want, info)
            if not changed:
                return  # (another replica rebuilt it meanwhile)
            retype(conn, table, changed, self._quote)
        log.warning(
            "replica table %s: column(s) %s now hold the values of source %s version %d"
            " (%s); their type was changed and their values converted",
            table,
            ", ".join(sorted(changed)),
            schema.name,
            schema.version,
            ", ".join(f"{c} {t}" for c, t in sorted(changed.items())),
        )

    def _short_columns(
        self,
        conn: sqlite3.Connection,
        table: str,
        want: Mapping[str, str],
        info: Sequence[Any] | None = None,
    ) -> dict[str, str]:
        """Columns of ``table`` (name -> the affinity they need) whose declared affinity
        does not hold the wanted one."""
        if info is None:
            info = conn.execute(f"PRAGMA table_info({self._quote(table)})").fetchall()
        out: dict[str, str] = {}
        for row in info:
            name, declared = str(row[1]), str(row[2]).upper()
            wanted = want.get(name)
            if wanted is None or declared not in AFFINITIES:
                continue  # (a column of the operator's own, or a type the replica never makes)
            joined = affinity_join(declared, wanted)
            if joined != declared:
                out[name] = joined
        return out

    def _column_type(self, column: Column) -> str:
        t = column.type
        if isinstance(t, str):
            if t in _INTEGER:
                return "INTEGER"
            if t in _REAL:
                return "REAL"
            if t == "bytes":
                return "BLOB"
            return "TEXT"
        if isinstance(t, dict) and t.get("logicalType") is None:
            base = t.get("type")
            if base in _INTEGER:
                return "INTEGER"
            if base in _REAL:
                return "REAL"
        return "TEXT"

    def _adapt(self, value: Any) -> Any:
        if type(value) is float and value != value:
            # SQLite stores a NaN as NULL: the text keeps the value (as JSON and decimal
            # NaN are written; review); infinities are REAL values of their own
            return "NaN"
        if value is None or isinstance(value, int | float | str | bytes):
            return value  # bool is an int: stored as 0 / 1
        if isinstance(value, decimal.Decimal | uuid.UUID):
            return str(value)
        if isinstance(value, datetime.date | datetime.time | datetime.datetime):
            return value.isoformat()
        return json_text(value)
