"""The PostgreSQL replica (psycopg 3); see :mod:`._apply` for the semantics.

Column types come from the Avro types: int/long -> integer/bigint,
float/double -> real/double precision, boolean, bytes -> bytea, decimal ->
numeric(p,s), date, time-micros -> time, timestamp-micros -> timestamptz,
local-timestamp-micros -> timestamp, uuid, a source's json -> json (its text
as it is), jsonb and records, arrays and maps -> jsonb, anything else text. A source ``schema.table`` goes to the
same schema and table (created when missing) unless ``table_names`` says
otherwise.

The psycopg connection (sync API) is opened in the replica's worker thread
and used only there; each window is one ``conn.transaction()``. The DSN is
never logged (and scrubbed from the unit store's errors).
"""

from __future__ import annotations

import contextlib
import decimal
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from changebus.schemas import ChangebusError, Column, ConfigError, TableSchema, TransportError
from changebus.schemas.config import scrub_exception

from ._apply_pgtypes import FLOAT_TYPES, canonical, join
from ._apply_units import UnitReplica
from ._json import json_text
from ._pgsession import IDLE_IN_TRANSACTION_S, connect, session_lost
from ._unitsql import DEFAULT_TABLE, POSTGRES_TIME

__all__ = ["PostgresReplica"]

log = logging.getLogger(__name__)

_SIMPLE = {
    "int": "integer",
    "long": "bigint",
    "float": "real",
    "double": "double precision",
    "boolean": "boolean",
    "bytes": "bytea",
    "string": "text",
}
_LOGICAL = {
    "date": "date",
    "time-micros": "time",
    "time-millis": "time",
    "timestamp-micros": "timestamptz",
    "timestamp-millis": "timestamptz",
    "local-timestamp-micros": "timestamp",
    "local-timestamp-millis": "timestamp",
    "uuid": "uuid",
}


#: the bytes of a name PostgreSQL keeps (NAMEDATALEN - 1)
_NAME_BYTES = 63


