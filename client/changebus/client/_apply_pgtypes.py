"""Column types of the PostgreSQL replica when a source column's type changes.

A source that widens a column (``numeric(10,2)`` to ``numeric(12,4)``,
``integer`` to ``bigint``, anything to ``text``) sends values the replica's
old column cannot hold: numerics were rounded to the old scale without a
word, and integers out of range failed every retry. The replica's column
type follows the source's, but only ever **widens**: the type it gets is
the *join* of its present type and the new one (:func:`join`), the
narrowest type that holds the values of both. Windows of an older schema
version (a bootstrap's snapshot rows keep the version they were written
with) therefore never narrow a column back, whatever order they come in.

Types are compared in ``format_type`` spelling (what the catalog says):
:func:`canonical` turns the replica's own type names into it. Only the
types the replica itself creates are changed: a column an operator gave
another type (``varchar(255)``, ``timestamp(3) with time zone``, ``json``)
is left as it is, and so is a timestamp with or without time zone against
the other (the conversion would read the values in the session's zone).

Pure functions; thread-safe.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["FLOAT_TYPES", "canonical", "join"]

#: the replica's type names whose ``format_type`` spelling differs
_SPELLING: Final = {
    "timestamptz": "timestamp with time zone",
    "timestamp": "timestamp without time zone",
    "time": "time without time zone",
}
_NUMERIC: Final = re.compile(r"numeric\((\d+),(\d+)\)")
#: integer digits each integer type needs in a numeric
_INT_DIGITS: Final = {"smallint": 5, "integer": 10, "bigint": 19}
#: chains of widening: a later type holds every value of an earlier one
_CHAINS: Final = (
    ("smallint", "integer", "bigint"),
    ("real", "double precision"),
    ("date", "timestamp without time zone"),
)
#: the types the replica creates (``format_type`` spelling), besides numeric(p,s)
_OWN: Final = frozenset(
    {
        "integer",
        "bigint",
        "real",
        "double precision",
        "boolean",
        "bytea",
        "text",
        "date",
        "time without time zone",
        "timestamp with time zone",
        "timestamp without time zone",
        "uuid",
        "json",
        "jsonb",
    }
)
_FLOATS: Final = frozenset({"real", "double precision"})
#: (the float types, for the replica's widening)
FLOAT_TYPES: Final = _FLOATS
#: pairs whose column stays as it is: timestamps (module docstring); json against jsonb
#: (replicas made before 2026-12-01 have jsonb for a source's json: no rewrite of them)
_KEEP: Final = (
    frozenset({"timestamp with time zone", "timestamp without time zone"}),
    frozenset({"json", "jsonb"}),
)
#: the largest precision of a numeric type modifier
_MAX_PRECISION: Final = 1000


def canonical(type_name: str) -> str:
    """``type_name`` (the replica's spelling) as ``format_type`` spells it."""
    return _SPELLING.get(type_name, type_name)


def _own(type_name: str) -> bool:
    """Whether the replica creates columns of this type."""
    return type_name in _OWN or _NUMERIC.fullmatch(type_name) is not None


def _numeric(type_name: str) -> tuple[int, int] | None:
    """``(integer digits, scale)`` of a numeric type, or of an integer type as one."""
    m = _NUMERIC.fullmatch(type_name)
    if m is not None:
        precision, scale = int(m[1]), int(m[2])
        return precision - scale, scale
    digits = _INT_DIGITS.get(type_name)
    return (digits, 0) if digits is not None else None


def join(have: str, new: str) -> str:
    """The narrowest type holding the values of both (``format_type`` spellings).

    ``have`` when it holds ``new``'s values already (then nothing changes),
    and when it is not a type the replica creates or both are timestamps
    (module docstring); ``text`` when no other type holds both (every value
    has a text form).
    """
    if have == new or have == "text" or not _own(have) or {have, new} in _KEEP:
        return have
    if new == "text":
        return new
    for chain in _CHAINS:
        if have in chain and new in chain:
            return max(have, new, key=chain.index)
    a, b = _numeric(have), _numeric(new)
    if (have in _FLOATS and b is not None) or (new in _FLOATS and a is not None):
        return "numeric"  # (holds floats and integers or decimals exactly)
    if a is not None and b is not None:
        if have == "numeric" or new == "numeric":
            return "numeric"
        digits, scale = max(a[0], b[0]), max(a[1], b[1])
        if digits + scale > _MAX_PRECISION:
            return "numeric"
        return f"numeric({digits + scale},{scale})"
    if "numeric" in (have, new) and (a is not None or b is not None):
        return "numeric"
    return "text"
