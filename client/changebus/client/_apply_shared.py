"""Target tables that several writers share: a TRUNCATE empties them once, for every writer.

The units of a consumer group (and consumers with key filters that write to
one database) each apply a share of a table's keys, each at its own pace.
A TRUNCATE has no key: every share receives it (the relay's key filter
passes it to all). Applied by each writer as ``DELETE FROM table``, the
slowest writer's TRUNCATE at SCN T would delete the rows the faster writers
had already written after T.

The rule instead: a TRUNCATE makes every change of that table before it
dead, whoever writes it. Events are ordered by ``(scn, seq)``, the same for
an event in every delivery and every share. The replica database keeps, per
(partition, target table), the ``(scn, seq)`` of the newest TRUNCATE applied
(``<checkpoint_table>_truncations``, one row each, created at ``(-1, -1)``
the first time a writer sees the table). In the transaction that applies a
window, before any of its rows:

* the records of the tables the window touches are locked (PostgreSQL:
  ``FOR SHARE``, or ``FOR UPDATE`` when the window truncates one of them,
  in table order so that two writers never wait on each other in a cycle;
  SQLite: ``BEGIN IMMEDIATE`` serialises writers already) and read;
* the window's changes of a table at or before its record are dropped
  (the TRUNCATE itself too: another writer applied it);
* what remains is applied as usual; a TRUNCATE left runs ``DELETE FROM``
  (this writer is the first to reach it: every other writer is still before
  it, so all rows are older than it) and is recorded.

A writer still before a TRUNCATE that applies a window after it was applied
drops its changes of the table before it; one that applied them earlier
has them deleted by the TRUNCATE (the lock orders the two). The rule does
not depend on which rows are whose, so it needs no per-row bookkeeping, and
it holds for a window that arrives in pieces too.

Thread-safety: used from the replica's worker thread only (like the
connection it is given).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ._model import ChangeEvent, ChangeOp

__all__ = ["SharedTables"]


class SharedTables:
    """The truncation records of one replica database (module docstring).

    ``execute(conn, sql, params)`` runs one statement and returns its rows;
    ``quote`` quotes an identifier; ``placeholder`` is the DB-API
    parameter mark; ``lock(exclusive)`` is the dialect's row lock clause
    for a read (empty when transactions are serial already).
    """

    def __init__(
        self,
        table: str,
        *,
        execute: Callable[[Any, str, Sequence[Any]], list[tuple[Any, ...]]],
        quote: Callable[[str], str],
        placeholder: str,
        lock: Callable[[bool], str],
    ) -> None:
        self.table = table
        self._execute = execute
        self._lock = lock
        q, p = quote(table), placeholder
        self.create = (
            f"CREATE TABLE IF NOT EXISTS {q} (part TEXT NOT NULL, tbl TEXT NOT NULL,"
            " scn BIGINT NOT NULL, seq BIGINT NOT NULL, PRIMARY KEY (part, tbl))"
        )
        self._insert = (
            f"INSERT INTO {q} (part, tbl, scn, seq) VALUES ({p}, {p}, -1, -1)"
            " ON CONFLICT DO NOTHING"
        )
        self._select = f"SELECT tbl, scn, seq FROM {q} WHERE part = {p} AND tbl IN "
        self._set = (
            f"UPDATE {q} SET scn = {p}, seq = {p} WHERE part = {p} AND tbl = {p}"
            f" AND (scn, seq) < ({p}, {p})"
        )
        self._p = p
        #: (partition, target table) pairs whose row exists (per connection)
        self.known: set[tuple[str, str]] = set()

    def missing(self, part: str, tables: Sequence[str]) -> list[str]:
        """Of ``tables``, those whose record this connection has not made sure of."""
        return [t for t in tables if (part, t) not in self.known]

    def add(self, conn: Any, part: str, tables: Sequence[str]) -> None:
        """Create the records of ``tables`` (at -1) when missing; run in a transaction."""
        for t in tables:
            self._execute(conn, self._insert, (part, t))
        self.known.update((part, t) for t in tables)

    def filter(
        self, conn: Any, part: str, events: list[ChangeEvent], table_of: Callable[[str], str]
    ) -> tuple[list[ChangeEvent], dict[str, tuple[int, int]]]:
        """The events of a window still alive, and the TRUNCATEs to record (table ->
        ``(scn, seq)``).

        Runs inside the window's transaction, before its rows are written;
        the records of every table of ``events`` exist (:meth:`add`).
        """
        targets = [table_of(e.table) for e in events]
        tables = sorted(set(targets))
        if not tables:
            return events, {}
        truncating = any(e.op is ChangeOp.TRUNCATE for e in events)
        marks = ", ".join([self._p] * len(tables))
        rows = self._execute(
            conn,
            f"{self._select}({marks}) ORDER BY tbl{self._lock(truncating)}",
            (part, *tables),
        )
        done = {str(t): (int(s), int(q)) for t, s, q in rows}
        alive: list[ChangeEvent] = []
        record: dict[str, tuple[int, int]] = {}
        for e, t in zip(events, targets, strict=True):
            at = (e.scn, e.seq)
            if at <= done.get(t, (-1, -1)):
                continue  # before a TRUNCATE applied (or the TRUNCATE itself)
            if e.op is ChangeOp.TRUNCATE:
                record[t] = max(record.get(t, at), at)
            alive.append(e)
        return alive, record

    def record(self, conn: Any, part: str, truncated: dict[str, tuple[int, int]]) -> None:
        """Record the TRUNCATEs applied (in the window's transaction, after its rows)."""
        for t, (scn, seq) in sorted(truncated.items()):
            self._execute(conn, self._set, (scn, seq, part, t, scn, seq))
