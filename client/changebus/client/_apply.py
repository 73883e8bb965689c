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

Target tables are created from the event's table schema when missing
(column types from the Avro types, primary key = the source key), and
columns added by later schema versions are added with ``ALTER TABLE``.
Tables without a key cannot be upserted: the replica stops (FATAL).

Consumer groups: a replica is also a :class:`~changebus.schemas.UnitStore`
over a unit-checkpoint table in the target database (``unit_table``, the
shape of :mod:`._unitsql`). :meth:`Replica.claim` remembers the token of
each unit it claims; a window of a unit (``window.unit`` set) is applied
together with ``UPDATE <unit row> ... WHERE generation = token`` in one
transaction. When that updates nothing another member claimed the unit
since: the transaction is rolled back (no row of the window is written),
the unit is remembered as fenced and :meth:`Replica.commit` reports it once.
``commit`` writes the positions of units whose windows had no rows (same
fence) and never moves a unit back behind rows already applied. Windows at
or below a unit's checkpoint are skipped (a replay after the unit moved).
So rows and unit checkpoints agree even across moves and zombie members.
Without a group (``window.unit`` empty) nothing of this is used: one
checkpoint row per ``consumer_name`` in ``checkpoint_table``, as above.

All database work runs in one worker thread per replica (the connection
lives and dies there), never on the event loop. Dialects
(:class:`~._apply_sqlite.SqliteReplica`,
:class:`~._apply_pg.PostgresReplica`) supply the connection, quoting,
types and value adaptation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

from changebus.schemas import (
    Checkpoint,
    Column,
    CommitResult,
    ConfigError,
    PartitionCheckpoint,
    StoredUnit,
    TableSchema,
    Unit,
    UnitClaim,
    UnitCommit,
    check_group_name,
)

from ._callbacks import AsyncCallbacks, CallbackResult, Result
from ._config import ConsumerConfig
from ._model import ChangeEvent, ChangeOp, Window
from ._unitsql import (
    DEFAULT_TABLE,
    SQLITE_TIME,
    UnitSql,
    UnitTime,
    checkpoint_text,
    parse_checkpoint,
    stored_unit,
)

__all__ = ["Replica"]

log = logging.getLogger(__name__)


