"""The unit-checkpoint table of consumer groups, written once for every SQL dialect.

:class:`~._unitstore_pg.PostgresUnitStore` and the replicas in group mode
(:class:`~._apply_sqlite.SqliteReplica`, :class:`~._apply_pg.PostgresReplica`)
keep the fenced checkpoints of a group's units (see
:class:`changebus.schemas.UnitStore`) in one table shape::

    group_name  text      -- the consumer group
    unit        text      -- <partition>.<bucket>
    checkpoint  text      -- PartitionCheckpoint JSON (its dict form), NULL before the first commit
    owner       text      -- the member that claimed the unit last
    generation  bigint    -- claims so far; the fencing token
    updated_at  timestamp -- wall clock of the last write (dialect type)
    fence       bigint    -- the highest claim fence (-1: none; added to older tables)
    PRIMARY KEY (group_name, unit)

The token handed out by a claim is the generation. A claim is one upsert
raising the generation (``RETURNING`` the stored checkpoint and the new
generation) unless the stored fence is higher than the claim's: then no
row comes back and the claim is refused (:func:`claim_fenced`; see
:class:`changebus.schemas.UnitStore`). A commit is ``UPDATE ... WHERE
generation = token RETURNING generation``: no row back means another member
claimed the unit since (the commit is fenced). Both statements are
single-row and atomic in either database, so two claimers never get the
same generation.

Dialects differ in the parameter placeholder and the timestamp column
(:class:`UnitTime`); the statements are built by :meth:`UnitSql.build`.
Everything here is pure (immutable values, no I/O).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from changebus.schemas import CheckpointError, FencedError, PartitionCheckpoint, StoredUnit, Unit

__all__ = [
    "DEFAULT_TABLE",
    "POSTGRES_TIME",
    "SQLITE_TIME",
    "UnitSql",
    "UnitTime",
    "checkpoint_text",
    "claim_fenced",
    "parse_checkpoint",
    "stored_unit",
]

#: the default name of the unit-checkpoint table
DEFAULT_TABLE: Final = "changebus_unit_checkpoints"


@dataclass(frozen=True, slots=True)
class UnitTime:
    """How a dialect stores ``updated_at``: column type, SQL of a ns parameter, SQL reading ns.

    ``write`` and ``read`` are templates: ``{p}`` is the placeholder, ``{c}``
    the column.
    """

    column_type: str
    write: str
    read: str


#: PostgreSQL: a ``timestamptz`` (microseconds; nanoseconds are rounded)
POSTGRES_TIME: Final = UnitTime(
    "timestamptz",
    "to_timestamp({p}::bigint / 1000000000.0)",
    "(extract(epoch FROM {c}) * 1000000)::bigint * 1000",
)
#: SQLite: nanoseconds since the epoch as an integer
SQLITE_TIME: Final = UnitTime("INTEGER", "{p}", "{c}")


@dataclass(frozen=True, slots=True)
class UnitSql:
    """The statements on one unit-checkpoint table in one dialect.

    * ``create`` -- the table when missing (no parameters);
    * ``add_fence`` -- the ``fence`` column, to a table made by an older version
      (run when the column is missing);
    * ``claim`` -- (group, unit, owner, fence, now_ns) -> one row (checkpoint,
      generation), none when the claim is fenced;
    * ``commit`` -- (checkpoint, now_ns, group, unit, token) -> one row (generation)
      when written, none when fenced;
    * ``read`` -- (group,) -> rows (unit, checkpoint, owner, generation, updated_ns, fence).
    """

    create: str
    add_fence: str
    claim: str
    commit: str
    read: str

    @classmethod
    def build(cls, table: str, placeholder: str, time: UnitTime) -> UnitSql:
        """The statements on ``table`` (already quoted) with the dialect's placeholder."""
        p = placeholder
        now = time.write.format(p=p)
        return cls(
            create=(
                f"CREATE TABLE IF NOT EXISTS {table} ("
                "group_name text NOT NULL, unit text NOT NULL, checkpoint text,"
                " owner text NOT NULL, generation bigint NOT NULL,"
                f" updated_at {time.column_type} NOT NULL,"
                " fence bigint NOT NULL DEFAULT -1,"
                " PRIMARY KEY (group_name, unit))"
            ),
            add_fence=f"ALTER TABLE {table} ADD COLUMN fence bigint NOT NULL DEFAULT -1",
            claim=(
                f"INSERT INTO {table} AS u"
                " (group_name, unit, checkpoint, owner, generation, fence, updated_at)"
                f" VALUES ({p}, {p}, NULL, {p}, 1, {p}, {now})"
                " ON CONFLICT (group_name, unit) DO UPDATE SET owner = excluded.owner,"
                " generation = u.generation + 1, fence = excluded.fence,"
                " updated_at = excluded.updated_at WHERE u.fence <= excluded.fence"
                " RETURNING checkpoint, generation"
            ),
            commit=(
                f"UPDATE {table} SET checkpoint = {p}, updated_at = {now}"
                f" WHERE group_name = {p} AND unit = {p} AND generation = {p}"
                " RETURNING generation"
            ),
            read=(
                "SELECT unit, checkpoint, owner, generation,"
                f" {time.read.format(c='updated_at')}, fence FROM {table}"
                f" WHERE group_name = {p} ORDER BY unit"
            ),
        )


def claim_fenced(group: str, unit: Unit, owner: str, fence: int, stored: int = -1) -> FencedError:
    """The error of a claim refused by its fence (a later owner of the unit claimed it)."""
    seen = f" {stored}" if stored >= 0 else " higher"
    return FencedError(
        f"group {group}: the claim of unit {unit} by {owner} is fenced (its fence {fence},"
        f" the unit's{seen}): a later owner of the unit claimed it",
        units=frozenset({str(unit)}),
    )


def checkpoint_text(checkpoint: PartitionCheckpoint | None) -> str | None:
    """The stored form of a unit checkpoint: compact JSON of its dict form (None stays None)."""
    if checkpoint is None:
        return None
    return json.dumps(checkpoint.to_dict(), separators=(",", ":"), sort_keys=True)


def parse_checkpoint(value: Any, where: str) -> PartitionCheckpoint | None:
    """A unit checkpoint from its stored form (JSON text or its dict); CheckpointError if bad."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise CheckpointError(f"{where}: the stored checkpoint is not JSON") from None
    try:
        return PartitionCheckpoint.from_dict(value, where)
    except CheckpointError as exc:
        raise CheckpointError(f"{where}: {exc.message}") from None


def stored_unit(row: Sequence[Any], where: str) -> StoredUnit:
    """A :class:`StoredUnit` from a row of :attr:`UnitSql.read`."""
    unit, checkpoint, owner, generation, updated_ns, fence = row
    return StoredUnit(
        unit=Unit.parse(str(unit)),
        checkpoint=parse_checkpoint(checkpoint, f"{where} unit {unit}"),
        owner=str(owner),
        generation=int(generation),
        updated_ns=int(updated_ns),
        fence=int(fence),
    )
