"""Replicas: apply a change stream to tables of another database, effectively once.

A :class:`Replica` is both the consumer's callbacks and its checkpoint
persister. It collects a window's events and, in ``on_end_window``, applies
them in **one database transaction together with the checkpoint after that
window**: the target tables and the stored position always agree, so a
crash anywhere replays nothing twice and loses nothing. Windows at or below
the stored position are skipped (a replay after a commit), and the writes
are idempotent anyway:

* INSERT / UPDATE -- an upsert on the key columns (``INSERT ... ON
  CONFLICT (key) DO UPDATE``) of the columns the source sent (``not_sent``
  columns keep their old value); an update whose before-image has another
  key deletes the old key first;
* DELETE -- ``DELETE ... WHERE key``; TRUNCATE -- ``DELETE FROM`` the table.

(The statements: :mod:`._apply_rows`.)

Tables several writers share (the units of a consumer group, consumers
with key filters writing to one database: :attr:`Replica.shared_tables`)
apply a TRUNCATE once for all of them, and drop changes it made dead
(:mod:`._apply_shared`).

Target tables are created from the event's table schema when missing
(column types from the Avro types, primary key = the source key), and
columns added by later schema versions are added with ``ALTER TABLE``;
a column whose type changed at the source is widened where the dialect
types its columns (:mod:`._apply_pgtypes`). (The shaping: :mod:`._apply_tables`.)
Tables without a key cannot be upserted: the replica stops (FATAL).

Consumer groups: the dialects are :class:`~._apply_units.UnitReplica`
subclasses, which add the fenced unit checkpoints of a group (windows with
``window.unit`` set); windows without a unit take the path described here.

All database work runs in one worker thread per replica (the connection
lives and dies there), never on the event loop. A connection the server
dropped (a database restart) is replaced by a new one before the next use: the
window that failed on it was rolled back and is applied again. Dialects
(:class:`~._apply_sqlite.SqliteReplica`,
:class:`~._apply_pg.PostgresReplica`) supply the connection, quoting,
types and value adaptation.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

from changebus.schemas import (
    BootstrapFailedError,
    Checkpoint,
    CheckpointError,
    Column,
    ConfigError,
    PartitionCheckpoint,
    PartitionFilter,
    RowEncoder,
    TableSchema,
    Unit,
    key_hash,
)

from ._apply_reset import TableLedger, reset_config
from ._apply_rows import RowStatements, runs
from ._apply_shared import SharedTables
from ._apply_tables import TableShapes
from ._callbacks import AsyncCallbacks, CallbackResult, Result
from ._config import ConsumerConfig
from ._model import ChangeEvent, Window

__all__ = ["Replica"]

log = logging.getLogger(__name__)


class Replica(TableShapes, RowStatements, AsyncCallbacks):
    """Base of the database replicas (module docstring); use a dialect subclass.

    ``consumer_name`` keys the stored checkpoint (several replicas may share
    a database); ``table_names`` maps a source name to its target table
    (a mapping or a function; default: the dialect's rule);
    ``checkpoint_table`` names the table holding checkpoints.
    """

    #: the DB-API parameter placeholder of the dialect
    placeholder: ClassVar[str] = "?"

    def __init__(
        self,
        *,
        consumer_name: str = "default",
        table_names: Mapping[str, str] | Callable[[str], str] | None = None,
        checkpoint_table: str = "changebus_checkpoints",
    ) -> None:
        self.consumer_name = consumer_name
        self._table_names = table_names
        #: (target table as the database tells them apart, source) pairs checked against
        #: the sources table (:meth:`_claim_table`); worker thread only
        self._claimed: set[tuple[str, str]] = set()
        self.checkpoint_table = checkpoint_table
        #: which source first wrote each target table (:meth:`_claim_table`)
        self.sources_table = f"{checkpoint_table}_sources"
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="changebus-replica")
        self._conn: Any = None  # worker thread only
        #: other writers apply other keys of the same tables (a key filter; the units
        #: of a group always do): TRUNCATEs go through :mod:`._apply_shared`
        self.shared_tables = False
        #: the keys this writer of shared tables owns (its consumer's filter; None: not
        #: known): an update moving a row from a key it owns moves the row here
        #: (:meth:`_foreign_old_key`)
        self.key_filter: PartitionFilter | None = None
        #: a group's bucket count (0: not known; :meth:`run` of a group config sets it):
        #: a unit's window moves a row from a key of its own bucket (:meth:`_foreign_to_unit`)
        self.unit_buckets = 0
        self._key_encoders: dict[int, RowEncoder] = {}  # worker thread only
        self._shared = SharedTables(
            f"{checkpoint_table}_truncations",
            execute=lambda conn, sql, params: self._execute(conn, sql, params),
            quote=self._quote,
            placeholder=self.placeholder,
            lock=self._row_lock,
        )
        self._shared_ready = False  # worker thread only
        #: start again from nothing when no bootstrap server can serve the position
        #: (:meth:`run`; :mod:`._apply_reset`)
        self.reset_unservable = False
        self.resets = 0
        self._ledger = TableLedger(
            f"{checkpoint_table}_tables",
            execute=lambda conn, sql, params: self._execute(conn, sql, params),
            quote=self._quote,
            placeholder=self.placeholder,
        )
        self._columns: dict[str, set[str]] = {}  # worker thread only
        #: target table -> fingerprints of the schemas its columns were made to hold
        self._shapes: dict[str, set[int]] = {}  # worker thread only
        self._pending: list[ChangeEvent] = []
        self._stored: Checkpoint | None = None
        #: the partitions this replicator moved (the only ones it writes: _write_checkpoint)
        self._advanced: set[str] = set()
        self._consumer: Any = None
        self.windows_applied = 0
        self.windows_skipped = 0

    # ---- dialect hooks (worker thread) ----------------------------------

    def _connect(self) -> Any:
        raise NotImplementedError

    def _close_connection(self, conn: Any) -> None:
        conn.close()

    def _connection_lost(self, conn: Any) -> bool:
        """Whether ``conn`` can no longer be used (the server restarted, the network cut it)."""
        return False

    def _transaction(self, conn: Any) -> contextlib.AbstractContextManager[Any]:
        raise NotImplementedError

    def _execute(self, conn: Any, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def _executemany(self, conn: Any, sql: str, rows: list[list[Any]]) -> None:
        raise NotImplementedError

    def _row_lock(self, exclusive: bool) -> str:
        """The clause locking the rows a SELECT reads until the transaction ends
        (empty: the dialect's write transactions are serial already)."""
        return ""

    def _quote(self, name: str) -> str:
        return '"' + name.replace('"', '""') + '"'

    def _kept_name(self, name: str) -> str:
        """``name`` as the target database keeps it (PostgreSQL shortens long names)."""
        return name

    def _qualified(self, table: str) -> str:
        return self._quote(table)

    def _existing_columns(self, conn: Any, table: str) -> set[str] | None:
        raise NotImplementedError

    def _prepare_table(self, conn: Any, table: str) -> None:
        return None

    def _widen_columns(self, conn: Any, table: str, schema: TableSchema) -> None:
        """Widen the columns whose type cannot hold ``schema``'s values (its own
        transactions); the dialects whose columns take any value do nothing."""
        return None

    def _column_type(self, column: Column) -> str:
        raise NotImplementedError

    def _adapt(self, value: Any) -> Any:
        return value

    def default_table_name(self, source: str) -> str:
        """The target table of ``source`` when ``table_names`` does not say."""
        return source.replace(".", "_")

    # ---- naming -----------------------------------------------------------

    def table_for(self, source: str) -> str:
        """The target table name of source ``source``."""
        names = self._table_names
        if names is None:
            return self.default_table_name(source)
        if callable(names):
            return names(source)
        return names.get(source) or self.default_table_name(source)

    # ---- thread plumbing --------------------------------------------------

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _connection(self) -> Any:
        if self._conn is not None and self._connection_lost(self._conn):
            log.warning("replica connection lost: connecting again")
            self._close()  # a window rolled back on it is applied again on a new one
        if self._conn is None:
            conn = self._connect()
            try:
                self._create_missing(
                    conn,
                    self.checkpoint_table,
                    f"CREATE TABLE IF NOT EXISTS {self._quote(self.checkpoint_table)}"
                    " (consumer TEXT PRIMARY KEY, checkpoint TEXT NOT NULL)",
                )
                self._create_missing(conn, self._ledger.table, self._ledger.create)
                self._create_missing(
                    conn,
                    self.sources_table,
                    f"CREATE TABLE IF NOT EXISTS {self._quote(self.sources_table)}"
                    " (tbl TEXT PRIMARY KEY, source TEXT NOT NULL, defaulted INTEGER NOT NULL)",
                )
            except BaseException:
                self._close_connection(conn)
                raise
            self._conn = conn
        return self._conn

    def _write_checkpoint(self, conn: Any, checkpoint: Checkpoint) -> None:
        """Write this consumer's checkpoint: the partitions it moved; others stay as stored.

        Two replicators of one consumer name writing one database (each its own
        partitions) each wrote the whole row: one's commit erased the other's
        position, which on restart started over from ``--from`` (review). Only
        missing partitions were kept at first, but after a restart each held the
        other's partitions as loaded, and wrote those stale positions back: the
        next restart applied windows again (review).
        """
        q, p = self._quote, self.placeholder
        rows = self._execute(
            conn,
            f"SELECT checkpoint FROM {q(self.checkpoint_table)} WHERE consumer = {p}"
            + self._row_lock(True),
            (self._checkpoint_key,),
        )
        if rows:
            with contextlib.suppress(CheckpointError):  # (unreadable: this one replaces it)
                merged = Checkpoint.parse(rows[0][0])
                for name, pc in checkpoint.partitions.items():
                    if name in self._advanced or name not in merged.partitions:
                        merged = merged.with_partition(name, pc)
                checkpoint = merged
        self._execute(
            conn,
            f"INSERT INTO {q(self.checkpoint_table)} (consumer, checkpoint) VALUES ({p}, {p})"
            " ON CONFLICT (consumer) DO UPDATE SET checkpoint = excluded.checkpoint",
            (self._checkpoint_key, checkpoint.to_json()),
        )

    @property
    def _checkpoint_key(self) -> str:
        """The checkpoint row's key: the consumer name, and the key filter when there is
        one. Replicators of one name and partition with other filters (``mod:2:0`` and
        ``mod:2:1``) shared one row: the one ahead wrote its position, and the other,
        restarted, skipped the windows in between as applied; their changes to its keys
        were lost for good (review)."""
        if self.key_filter is None:
            return self.consumer_name
        return f"{self.consumer_name} {self.key_filter}"

    @property
    def checkpoint(self) -> Checkpoint | None:
        """The checkpoint last committed with the rows (None before the first)."""
        return self._stored

    # ---- persister protocol ---------------------------------------------

    async def load(self) -> Checkpoint | None:
        """The checkpoint stored with the replicated rows (None: start afresh)."""
        self._stored = await self._in_thread(self._load)
        return self._stored

    def _load(self) -> Checkpoint | None:
        conn = self._connection()
        q, p = self._quote, self.placeholder
        rows = self._execute(
            conn,
            f"SELECT checkpoint FROM {q(self.checkpoint_table)} WHERE consumer = {p}",
            (self._checkpoint_key,),
        )
        if not rows and self._checkpoint_key != self.consumer_name:
            # (written before filters had rows of their own: under the name alone)
            rows = self._execute(
                conn,
                f"SELECT checkpoint FROM {q(self.checkpoint_table)} WHERE consumer = {p}",
                (self.consumer_name,),
            )
            if rows:
                log.warning(
                    "replica %s: the checkpoint of filter %s is taken from the one stored "
                    "under the consumer name alone (an older version); from now on it has "
                    "its own row",
                    self.consumer_name,
                    self.key_filter,
                )
        if not rows:  # from nothing: the ledger will list every table it writes
            with self._transaction(conn):
                self._ledger.mark_complete(conn, self.consumer_name)
        return Checkpoint.parse(rows[0][0]) if rows else None

    async def store(self, checkpoint: Checkpoint) -> None:
        """Store a checkpoint not written with rows already (empty windows)."""
        if checkpoint == self._stored:
            return
        before = self._stored.partitions if self._stored is not None else {}
        self._advanced.update(
            name for name, pc in checkpoint.partitions.items() if before.get(name) != pc
        )
        await self._in_thread(self._store, checkpoint)
        self._stored = checkpoint

    def _store(self, checkpoint: Checkpoint) -> None:
        conn = self._connection()
        with self._transaction(conn):
            self._write_checkpoint(conn, checkpoint)

    # ---- callbacks ------------------------------------------------------

    async def on_start_window(self, window: Window) -> Result:
        """Start collecting the window's events."""
        self._pending = []
        return None

    async def on_event(self, event: ChangeEvent) -> Result:
        """Collect one event (applied at the window's end)."""
        self._pending.append(event)
        return None

    async def on_rollback(self, checkpoint: Checkpoint) -> Result:
        """Drop collected events; the database never saw them."""
        self._pending = []
        return None

    async def on_end_window(self, window: Window) -> Result:
        """Apply the window and its checkpoint in one transaction."""
        stored = self._stored.get(window.partition) if self._stored is not None else None
        if stored is not None and applied_before(stored, window):
            self.windows_skipped += 1  # applied before a crash or a failed checkpoint
            return None
        base = self._stored if self._stored is not None else Checkpoint({})
        after = base.with_partition(
            window.partition, window.position_after(base.get(window.partition))
        )
        events, self._pending = self._pending, []
        self._advanced.add(window.partition)
        try:
            await self._in_thread(self._apply, events, after, window.partition)
        except ConfigError as exc:
            log.error("replica cannot apply window %d: %s", window.scn, exc.message)
            return CallbackResult.FATAL
        except Exception:
            # the window is tried again: with the tables looked at afresh (another
            # writer may have widened a column, whose type the key matches follow)
            self._shapes.clear()
            raise
        self._stored = after
        self.windows_applied += 1
        return None

    # ---- applying (worker thread) -------------------------------------------

    def _apply(self, events: list[ChangeEvent], checkpoint: Checkpoint, partition: str) -> None:
        conn = self._connection()
        for event in events:
            self._ensure_table(conn, event)
        if self.shared_tables:
            self._shared_setup(conn, partition, events)
        with self._transaction(conn):
            self._write_rows(conn, events, partition if self.shared_tables else None)
            self._write_checkpoint(conn, checkpoint)

    def _shared_setup(self, conn: Any, partition: str, events: list[ChangeEvent]) -> None:
        """Make sure the truncation records of ``events``' tables exist (their own
        transactions; before the window's)."""
        if not self._shared_ready:
            self._create_missing(conn, self._shared.table, self._shared.create)
            self._shared_ready = True
        tables = sorted({self.table_for(e.table) for e in events})
        missing = self._shared.missing(partition, tables)
        if missing:
            with self._transaction(conn):
                self._shared.add(conn, partition, missing)

    def _write_rows(
        self, conn: Any, events: list[ChangeEvent], shared: str | None, unit: str = ""
    ) -> None:
        """Write a window's rows (in its transaction); ``shared``: the partition of
        tables other writers share (:mod:`._apply_shared`), None when they do not;
        ``unit``: the group unit whose window it is."""
        truncated: dict[str, tuple[int, int]] = {}
        if shared is not None:
            events, truncated = self._shared.filter(conn, shared, events, self.table_for)
        foreign: Callable[[ChangeEvent], bool] | None = None
        if shared is not None:
            foreign = (
                functools.partial(self._foreign_to_unit, Unit.parse(unit).bucket)
                if unit
                else self._foreign_old_key
            )
        for sql, rows in runs(self._statements(events, foreign)):
            self._executemany(conn, sql, rows)
        if truncated:
            assert shared is not None
            self._shared.record(conn, shared, truncated)

    def _foreign_old_key(self, event: ChangeEvent) -> bool:
        """Whether the old key of ``event`` (an update moving its row) is another
        writer's: outside :attr:`key_filter`, or not known to be this writer's."""
        keys = self.key_filter
        old = None if keys is None else self._old_key_hash(event)
        return keys is None or old is None or not keys.matches(old)

    def _foreign_to_unit(self, bucket: int, event: ChangeEvent) -> bool:
        """Whether the old key of ``event`` (an update moving its row, in a window of
        the group unit of ``bucket``) is another unit's: its bucket is another, or
        the group's bucket count is not known. A key of the same bucket is moved in
        the same window's transaction (the fetcher's DELETE of the old key comes in
        the same unit window, after the UPDATE)."""
        old = self._old_key_hash(event) if self.unit_buckets else None
        return old is None or old % self.unit_buckets != bucket

    def _old_key_hash(self, event: ChangeEvent) -> int | None:
        """The routing hash of ``event``'s before-image key (None: it has none)."""
        schema = event.schema
        if event.before is None or schema is None:
            return None
        encoder = self._key_encoders.get(schema.fingerprint)
        if encoder is None:
            encoder = self._key_encoders[schema.fingerprint] = RowEncoder(schema, source_id=0)
        try:
            return key_hash(encoder.key_bytes(event.before))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    async def run(self, config: ConsumerConfig) -> None:
        """Consume ``config``'s stream into this replica until :meth:`stop` or an error.

        With :attr:`reset_unservable`, a position no bootstrap server can serve
        (:class:`~changebus.schemas.BootstrapFailedError`) resets the replica
        (:meth:`reset`) and it starts again from nothing, once per run; not for
        tables other writers share (a key filter, a group), whose rows are
        not all this replica's.
        """
        from ._consumer import Consumer

        if config.group:
            self.unit_buckets = config.buckets
        if config.filter is not None:
            self.shared_tables = True  # other filters' writers may share the tables
            # (ConsumerConfig parses a filter given as text)
            self.key_filter = (
                PartitionFilter.parse(config.filter)
                if isinstance(config.filter, str)
                else config.filter
            )
        self.resets = 0
        while True:
            consumer = Consumer(config, persister=self)
            self._consumer = consumer
            try:
                async with consumer:
                    await consumer.run(self)
                return
            except BootstrapFailedError as exc:
                again = reset_config(config) if self._resettable() else None
                if again is None:
                    raise
                log.error("replica %s: %s; resetting it", self.consumer_name, exc.message)
                try:
                    await self.reset()
                except ConfigError as refused:
                    raise BootstrapFailedError(
                        f"{exc.message}; the replica cannot reset itself: {refused.message}"
                    ) from None
                config = again
            finally:
                self._consumer = None

    def _resettable(self) -> bool:
        return (
            self.reset_unservable
            and not self.shared_tables
            and self.resets == 0
            and (self._stored is not None)
        )

    async def reset(self) -> list[str]:
        """Delete the rows of every table this consumer wrote and its checkpoint, in
        one transaction (the next run starts from nothing); the tables emptied."""
        tables: list[str] = await self._in_thread(self._reset)
        self._stored = None
        self.resets += 1
        log.warning(
            "replica %s: reset: %d table(s) emptied, checkpoint forgotten",
            self.consumer_name,
            len(tables),
        )
        return tables

    def _reset(self) -> list[str]:
        conn = self._connection()
        with self._transaction(conn):
            return self._ledger.reset(
                conn,
                self.consumer_name,
                exists=lambda t: self._existing_columns(conn, t) is not None,
                qualified=self._qualified,
                checkpoints=self._quote(self.checkpoint_table),
            )

    def stats(self) -> dict[str, Any]:
        """The running consumer's :meth:`~._consumer.Consumer.stats` (empty when not running)."""
        consumer = self._consumer
        return consumer.stats() if consumer is not None else {}

    def stop(self) -> None:
        """End :meth:`run` after the current window (any thread)."""
        consumer = self._consumer
        if consumer is not None:
            consumer.stop()

    async def close(self) -> None:
        """Close the database connection and the worker thread."""
        if self._conn is not None:
            await self._in_thread(self._close)
        await asyncio.to_thread(self._executor.shutdown, True)

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        self._columns.clear()
        self._shapes.clear()
        self._shared.known.clear()
        self._shared_ready = False
        if conn is not None:
            self._close_connection(conn)

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Run a read query on the replica's connection (blocking; for inspection)."""
        return self._executor.submit(
            lambda: self._execute(self._connection(), sql, params)
        ).result()


def applied_before(stored: PartitionCheckpoint, window: Window) -> bool:
    """Whether ``window`` is at or below ``stored``: applied already, to be skipped."""
    return not window.bootstrapping and stored.window_scn >= window.scn and stored.window_offset < 0