class Replica(AsyncCallbacks):
    """Base of the database replicas (module docstring); use a dialect subclass.

    ``consumer_name`` keys the stored checkpoint (several replicas may share
    a database); ``table_names`` maps a source name to its target table
    (a mapping or a function; default: the dialect's rule);
    ``checkpoint_table`` names the table holding checkpoints;
    ``unit_table`` the table of a consumer group's unit checkpoints (group
    mode, module docstring).
    """

    #: the DB-API parameter placeholder of the dialect
    placeholder: ClassVar[str] = "?"
    #: how the dialect stores the unit table's ``updated_at``
    unit_time: ClassVar[UnitTime] = SQLITE_TIME

    def __init__(
        self,
        *,
        consumer_name: str = "default",
        table_names: Mapping[str, str] | Callable[[str], str] | None = None,
        checkpoint_table: str = "changebus_checkpoints",
        unit_table: str = DEFAULT_TABLE,
    ) -> None:
        self.consumer_name = consumer_name
        self._table_names = table_names
        self.checkpoint_table = checkpoint_table
        self.unit_table = unit_table
        self._unit_sql = UnitSql.build(
            self._qualified(unit_table), self.placeholder, self.unit_time
        )
        self._unit_table_ready = False  # worker thread only
        self._held: dict[str, _Held] = {}  # unit text -> this replica's claim of it
        self._fenced: set[str] = set()  # units found claimed by another member, not yet reported
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="changebus-replica")
        self._conn: Any = None  # worker thread only
        self._columns: dict[str, set[str]] = {}  # worker thread only
        self._pending: list[ChangeEvent] = []
        self._stored: Checkpoint | None = None
        self._consumer: Any = None
        self.windows_applied = 0
        self.windows_skipped = 0

    # ---- dialect hooks (worker thread) ----------------------------------

    def _connect(self) -> Any:
        raise NotImplementedError

    def _close_connection(self, conn: Any) -> None:
        conn.close()

    def _transaction(self, conn: Any) -> contextlib.AbstractContextManager[Any]:
        raise NotImplementedError

    def _execute(self, conn: Any, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def _executemany(self, conn: Any, sql: str, rows: list[list[Any]]) -> None:
        raise NotImplementedError

    def _quote(self, name: str) -> str:
        return '"' + name.replace('"', '""') + '"'

    def _qualified(self, table: str) -> str:
        return self._quote(table)

    def _existing_columns(self, conn: Any, table: str) -> set[str] | None:
        raise NotImplementedError

    def _prepare_table(self, conn: Any, table: str) -> None:
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
        if self._conn is None:
            self._conn = self._connect()
            q = self._quote
            self._execute(
                self._conn,
                f"CREATE TABLE IF NOT EXISTS {q(self.checkpoint_table)}"
                " (consumer TEXT PRIMARY KEY, checkpoint TEXT NOT NULL)",
            )
        return self._conn

    def _write_checkpoint(self, conn: Any, checkpoint: Checkpoint) -> None:
        q, p = self._quote, self.placeholder
        self._execute(
            conn,
            f"INSERT INTO {q(self.checkpoint_table)} (consumer, checkpoint) VALUES ({p}, {p})"
            " ON CONFLICT (consumer) DO UPDATE SET checkpoint = excluded.checkpoint",
            (self.consumer_name, checkpoint.to_json()),
        )

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
            (self.consumer_name,),
        )
        return Checkpoint.parse(rows[0][0]) if rows else None

    async def store(self, checkpoint: Checkpoint) -> None:
        """Store a checkpoint not written with rows already (empty windows)."""
        if checkpoint == self._stored:
            return
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
        """Apply the window and its checkpoint (of its unit in a group) in one transaction."""
        if window.unit:
            return await self._end_unit_window(window)
        stored = self._stored.get(window.partition) if self._stored is not None else None
        if stored is not None and _applied(stored, window):
            self.windows_skipped += 1  # applied before a crash or a failed checkpoint
            return None
        base = self._stored if self._stored is not None else Checkpoint({})
        after = base.with_partition(
            window.partition, window.position_after(base.get(window.partition))
        )
        events, self._pending = self._pending, []
        try:
            await self._in_thread(self._apply, events, after)
        except ConfigError as exc:
            log.error("replica cannot apply window %d: %s", window.scn, exc.message)
            return CallbackResult.FATAL
        self._stored = after
        self.windows_applied += 1
        return None

    # ---- unit store (consumer groups) -----------------------------------------

    async def claim(self, group: str, unit: Unit, owner: str) -> UnitClaim:
        """Claim ``unit`` in the unit table; its windows are applied fenced by the new token."""
        check_group_name(group)
        claim: UnitClaim = await self._in_thread(self._claim_unit, group, unit, owner)
        self._held[str(unit)] = _Held(group, claim.token, claim.checkpoint)
        self._fenced.discard(str(unit))
        return claim

    async def commit(self, group: str, commits: Sequence[UnitCommit]) -> CommitResult:
        """Report units found fenced while applying; write the other positions, fenced."""
        check_group_name(group)
        lost = {Unit.parse(u) for u in self._fenced}  # reported once
        self._fenced.clear()
        writes: list[UnitCommit] = []
        for c in commits:
            held = self._held.get(str(c.unit))
            if c.unit in lost:
                continue
            if (
                held is not None
                and held.token == c.token
                and held.checkpoint is not None
                and held.checkpoint.window_scn > c.checkpoint.window_scn
            ):
                c = UnitCommit(c.unit, held.checkpoint, c.token)  # never behind applied rows
            writes.append(c)
        result = CommitResult()
        if writes:
            result = await self._in_thread(self._commit_units, group, writes)
        for c in writes:
            held = self._held.get(str(c.unit))
            if c.unit in result.tokens and held is not None and held.token == c.token:
                held.checkpoint = c.checkpoint
        fenced = lost | result.fenced
        if fenced:
            log.info("replica: %d unit(s) of group %s fenced", len(fenced), group)
        return CommitResult(tokens=result.tokens, fenced=frozenset(fenced))

    async def read(self, group: str) -> dict[Unit, StoredUnit]:
        """Every unit of ``group`` in the unit table."""
        check_group_name(group)
        rows = await self._in_thread(
            lambda: self._execute(self._unit_connection(), self._unit_sql.read, (group,))
        )
        where = f"replica unit table {self.unit_table}"
        return {s.unit: s for s in (stored_unit(r, where) for r in rows)}

    async def _end_unit_window(self, window: Window) -> Result:
        events, self._pending = self._pending, []
        held = self._held.get(window.unit)
        if held is None:
            log.error("replica holds no claim of unit %s: use it as the group's store", window.unit)
            return CallbackResult.FATAL
        if window.unit in self._fenced:
            return None  # lost: reported by the next commit
        if held.checkpoint is not None and _applied(held.checkpoint, window):
            self.windows_skipped += 1  # applied before the unit moved here
            return None
        after = window.position_after(held.checkpoint or PartitionCheckpoint())
        try:
            written = await self._in_thread(self._apply_unit, events, held, window.unit, after)
        except ConfigError as exc:
            log.error("replica cannot apply window %d: %s", window.scn, exc.message)
            return CallbackResult.FATAL
        if not written:
            self._fenced.add(window.unit)
            log.warning(
                "replica: unit %s was claimed by another member; window %d not applied",
                window.unit,
                window.scn,
            )
            return None
        if self._held.get(window.unit) is held:
            held.checkpoint = after
        self.windows_applied += 1
        return None

    def _unit_connection(self) -> Any:
        conn = self._connection()
        if not self._unit_table_ready:
            self._prepare_table(conn, self.unit_table)
            self._execute(conn, self._unit_sql.create)
            self._unit_table_ready = True
        return conn

    def _claim_unit(self, group: str, unit: Unit, owner: str) -> UnitClaim:
        conn = self._unit_connection()
        with self._transaction(conn):
            rows = self._execute(
                conn, self._unit_sql.claim, (group, str(unit), owner, time.time_ns())
            )
        checkpoint = parse_checkpoint(rows[0][0], f"replica unit table, unit {unit}")
        generation = int(rows[0][1])
        return UnitClaim(unit, checkpoint, token=generation, generation=generation)

    def _write_unit(
        self, conn: Any, group: str, unit: str, checkpoint: PartitionCheckpoint, token: int
    ) -> bool:
        params = (checkpoint_text(checkpoint), time.time_ns(), group, unit, token)
        return bool(self._execute(conn, self._unit_sql.commit, params))

    def _commit_units(self, group: str, commits: list[UnitCommit]) -> CommitResult:
        conn = self._unit_connection()
        tokens: dict[Unit, int] = {}
        fenced: set[Unit] = set()
        with self._transaction(conn):
            for c in commits:
                if self._write_unit(conn, group, str(c.unit), c.checkpoint, c.token):
                    tokens[c.unit] = c.token
                else:
                    fenced.add(c.unit)
        return CommitResult(
            tokens={u: t for u, t in tokens.items() if u not in fenced}, fenced=frozenset(fenced)
        )

    def _apply_unit(
        self, events: list[ChangeEvent], held: _Held, unit: str, after: PartitionCheckpoint
    ) -> bool:
        conn = self._unit_connection()
        for event in events:
            self._ensure_table(conn, event)
        try:
            with self._transaction(conn):
                for sql, rows in _runs(self._statements(events)):
                    self._executemany(conn, sql, rows)
                if not self._write_unit(conn, held.group, unit, after, held.token):
                    raise _Fenced  # roll the rows back
        except _Fenced:
            return False
        return True

    # ---- applying (worker thread) -------------------------------------------

    def _apply(self, events: list[ChangeEvent], checkpoint: Checkpoint) -> None:
        conn = self._connection()
        for event in events:
            self._ensure_table(conn, event)
        with self._transaction(conn):
            for sql, rows in _runs(self._statements(events)):
                self._executemany(conn, sql, rows)
            self._write_checkpoint(conn, checkpoint)

    def _ensure_table(self, conn: Any, event: ChangeEvent) -> None:
        schema = event.schema
        if schema is None:
            raise ConfigError(f"event of {event.table!r} carries no table schema")
        table = self.table_for(event.table)
        known = self._columns.get(table)
        wanted = {c.name for c in schema.columns}
        if known is not None and wanted <= known:
            return
        if not schema.key:
            raise ConfigError(f"table {schema.name!r} has no key: rows cannot be upserted")
        if known is None:
            known = self._existing_columns(conn, table)
        with self._transaction(conn):
            if known is None:
                self._prepare_table(conn, table)
                self._execute(conn, self._create_sql(table, schema))
                known = wanted
                log.info("replica created table %s for source %s", table, schema.name)
            for column in schema.columns:
                if column.name not in known:
                    self._execute(
                        conn,
                        f"ALTER TABLE {self._qualified(table)} ADD COLUMN"
                        f" {self._quote(column.name)} {self._column_type(column)}",
                    )
                    known.add(column.name)
        self._columns[table] = known

    def _create_sql(self, table: str, schema: TableSchema) -> str:
        q = self._quote
        cols = [f"{q(c.name)} {self._column_type(c)}" for c in schema.columns]
        key = ", ".join(q(k) for k in schema.key)
        return f"CREATE TABLE {self._qualified(table)} ({', '.join(cols)}, PRIMARY KEY ({key}))"

    def _statements(self, events: list[ChangeEvent]) -> Iterator[tuple[str, list[Any]]]:
        q, p = self._quote, self.placeholder
        for e in events:
            schema = e.schema
            assert schema is not None
            table = self._qualified(self.table_for(e.table))
            key = schema.key
            where = " AND ".join(f"{q(k)} = {p}" for k in key)
            if e.op is ChangeOp.TRUNCATE:
                yield f"DELETE FROM {table}", []
                continue
            if e.op is ChangeOp.DELETE or e.after is None:
                image = e.key or (e.before or {})
                yield f"DELETE FROM {table} WHERE {where}", [self._adapt(image[k]) for k in key]
                continue
            skip = set(e.not_sent)
            if e.before is not None:
                old = {k: e.before.get(k) for k in key}
                if all(v is not None for v in old.values()) and old != {k: e.key[k] for k in key}:
                    old_values = [self._adapt(old[k]) for k in key]
                    if skip:
                        # columns not sent keep their value: move the row to its new key
                        sets = ", ".join(f"{q(k)} = {p}" for k in key)
                        yield (
                            f"UPDATE {table} SET {sets} WHERE {where}",
                            [self._adapt(e.key[k]) for k in key] + old_values,
                        )
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

    # ---- running ----------------------------------------------------------

    async def run(self, config: ConsumerConfig) -> None:
        """Consume ``config``'s stream into this replica until :meth:`stop` or an error."""
        from ._consumer import Consumer

        consumer = Consumer(config, persister=self)
        self._consumer = consumer
        try:
            async with consumer:
                await consumer.run(self)
        finally:
            self._consumer = None

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
        self._unit_table_ready = False
        if conn is not None:
            self._close_connection(conn)

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Run a read query on the replica's connection (blocking; for inspection)."""
        return self._executor.submit(
            lambda: self._execute(self._connection(), sql, params)
        ).result()


@dataclass(slots=True)
class _Held:
    """A unit claimed by this replica: its group, token and checkpoint (event loop only)."""

    group: str
    token: int
    checkpoint: PartitionCheckpoint | None


class _Fenced(Exception):
    """The unit row was not updated (another member claimed it): roll the window back."""


def _applied(stored: PartitionCheckpoint, window: Window) -> bool:
    """Whether ``window`` is at or below ``stored``: applied already, to be skipped."""
    return not window.bootstrapping and stored.window_scn >= window.scn and stored.window_offset < 0


def _runs(statements: Iterator[tuple[str, list[Any]]]) -> Iterator[tuple[str, list[list[Any]]]]:
    """Consecutive statements with the same SQL, grouped for ``executemany``."""
    sql: str | None = None
    rows: list[list[Any]] = []
    for text, params in statements:
        if text != sql and sql is not None:
            yield sql, rows
            rows = []
        sql = text
        rows.append(params)
    if sql is not None:
        yield sql, rows
