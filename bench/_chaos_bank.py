"""Bank samples of the chaos harness (re-exported by :mod:`_chaos_check`).

The bank workload keeps ``sum(balance)`` of ``accounts`` constant in every
committed source state; a replica that applies each window atomically with
its checkpoint shows the same sum in every state it passes through -- while
it reads online. While it bootstraps (snapshot pages, then catch-up windows)
it is not transactionally consistent by design, so samples taken then are
*exempt*: the replica's stored checkpoint (``changebus_checkpoints``, the
JSON of a :class:`~changebus.schemas.Checkpoint`, written in the same
transaction as the rows) tells the mode.

:class:`BankSampler` is the sampling thread; :func:`sqlite_bank_sample` and
:func:`pg_bank_sample` read a replica's checkpoint and sums in one read
transaction. Also here: the SQLite naming of ``changebus replicate``
(:func:`sqlite_table`) and the small SQL helpers the readers share.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from changebus.schemas import Checkpoint, CheckpointError, Mode

__all__ = [
    "CHECKPOINT_TABLE",
    "BankSampler",
    "ReplicaSample",
    "pg_bank_sample",
    "quote",
    "replica_online",
    "sqlite_bank_sample",
    "sqlite_connect",
    "sqlite_table",
    "stored_checkpoint_scn",
]

log = logging.getLogger("changebus.bench.chaos.bank")

#: the table where ``changebus replicate`` keeps its checkpoints (consumer -> JSON)
CHECKPOINT_TABLE = "changebus_checkpoints"
#: violations kept (as messages) by a sampler; all are counted
MAX_VIOLATIONS = 200


def sqlite_table(table: str, schema: str = "public") -> str:
    """The SQLite replica's table for source ``<schema>.<table>`` (``.`` becomes ``_``)."""
    source = table if "." in table else f"{schema}.{table}"
    return source.replace(".", "_")


def sqlite_connect(path: Path) -> sqlite3.Connection:
    """A read-only connection in autocommit mode (never creates the file)."""
    # read-only, never creates the file; a busy writer makes readers wait, not fail
    conn = sqlite3.connect(
        f"file:{os.fspath(path)}?mode=ro", uri=True, timeout=10.0, check_same_thread=False
    )
    conn.isolation_level = None
    return conn


def stored_checkpoint_scn(
    sink: str, path: Path | None, dsn: str, consumer: str, partition: str
) -> int:
    """The window SCN a replica's stored checkpoint resumes after (-1: none; blocking).

    ``sink``: "sqlite" (the file ``path``) or "pg" (the database ``dsn``).
    """
    import psycopg

    sql = f"SELECT checkpoint FROM {CHECKPOINT_TABLE} WHERE consumer = '{consumer}'"
    try:
        if sink == "sqlite":
            assert path is not None
            conn = sqlite_connect(path)
            try:
                row = conn.execute(sql).fetchone()
            finally:
                conn.close()
        else:
            with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as pg:
                row = pg.execute(sql).fetchone()
    except (sqlite3.Error, psycopg.Error):
        return -1
    if row is None:
        return -1
    return Checkpoint.parse(row[0]).get(partition).window_scn


def quote(name: str) -> str:
    """An SQL identifier in double quotes."""
    return '"' + name.replace('"', '""') + '"'


# ---- the replica's checkpoint and bank samples --------------------------------------


def replica_online(text: str | None, partition: str | None = None) -> bool:
    """Whether a stored checkpoint (JSON) says the replica reads online (not bootstrapping).

    ``partition``: the partition to look at (None: every partition in the
    checkpoint must be online). No checkpoint: False (nothing applied yet).
    """
    if not text:
        return False
    try:
        cp = Checkpoint.parse(text)
    except CheckpointError:
        return False
    if partition is not None:
        return partition in cp.partitions and cp.get(partition).mode is Mode.ONLINE
    return bool(cp.partitions) and all(pc.mode is Mode.ONLINE for pc in cp.partitions.values())


Sample = Callable[[], "tuple[int, int] | None"]


class ReplicaSample:
    """A bank sample function over one replica, keeping its connection between calls.

    Called from one thread at a time (the sampler's); :meth:`close` closes
    the connection (the sampler calls it when it ends).
    """

    def __init__(self, checkpoint_table: str, consumer: str, partition: str | None) -> None:
        self.checkpoint_table = checkpoint_table
        self.consumer = consumer
        self.partition = partition
        self._conn: Any = None

    def _connect(self) -> Any:
        raise NotImplementedError

    def _read(self, conn: Any) -> tuple[int, int] | None:
        raise NotImplementedError

    def __call__(self) -> tuple[int, int] | None:
        if self._conn is None:
            self._conn = self._connect()
            if self._conn is None:
                return None
        try:
            return self._read(self._conn)
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


