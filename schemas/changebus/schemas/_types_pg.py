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
time                            long, logicalType time-micros
time with time zone             string, ``changebus.type: timetz``
timestamp                       long, logicalType local-timestamp-micros
timestamp with time zone        long, logicalType timestamp-micros (UTC)
interval                        record changebus.Interval {months: int,
                                days: int, micros: long}
uuid                            string, logicalType uuid
json / jsonb                    string, ``changebus.type: json / jsonb``
enum                            string, ``changebus.type: enum`` with
                                ``changebus.symbols`` (new labels need no new
                                schema version)
T[]                             array of ["null", T]
anything else (inet, cidr,      string, ``changebus.type: <type name>`` (the
macaddr, money, xml, ...)       value's text form)
==============================  ================================================

Values: fastavro takes ``int``, ``float``, ``Decimal``, ``bool``, ``str``,
``bytes``, ``datetime.date``, ``datetime.time``, ``datetime.datetime`` (naive
for local timestamps, aware for UTC ones) and ``uuid.UUID`` directly. The
converters below cover the rest: :func:`pg_numeric_text` for unconstrained
numerics and :func:`pg_interval` for intervals.
"""

from __future__ import annotations

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
    if base == "numeric" or base == "decimal":
        if mods and mods.group(1).strip():
            parts = [int(p) for p in mods.group(1).split(",")]
            precision, scale = parts[0], parts[1] if len(parts) > 1 else 0
            return {
                "type": "bytes",
                "logicalType": "decimal",
                "precision": precision,
                "scale": max(scale, 0),
            }
        return {"type": "string", "changebus.type": "numeric"}
    if base == "interval":
        return INTERVAL_SCHEMA
    if base in _SIMPLE:
        return _SIMPLE[base]
    return {"type": "string", "changebus.type": base}


def pg_numeric_text(value: decimal.Decimal | str | int | float) -> str:
    """Text of an unconstrained numeric (keeps NaN and +/-Infinity)."""
    if isinstance(value, decimal.Decimal):
        if value.is_nan():
            return "NaN"
        if value.is_infinite():
            return "Infinity" if value > 0 else "-Infinity"
    return str(value)


def pg_interval(months: int, days: int, micros: int) -> dict[str, int]:
    """An interval value as its three independent Postgres parts."""
    return {"months": months, "days": days, "micros": micros}
