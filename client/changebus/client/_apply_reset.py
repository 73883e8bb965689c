"""The tables a replica consumer wrote, so that it can start again from nothing by itself.

A replica whose position no bootstrap server can serve any more (it lies in
SCNs a server never received, or before every server's history) cannot be
caught up: the snapshot it would get cannot say which of its rows were
deleted meanwhile. Its state must be reset: its rows deleted and its
checkpoint forgotten, then it bootstraps from nothing. An operator can do
that by hand; a replica with ``reset_unservable`` set does it itself
(:meth:`~._apply.Replica.run`), which needs to know which tables are its.

The ledger (``<checkpoint_table>_tables``: one row per consumer name and
target table) is written the first time a connection of the replica makes
sure of a table, so it lists every table the consumer has written since it
was introduced. A reset deletes the rows of those tables and the
consumer's checkpoint in one transaction; readers of the target database
then see the tables fill again as the bootstrap goes on.

Thread-safety: the replica's worker thread only (like its connection).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["TableLedger"]


class TableLedger:
    """The ledger of one replica database (module docstring)."""

    def __init__(
        self,
        table: str,
        *,
        execute: Callable[[Any, str, Sequence[Any]], list[tuple[Any, ...]]],
        quote: Callable[[str], str],
        placeholder: str,
    ) -> None:
        self.table = table
        self._execute = execute
        q, p = quote(table), placeholder
        self.create = (
            f"CREATE TABLE IF NOT EXISTS {q} (consumer TEXT NOT NULL, tbl TEXT NOT NULL,"
            " PRIMARY KEY (consumer, tbl))"
        )
        self._insert = f"INSERT INTO {q} (consumer, tbl) VALUES ({p}, {p}) ON CONFLICT DO NOTHING"
        self._select = f"SELECT tbl FROM {q} WHERE consumer = {p} ORDER BY tbl"
        self._p = p

    def record(self, conn: Any, consumer: str, table: str) -> None:
        """Note that ``consumer`` writes ``table`` (in a transaction)."""
        self._execute(conn, self._insert, (consumer, table))

    def tables(self, conn: Any, consumer: str) -> list[str]:
        """The tables ``consumer`` wrote."""
        return [str(t) for (t,) in self._execute(conn, self._select, (consumer,))]

    def reset(
        self,
        conn: Any,
        consumer: str,
        *,
        exists: Callable[[str], bool],
        qualified: Callable[[str], str],
        checkpoints: str,
    ) -> list[str]:
        """Delete the rows of ``consumer``'s tables (those that ``exists``) and its row in
        the checkpoint table ``checkpoints`` (quoted); run in a transaction. The tables."""
        tables = [t for t in self.tables(conn, consumer) if exists(t)]
        for table in tables:
            self._execute(conn, f"DELETE FROM {qualified(table)}", ())
        self._execute(conn, f"DELETE FROM {checkpoints} WHERE consumer = {self._p}", (consumer,))
        return tables
