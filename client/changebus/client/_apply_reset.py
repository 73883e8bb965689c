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
was introduced. It is *complete* (a row with the empty table name) only
for a consumer that started from nothing with it: a replica older than the
ledger may have written tables it does not list, and is not reset by
itself. Nor is one whose tables another consumer name writes too (their
rows are not all its own). A reset deletes the rows of the tables and the
consumer's checkpoint in one transaction; readers of the target database
then see the tables fill again as the bootstrap goes on.

Thread-safety: the replica's worker thread only (like its connection).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Final

from changebus.schemas import ConfigError

from ._config import ConsumerConfig

__all__ = ["TableLedger", "reset_config"]

#: the ledger's "complete" mark of a consumer (no table has an empty name)
_COMPLETE: Final = ""


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
        self._others = f"SELECT DISTINCT consumer FROM {q} WHERE consumer <> {p} AND tbl IN "
        self._p = p

    def record(self, conn: Any, consumer: str, table: str) -> None:
        """Note that ``consumer`` writes ``table`` (in a transaction)."""
        self._execute(conn, self._insert, (consumer, table))

    def mark_complete(self, conn: Any, consumer: str) -> None:
        """``consumer`` starts from nothing: its ledger lists every table it writes."""
        self._execute(conn, self._insert, (consumer, _COMPLETE))

    def check_resettable(self, conn: Any, consumer: str) -> list[str]:
        """``consumer``'s tables, or :class:`ConfigError` when a reset cannot be trusted
        (module docstring)."""
        rows = self._execute(conn, self._select, (consumer,))
        names = [str(t) for (t,) in rows]
        if _COMPLETE not in names:
            raise ConfigError(
                f"consumer {consumer!r} was started before the replica listed the tables it "
                "writes: reset it by hand (empty its tables and delete its checkpoint row)"
            )
        tables = [t for t in names if t != _COMPLETE]
        if tables:
            marks = ", ".join([self._p] * len(tables))
            others = self._execute(conn, f"{self._others}({marks})", (consumer, *tables))
            if others:
                shown = ", ".join(sorted(repr(str(c)) for (c,) in others)[:5])
                raise ConfigError(
                    f"consumer {consumer!r} shares tables with other consumers ({shown}): "
                    "a reset would delete their rows too; reset them together by hand"
                )
        return tables

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
        the checkpoint table ``checkpoints`` (quoted); run in a transaction. The tables.
        :class:`ConfigError` (and nothing deleted) when a reset cannot be trusted."""
        tables = [t for t in self.check_resettable(conn, consumer) if exists(t)]
        for table in tables:
            self._execute(conn, f"DELETE FROM {qualified(table)}", ())
        self._execute(conn, f"DELETE FROM {checkpoints} WHERE consumer = {self._p}", (consumer,))
        return tables


def reset_config(config: ConsumerConfig) -> ConsumerConfig | None:
    """The configuration a reset replica starts again with: from nothing (a snapshot of
    everything, whatever ``start`` said); None when it may not reset: a key filter or a
    group (other writers' rows share its tables), or no bootstrap server to start from."""
    if config.filter is not None or config.group:
        return None
    if not (config.bootstrap_servers or config.zookeeper):
        return None
    return dataclasses.replace(config, start="earliest")
