"""How a replica shapes its target tables (one mixin, every dialect).

:class:`TableShapes` makes the table of a source when it is missing, adds
the columns of later schema versions, widens columns whose type changed
(through the dialect's ``_widen_columns``) and records every table it wrote
in the consumer's ledger (:mod:`._apply_reset`). It also refuses a second
source whose rows would land in a table another source writes
(:meth:`TableShapes._claim_table`). What the shapes are is described in
:mod:`._apply`.

State (on the :class:`~._apply.Replica` it is mixed into, worker thread
only): ``_columns`` caches each table's column names as the database keeps
them; ``_shapes`` the fingerprints of the schemas each table was made to
hold (a schema seen once costs nothing after); ``_claimed`` the
(table, source) pairs already checked against :attr:`sources_table`.
Every method runs in the replica's worker thread, with its connection.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from changebus.schemas import Column, ConfigError, TableSchema

from ._apply_reset import TableLedger
from ._model import ChangeEvent

__all__ = ["TableShapes"]

log = logging.getLogger(__name__)


class TableShapes:
    """The table-shaping methods mixed into :class:`~._apply.Replica` (module docstring)."""

    placeholder: ClassVar[str]
    consumer_name: str
    sources_table: str
    _table_names: Mapping[str, str] | Callable[[str], str] | None
    _claimed: set[tuple[str, str]]
    _columns: dict[str, set[str]]
    _shapes: dict[str, set[int]]
    _ledger: TableLedger

    # ---- the dialect's hooks (:class:`~._apply.Replica` and its subclasses) ----------

    def _quote(self, name: str) -> str:
        raise NotImplementedError

    def _qualified(self, table: str) -> str:
        raise NotImplementedError

    def _kept_name(self, name: str) -> str:
        raise NotImplementedError

    def _transaction(self, conn: Any) -> contextlib.AbstractContextManager[Any]:
        raise NotImplementedError

    def _execute(self, conn: Any, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def _existing_columns(self, conn: Any, table: str) -> set[str] | None:
        raise NotImplementedError

    def _prepare_table(self, conn: Any, table: str) -> None:
        raise NotImplementedError

    def _widen_columns(self, conn: Any, table: str, schema: TableSchema) -> None:
        raise NotImplementedError

    def _column_type(self, column: Column) -> str:
        raise NotImplementedError

    def table_for(self, source: str) -> str:
        raise NotImplementedError

    # ---- shaping ------------------------------------------------------------------

    def _table_key(self, table: str) -> str:
        """What the target database tells tables apart by (:meth:`_claim_table`)."""
        return ".".join(self._kept_name(part) for part in table.split("."))

    def _claim_table(self, conn: Any, table: str, source: str) -> None:
        """Refuse a second source whose rows would go to ``table`` by the default naming.

        ``a_b.c`` and ``a.b_c`` are both ``a_b_c`` in SQLite (so are ``App.T``
        and ``app.t``: its names ignore case), and two long names that share
        their first 63 bytes are one table in PostgreSQL: their rows were
        merged into one table, keys of one overwriting the other's. Sources
        that ``table_names`` sends to one table on purpose (shards into one)
        are left alone. The first source of each table is kept in the
        database (:attr:`sources_table`), so the check holds across restarts
        and between the processes writing one database (a group's members).
        Worker thread only; once per table and source in a process.
        """
        key = self._table_key(table)
        if (key, source) in self._claimed:
            return
        named = self._table_names
        defaulted = named is None or (not callable(named) and source not in named)
        q, p = self._quote(self.sources_table), self.placeholder
        self._execute(
            conn,
            f"INSERT INTO {q} (tbl, source, defaulted) VALUES ({p}, {p}, {p})"
            " ON CONFLICT (tbl) DO NOTHING",
            (key, source, int(defaulted)),
        )
        rows = self._execute(conn, f"SELECT source, defaulted FROM {q} WHERE tbl = {p}", (key,))
        owner, owner_defaulted = str(rows[0][0]), bool(rows[0][1])
        if owner != source and (defaulted or owner_defaulted):
            raise ConfigError(
                f"sources {owner!r} and {source!r} would both write replica table {table!r}"
                " (the target database cannot tell their names apart): map one of them"
                " elsewhere with table_names"
            )
        self._claimed.add((key, source))

    def _create_missing(self, conn: Any, table: str, create: str) -> None:
        """Run ``create`` (``CREATE TABLE IF NOT EXISTS``) in a transaction of its own.

        Replicas opening one database at once race on it (PostgreSQL: a
        duplicate-type error; SQLite: a busy snapshot): when the statement
        fails and the table exists now, another session made it.
        """
        try:
            with self._transaction(conn):
                self._execute(conn, create)
        except Exception:
            if not self._existing_columns(conn, table):
                raise

    def _ensure_table(self, conn: Any, event: ChangeEvent) -> None:
        schema = event.schema
        if schema is None:
            raise ConfigError(f"event of {event.table!r} carries no table schema")
        table = self.table_for(event.table)
        self._claim_table(conn, table, schema.name)
        known, wanted = self._columns.get(table), {self._kept_name(c.name) for c in schema.columns}
        if len(wanted) != len(schema.columns):
            raise ConfigError(
                f"table {schema.name!r}: two columns are one name to the target database"
                " (it shortens long names): rename one at the source"
            )
        shaped = schema.fingerprint in self._shapes.get(table, ())
        if known is not None and wanted <= known and shaped:
            return
        if not schema.key:
            raise ConfigError(f"table {schema.name!r} has no key: rows cannot be upserted")
        # the database's columns, not the cache's: another replica of the same database
        # (a group member) may have added them meanwhile
        found = self._existing_columns(conn, table)
        have = set(found) if found is not None else None
        try:
            with self._transaction(conn):
                if have is None:
                    self._prepare_table(conn, table)
                    self._execute(conn, self._create_sql(table, schema))
                    have = set(wanted)
                    log.info("replica created table %s for source %s", table, schema.name)
                for column in schema.columns:
                    if self._kept_name(column.name) not in have:
                        self._execute(
                            conn,
                            f"ALTER TABLE {self._qualified(table)} ADD COLUMN"
                            f" {self._quote(column.name)} {self._column_type(column)}",
                        )
                        have.add(self._kept_name(column.name))
        except Exception:
            # another replica made the same change at the same time: fine when it is there
            now = self._existing_columns(conn, table)
            if now is None or not wanted <= set(now):
                raise
            have = set(now)
        self._columns[table] = have
        self._check_key(conn, table, schema)
        if schema.nullable_key:
            self._key_index(conn, table, schema)
        self._widen_columns(conn, table, schema)
        self._shapes.setdefault(table, set()).add(schema.fingerprint)
        with self._transaction(conn):
            self._ledger.record(conn, self.consumer_name, table)

    def _check_key(self, conn: Any, table: str, schema: TableSchema) -> None:
        """Refuse a table whose primary key is not the source's key (it changed at the
        source): every upsert of it failed, rolled back and retried until the replica
        gave up, with the database's words only (review)."""
        have = self._primary_key(conn, table)
        if have is None:
            return  # (the dialect does not say)
        want = () if schema.nullable_key else tuple(self._kept_name(k) for k in schema.key)
        if sorted(have) == sorted(want):
            return

        def shown(cols: tuple[str, ...]) -> str:
            return f"({', '.join(cols)})" if cols else "none"

        raise ConfigError(
            f"replica table {table}: its primary key is {shown(have)}, the key of source"
            f" {schema.name!r} is now {shown(want)}: its changes cannot be applied; drop the"
            " table and replicate from nothing again (a new consumer name, or its checkpoint"
            " deleted), or give the source's rows another table (table_names)"
        )

    def _primary_key(self, conn: Any, table: str) -> tuple[str, ...] | None:
        """The primary key columns of ``table`` (() none; None: the dialect does not say)."""
        return None

    def _key_index(self, conn: Any, table: str, schema: TableSchema) -> None:
        """A (non-unique) index on the key columns of a table without a primary key
        (``nullable_key``): each change deletes its old row by key. Made by the
        first replica that needs it, so tables of older versions get it too."""
        columns = {c.name: c for c in schema.columns}
        indexed = [k for k in schema.key if self._indexable(schema, columns[k])]
        if not indexed:
            return  # (every event scans the table: correct, only slower)
        digest = hashlib.sha256("\0".join((table, *indexed)).encode()).hexdigest()[:16]
        key = ", ".join(self._quote(k) for k in indexed)
        try:
            with self._transaction(conn):
                self._execute(
                    conn,
                    f"CREATE INDEX IF NOT EXISTS {self._quote('cb_key_' + digest)}"
                    f" ON {self._qualified(table)} ({key})",
                )
        except Exception as exc:  # noqa: BLE001 - the replica works without it, only slower
            # (another replica making it at the same moment: it is there either way)
            log.warning("replica table %s: no index on its key columns (%s)", table, exc)

    def _indexable(self, schema: TableSchema, column: Column) -> bool:
        """Whether the key index of a table without a primary key takes ``column``."""
        return True

    def _create_sql(self, table: str, schema: TableSchema) -> str:
        q = self._quote
        cols = [f"{q(c.name)} {self._column_type(c)}" for c in schema.columns]
        if schema.nullable_key or not schema.key:
            # keyed by all its columns, any of them NULL: no primary key can hold it
            return f"CREATE TABLE {self._qualified(table)} ({', '.join(cols)})"
        key = ", ".join(q(k) for k in schema.key)
        return f"CREATE TABLE {self._qualified(table)} ({', '.join(cols)}, PRIMARY KEY ({key}))"
