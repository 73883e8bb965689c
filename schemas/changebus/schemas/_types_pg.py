"""Postgres types as Avro types.

:func:`pg_avro_type` takes ``format_type(oid, typmod)`` text (domains already
resolved to their base type by the caller; enums with their labels):

==============================  ================================================
Postgres                        Avro (type of a non-null value)
==============================  ================================================
smallint, integer               int
bigint, oid                     long
real / double precision         float / double
numeric(p,s)                    bytes, logicalType decimal(p, s)
numeric (no typmod)             string, ``changebus.type: numeric`` (lossless,
                                also NaN and Infinity)
boolean                         boolean
text, varchar, char, name,      string
citext
bytea                           bytes
date                            int, logicalType date
time                            long, logicalType time-micros (``24:00:00``
                                is 86400000000, the end of the day)
time with time zone             string, ``changebus.type: timetz``
timestamp                       long, logicalType local-timestamp-micros
timestamp with time zone        long, logicalType timestamp-micros (UTC)
interval                        record changebus.Interval {months: int,
                                days: int, micros: long}
uuid                            string, logicalType uuid
json / jsonb                    string, ``changebus.type: json / jsonb``
enum (labels given)             string, ``changebus.type: enum`` with
                                ``changebus.symbols`` (not an Avro enum: a
                                label added later, for which Postgres sends
                                no new Relation, still encodes)
T[]                             array of ["null", T]
anything else (inet, cidr,      string, ``changebus.type: <type name>`` (the
macaddr, money, xml, pg_lsn,    value's text form, as Postgres prints it)
bit, ranges, geometric and
composite types, ...)
==============================  ================================================

Notes on the mapping:

* ``numeric(p,s)`` with a negative scale (Postgres 15+) becomes
  ``decimal(p - s, 0)``; a scale above the precision raises the precision
  to the scale (Avro requires ``scale <= precision``).
* ``interval`` with a field restriction or precision (``interval year to
  month``, ``interval(3)``) maps like ``interval``.
* ``format_type`` prints ``T[]`` whatever the number of dimensions; the
  mapping describes one-dimensional arrays (nested lists do not fit).

Python values fastavro takes directly, per Avro type:

==============================  ================================================
Avro type                       Python value
==============================  ================================================
int / long                      ``int``
float / double                  ``float`` (float: rounded to 32 bits)
decimal(p, s)                   ``decimal.Decimal`` with at most ``s`` places
string, uuid                    ``str`` (uuid: also ``uuid.UUID``)
bytes                           ``bytes``
boolean                         ``bool``
date                            ``datetime.date``
time-micros                     ``datetime.time`` (naive)
local-timestamp-micros          naive ``datetime.datetime``
timestamp-micros                *aware* ``datetime.datetime`` (fastavro takes a
                                naive one as process-local time)
changebus.Interval              ``{"months": int, "days": int, "micros": int}``
array                           ``list`` (``None`` for NULL elements)
==============================  ================================================

Converters for the rest: :func:`pg_numeric_text` (unconstrained numeric, a
``Decimal`` including NaN/Infinity, to its text) and :func:`pg_interval`
(interval parts to the record). Values read back: fastavro returns
``uuid.UUID`` for uuid, aware UTC datetimes for timestamp-micros.
"""

from __future__ import annotations

import copy
import decimal
import re
from collections.abc import Sequence
from typing import Any, Final

from ._table import AvroType

__all__ = ["INTERVAL_SCHEMA", "pg_avro_type", "pg_interval", "pg_numeric_text"]

INTERVAL_SCHEMA: Final[dict[str, Any]] = {
    "type": "record",
    "name": "Interval",
    "namespace": "changebus",
    "fields": [
        {"name": "months", "type": "int"},
        {"name": "days", "type": "int"},
        {"name": "micros", "type": "long"},
    ],
}

