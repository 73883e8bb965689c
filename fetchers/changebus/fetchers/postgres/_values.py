"""Postgres binary send formats to Python values (for pgoutput ``binary 'true'``).

:func:`decode_value` turns one tuple cell into the Python value the Avro
mapping of :mod:`changebus.schemas` expects for its type:

================================  ==========================================
type                              value
================================  ==========================================
int2, int4, int8, oid             int
float4, float8                    float
numeric                           Decimal (NaN, +/-Infinity included)
bool                              bool
text, varchar, bpchar, name,      str
xml, enum labels
bytea                             bytes
date                              datetime.date (+/-infinity: date.max/min);
                                  int days since 1970-01-01 outside
                                  Python's years 1-9999 (BC, 10000+)
time                              datetime.time; 24:00:00 as the int
                                  86400000000 (µs since midnight: the
                                  Avro time-micros value itself)
timetz                            str, ``HH:MM:SS[.ffffff]+HH[:MM]``
                                  (``24:00:00+HH`` for the end of the day)
timestamp                         naive datetime (+/-infinity: max/min);
                                  int µs since 1970-01-01 outside years
                                  1-9999, :data:`OUT_OF_RANGE` beyond an
                                  Avro long (after 294247-01-10)
timestamptz                       aware datetime in UTC (the same rules)
interval                          {"months", "days", "micros"}
uuid                              uuid.UUID
json, jsonb                       str (the JSON text)
inet, cidr                        str, as Postgres prints it
macaddr                           str ``08:00:2b:01:02:03``
money                             str with the decimals of the database's
                                  ``lc_monetary`` (:func:`money_decoder`)
"char", pg_lsn, xid, xid8, cid,   str, Postgres' own text form (:mod:`._pgtext`):
tid, macaddr8, bit, varbit,       ``\\351`` ("char" above 0x7F, Postgres 15),
int2vector, oidvector,            ``16/B374D848``, ``1010``, ``1 2 3``,
pg_snapshot, txid_snapshot,       ``(1.5,2)``, ``'a':1A 'b'``, ``[1,5)``,
point, line, lseg, box, path,     ``{[1,3),[5,7)}``; timestamps in ranges
polygon, circle, tsvector,        as ``2020-01-01 10:00:00+00`` (UTC)
jsonpath, the built-in ranges
and multiranges
arrays of any of these            list (nested lists for more dimensions)
================================  ==========================================

The ints are the Avro values themselves (fastavro writes ints of a ``date``,
``time-micros`` or ``timestamp-micros`` type unchanged), computed from
Postgres' binary value (days or µs since 2000-01-01) without Python date
objects.

Other range types, multiranges and composite types get their text form from
decoders the type resolver composes (:mod:`._types`, :mod:`._textcompose`);
it gives every column its own decoder and refuses, once per table, a type
none fits. Cells in text format (a ``str``) are returned as the text itself.
:func:`decode_value` decodes OIDs without a decoder here as UTF-8 text: only
right for types that send their text (enums); the resolver never relies on it.
Domains must be resolved to their base type by the caller.
"""

from __future__ import annotations

import datetime
import decimal
import struct
import uuid
from collections.abc import Callable
from typing import Any, Final

from changebus.schemas import CorruptEventError

from . import _pgtext as pgtext, _textcompose as textcompose
from ._pgoutput import UNCHANGED, Cell
from ._pgtext import inet_text, numeric_value, time_text

__all__ = [
    "DECODERS",
    "OUT_OF_RANGE",
    "TEXT_FORMS",
    "TEXT_FORM_OIDS",
    "TYPE_OIDS",
    "array_decoder",
    "contains_out_of_range",
    "decode_value",
    "money_decoder",
    "non_finite",
]

