"""The SQL a replica writes a window's row changes with (one mixin, every dialect).

:class:`RowStatements` turns decoded change events into ``(sql, params)``
pairs, in event order; :func:`runs` groups consecutive pairs with the same
text for ``executemany``. What each change becomes is described in
:mod:`._apply` (upserts on the key, columns not sent kept, key moves, tables
keyed by all their columns). Writers of tables other writers share
(``shared``: a consumer group's units, key filters) leave an update's old key
alone: the fetchers follow a key-changing update with the old key's DELETE,
which reaches the old key's writer in its own order.

The dialect supplies quoting, placeholders, the NULL-safe equality and value
adaptation (the :class:`~._apply.Replica` subclasses). Pure functions of
their input: no connection, no state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from changebus.schemas import Column, ConfigError, TableSchema

from ._apply_wide import written
from ._model import ChangeEvent, ChangeOp

__all__ = ["RowStatements", "runs"]


class RowStatements:
    """The statement builder mixed into :class:`~._apply.Replica` (module docstring)."""

    placeholder: ClassVar[str]

    def _quote(self, name: str) -> str:
        raise NotImplementedError

    def _qualified(self, table: str) -> str:
        raise NotImplementedError

    def _adapt(self, value: Any) -> Any:
        raise NotImplementedError

    def _key_equals(self, column: Column, table: str = "", alias: str = "") -> str:
        """The SQL matching ``column`` of target ``table`` (unqualified; "" : unknown) with
        a parameter, the column named through ``alias`` when given (a dialect may need a
        cast: the column's type in the target may be wider than the event's)."""
        return f"{alias}{self._quote(column.name)} = {self.placeholder}"

    def _key_where(self, target: str, schema: TableSchema, alias: str = "") -> str:
        """The WHERE text matching ``schema``'s key in target table ``target``, built once
        per (table, schema version, alias) instead of for every event
        (:meth:`_forget_key_matches` when a column's type changes)."""
        cache: dict[tuple[str, int, str], str] = self.__dict__.setdefault("_key_wheres", {})
        k = (target, schema.fingerprint, alias)
        where = cache.get(k)
        if where is None:
            by_name = {c.name: c for c in schema.columns}
            where = cache[k] = " AND ".join(
                self._key_equals(by_name[c], target, alias) for c in schema.key
            )
        return where

    def _forget_key_matches(self) -> None:
        """Build the key matches again (a target column's type changed)."""
        self.__dict__.pop("_key_wheres", None)

    def table_for(self, source: str) -> str:
        raise NotImplementedError

    def _statements(
        self, events: list[ChangeEvent], foreign: Callable[[ChangeEvent], bool] | None = None
    ) -> Iterator[tuple[str, list[Any]]]:
        """The statements writing ``events``. ``foreign`` (tables shared by writers of
        other keys: a group's units, key filters): whether an update's old key is
        another writer's; such an update leaves the old key to that writer (the
        fetchers follow it with the old key's DELETE, which goes there). An old key
        of this writer's own is moved as by a lone writer (its DELETE comes here too)."""
        q, p = self._quote, self.placeholder
        for event in events:
            e, theirs = written(event), foreign
            if foreign is not None and e is not event:
                # (the old key's routing hash is of the values as decoded)
                theirs = functools.partial(_as_decoded, foreign, event)
            schema = e.schema
            assert schema is not None
            target = self.table_for(e.table)
            table = self._qualified(target)
            key = schema.key
            where = self._key_where(target, schema)
            if e.op is ChangeOp.TRUNCATE:
                yield f"DELETE FROM {table}", []
                continue
            if schema.nullable_key:
                yield from self._whole_row_statements(e, target, theirs)
                continue
            if e.op is ChangeOp.DELETE or e.after is None:
                image = e.key or (e.before or {})
                yield f"DELETE FROM {table} WHERE {where}", [self._adapt(image[k]) for k in key]
                continue
            skip = set(e.not_sent)
            if e.before is not None:
                old = {k: e.before.get(k) for k in key}
                moved = all(v is not None for v in old.values()) and old != {
                    k: e.key[k] for k in key
                }
                if moved and theirs is not None and theirs(e):
                    if skip - set(key):
                        raise ConfigError(_unsent_move(schema.name, sorted(skip - set(key))))
                elif moved:
                    old_values = [self._adapt(old[k]) for k in key]
                    if skip:
                        # columns not sent keep their value: move the row to its new key,
                        # unless a row holds that key already (a replay over newer state: a
                        # bootstrap's catch-up), whose values are at least as new; the old
                        # key's row goes either way (what follows in the log brings back
                        # whatever came to it later)
                        new_values = [self._adapt(e.key[k]) for k in key]
                        sets = ", ".join(f"{q(k)} = {p}" for k in key)
                        taken = self._key_where(target, schema, "x.")
                        yield (
                            f"UPDATE {table} SET {sets} WHERE {where} AND NOT EXISTS"
                            f" (SELECT 1 FROM {table} AS x WHERE {taken})",
                            new_values + old_values + new_values,
                        )
                        yield f"DELETE FROM {table} WHERE {where}", old_values
                    else:
                        yield f"DELETE FROM {table} WHERE {where}", old_values
            cols = [c for c in e.after if c not in skip]
            values = [self._adapt(e.key[c] if c in e.key else e.after[c]) for c in cols]
            updates = [c for c in cols if c not in key]
            conflict = (
                "DO UPDATE SET " + ", ".join(f"{q(c)} = excluded.{q(c)}" for c in updates)
                if updates
                else "DO NOTHING"
            )
            yield (
                f"INSERT INTO {table} ({', '.join(q(c) for c in cols)})"
                f" VALUES ({', '.join(p for _ in cols)})"
                f" ON CONFLICT ({', '.join(q(k) for k in key)}) {conflict}",
                values,
            )

    def _whole_row_statements(
        self, e: ChangeEvent, table: str, foreign: Callable[[ChangeEvent], bool] | None
    ) -> Iterator[tuple[str, list[Any]]]:
        """A change of a table keyed by all its columns (``nullable_key``: no primary
        key, NULLs in the key): the old row goes (matched NULL-safely, by the key the
        event names), the new one comes. Identical rows are one key: a delete or an
        update removes all of them. An update's old row of another writer's key
        (``foreign``) is left to that writer (:meth:`_statements`)."""
        q, p = self._quote, self.placeholder
        target, table = table, self._qualified(table)
        key = e.schema.key if e.schema is not None else ()
        columns = {c.name: c for c in e.schema.columns} if e.schema is not None else {}

        def delete(values: list[Any]) -> tuple[str, list[Any]]:
            # NULL-safe, one statement per pattern of NULLs: ``k IS NULL`` / ``k = ?``
            # use the key columns' index (:meth:`_ensure_table`), where Postgres's
            # ``IS NOT DISTINCT FROM`` scanned the table for every event
            where = " AND ".join(
                f"{q(k)} IS NULL" if v is None else self._key_equals(columns[k], target)
                for k, v in zip(key, values, strict=True)
            )
            return f"DELETE FROM {table} WHERE {where}", [v for v in values if v is not None]

        old = e.before if e.after is not None else (e.key or e.before)
        theirs = foreign is not None and e.after is not None and foreign(e)
        if old is not None and e.op is not ChangeOp.INSERT and not theirs:
            yield delete([self._adapt(old.get(k)) for k in key])
        if e.op is ChangeOp.DELETE or e.after is None:
            return
        image = {k: (e.key[k] if k in e.key else e.after.get(k)) for k in key}
        for k in e.not_sent:  # (events of older fetchers: an unchanged TOASTed key value)
            if k in image and e.before is not None and k not in e.before_not_sent:
                image[k] = e.before.get(k)
        yield delete([self._adapt(image[k]) for k in key])
        cols = list(image)
        yield (
            f"INSERT INTO {table} ({', '.join(q(c) for c in cols)})"
            f" VALUES ({', '.join(p for _ in cols)})",
            [self._adapt(image[c]) for c in cols],
        )


def _as_decoded(
    foreign: Callable[[ChangeEvent], bool], decoded: ChangeEvent, _written: ChangeEvent
) -> bool:
    return foreign(decoded)


def _unsent_move(table: str, columns: list[str]) -> str:
    return (
        f"an update of {table!r} changed its row's key without sending columns {columns} "
        "(Postgres leaves unchanged TOASTed values out of the log); writers sharing the "
        "tables (a consumer group, a key filter) cannot take them from the old key's row: "
        "set REPLICA IDENTITY FULL on the source table"
    )


#: statements one ``executemany`` takes at most
RUN_ROWS = 2000


def runs(
    statements: Iterator[tuple[str, list[Any]]], limit: int = RUN_ROWS
) -> Iterator[tuple[str, list[list[Any]]]]:
    """Consecutive statements with the same SQL, grouped for ``executemany``, at most
    ``limit`` a group.

    Bounded: the parameters of a group are built inside the window's transaction
    before it is sent, and a whole window's (a bulk update of 400k rows) left the
    session idle in its transaction for seconds, past the server's
    ``idle_in_transaction_session_timeout``, on every retry (found by review).
    """
    sql: str | None = None
    rows: list[list[Any]] = []
    for text, params in statements:
        if sql is not None and (text != sql or len(rows) >= limit):
            yield sql, rows
            rows = []
        sql = text
        rows.append(params)
    if sql is not None:
        yield sql, rows