class _SqliteSample(ReplicaSample):
    def __init__(self, path: Path, schema: str, *args: Any) -> None:
        super().__init__(*args)
        self.path = Path(path)
        self.table = sqlite_table("accounts", schema)

    def _connect(self) -> Any:
        if not self.path.exists():
            return None
        conn = sqlite_connect(self.path)
        return conn

    def _read(self, conn: Any) -> tuple[int, int] | None:
        conn.execute("BEGIN")  # one read snapshot for the checkpoint and the sums
        try:
            names = {
                r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            }
            if self.checkpoint_table not in names or self.table not in names:
                return None
            row = conn.execute(
                f"SELECT checkpoint FROM {quote(self.checkpoint_table)} WHERE consumer = ?",
                (self.consumer,),
            ).fetchone()
            if not replica_online(row[0] if row else None, self.partition):
                return None
            count, total = conn.execute(
                f"SELECT count(*), coalesce(sum(balance), 0) FROM {quote(self.table)}"
            ).fetchone()
            return int(count), int(total)
        finally:
            conn.execute("COMMIT")


class _PgSample(ReplicaSample):
    def __init__(self, dsn: str, schema: str, *args: Any) -> None:
        super().__init__(*args)
        self._dsn = dsn
        self.table = f"{quote(schema)}.{quote('accounts')}"

    def __repr__(self) -> str:
        return f"_PgSample({self.table})"  # no DSN: it may hold a password

    def _connect(self) -> Any:
        import psycopg

        return psycopg.connect(self._dsn, autocommit=True, connect_timeout=5)

    def _read(self, conn: Any) -> tuple[int, int] | None:
        with conn.transaction(), conn.cursor() as cur:
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            cur.execute(
                "SELECT to_regclass(%s) IS NOT NULL, to_regclass(%s) IS NOT NULL",
                (quote(self.checkpoint_table), self.table),
            )
            have = cur.fetchone()
            if have is None or not (have[0] and have[1]):
                return None
            cur.execute(
                f"SELECT checkpoint FROM {quote(self.checkpoint_table)} WHERE consumer = %s",
                (self.consumer,),
            )
            row = cur.fetchone()
            if not replica_online(row[0] if row else None, self.partition):
                return None
            cur.execute(f"SELECT count(*), coalesce(sum(balance), 0) FROM {self.table}")
            count, total = cur.fetchone()
            return int(count), int(total)


def sqlite_bank_sample(
    path: Path,
    *,
    schema: str = "public",
    consumer: str = "default",
    partition: str | None = None,
    checkpoint_table: str = CHECKPOINT_TABLE,
) -> ReplicaSample:
    """A sample function for :class:`BankSampler` over a SQLite replica.

    Returns ``(count, sum)`` of the accounts table, or None (exempt) while the
    replica has no accounts table or its checkpoint (``consumer``'s row;
    ``partition`` as in :func:`replica_online`) is not online -- both read in
    one read transaction. The connection is opened lazily in the calling
    (sampler) thread and kept; an error closes it and propagates. ``close()``
    closes it.
    """
    return _SqliteSample(path, schema, checkpoint_table, consumer, partition)


def pg_bank_sample(
    dsn: str,
    *,
    schema: str = "public",
    consumer: str = "default",
    partition: str | None = None,
    checkpoint_table: str = CHECKPOINT_TABLE,
) -> ReplicaSample:
    """Like :func:`sqlite_bank_sample` for a Postgres replica (one REPEATABLE READ transaction)."""
    return _PgSample(dsn, schema, checkpoint_table, consumer, partition)


class BankSampler(threading.Thread):
    """Samples a replica's accounts every ``interval_s`` in a thread; checks count and sum.

    ``sample()`` returns ``(count, sum)`` or None for an exempt sample (the
    replica is bootstrapping or has nothing yet); an exception is an error (the
    replica's database is restarting, say), counted and not a violation.
    Counters: ``samples`` (checked), ``exempt``, ``errors``; ``violations``
    (messages, the first :data:`MAX_VIOLATIONS`; ``violation_count`` counts
    all). Written by the sampler thread only; read them after :meth:`stop`
    (or as approximate progress while running).
    """

    def __init__(
        self,
        name: str,
        sample: Sample,
        accounts: int,
        total: int,
        *,
        interval_s: float = 0.05,
    ) -> None:
        super().__init__(name=f"bank-sampler-{name}", daemon=True)
        self.replica = name
        self._sample = sample
        self.accounts = accounts
        self.total = total
        self.interval_s = interval_s
        self.samples = 0
        self.exempt = 0
        self.errors = 0
        self.violations: list[str] = []
        self.violation_count = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                self.sample_once()
                self._stop_event.wait(self.interval_s)
        finally:
            close = getattr(self._sample, "close", None)
            if callable(close):
                close()

    def sample_once(self) -> None:
        """Take one sample now (the thread's step; callable directly in tests)."""
        try:
            got = self._sample()
        except Exception:
            self.errors += 1
            log.debug("sample of %s failed", self.replica, exc_info=True)
            return
        if got is None:
            self.exempt += 1
            return
        self.samples += 1
        count, total = got
        if count != self.accounts or total != self.total:
            self.violation_count += 1
            if len(self.violations) < MAX_VIOLATIONS:
                self.violations.append(
                    f"{self.replica}: {count} accounts with sum {total}"
                    f" (expected {self.accounts} with sum {self.total}) at {time.time():.3f}"
                )

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the thread (waits for it when it was started)."""
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout_s)