_EPOCH_DATE: Final = datetime.date(2000, 1, 1)
_EPOCH_TS: Final = datetime.datetime(2000, 1, 1)
_EPOCH_TSZ: Final = datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC)
_INT32_MAX: Final = 2**31 - 1
_INT64_MAX: Final = 2**63 - 1
_PG_EPOCH_DAYS: Final = 10_957  # 1970-01-01 -> 2000-01-01
_PG_EPOCH_US: Final = _PG_EPOCH_DAYS * 86_400_000_000
#: Postgres days / microseconds (since 2000-01-01) that Python's date and datetime hold
_DAY_MIN: Final = -730_119  # 0001-01-01
_DAY_MAX: Final = 2_921_939  # 9999-12-31
_US_MIN: Final = _DAY_MIN * 86_400_000_000
_US_MAX: Final = (_DAY_MAX + 1) * 86_400_000_000 - 1
_DAY_US: Final = 86_400_000_000


class _OutOfRange:
    """The type of :data:`OUT_OF_RANGE`."""

    def __repr__(self) -> str:
        return "OUT_OF_RANGE"


#: a timestamp an Avro long cannot hold (after 294247-01-10 UTC): sent as not-sent
OUT_OF_RANGE: Final = _OutOfRange()


def contains_out_of_range(value: Any) -> bool:
    """True when ``value`` is :data:`OUT_OF_RANGE` or a (nested) list holding it."""
    if isinstance(value, list):
        return any(contains_out_of_range(v) for v in value)
    return value is OUT_OF_RANGE


def non_finite(value: Any) -> bool:
    """True when ``value`` is a NaN or infinite ``Decimal``, or a (nested) list holding one
    (what a ``numeric(p,s)`` column's Avro decimal cannot carry)."""
    if isinstance(value, list):
        return any(non_finite(v) for v in value)
    return isinstance(value, decimal.Decimal) and not value.is_finite()


_S_I16 = struct.Struct(">h")
_S_I32 = struct.Struct(">i")
_S_U32 = struct.Struct(">I")
_S_I64 = struct.Struct(">q")
_S_F32 = struct.Struct(">f")
_S_F64 = struct.Struct(">d")
_S_INTERVAL = struct.Struct(">qii")
_S_TIMETZ = struct.Struct(">qi")
_S_ARRAY = struct.Struct(">iiI")


def _text(b: bytes) -> str:
    return b.decode()


def _date(b: bytes) -> datetime.date | int:
    (days,) = _S_I32.unpack(b)
    if days == _INT32_MAX:
        return datetime.date.max
    if days == -_INT32_MAX - 1:
        return datetime.date.min
    if _DAY_MIN <= days <= _DAY_MAX:
        return _EPOCH_DATE + datetime.timedelta(days=days)
    # outside Python's dates (BC, after 9999): the Avro value, days since 1970-01-01
    return int(days) + _PG_EPOCH_DAYS


def _time_of_day(us: int) -> datetime.time:
    if not 0 <= us < _DAY_US:
        raise ValueError(f"a time of {us} µs")
    secs, us = divmod(us, 1_000_000)
    mins, secs = divmod(secs, 60)
    hours, mins = divmod(mins, 60)
    return datetime.time(hours, mins, secs, us)


def _time(b: bytes) -> datetime.time | int:
    us: int = _S_I64.unpack(b)[0]
    if us == _DAY_US:  # 24:00:00, the end of the day: the Avro value itself
        return us
    return _time_of_day(us)


def _timetz(b: bytes) -> str:
    us, zone_west = _S_TIMETZ.unpack(b)
    if not 0 <= us <= _DAY_US:
        raise ValueError(f"a time of {us} µs")
    t = time_text(us)  # Postgres' text, as in a composite or a range (not isoformat)
    east = -zone_west
    sign = "+" if east >= 0 else "-"
    hh, rem = divmod(abs(east), 3600)
    mm, ss = divmod(rem, 60)
    zone = f"{sign}{hh:02d}" + (f":{mm:02d}" if mm or ss else "") + (f":{ss:02d}" if ss else "")
    return t + zone


