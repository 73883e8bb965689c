"""What a table looks like in the binlog: column type codes and the layout records.

With ``binlog_row_metadata=FULL`` every TABLE_MAP event describes the table
as it was when the rows that follow were written: column names, binlog
types with their metadata (lengths, precision, fractional seconds),
signedness, character sets, enum and set labels, nullability and the
primary key. A :class:`TableLayout` holds one such description
(:func:`._layout.layout_from_table_map` builds it); the code generators
(:mod:`._decoder`, :mod:`._transcoder`) compile a layout into a function
that reads its row images.

Layouts are immutable and may be shared between threads (and pickled to
decode workers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from changebus.schemas import AvroType, Column, TableSchema

from .._policy import ColumnPolicy, ColumnRule, TablePlan

__all__ = ["ColumnLayout", "TableLayout", "base_type"]

# binlog column type codes (MySQL's enum_field_types)
T_DECIMAL, T_TINY, T_SHORT, T_LONG, T_FLOAT, T_DOUBLE = 0, 1, 2, 3, 4, 5
T_TIMESTAMP, T_LONGLONG, T_INT24, T_DATE, T_TIME, T_DATETIME, T_YEAR = 7, 8, 9, 10, 11, 12, 13
T_VARCHAR, T_BIT, T_TIMESTAMP2, T_DATETIME2, T_TIME2 = 15, 16, 17, 18, 19
T_JSON, T_NEWDECIMAL, T_ENUM, T_SET = 245, 246, 247, 248
T_TINY_BLOB, T_MEDIUM_BLOB, T_LONG_BLOB, T_BLOB = 249, 250, 251, 252
T_VAR_STRING, T_STRING, T_GEOMETRY = 253, 254, 255

_DECLARED: Final = re.compile(r"\s*([a-z0-9_ ]+?)\s*(?:\(|$| unsigned| signed| zerofill)")


@dataclass(frozen=True, slots=True)
class ColumnLayout:
    """One column as the binlog describes it, plus its declared type when known.

    ``meta`` holds the type's binlog metadata: ``length`` (bytes of a
    length prefix, or the maximum byte length of a char/binary column),
    ``fsp``, ``precision``/``scale``, ``bits``, ``size`` (enum/set bytes).
    ``codec`` is the Python codec of a text column, ``""`` for binary data.
    """

    name: str
    binlog_type: int
    nullable: bool
    unsigned: bool
    codec: str
    labels: tuple[str, ...]
    meta: tuple[tuple[str, int], ...]
    source_type: str
    avro: AvroType

    def m(self, key: str) -> int:
        return dict(self.meta)[key]


@dataclass(frozen=True, slots=True)
class TableLayout:
    """The layout of one table at one binlog position (see the module docstring).

    ``plan`` -- the column policy applied to the table (None: none): the
    table schema's columns and a rule per column, which the generated code
    applies (:mod:`changebus.fetchers._policy`). Set by :meth:`with_policy`.
    """

    database: str
    table: str
    columns: tuple[ColumnLayout, ...]
    key: tuple[str, ...]
    plan: TablePlan | None = None

    @property
    def name(self) -> str:
        return f"{self.database}.{self.table}"

    @property
    def rules(self) -> tuple[ColumnRule | None, ...]:
        """The policy's rule per column (all None without a policy)."""
        return self.plan.rules if self.plan is not None else (None,) * len(self.columns)

    def source_columns(self) -> tuple[Column, ...]:
        """The columns as the source has them (before any policy)."""
        return tuple(
            Column(c.name, c.avro, nullable=c.nullable, source_type=c.source_type)
            for c in self.columns
        )

    def with_policy(self, policy: ColumnPolicy | None) -> TableLayout:
        """This layout with ``policy`` applied (itself when no policy names the table).

        Raises :class:`~changebus.schemas.SourceConfigError` for a policy the
        table refuses (an excluded or truncated key column, ...).
        """
        if not policy:
            return self
        plan = policy.plan(self.name, self.source_columns(), self.key)
        if plan is None:
            return self
        return TableLayout(self.database, self.table, self.columns, self.key, plan)

    def table_schema(self) -> TableSchema:
        columns = self.plan.columns if self.plan is not None else self.source_columns()
        return TableSchema(self.name, columns, self.key)


def base_type(declared: str) -> str:
    """The base name of a declared type text (``"decimal(10,2) unsigned"`` -> ``"decimal"``)."""
    m = _DECLARED.match(declared.lower())
    return m.group(1).strip() if m else ""
