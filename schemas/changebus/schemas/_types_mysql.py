"""MySQL / MariaDB types as Avro types.

:func:`mysql_avro_type` takes ``COLUMN_TYPE`` text (``int(10) unsigned``,
``decimal(12,2)``, ``enum('a','b')``, ...):

============================================  ====================================
MySQL / MariaDB                               Avro (type of a non-null value)
============================================  ====================================
tinyint, smallint, mediumint, int (signed);   int
tinyint..mediumint unsigned
int unsigned, bigint                          long
bigint unsigned                               bytes decimal(20, 0) (lossless)
tinyint(1)                                    int, or boolean with
                                              ``tinyint1_as_boolean=True``
decimal(p,s) / numeric                        bytes decimal(p, s)
float / double                                float / double
bit(n)                                        long, ``changebus.type: bit``
enum(...)                                     string, ``changebus.type: enum`` +
                                              ``changebus.symbols``
set(...)                                      array of string, ``changebus.type: set``
json                                          string, ``changebus.type: json``
uuid                                          string, logicalType uuid
date                                          int, logicalType date
time                                          long micros, ``changebus.type:
                                              time-micros-signed`` (-838..838 h)
datetime                                      long, logicalType local-timestamp-micros
timestamp                                     long, logicalType timestamp-micros (UTC)
year                                          int
char, varchar, *text                          string
binary, varbinary, *blob                      bytes
geometry types                                bytes, ``changebus.type: wkb``
anything else                                 string, ``changebus.type: <type>``
============================================  ====================================

Value converters for what mysql-replication delivers in another shape:
:func:`mysql_bit`, :func:`mysql_set`, :func:`mysql_uuid`,
:func:`mysql_time_micros`, :func:`mysql_unsigned_bigint`.
"""

from __future__ import annotations

import datetime
import decimal
import re
import uuid
from collections.abc import Iterable
from typing import Final

from ._table import AvroType

__all__ = [
    "mysql_avro_type",
    "mysql_bit",
    "mysql_set",
    "mysql_time_micros",
    "mysql_unsigned_bigint",
    "mysql_uuid",
]

_TYPE_RE: Final = re.compile(
    r"\s*([a-z ]+?)\s*(?:\((.*)\))?\s*((?:unsigned|signed|zerofill|\s)*)\s*", re.S
)
_QUOTED: Final = re.compile(r"'((?:[^']|'')*)'")

_SMALL_INTS: Final = {"tinyint", "smallint", "mediumint"}
_STRINGS: Final = {
    "char",
    "varchar",
    "tinytext",
    "text",
    "mediumtext",
    "longtext",
    "national char",
    "national varchar",
    "nchar",
    "nvarchar",
    "inet4",
    "inet6",
}
_BINARIES: Final = {"binary", "varbinary", "tinyblob", "blob", "mediumblob", "longblob"}
_GEOMETRY: Final = {
    "geometry",
    "point",
    "linestring",
    "polygon",
    "multipoint",
    "multilinestring",
    "multipolygon",
    "geometrycollection",
}


def _labels(mods: str) -> list[str]:
    return [m.replace("''", "'") for m in _QUOTED.findall(mods)]


def mysql_avro_type(column_type: str, *, tinyint1_as_boolean: bool = False) -> AvroType:
    """The Avro type for a MySQL/MariaDB ``COLUMN_TYPE`` (see the module docstring)."""
    m = _TYPE_RE.fullmatch(column_type.lower())
    if not m:
        return {"type": "string", "changebus.type": column_type.strip().lower()}
    base, mods, flags = m.group(1).strip(), (m.group(2) or "").strip(), m.group(3) or ""
    unsigned = "unsigned" in flags
    if base == "tinyint" and mods == "1" and tinyint1_as_boolean:
        return "boolean"
    if base in _SMALL_INTS or (base in ("int", "integer") and not unsigned):
        return "int"
    if base in ("int", "integer"):
        return "long"
    if base == "bigint":
        if unsigned:
            return {"type": "bytes", "logicalType": "decimal", "precision": 20, "scale": 0}
        return "long"
    if base in ("decimal", "numeric", "dec", "fixed"):
        parts = [int(p) for p in mods.split(",")] if mods else [10, 0]
        return {
            "type": "bytes",
            "logicalType": "decimal",
            "precision": parts[0],
            "scale": parts[1] if len(parts) > 1 else 0,
        }
    if base == "float":
        return "float"
    if base in ("double", "double precision", "real"):
        return "double"
    if base == "bit":
        return {"type": "long", "changebus.type": "bit", "changebus.bits": int(mods or 1)}
    if base == "enum":
        return {"type": "string", "changebus.type": "enum", "changebus.symbols": _labels(mods)}
    if base == "set":
        return {
            "type": "array",
            "items": "string",
            "changebus.type": "set",
            "changebus.symbols": _labels(mods),
        }
    if base == "json":
        return {"type": "string", "changebus.type": "json"}
    if base == "uuid":
        return {"type": "string", "logicalType": "uuid"}
    if base == "date":
        return {"type": "int", "logicalType": "date"}
    if base == "time":
        return {"type": "long", "changebus.type": "time-micros-signed"}
    if base == "datetime":
        return {"type": "long", "logicalType": "local-timestamp-micros"}
    if base == "timestamp":
        return {"type": "long", "logicalType": "timestamp-micros"}
    if base == "year":
        return "int"
    if base in _STRINGS:
        return "string"
    if base in _BINARIES:
        return "bytes"
    if base in _GEOMETRY:
        return {"type": "bytes", "changebus.type": "wkb"}
    return {"type": "string", "changebus.type": base}


def mysql_bit(value: str | int | bytes) -> int:
    """A BIT value (``'10101'``, raw bytes or int) as an integer."""
    if isinstance(value, int):
        return value
    if isinstance(value, bytes):
        return int.from_bytes(value, "big")
    return int(value, 2) if value else 0


def mysql_set(value: Iterable[str] | str) -> list[str]:
    """A SET value as a sorted list of its members."""
    if isinstance(value, str):
        return sorted(v for v in value.split(",") if v)
    return sorted(value)


def mysql_uuid(value: bytes | str | uuid.UUID) -> str:
    """A MariaDB UUID (16 raw bytes or text) as canonical text."""
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, bytes):
        return str(uuid.UUID(bytes=value))
    return str(uuid.UUID(value))


def mysql_time_micros(value: datetime.timedelta) -> int:
    """A TIME value (a possibly negative timedelta) in microseconds."""
    return (value.days * 86400 + value.seconds) * 1_000_000 + value.microseconds


def mysql_unsigned_bigint(value: int) -> decimal.Decimal:
    """A BIGINT UNSIGNED value for its decimal(20,0) Avro type."""
    return decimal.Decimal(value)