def _timestamp(b: bytes) -> datetime.datetime | int | _OutOfRange:
    (us,) = _S_I64.unpack(b)
    if us == _INT64_MAX:
        return datetime.datetime.max
    if us == -_INT64_MAX - 1:
        return datetime.datetime.min
    if _US_MIN <= us <= _US_MAX:
        return _EPOCH_TS + datetime.timedelta(microseconds=us)
    return _unix_micros(us)


def _timestamptz(b: bytes) -> datetime.datetime | int | _OutOfRange:
    (us,) = _S_I64.unpack(b)
    if us == _INT64_MAX:
        return datetime.datetime.max.replace(tzinfo=datetime.UTC)
    if us == -_INT64_MAX - 1:
        return datetime.datetime.min.replace(tzinfo=datetime.UTC)
    if _US_MIN <= us <= _US_MAX:
        return _EPOCH_TSZ + datetime.timedelta(microseconds=us)
    return _unix_micros(us)


def _unix_micros(us: int) -> int | _OutOfRange:
    """Microseconds since 2000 -> since 1970 (the Avro value), when an Avro long holds it."""
    unix = us + _PG_EPOCH_US
    return unix if -_INT64_MAX - 1 <= unix <= _INT64_MAX else OUT_OF_RANGE


def _interval(b: bytes) -> dict[str, int]:
    micros, days, months = _S_INTERVAL.unpack(b)
    return {"months": months, "days": days, "micros": micros}


def _macaddr(b: bytes) -> str:
    return ":".join(f"{x:02x}" for x in b)


def _money(b: bytes) -> str:
    (cents,) = _S_I64.unpack(b)
    return str(decimal.Decimal(cents).scaleb(-2))


def money_decoder(scale: int) -> Callable[[bytes], str]:
    """``money`` with ``scale`` decimals: Postgres keeps a count of the minor unit of
    ``lc_monetary`` (two decimals in most locales and in C, none for yen, three for
    dinars); read as if it had two, ¥1000 became ``"10.00"`` (review)."""
    if scale == 2:
        return _money

    def money(b: bytes) -> str:
        (units,) = _S_I64.unpack(b)
        return str(decimal.Decimal(units).scaleb(-scale))

    return money


def _jsonb(b: bytes) -> str:
    if not b or b[0] != 1:
        raise CorruptEventError("unknown jsonb binary format version")
    return b[1:].decode()


def array_decoder(element: Callable[[bytes], Any]) -> Callable[[bytes], list[Any]]:
    """The decoder of an array whose elements ``element`` decodes."""
    return lambda b: _array(b, element)


def _array(b: bytes, element: Callable[[bytes], Any] | None = None) -> list[Any]:
    """An array's elements as (nested) lists; ``element`` decodes one (None: by the
    element OID in the array's header)."""
    ndim, _flags, elem_oid = _S_ARRAY.unpack_from(b)
    if ndim == 0:
        return []
    pos = 12
    dims = []
    for _ in range(ndim):
        length, _lbound = struct.unpack_from(">ii", b, pos)
        dims.append(length)
        pos += 8
    decode = element or DECODERS.get(elem_oid, _text)
    flat: list[Any] = []
    total = 1
    for d in dims:
        total *= d
    for _ in range(total):
        (size,) = _S_I32.unpack_from(b, pos)
        pos += 4
        if size < 0:
            flat.append(None)
        else:
            value = b[pos : pos + size]
            if len(value) != size:
                raise ValueError("an array element past the value's end")
            flat.append(decode(value))
            pos += size
    if pos != len(b):
        raise ValueError("trailing bytes after an array")
    return _nest(flat, dims)


def _nest(flat: list[Any], dims: list[int]) -> list[Any]:
    if len(dims) == 1:
        return flat
    step = len(flat) // dims[0]
    return [_nest(flat[i * step : (i + 1) * step], dims[1:]) for i in range(dims[0])]