_SIMPLE: Final[dict[str, AvroType]] = {
    "smallint": "int",
    "integer": "int",
    "bigint": "long",
    "oid": "long",
    "real": "float",
    "double precision": "double",
    "boolean": "boolean",
    "text": "string",
    "name": "string",
    "citext": "string",
    "character varying": "string",
    "character": "string",
    '"char"': "string",
    "bpchar": "string",
    "bytea": "bytes",
    "date": {"type": "int", "logicalType": "date"},
    "time without time zone": {"type": "long", "logicalType": "time-micros"},
    "time with time zone": {"type": "string", "changebus.type": "timetz"},
    "timestamp without time zone": {"type": "long", "logicalType": "local-timestamp-micros"},
    "timestamp with time zone": {"type": "long", "logicalType": "timestamp-micros"},
    "uuid": {"type": "string", "logicalType": "uuid"},
    "json": {"type": "string", "changebus.type": "json"},
    "jsonb": {"type": "string", "changebus.type": "jsonb"},
}
# internal type names (``pg_type.typname``), should a caller pass those
for _alias, _name in {
    "int2": "smallint",
    "int4": "integer",
    "int8": "bigint",
    "float4": "real",
    "float8": "double precision",
    "bool": "boolean",
    "varchar": "character varying",
    "time": "time without time zone",
    "timetz": "time with time zone",
    "timestamp": "timestamp without time zone",
    "timestamptz": "timestamp with time zone",
}.items():
    _SIMPLE[_alias] = _SIMPLE[_name]

_MODS: Final = re.compile(r"\(([^)]*)\)")


def pg_avro_type(formatted: str, *, enum_labels: Sequence[str] | None = None) -> AvroType:
    """The Avro type for a Postgres column type (see the module docstring)."""
    text = formatted.strip()
    if text.endswith("[]"):
        return {
            "type": "array",
            "items": ["null", pg_avro_type(text[:-2].rstrip(), enum_labels=enum_labels)],
        }
    if enum_labels is not None:
        return {"type": "string", "changebus.type": "enum", "changebus.symbols": list(enum_labels)}
    mods = _MODS.search(text)
    base = _MODS.sub("", text).strip()
    base = " ".join(base.split())
    if base in ("numeric", "decimal"):
        if mods and mods.group(1).strip():
            parts = [int(p) for p in mods.group(1).split(",")]
            precision, scale = parts[0], parts[1] if len(parts) > 1 else 0
            if scale < 0:  # numeric(3,-2): multiples of 100 up to 99900
                precision, scale = precision - scale, 0
            return {
                "type": "bytes",
                "logicalType": "decimal",
                "precision": max(precision, scale, 1),
                "scale": scale,
            }
        return {"type": "string", "changebus.type": "numeric"}
    if base == "interval" or base.startswith("interval "):
        return copy.deepcopy(INTERVAL_SCHEMA)
    if base in _SIMPLE:
        return copy.deepcopy(_SIMPLE[base])
    return {"type": "string", "changebus.type": base}


def pg_numeric_text(value: decimal.Decimal | str | int | float) -> str:
    """Text of an unconstrained numeric as Postgres prints it.

    A ``Decimal`` keeps its digits and scale (``1.500`` stays ``1.500``),
    never in exponent form; NaN and +/-Infinity become ``NaN``,
    ``Infinity`` and ``-Infinity``. ``str`` is passed through, ``int`` and
    ``float`` are printed the same way.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        value = decimal.Decimal(repr(value))
    elif isinstance(value, int):
        return str(value)
    if value.is_nan():
        return "NaN"
    if value.is_infinite():
        return "Infinity" if value > 0 else "-Infinity"
    return format(value, "f")


def pg_interval(months: int, days: int, micros: int) -> dict[str, int]:
    """An interval as the ``changebus.Interval`` record.

    Postgres keeps months, days and microseconds apart (a month is not 30
    days, a day not always 24 hours), so all three are kept.
    """
    return {"months": months, "days": days, "micros": micros}
