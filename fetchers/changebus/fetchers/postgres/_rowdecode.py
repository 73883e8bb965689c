"""The general path's row decoding: pgoutput cells to the values fastavro encodes.

:func:`decode_row` decodes each cell of a row image through its column's
:class:`~._types.ColumnType` and adapter, in the Relation message's column
order (:class:`~._tables.Table`), and applies the column policy. A value
Avro cannot carry is never sent as a wrong one: an unchanged TOASTed value,
an array of other dimensions than its column declares, a timestamp past an
Avro long's microseconds and a NaN or infinity in a ``numeric(p,s)`` column
become ``None`` listed as not sent (the last three with a warning). Other
values of excluded columns are left out of the row.

A pure function: no state, safe from any thread.
"""

from __future__ import annotations

import logging
from typing import Any

from ._pgoutput import UNCHANGED, Cell
from ._tables import Table, apply_rules, depth
from ._values import OUT_OF_RANGE, contains_out_of_range, non_finite

__all__ = ["decode_row"]

log = logging.getLogger("changebus.fetchers.postgres")


def decode_row(table: Table, cells: tuple[Cell, ...]) -> tuple[dict[str, Any], list[str]]:
    """The row of ``cells`` by column name, and the names of the columns not sent."""
    row: dict[str, Any] = {}
    not_sent: list[str] = []
    for name, ctype, adapt, cell in zip(
        table.names, table.types, table.adapters, cells, strict=True
    ):
        if cell is UNCHANGED:
            row[name] = None
            not_sent.append(name)
            continue
        if name in table.excluded:
            continue
        value = ctype.decode(cell)
        if ctype.is_array and value and depth(value) != ctype.dims:
            # Postgres does not enforce declared dimensions; Avro types do
            log.warning(
                "%s.%s holds a %d-dimensional array in a column declared with %d; sent as not-sent",
                table.schema.name,
                name,
                depth(value),
                ctype.dims,
            )
            row[name] = None
            not_sent.append(name)
            continue
        if value is OUT_OF_RANGE or (ctype.is_array and contains_out_of_range(value)):
            log.warning(
                "%s.%s holds a timestamp after 294247-01-10, beyond an Avro long's "
                "microseconds; sent as not-sent",
                table.schema.name,
                name,
            )
            row[name] = None
            not_sent.append(name)
            continue
        if adapt is None and non_finite(value):
            # NaN/Infinity in a numeric(p,s) column (or numeric(p,s)[] element): Avro's
            # decimal cannot hold it
            log.warning(
                "%s.%s holds %s, which numeric(p,s) maps cannot carry; sent as not-sent",
                table.schema.name,
                name,
                value,
            )
            row[name] = None
            not_sent.append(name)
            continue
        row[name] = value if adapt is None or value is None else adapt(value)
    if table.rules is not None:
        apply_rules(table.names, table.rules, row, not_sent)
    return row, not_sent