#: well-known type OIDs (pg_type) by name
TYPE_OIDS: Final = {
    "bool": 16, "bytea": 17, "char": 18, "name": 19, "int8": 20, "int2": 21, "int4": 23,
    "text": 25, "oid": 26, "json": 114, "xml": 142, "cidr": 650, "float4": 700, "float8": 701,
    "money": 790, "macaddr": 829, "inet": 869, "bpchar": 1042, "varchar": 1043, "date": 1082,
    "time": 1083, "timestamp": 1114, "timestamptz": 1184, "interval": 1186, "timetz": 1266,
    "numeric": 1700, "uuid": 2950, "jsonb": 3802,
}  # fmt: skip

#: binary decoders by type OID (any other OID is decoded as UTF-8 text)
DECODERS: Final[dict[int, Callable[[bytes], Any]]] = {
    16: lambda b: b == b"\x01",
    17: bytes,
    18: pgtext.char,
    19: _text,
    20: lambda b: _S_I64.unpack(b)[0],
    21: lambda b: _S_I16.unpack(b)[0],
    23: lambda b: _S_I32.unpack(b)[0],
    25: _text,
    26: lambda b: _S_U32.unpack(b)[0],
    114: _text,
    142: _text,
    650: lambda b: inet_text(b, cidr=True),
    700: lambda b: _S_F32.unpack(b)[0],
    701: lambda b: _S_F64.unpack(b)[0],
    790: _money,
    829: _macaddr,
    869: inet_text,
    1042: _text,
    1043: _text,
    1082: _date,
    1083: _time,
    1114: _timestamp,
    1184: _timestamptz,
    1186: _interval,
    1266: _timetz,
    1700: numeric_value,
    2950: lambda b: uuid.UUID(bytes=b),
    3802: _jsonb,
}
#: types mapped to their text form (:mod:`._pgtext`): ``int2vector`` and ``oidvector``,
#: ``tid``, ``xid``, ``cid``, ``xid8``, geometric types, ``macaddr8``, ``bit``,
#: ``varbit``, snapshots, ``pg_lsn``, ``tsvector``, ``jsonpath``, built-in (multi)ranges
TEXT_FORM_OIDS: Final = frozenset(
    {22, 27, 28, 29, 30, 600, 601, 602, 603, 604, 628, 718, 774, 1560, 1562, 2970, 3220, 3614,
     4072, 5038, 5069, *textcompose.BUILTIN}
)  # fmt: skip
#: Postgres' text form of the built-in types that have one, by type OID
TEXT_FORMS: Final[dict[int, Callable[[bytes], str]]] = {**pgtext.TEXT, **textcompose.BUILTIN}
DECODERS.update((oid, TEXT_FORMS[oid]) for oid in TEXT_FORM_OIDS)
# arrays: the array's element OID is in its binary header
_ARRAY_OIDS: Final = frozenset(
    {1000, 1001, 1002, 1003, 1005, 1007, 1009, 1014, 1015, 1016, 1021, 1022, 1028, 1040, 1041,
     651, 791, 1115, 1182, 1183, 1185, 1187, 1231, 1270, 2951, 3807, 199, 143}
)  # fmt: skip


def decode_value(type_oid: int, cell: Cell, *, is_array: bool = False) -> Any:
    """The Python value of one cell (see the module docstring).

    ``is_array`` marks a column whose type is an array type with an OID not in
    the built-in list (arrays of enums or domains); NULL and UNCHANGED cells
    are returned as they are.
    """
    if cell is None or cell is UNCHANGED or isinstance(cell, str):
        return cell
    assert isinstance(cell, bytes)
    try:
        if is_array or type_oid in _ARRAY_OIDS:
            return _array(cell)
        return DECODERS.get(type_oid, _text)(cell)
    except (
        struct.error,
        ValueError,
        IndexError,
        UnicodeDecodeError,
        decimal.InvalidOperation,
    ) as exc:
        raise CorruptEventError(f"cannot decode a value of type oid {type_oid}: {exc}") from exc
