"""A consistent snapshot of MariaDB tables aligned with the binlog (bootstrap seeding).

:func:`consistent_snapshot` opens a ``REPEATABLE READ`` transaction with
``START TRANSACTION WITH CONSISTENT SNAPSHOT`` and reads, inside it, the
binlog position the snapshot corresponds to (MariaDB's
``binlog_snapshot_file`` / ``binlog_snapshot_position`` status; InnoDB
commits and binlog writes are ordered together, so the snapshot holds exactly
the transactions before that position) and its GTID state
(``BINLOG_GTID_POS``). No lock is taken; writers go on.

A seeder reads every table through :meth:`MySQLSnapshot.rows` (server-side
cursor, batches) and then follows the relay from :attr:`MySQLSnapshot.scn`:
every window with a larger SCN is after the snapshot, every other one is in
it. ``@@gtid_binlog_pos`` is *not* used: read inside the transaction it runs
ahead of the snapshot.

MySQL has neither status variable; :func:`consistent_snapshot` refuses it with
a clear :class:`~changebus.schemas.SourceConfigError`.

Blocking (PyMySQL); one snapshot per thread. Close it (or use ``with``) to end
the transaction.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from changebus.schemas import SourceConfigError, binlog_file_number, binlog_to_scn

from ._config import MySQLConfig
from ._connect import open_connection

__all__ = ["MySQLSnapshot", "consistent_snapshot"]


@dataclass
class MySQLSnapshot:
    """An open snapshot transaction and the binlog point it matches."""

    #: binlog file and offset: the first transaction *not* in the snapshot starts here
    file: str
    pos: int
    #: GTID state of the snapshot (``D-S-N`` per domain, comma separated)
    gtid: str
    connection: Any = field(repr=False)

    @property
    def scn(self) -> int:
        """Windows with a larger SCN are after the snapshot; the others are in it."""
        return binlog_to_scn(binlog_file_number(self.file), self.pos)

    @property
    def source_position(self) -> str:
        """The position in the fetcher's ``source_position`` form (docs/protocol.md 5)."""
        return f"gtid={self.gtid};file={self.file};pos={self.pos}"

    def rows(self, database: str, table: str, batch_rows: int = 10_000) -> Iterator[list[Any]]:
        """Batches of a table's rows as the snapshot sees them (dicts: column -> value)."""
        import pymysql.cursors

        name = f"`{database.replace('`', '``')}`.`{table.replace('`', '``')}`"
        with self.connection.cursor(pymysql.cursors.SSDictCursor) as cur:
            cur.execute(f"SELECT * FROM {name}")
            while batch := cur.fetchmany(batch_rows):
                yield batch

    def close(self) -> None:
        try:
            self.connection.rollback()
        finally:
            self.connection.close()

    def __enter__(self) -> MySQLSnapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def consistent_snapshot(config: MySQLConfig) -> MySQLSnapshot:
    """Open a snapshot on the server of ``config`` (see the module docstring)."""
    import pymysql

    try:
        conn = open_connection(
            config,
            connect_timeout=config.connect_timeout_s,
            autocommit=False,
            charset="utf8mb4",
        )
    except pymysql.err.OperationalError as exc:
        raise SourceConfigError(f"cannot connect to MySQL for a snapshot: {exc.args[-1]}") from None
    try:
        with conn.cursor() as cur:
            cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            cur.execute("SET SESSION time_zone = '+00:00'")
            cur.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT")
            cur.execute("SHOW STATUS LIKE 'binlog_snapshot_%'")
            status = {str(k).lower(): str(v) for k, v in cur.fetchall()}
            file = status.get("binlog_snapshot_file", "")
            if not file:
                raise SourceConfigError(
                    "the server reports no binlog snapshot position (binlog_snapshot_file): "
                    "consistent seeding needs MariaDB with log_bin on"
                )
            pos = int(status["binlog_snapshot_position"])
            cur.execute("SELECT BINLOG_GTID_POS(%s, %s)", (file, pos))
            row = cur.fetchone()
            gtid = "" if row is None or row[0] is None else str(row[0])
    except BaseException:
        conn.close()
        raise
    return MySQLSnapshot(file, pos, gtid, conn)
