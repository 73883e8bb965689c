"""The bootstrap server's storage: a log store and a snapshot store in one SQL database.

Tables (one database holds every physical partition, ``part`` = its name),
each described with the part of :class:`Store` that writes it:

``cb_log`` -- the **log store** (:mod:`._logstore`): every event the producer
  took from the relay, raw, whole windows in stream order.
``cb_snap`` / ``cb_trunc`` -- the **snapshot store** (:mod:`._fold`): per key
  the latest data event (or a tombstone), and the newest TRUNCATE per source.
``cb_seed`` -- tables copied from the source in full, and gaps in the log
  (:mod:`._gaps`); ``cb_snapjob`` -- chunked snapshots in progress
  (:mod:`._snapjobs`); ``cb_unfilled`` -- rows lacking columns a seed re-reads
  (:mod:`._refill`), and ``cb_moved`` -- those of them that moved to their key,
  when (no chunk read before completes them); ``cb_purge`` -- how far old tombstones were deleted
  (:mod:`._purge`).
``cb_state`` / ``cb_schema`` -- positions per partition and table schemas
  (:mod:`._db`, which also holds the dialects and the DDL).

Reads for consumers are :mod:`._pages`.

Invariants: ``applier_scn <= producer_scn``; ``cb_snap`` = the fold of the log
windows up to ``applier_scn`` (plus what was seeded); the log holds every
window in ``(log_min_scn, producer_scn]``; ``base_scn <= log_min_scn`` (pruning
the log moves only ``log_min_scn``). Windows that carry a DATA_LOSS signal
are appended together with the gap they open (:meth:`Store.append`), so no
crash keeps the one without the other.

Two dialects with the same statements: SQLite (the default: one file, no
server; the file, its ``-wal`` and ``-shm`` are private: mode 0600 in a
directory created 0700, :mod:`changebus.schemas.files`) and Postgres
(``psycopg``; a failed connection is a :class:`SourceError` whose message
never quotes the DSN). A :class:`Store` is **not thread-safe**:
the daemon owns each one from a single thread (see :mod:`._storethreads`).
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from changebus.schemas.files import FILE_MODE, private_dir, private_file

from ._db import PartitionState, StoreDb
from ._fold import SnapshotFold
from ._logstore import LogStore
from ._pages import CatchupPage, Pages, SnapshotPage
from ._purge import TombstonePurge
from ._refill import Refills

__all__ = ["CatchupPage", "PartitionState", "SnapshotPage", "Store"]


class Store(LogStore, SnapshotFold, Refills, Pages, TombstonePurge, StoreDb):
    """One bootstrap database (see the module docstring). Not thread-safe."""

    @classmethod
    def sqlite(cls, path: Path) -> Store:
        """Open (create) a SQLite store file; WAL journal, synchronous=NORMAL, the WAL
        checkpointed every ~10,000 pages.

        The file is created (or narrowed to) mode 0600 before SQLite opens it;
        SQLite gives the ``-wal`` and ``-shm`` files the database's mode, and
        ones left by an older version are narrowed here too.
        """
        private_dir(path.parent, narrow=False)
        private_file(path)
        for side in ("-wal", "-shm"):
            side_path = path.with_name(path.name + side)
            if side_path.exists():
                os.chmod(side_path, FILE_MODE)
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA cache_size=-65536")
        # checkpoint the WAL at ~40 MB instead of 4 MB: big writes (snapshot chunks, applier
        # batches) then pay for a checkpoint and its fsync far less often, and pages written
        # again between checkpoints are copied into the database once
        conn.execute("PRAGMA wal_autocheckpoint=10000")
        return cls(conn, "sqlite")

    @classmethod
    def postgres(cls, dsn: str) -> Store:
        """Open a Postgres store (the tables are created when missing)."""
        from changebus.client import pg_session_defaults
        from changebus.fetchers.postgres import pg_connect

        # TCP keepalives and libpq's tcp_user_timeout unless the DSN sets its own (the
        # client's sessions' rule): a dead path fails a call in about 30 s, not minutes
        extra = pg_session_defaults(dsn)
        extra.pop("connect_timeout", None)  # (pg_connect's timeout_s says it)
        conn = pg_connect(
            dsn, "cannot open the Postgres store", option="store.dsn", timeout_s=10, **extra
        )
        return cls(conn, "postgres")

    def append(
        self,
        part: str,
        data: bytes,
        *,
        start_scn: int = -1,
        lost: tuple[int, int | None] = (-1, None),
    ) -> int:
        """:meth:`LogStore.append`; ``lost``: ``(after, upto)`` when the windows carry a
        DATA_LOSS signal (``upto`` None: they do not).

        ``upto`` is the SCN of the (last) window that says SCNs were lost, and
        ``after`` the newest window before the first such one: a gap ending at
        ``upto`` is recorded (:meth:`SeedLedger.mark_gap`, with its lost range)
        in the same transaction as the windows, unless the log already held
        that window (a replay: its gap was recorded then, and maybe repaired).
        """
        after, upto = lost
        if upto is None:
            return super().append(part, data, start_scn=start_scn)
        with self._txn():
            before = self.state(part).producer_scn
            scn = super().append(part, data, start_scn=start_scn)
            if upto > before:
                self.mark_gap(part, upto, after=max(after, before))
        return scn

    def counts(self, part: str) -> dict[str, int]:
        """Rows in the log and the snapshot (live and tombstones) of a partition."""
        logn = self._one("SELECT count(*) FROM cb_log WHERE part = {p}", (part,))
        snap = self._all(
            "SELECT deleted, count(*) FROM cb_snap WHERE part = {p} GROUP BY deleted", (part,)
        )
        by = {int(d): int(n) for d, n in snap}
        return {"log_events": int(logn[0]), "rows": by.get(0, 0), "tombstones": by.get(1, 0)}
