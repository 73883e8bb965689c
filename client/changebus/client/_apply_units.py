"""Replicas in a consumer group: fenced unit checkpoints in the replica's own database.

A :class:`UnitReplica` (the base of :class:`~._apply_sqlite.SqliteReplica`
and :class:`~._apply_pg.PostgresReplica`) is also a
:class:`~changebus.schemas.UnitStore`, over a unit-checkpoint table in the
target database (``unit_table``; the table and its SQL are those of
:mod:`._unitsql`, shared with :class:`~._unitstore_pg.PostgresUnitStore`).
So a group member that replicates keeps rows and unit checkpoints in one
database and is effectively-once across unit moves and zombie members:

* :meth:`UnitReplica.claim` raises the unit's generation (an upsert) and
  remembers the token and the stored checkpoint of the unit;
* a window of a unit (``window.unit`` set) is applied with ``UPDATE <unit
  row> SET checkpoint = <after the window> WHERE generation = <token>`` in
  the same transaction. When that updates nothing, another member claimed
  the unit since: the transaction is rolled back (no row of the window is
  written), the unit is remembered as fenced, ``on_end_window`` returns None
  (the window is not the replica's to apply) and the next :meth:`commit`
  reports the unit in ``fenced`` (once; later windows of it are fenced again);
* :meth:`UnitReplica.commit` writes the positions the consumer reached
  (units whose windows had no rows advance that way), each fenced the same
  way, all in one transaction; a position behind the rows already applied
  with the same token is not written back;
* windows at or below a unit's checkpoint are skipped (a replay after the
  unit moved here: those rows were applied by the previous owner).

Windows without a unit take the single-consumer path of :mod:`._apply`
unchanged (one checkpoint row per ``consumer_name``).

Thread-safety: the claims held (``_held``, ``_fenced``) are touched on the
event loop only; the database work runs on the replica's worker thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from changebus.schemas import (
    ChangebusError,
    CommitResult,
    ConfigError,
    PartitionCheckpoint,
    StoredUnit,
    Unit,
    UnitClaim,
    UnitCommit,
    check_group_name,
)

from ._apply import Replica, applied_before
from ._callbacks import CallbackResult, Result
from ._model import ChangeEvent, Window
from ._unitsql import (
    DEFAULT_TABLE,
    SQLITE_TIME,
    UnitSql,
    UnitTime,
    checkpoint_text,
    claim_fenced,
    parse_checkpoint,
    stored_unit,
)

__all__ = ["UnitReplica"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class _Held:
    """A unit claimed by this replica: its group, token and checkpoint (event loop only)."""

    group: str
    token: int
    checkpoint: PartitionCheckpoint | None


class _Fenced(Exception):
    """The unit row was not updated (another member claimed the unit): roll back."""


class UnitReplica(Replica):
    """A replica that is also a consumer group's unit store (module docstring).

    ``unit_table`` names the unit-checkpoint table in the target database;
    the other arguments are :class:`~._apply.Replica`'s.
    """

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
        super().__init__(
            consumer_name=consumer_name,
            table_names=table_names,
            checkpoint_table=checkpoint_table,
        )
        self.unit_table = unit_table
        self._unit_sql = UnitSql.build(
            self._qualified(unit_table), self.placeholder, self.unit_time
        )
        self._unit_table_ready = False  # worker thread only
        self._held: dict[str, _Held] = {}  # unit text -> this replica's claim of it
        self._fenced: set[str] = set()  # units found claimed by another member, not yet reported
        #: unit text -> (claim token, the position after its last window applied under it);
        #: worker thread only: the commits run there too, after the applies before them,
        #: and never write behind it
        self._applied: dict[str, tuple[int, PartitionCheckpoint]] = {}

    # ---- dialect hook (worker thread) ---------------------------------------

    def _store_error(self, exc: Exception) -> ChangebusError | None:
        """The retriable error for a database failure of a store call (None: raise as is)."""
        return None

    # ---- UnitStore -------------------------------------------------------------

    async def claim(self, group: str, unit: Unit, owner: str, fence: int = -1) -> UnitClaim:
        """Claim ``unit`` in the unit table; its windows are applied fenced by the new token."""
        check_group_name(group)
        claim = await self._store_call(self._claim_unit, group, unit, owner, fence)
        self._held[str(unit)] = _Held(group, claim.token, claim.checkpoint)
        self._fenced.discard(str(unit))
        return claim

    async def commit(self, group: str, commits: Sequence[UnitCommit]) -> CommitResult:
        """Report the units found fenced while applying; write the other positions, fenced."""
        check_group_name(group)
        lost = {Unit.parse(u) for u in self._fenced}  # reported once
        self._fenced.clear()
        writes: list[UnitCommit] = []
        for c in commits:
            if c.unit in lost:
                continue
            held = self._held.get(str(c.unit))
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
            result = await self._store_call(self._commit_units, group, writes)
        for c in writes:
            held = self._held.get(str(c.unit))
            if (
                c.unit in result.tokens
                and held is not None
                and held.token == c.token
                and (
                    held.checkpoint is None or held.checkpoint.window_scn <= c.checkpoint.window_scn
                )
            ):
                held.checkpoint = c.checkpoint
        fenced = lost | result.fenced
        if fenced:
            log.info("replica: %d unit(s) of group %s fenced", len(fenced), group)
        return CommitResult(tokens=result.tokens, fenced=frozenset(fenced))

    async def read(self, group: str) -> dict[Unit, StoredUnit]:
        """Every unit of ``group`` in the unit table."""
        check_group_name(group)
        return await self._store_call(self._read_units, group)

    # close() is Replica.close: the connection and the worker thread

    # ---- windows of units --------------------------------------------------------

    async def on_end_window(self, window: Window) -> Result:
        """Apply the window with the checkpoint of its unit (or of its partition) in one transaction."""
        if not window.unit:
            return await super().on_end_window(window)
        events, self._pending = self._pending, []
        held = self._held.get(window.unit)
        if held is None:
            log.error("replica holds no claim of unit %s: use it as the group's store", window.unit)
            return CallbackResult.FATAL
        if window.unit in self._fenced:
            return None  # lost: reported by the next commit
        if held.checkpoint is not None and applied_before(held.checkpoint, window):
            self.windows_skipped += 1  # applied before the unit moved here
            return None
        after = window.position_after(held.checkpoint or PartitionCheckpoint())
        try:
            written = await self._in_thread(
                self._apply_unit, events, held, window.unit, after, window.partition
            )
        except ConfigError as exc:
            log.error("replica cannot apply window %d: %s", window.scn, exc.message)
            return CallbackResult.FATAL
        if not written:
            if self._held.get(window.unit) is held:
                # (a claim taken again meanwhile is another claim: not fenced; review)
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

    # ---- worker thread -------------------------------------------------------------

    async def _store_call(self, fn: Callable[..., T], *args: Any) -> T:
        result: T = await self._in_thread(self._guarded, fn, *args)
        return result

    def _guarded(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except ChangebusError:
            raise
        except Exception as exc:
            error = self._store_error(exc)
            if error is None:
                raise
            self._close()  # connect again on the next call
            raise error from None

    def _unit_connection(self) -> Any:
        conn = self._connection()
        if not self._unit_table_ready:
            self._prepare_table(conn, self.unit_table)
            self._create_missing(conn, self.unit_table, self._unit_sql.create)
            if "fence" not in (self._existing_columns(conn, self.unit_table) or ()):
                self._create_missing(conn, self.unit_table, self._unit_sql.add_fence)
            self._unit_table_ready = True
        return conn

    def _close(self) -> None:
        super()._close()
        self._unit_table_ready = False

    def _claim_unit(self, group: str, unit: Unit, owner: str, fence: int) -> UnitClaim:
        conn = self._unit_connection()
        with self._transaction(conn):
            params = (group, str(unit), owner, fence, time.time_ns())
            rows = self._execute(conn, self._unit_sql.claim, params)
        if not rows:
            raise claim_fenced(group, unit, owner, fence)
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
                token, applied = self._applied.get(str(c.unit), (None, None))
                checkpoint = c.checkpoint
                if (
                    applied is not None
                    and token == c.token
                    and applied.window_scn > checkpoint.window_scn
                ):
                    # (prepared on the loop while a window of the unit was being applied
                    # here: never write a position behind rows already committed)
                    checkpoint = applied
                if self._write_unit(conn, group, str(c.unit), checkpoint, c.token):
                    tokens[c.unit] = c.token
                else:
                    fenced.add(c.unit)
        tokens = {u: t for u, t in tokens.items() if u not in fenced}
        return CommitResult(tokens=tokens, fenced=frozenset(fenced))

    def _read_units(self, group: str) -> dict[Unit, StoredUnit]:
        rows = self._execute(self._unit_connection(), self._unit_sql.read, (group,))
        where = f"replica unit table {self.unit_table}"
        return {s.unit: s for s in (stored_unit(r, where) for r in rows)}

    def _apply_unit(
        self,
        events: list[ChangeEvent],
        held: _Held,
        unit: str,
        after: PartitionCheckpoint,
        partition: str,
    ) -> bool:
        conn = self._unit_connection()
        for event in events:
            self._ensure_table(conn, event)
        self._shared_setup(conn, partition, events)  # the group's units share the tables
        try:
            with self._transaction(conn):
                self._write_rows(conn, events, partition, unit)
                if not self._write_unit(conn, held.group, unit, after, held.token):
                    raise _Fenced  # roll the window's rows back
        except _Fenced:
            return False
        self._applied[unit] = (held.token, after)
        return True
