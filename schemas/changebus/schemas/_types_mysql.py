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

How mysql-replication 1.0 (``binlog_row_metadata=FULL``) delivers values,
and what fastavro needs:

==================  ==========================  ===============================
column              mysql-replication gives     for fastavro
==================  ==========================  ===============================
integers, year      ``int``                     as is
bigint unsigned     ``int`` up to 2**64-1       :func:`mysql_unsigned_bigint`
tinyint(1)          ``int``                     as is; as boolean:
                                                :func:`mysql_boolean` (in a
                                                nullable union fastavro takes
                                                only a real ``bool``)
decimal             ``Decimal``                 as is
float               ``float`` (widened float32) as is (exact in Avro float)
double              ``float``                   as is
bit(n)              ``str`` like ``'10101'``    :func:`mysql_bit`
enum                ``str``                     as is
set                 ``set`` of ``str``          :func:`mysql_set`
json                ``str`` (MariaDB) or parsed :func:`mysql_json`
                    JSON (MySQL)
uuid (MariaDB)      16 raw ``bytes``            :func:`mysql_uuid`
date                ``datetime.date``           as is
time                ``datetime.timedelta``      :func:`mysql_time_micros`
datetime            naive ``datetime``          as is
timestamp           naive ``datetime`` in UTC   :func:`mysql_timestamp` (fastavro
                                                takes a naive datetime as
                                                process-local time)
strings             ``str``                     as is
binary, blob        ``bytes``                   as is
geometry            ``bytes``                   as is (MySQL's internal form:
                                                4-byte SRID, then WKB)
==================  ==========================  ===============================

Values read back: fastavro returns ``Decimal`` for decimals (bigint unsigned
too), ``uuid.UUID`` for uuid, aware UTC datetimes for timestamps, ``int``
microseconds for time.
"""

from __future__ import annotations

import datetime
import decimal
import json
import re
import uuid
from collections.abc import Iterable
from typing import Any, Final

from ._table import AvroType

__all__ = [
    "mysql_avro_type",
    "mysql_bit",
    "mysql_boolean",
    "mysql_json",
    "mysql_set",
    "mysql_time_micros",
    "mysql_timestamp",
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
    """A BIT value (``'10101'``, raw big-endian bytes or int) as an Avro long.

    ``bit(64)`` values with the top bit set do not fit a signed long; they
    are stored as the negative long with the same 64 bits (``v & (2**64 - 1)``
    gives the unsigned value back).
    """
    if isinstance(value, bytes):
        n = int.from_bytes(value, "big")
    elif isinstance(value, str):
        n = int(value, 2) if value else 0
    else:
        n = value
    return n - (1 << 64) if n >= 1 << 63 else n


def mysql_boolean(value: int | bool) -> bool:
    """A ``tinyint(1)`` value for its boolean mapping (any non-zero is true)."""
    return bool(value)


def mysql_set(value: Iterable[str] | str) -> list[str]:
    """A SET value (a ``set``, or the ``'a,b'`` text) as a sorted list of members."""
    if isinstance(value, str):
        return sorted(v for v in value.split(",") if v)
    return sorted(value)


def mysql_uuid(value: bytes | str | uuid.UUID) -> str:
    """A MariaDB UUID (16 raw bytes, text or ``uuid.UUID``) as canonical text."""
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, bytes):
        return str(uuid.UUID(bytes=value))
    return str(uuid.UUID(value))


#: a zero DATE (``0000-00-00``, ``2024-05-00``) in a key column has the key value
#: ``MYSQL_ZERO_DATE_KEY + (year << 9 | month << 5 | day)``: below every real date
#: (the earliest, ``0000-01-01``, is day -719528), one value per zero date
MYSQL_ZERO_DATE_KEY: Final = -(1 << 31)
#: a zero DATETIME / TIMESTAMP in a key column: ``MYSQL_ZERO_DATETIME_KEY + (packed
#: << 20 | microseconds)``, ``packed = ((year * 13 + month) << 5 | day) << 17 | hour <<
#: 12 | minute << 6 | second`` (the binlog's DATETIME2 form): below every real one
MYSQL_ZERO_DATETIME_KEY: Final = -(1 << 62)

_ZERO_DATE: Final = re.compile(
    r"(\d{1,4})-(\d{1,2})-(\d{1,2})(?:[ T](\d{1,2}):(\d{1,2}):(\d{1,2})(?:\.(\d{1,6}))?)?"
)


def mysql_zero_date_key(text: str, *, with_time: bool) -> int:
    """The key value of a zero date given as text (``2024-05-00``, ``0000-00-00
    00:00:00.5``): see :data:`MYSQL_ZERO_DATE_KEY` (``with_time`` false: a DATE) and
    :data:`MYSQL_ZERO_DATETIME_KEY`."""
    m = _ZERO_DATE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"not a MySQL date: {text!r}")
    year, month, day = int(m.group(1)), int(m.group(2)), int(m.group(3))
    if not with_time:
        return MYSQL_ZERO_DATE_KEY + (year << 9 | month << 5 | day)
    hour, minute, second = (int(m.group(g) or 0) for g in (4, 5, 6))
    micros = int((m.group(7) or "").ljust(6, "0"))
    packed = ((year * 13 + month) << 5 | day) << 17 | hour << 12 | minute << 6 | second
    return MYSQL_ZERO_DATETIME_KEY + (packed << 20 | micros)


def mysql_time_micros(value: datetime.timedelta) -> int:
    """A TIME value (a possibly negative timedelta) in microseconds."""
    return (value.days * 86400 + value.seconds) * 1_000_000 + value.microseconds


_UTC: Final = datetime.UTC


def mysql_timestamp(value: datetime.datetime) -> datetime.datetime:
    """A TIMESTAMP value (a naive datetime in UTC) made timezone-aware (UTC).

    An aware datetime is passed through.
    """
    return value.replace(tzinfo=_UTC) if value.tzinfo is None else value


def _json_text(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, dict):
        return {_json_text(k): _json_text(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_text(v) for v in value]
    return value


def mysql_json(value: Any) -> str:
    """A JSON value as its text.

    MariaDB's ``str`` (JSON is LONGTEXT there) is passed through as JSON
    text; a value MySQL's binary JSON was parsed into (dict, list, number,
    ...) is re-encoded, ``bytes`` keys and strings (as some parser versions
    give) decoded as UTF-8. A ``str`` is always taken to be JSON text.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return json.dumps(_json_text(value), ensure_ascii=False, separators=(",", ":"))


def mysql_unsigned_bigint(value: int) -> decimal.Decimal:
    """A BIGINT UNSIGNED value for its decimal(20,0) Avro type.

    A negative value (the signed reading of the same 64 bits, as a reader
    without the unsigned flag would give) is taken modulo 2**64.
    """
    return decimal.Decimal(value + (1 << 64) if value < 0 else value)