class PostgresReplica(UnitReplica):
    """Applies a change stream to a PostgreSQL database (see :mod:`._apply`)."""

    placeholder = "%s"
    unit_time = POSTGRES_TIME

    def __init__(
        self,
        dsn: str,
        *,
        consumer_name: str = "default",
        table_names: Mapping[str, str] | Callable[[str], str] | None = None,
        checkpoint_table: str = "changebus_checkpoints",
        unit_table: str = DEFAULT_TABLE,
        idle_in_transaction_s: float = IDLE_IN_TRANSACTION_S,
    ) -> None:
        """``idle_in_transaction_s``: the server ends this replica's session when it idles
        inside a transaction that long (the process froze): see :mod:`._pgsession`; 0: never.
        """
        super().__init__(
            consumer_name=consumer_name,
            table_names=table_names,
            checkpoint_table=checkpoint_table,
            unit_table=unit_table,
        )
        self._dsn = dsn
        self._idle_in_transaction_s = idle_in_transaction_s
        #: target table -> its columns' types (``format_type``), as last read or widened
        #: (:meth:`_widen_columns`, once per table and schema version): key matches cast
        #: an event's value to a column's type when that is wider (:meth:`_key_equals`)
        self._actual_types: dict[str, dict[str, str]] = {}

    def __repr__(self) -> str:
        return (
            f"PostgresReplica(consumer_name={self.consumer_name!r})"  # no DSN: may hold a password
        )

    def default_table_name(self, source: str) -> str:
        return source

    def _store_error(self, exc: Exception) -> ChangebusError | None:
        if session_lost(exc):
            text = scrub_exception(exc, (self._dsn,))
            return TransportError(f"replica unit table {self.unit_table}: {text}")
        return None

    def _connect(self) -> Any:
        return connect(self._dsn, self._idle_in_transaction_s)

    def _connection_lost(self, conn: Any) -> bool:
        return bool(conn.closed or conn.broken)

    def _row_lock(self, exclusive: bool) -> str:
        return " FOR UPDATE" if exclusive else " FOR SHARE"

    def _transaction(self, conn: Any) -> contextlib.AbstractContextManager[Any]:
        result: contextlib.AbstractContextManager[Any] = conn.transaction()
        return result

    def _execute(self, conn: Any, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with conn.cursor() as cur:
            cur.execute(sql, params)
            return list(cur.fetchall()) if cur.description is not None else []

    def _executemany(self, conn: Any, sql: str, rows: list[list[Any]]) -> None:
        with conn.cursor() as cur:
            cur.executemany(sql, rows)

    def _quote(self, name: str) -> str:
        # every statement runs with parameters, so psycopg reads % in its text as a
        # placeholder: a column named "growth%" stopped the replica (found by review)
        return super()._quote(name).replace("%", "%%")

    def _kept_name(self, name: str) -> str:
        # PostgreSQL keeps the first 63 bytes of a name (whole characters): a longer one
        # was looked up in full after a restart, not found, and created again (review)
        raw = name.encode()
        return name if len(raw) <= _NAME_BYTES else raw[:_NAME_BYTES].decode("utf-8", "ignore")

    def _split(self, table: str) -> tuple[str | None, str]:
        schema, dot, name = table.rpartition(".")
        return (schema if dot else None), name

    def _qualified(self, table: str) -> str:
        schema, name = self._split(table)
        return f"{self._quote(schema)}.{self._quote(name)}" if schema else self._quote(name)

    def _prepare_table(self, conn: Any, table: str) -> None:
        schema, _ = self._split(table)
        if schema:
            self._execute(conn, f"CREATE SCHEMA IF NOT EXISTS {self._quote(schema)}")

    def _existing_columns(self, conn: Any, table: str) -> set[str] | None:
        schema, name = self._split(table)
        rows = self._execute(
            conn,
            "SELECT column_name FROM information_schema.columns"
            " WHERE table_schema = coalesce(%s, current_schema()) AND table_name = %s",
            (None if schema is None else self._kept_name(schema), self._kept_name(name)),
        )
        return {str(r[0]) for r in rows} if rows else None

    def _widen_columns(self, conn: Any, table: str, schema: TableSchema) -> None:
        """ALTER the columns whose type does not hold ``schema``'s to the join of both
        (:mod:`._apply_pgtypes`); another writer doing the same at once is fine."""
        import psycopg

        types = self._column_types(conn, table)
        self._actual_types[table] = types
        self._forget_key_matches()
        for column in schema.columns:
            have, want = (
                types.get(self._kept_name(column.name)),
                canonical(self._column_type(column)),
            )
            target = join(have, want) if have else None
            if target is None or target == have:
                continue
            name = self._quote(column.name)
            # a float becomes numeric through its text, which PostgreSQL writes exactly;
            # float8::numeric keeps 15 digits (1/3 lost its 16th and 17th: review)
            via = "::text" if have in FLOAT_TYPES and target.startswith("numeric") else ""
            try:
                with self._transaction(conn):
                    self._execute(
                        conn,
                        f"ALTER TABLE {self._qualified(table)} ALTER COLUMN {name}"
                        f" TYPE {target} USING {name}{via}::{target}",
                    )
            except psycopg.Error as exc:
                if session_lost(exc):
                    raise  # the window is tried again on a new connection
                now = self._column_types(conn, table).get(self._kept_name(column.name))
                if now is not None and join(now, want) == now:
                    continue  # another writer widened it meanwhile
                raise ConfigError(
                    f"replica table {table}: column {column.name!r} cannot change from "
                    f"{have} to {target} (source {schema.name} version {schema.version}): "
                    f"{scrub_exception(exc, (self._dsn,))}"
                ) from None
            types[self._kept_name(column.name)] = target
            log.warning(
                "replica table %s: column %s widened from %s to %s (source %s version %d)",
                table,
                column.name,
                have,
                target,
                schema.name,
                schema.version,
            )

    def _column_types(self, conn: Any, table: str) -> dict[str, str]:
        """The table's columns and their types, as ``format_type`` spells them."""
        rows = self._execute(
            conn,
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute"
            " WHERE attrelid = to_regclass(%s) AND attnum > 0 AND NOT attisdropped",
            (self._qualified(table).replace("%%", "%"),),  # (a value: no placeholders)
        )
        return {str(n): str(t) for n, t in rows}

    def _column_type(self, column: Column) -> str:
        t = column.type
        if isinstance(t, str):
            return _SIMPLE.get(t, "text")
        if isinstance(t, dict):
            logical = t.get("logicalType")
            if logical == "decimal":
                return f"numeric({int(t.get('precision', 38))},{int(t.get('scale', 0))})"
            if isinstance(logical, str) and logical in _LOGICAL:
                return _LOGICAL[logical]
            if t.get("changebus.type") == "json":
                # json, not jsonb: the source's text kept as it is, and a "\u0000" escape
                # (which jsonb refuses) no longer fails the window on every retry
                return "json"
            if t.get("changebus.type") == "jsonb" or t.get("type") in ("record", "array", "map"):
                return "jsonb"
            base = t.get("type")
            if isinstance(base, str) and base in _SIMPLE and logical is None:
                return _SIMPLE[base]
        return "text"

    def _primary_key(self, conn: Any, table: str) -> tuple[str, ...] | None:
        rows = self._execute(
            conn,
            "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid"
            " AND a.attnum = ANY(i.indkey) WHERE i.indrelid = to_regclass(%s) AND i.indisprimary",
            (self._qualified(table).replace("%%", "%"),),  # (a value: no placeholders)
        )
        return tuple(str(r[0]) for r in rows)

    def _indexable(self, schema: TableSchema, column: Column) -> bool:
        # a table keyed by all its columns (REPLICA IDENTITY FULL, no primary key): a
        # btree over its long values refused every row past ~2.7 KB on every retry, and
        # json has no btree at all (review). The bounded ones narrow the search enough
        if len(schema.key) < len(schema.columns):
            return True  # (a unique key of the source's: its index holds these values)
        kind = self._column_type(column)
        return kind not in ("text", "bytea", "json", "jsonb") and not kind.endswith("[]")

    def _key_equals(self, column: Column, table: str = "", alias: str = "") -> str:
        name, p = f"{alias}{self._quote(column.name)}", self.placeholder
        actual = self._actual_types.get(table, {}).get(self._kept_name(column.name))
        natural = self._column_type(column)
        if actual == "json" or (actual is None and natural == "json"):
            return f"{name}::jsonb = {p}::jsonb"  # (json has no = operator: jsonb's)
        if _stringy(actual) and natural not in ("text", "json"):
            # the column became text holding another type's values too (a source's
            # varchar, then uuid): psycopg sends a uuid, int or date as that type, and
            # "text = uuid" has no operator; every DELETE and key move failed (review).
            # Only to text (also for an operator's varchar(n) or char(n) column: a cast to
            # those would cut or pad the value, text compares with them losslessly); the
            # other widenings (int to numeric, date to timestamp) compare as they are
            return f"{name} = {p}::text"
        return f"{name} = {p}"

    def _adapt(self, value: Any) -> Any:
        if type(value) is float:
            # as the decimal of its shortest exact text: sent as float8 it was rounded to
            # 15 digits when the column is numeric (a float column widened; review); a
            # float column takes the decimal back exactly. Zero and the non-finite
            # go as float8: numeric has no -0 (-0.0 came back as 0), and a numeric
            # column takes NaN and the infinities from float8 as they are
            if value == 0.0 or not math.isfinite(value):
                return value
            return decimal.Decimal(repr(value))
        if isinstance(value, dict | list):
            from psycopg.types.json import Jsonb

            # (arrays of uuid, numeric, dates, bytes: plain json.dumps refused them, and
            # the window failed on every retry)
            return Jsonb(value, dumps=_dumps)
        if type(value) is str and "\x00" in value:
            # (MySQL text may hold NUL bytes; PostgreSQL text cannot: psycopg refused the
            # value and the window was retried until the replica gave up; review)
            raise ConfigError(
                "a text value holds a NUL byte (0x00), which PostgreSQL text cannot store:"
                " the replica cannot equal its source; exclude or hash the column at the"
                " source (column_policy), or replicate this table into SQLite"
            )
        return value


def _dumps(value: Any) -> str:
    """JSON text of a decoded value (:func:`~._json.json_text`) for the rest."""
    return json_text(value)


def _stringy(pg_type: str | None) -> bool:
    """Whether a column of ``pg_type`` (``format_type``'s text) holds text."""
    return pg_type is not None and (
        pg_type == "text" or pg_type.startswith(("character varying", "character("))
    )
