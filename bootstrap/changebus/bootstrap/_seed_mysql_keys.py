"""Key order of MariaDB chunked snapshots: keyset comparisons and the values they bind.

One job: how a chunk's "after this key" (and a ``where`` chunk's "up to this
key") is written in SQL, so that the comparison walks the same order as
``ORDER BY`` the key columns (the primary key index):

* :func:`compare_sql` -- a row constructor ``(k1, k2) > (%s, %s)`` or the
  expanded ``k1 > a OR (k1 = a AND k2 > b)`` form;
* :func:`enum_keys` -- ENUM key columns, whose labels must be bound as their
  numbers (an ENUM sorts by position but compares with a string by text);
  SET keys are refused;
* :func:`plain_key_type` -- whether a key column's JSON value is its Avro
  value (then the keys a ``keys`` snapshot asked for and the source lacks can
  be reported).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from changebus.schemas import SourceConfigError, TableSchema

__all__ = ["compare_sql", "enum_keys", "plain_key_type"]

#: key column types whose JSON value is the Avro value (absent keys can be reported)
_PLAIN_KEY_TYPES: Final = ("int", "long", "string")


def compare_sql(columns: Sequence[str], op: str, row_form: bool) -> tuple[str, tuple[int, ...]]:
    """SQL comparing the (quoted) ``columns`` with key values in key order, lexicographically.

    ``op`` is ``>`` or ``<=``. Returns the condition and, per ``%s`` in it,
    the index of the key value it takes. ``row_form``: a row constructor,
    else the expanded ``k1 > a OR (k1 = a AND k2 > b)`` form.
    """
    n = len(columns)
    if n == 1:
        return f"{columns[0]} {op} %s", (0,)
    if row_form:
        return f"({', '.join(columns)}) {op} ({', '.join(['%s'] * n)})", tuple(range(n))
    terms: list[str] = []
    at: list[int] = []
    for i in range(n):
        last_op = op if i == n - 1 else op[0]  # strict on every column but the last
        parts = [f"{columns[j]} = %s" for j in range(i)] + [f"{columns[i]} {last_op} %s"]
        terms.append("(" + " AND ".join(parts) + ")")
        at.extend(range(i + 1))
    return "(" + " OR ".join(terms) + ")", tuple(at)


def plain_key_type(avro: Any) -> bool:
    """Whether a key column's JSON value is its Avro value (int, long, string, uuid)."""
    if isinstance(avro, str):
        return avro in _PLAIN_KEY_TYPES
    return isinstance(avro, dict) and avro.get("logicalType") == "uuid"


def enum_keys(schema: TableSchema) -> dict[int, list[str]]:
    """Key column position -> its ENUM labels in definition order (ENUM keys only).

    A SET key is refused: it sorts by its bit mask, which a cursor of labels
    cannot be compared with reliably.
    """
    columns = {c.name: c for c in schema.columns}
    out: dict[int, list[str]] = {}
    for i, name in enumerate(schema.key):
        avro = columns[name].type
        if not isinstance(avro, dict):
            continue
        kind = avro.get("changebus.type")
        if kind == "enum":
            out[i] = [str(x) for x in avro.get("changebus.symbols", ())]
        elif kind == "set":
            raise SourceConfigError(
                f"table {schema.name}: key column {name} is a SET, which a snapshot cannot "
                "read in key order; give the table another primary key to snapshot it"
            )
    return out
