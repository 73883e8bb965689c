"""Postgres binary send formats to Postgres' own text form (as ``SELECT x::text`` prints it).

Types changebus maps to an Avro ``string`` holding the value's text
(``pg_lsn``, ``bit``, ranges, geometric types, composites, ...) arrive in
binary under pgoutput ``binary 'true'``; the functions here write the text
Postgres itself prints for them, and for the element, bound and field types
inside those (a range's bounds, a composite's fields, an array's elements).

The text is Postgres 15's output with the default settings that matter:
``DateStyle = ISO``, ``IntervalStyle = postgres``, ``bytea_output = hex``,
``extra_float_digits = 1`` (shortest exact floats), and ``TimeZone = UTC``
for ``timestamptz`` (``2020-01-01 10:00:00+00``: the same instant as any other
session would print, in one fixed zone).

:data:`TEXT` holds a renderer (binary value -> text) per built-in type OID;
types built from others (ranges, composites, arrays) get theirs from
:mod:`._textcompose`, which the type resolver (:mod:`._types`) composes once
per column type. A type
without a renderer here (``money``, whose text depends on ``lc_monetary``;
the ``reg*`` types, whose text is a catalog name; extension types) is refused
where its text would be needed.

Every renderer raises ``struct.error``, ``ValueError``, ``IndexError`` or
``UnicodeDecodeError`` on a malformed value (the caller turns those into a
:class:`~changebus.schemas.CorruptEventError`).
"""

from __future__ import annotations

import datetime
import decimal
import fractions
import ipaddress
import math
import struct
import uuid
from collections.abc import Callable
from typing import Final

from changebus.schemas import pg_numeric_text

__all__ = [
    "TEXT",
    "bits",
    "char",
    "float_text",
    "interval_text",
    "numeric_value",
    "time_text",
]

Render = Callable[[bytes], str]

_I16: Final = struct.Struct(">h")
_I32: Final = struct.Struct(">i")
_U32: Final = struct.Struct(">I")
_I64: Final = struct.Struct(">q")
_U64: Final = struct.Struct(">Q")
_F32: Final = struct.Struct(">f")
_F64: Final = struct.Struct(">d")
_INT64_MAX: Final = 2**63 - 1
_INT32_MAX: Final = 2**31 - 1
#: 2000-01-01 as a proleptic Gregorian day number (date.toordinal)
_EPOCH_ORDINAL: Final = datetime.date(2000, 1, 1).toordinal()
_DAY_US: Final = 86_400_000_000
#: white space as C's isspace() sees it (the output functions' quoting rule)


def _int(s: struct.Struct) -> Render:
    return lambda b: str(s.unpack(b)[0])


def float_text(value: float, single: bool = False) -> str:
    """A float (``single``: a 32-bit ``real``) as Postgres prints it: the shortest exact
    digits, in exponent form when the decimal exponent is below -4 or at least 15
    (``real``: 6)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    if value == 0:
        return "-0" if math.copysign(1.0, value) < 0 else "0"
    sign, digit_tuple, exp = _shortest(value, single).normalize().as_tuple()
    assert isinstance(exp, int)
    digit_text = "".join(map(str, digit_tuple))
    point = len(digit_text) + exp  # the decimal point's place after the first digit
    sci = point - 1
    out = "-" if sign else ""
    if -4 <= sci < (6 if single else 15):
        if point <= 0:
            out += "0." + "0" * -point + digit_text
        elif point >= len(digit_text):
            out += digit_text + "0" * (point - len(digit_text))
        else:
            out += digit_text[:point] + "." + digit_text[point:]
        return out
    mantissa = digit_text[0] + ("." + digit_text[1:] if len(digit_text) > 1 else "")
    return f"{out}{mantissa}e{'-' if sci < 0 else '+'}{abs(sci):02d}"


def _shortest(value: float, single: bool) -> decimal.Decimal:
    """The fewest decimal digits that read back as ``value`` (a double, or with
    ``single`` a 32-bit float), the closest to it of those: Ryu's answer, as Postgres
    prints floats. A decimal lying exactly halfway to a neighbouring float reads back
    to ``value`` too but is never taken (``1.9186245869097768e+16``, not
    ``1.918624586909777e+16``)."""
    exact = fractions.Fraction(value)
    if single:
        bits = _U32.unpack(_F32.pack(value))[0]
        neighbours = [
            _F32.unpack(_U32.pack(bits + d))[0] for d in (1, -1) if bits + d <= 0xFFFFFFFF
        ]
        places = 0
    else:
        neighbours = [math.nextafter(value, math.inf), math.nextafter(value, -math.inf)]
        places = len(repr(abs(value)).split("e")[0].replace(".", "").strip("0")) - 1
    ties = {(exact + fractions.Fraction(n)) / 2 for n in neighbours if math.isfinite(n)}
    while True:
        text = f"{value:.{max(places, 0)}e}"
        try:
            back = _F32.unpack(_F32.pack(float(text)))[0] if single else float(text)
        except OverflowError:  # rounded past the float4 maximum (3.403e+38): more digits
            places += 1
            continue
        if back == value and fractions.Fraction(decimal.Decimal(text)) not in ties:
            return decimal.Decimal(text)
        places += 1


def _float4(b: bytes) -> str:
    return float_text(_F32.unpack(b)[0], single=True)


def _float8(b: bytes) -> str:
    return float_text(_F64.unpack(b)[0])


_NUMERIC_HEAD: Final = struct.Struct(">hhHh")


def numeric_value(b: bytes) -> decimal.Decimal:
    """A binary numeric as a ``Decimal`` (its display scale kept; NaN, +/-Infinity)."""
    ndigits, weight, sign, dscale = _NUMERIC_HEAD.unpack_from(b)
    if sign == 0xC000:
        return decimal.Decimal("NaN")
    if sign == 0xD000:
        return decimal.Decimal("Infinity")
    if sign == 0xF000:
        return decimal.Decimal("-Infinity")
    if sign not in (0, 0x4000) or len(b) != 8 + 2 * ndigits:
        raise ValueError(f"a numeric of sign {sign:#x} and {ndigits} digits in {len(b)} bytes")
    digits = struct.unpack_from(f">{ndigits}H", b, 8)
    text = "".join(f"{d:04d}" for d in digits)
    int_len = (weight + 1) * 4
    if int_len <= 0:
        whole, frac = "0", "0" * -int_len + text
    elif int_len >= len(text):
        whole, frac = text + "0" * (int_len - len(text)), ""
    else:
        whole, frac = text[:int_len], text[int_len:]
    whole = whole.lstrip("0") or "0"
    frac = frac[:dscale].ljust(dscale, "0")
    return decimal.Decimal(f"{'-' if sign == 0x4000 else ''}{whole}{'.' + frac if dscale else ''}")


def _numeric(b: bytes) -> str:
    return pg_numeric_text(numeric_value(b))


def char(b: bytes) -> str:
    """``"char"``: the byte; ``\\ooo`` (octal) for a byte above 0x7F, nothing for 0 (Postgres 15)."""
    (byte,) = b
    if byte == 0:
        return ""
    return chr(byte) if byte < 0x80 else f"\\{byte:03o}"


def bits(b: bytes) -> str:
    """``bit`` / ``varbit``: the bit count, then the bits from the high end of each byte."""
    (count,) = _I32.unpack_from(b)
    data = b[4:]
    if count < 0 or len(data) != (count + 7) // 8:
        raise ValueError(f"a bit string of {count} bits in {len(data)} bytes")
    return "".join(format(x, "08b") for x in data)[:count]


def _pg_lsn(b: bytes) -> str:
    (lsn,) = _U64.unpack(b)
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def _macaddr(b: bytes) -> str:
    if len(b) not in (6, 8):
        raise ValueError(f"a MAC address of {len(b)} bytes")
    return ":".join(f"{x:02x}" for x in b)


def _tid(b: bytes) -> str:
    block, offset = struct.unpack(">IH", b)
    return f"({block},{offset})"


def _snapshot(b: bytes) -> str:
    """``txid_snapshot`` / ``pg_snapshot``: ``xmin:xmax:xip,xip``."""
    (nxip,) = _I32.unpack_from(b)
    values = struct.unpack(f">{2 + nxip}Q", b[4:])
    return f"{values[0]}:{values[1]}:" + ",".join(map(str, values[2:]))


def _vector(b: bytes) -> str:
    """``int2vector`` / ``oidvector`` (array send format): the elements, space-separated."""
    ndim, _flags, elem = struct.unpack_from(">iiI", b)
    if ndim == 0:
        return ""
    if ndim != 1:
        raise ValueError(f"a {ndim}-dimensional vector")
    (count,) = _I32.unpack_from(b, 12)
    elem_struct = _I16 if elem == 21 else _U32
    out, pos = [], 20
    for _ in range(count):
        (size,) = _I32.unpack_from(b, pos)
        out.append(str(elem_struct.unpack(b[pos + 4 : pos + 4 + size])[0]))
        pos += 4 + size
    return " ".join(out)


def _bool(b: bytes) -> str:
    if b not in (b"\x00", b"\x01"):
        raise ValueError(f"a bool of {b!r}")
    return "t" if b == b"\x01" else "f"


def _bytea(b: bytes) -> str:
    return "\\x" + b.hex()


def _utf8(b: bytes) -> str:
    return b.decode()


def _jsonb(b: bytes) -> str:
    if not b or b[0] != 1:
        raise ValueError("unknown jsonb/jsonpath binary format version")
    return b[1:].decode()


def _days_text(days: int) -> str:
    """A date from days since 2000-01-01, ISO style (``0044-03-15 BC`` before year 1)."""
    if days == _INT32_MAX:
        return "infinity"
    if days == -_INT32_MAX - 1:
        return "-infinity"
    year, month, day = _civil(days + _EPOCH_ORDINAL)
    if year <= 0:
        return f"{1 - year:04d}-{month:02d}-{day:02d} BC"
    return f"{year:04d}-{month:02d}-{day:02d}"


def _civil(ordinal: int) -> tuple[int, int, int]:
    """(year, month, day) of a proleptic Gregorian day number (1 = 0001-01-01; year 0 = 1 BC)."""
    if 1 <= ordinal <= datetime.date.max.toordinal():
        d = datetime.date.fromordinal(ordinal)
        return d.year, d.month, d.day
    # outside Python's dates: shift by whole 400-year cycles (146097 days each)
    cycles = (ordinal - 1) // 146_097
    d = datetime.date.fromordinal(ordinal - cycles * 146_097)
    return d.year + 400 * cycles, d.month, d.day


def _date(b: bytes) -> str:
    return _days_text(_I32.unpack(b)[0])


def _fraction(us: int) -> str:
    """``.ffffff`` with the trailing zeros dropped (nothing for a whole second)."""
    return f".{us:06d}".rstrip("0") if us else ""


def time_text(us: int) -> str:
    """A time of day from µs since midnight (``24:00:00`` included)."""
    secs, frac = divmod(us, 1_000_000)
    mins, sec = divmod(secs, 60)
    hour, minute = divmod(mins, 60)
    return f"{hour:02d}:{minute:02d}:{sec:02d}{_fraction(frac)}"


def _time(b: bytes) -> str:
    return time_text(_I64.unpack(b)[0])


def _zone(zone_west: int) -> str:
    east = -zone_west
    hh, rem = divmod(abs(east), 3600)
    mm, ss = divmod(rem, 60)
    return (
        ("+" if east >= 0 else "-")
        + f"{hh:02d}"
        + (f":{mm:02d}" if mm or ss else "")
        + (f":{ss:02d}" if ss else "")
    )


def _timetz(b: bytes) -> str:
    us, zone_west = struct.unpack(">qi", b)
    return time_text(us) + _zone(zone_west)


def _timestamp_text(us: int, zone: str) -> str:
    if us == _INT64_MAX:
        return "infinity"
    if us == -_INT64_MAX - 1:
        return "-infinity"
    days, day_us = divmod(us, _DAY_US)
    date = _days_text(days)
    era = ""
    if date.endswith(" BC"):
        date, era = date[:-3], " BC"
    return f"{date} {time_text(day_us)}{zone}{era}"


def _timestamp(b: bytes) -> str:
    return _timestamp_text(_I64.unpack(b)[0], "")


def _timestamptz(b: bytes) -> str:
    return _timestamp_text(_I64.unpack(b)[0], "+00")


def interval_text(months: int, days: int, micros: int) -> str:
    """An interval as Postgres prints it with ``IntervalStyle = postgres``."""
    parts: list[str] = []
    before = False  # the last part printed was negative: a positive one gets a "+"
    year, mon = int(months / 12), months - int(months / 12) * 12  # C division: toward zero
    for value, unit in ((year, "year"), (mon, "mon"), (days, "day")):
        if value:
            parts.append(
                f"{'+' if before and value > 0 else ''}{value} {unit}" + "s" * (value != 1)
            )
            before = value < 0
    if not parts or micros:
        negative = micros < 0
        hours, rest = divmod(abs(micros), 3_600_000_000)
        minutes, rest = divmod(rest, 60_000_000)
        secs, frac = divmod(rest, 1_000_000)
        sign = "-" if negative else ("+" if before else "")
        parts.append(f"{sign}{hours:02d}:{minutes:02d}:{secs:02d}{_fraction(frac)}")
    return " ".join(parts)


def _interval(b: bytes) -> str:
    micros, days, months = struct.unpack(">qii", b)
    return interval_text(months, days, micros)


def _uuid(b: bytes) -> str:
    return str(uuid.UUID(bytes=b))


def inet_text(b: bytes, cidr: bool = False) -> str:
    """An ``inet`` / ``cidr`` binary value as Postgres prints it."""
    family, bits_, is_cidr, nb = b[0], b[1], b[2], b[3]
    raw = b[4 : 4 + nb]
    text = str(ipaddress.IPv4Address(raw)) if family == 2 else _ipv6_text(raw)
    if cidr or is_cidr or bits_ != (32 if family == 2 else 128):
        return f"{text}/{bits_}"
    return text


def _ipv6_text(raw: bytes) -> str:
    """An IPv6 address as Postgres prints it: an IPv4 address inside one (``::ffff:a.b.c.d``,
    ``::a.b.c.d``) in dotted form, which Python 3.11 does not (``::ffff:102:304``;
    review). Postgres' rule: the longest run of zero words starts the address and is
    six words long, or five followed by ``ffff``."""
    words = struct.unpack(">8H", raw)
    run = 0
    while run < 8 and words[run] == 0:
        run += 1
    longest = max(
        (len(z) for z in "".join("0" if w == 0 else "x" for w in words).split("x")), default=0
    )
    if run == longest and (run == 6 or (run == 5 and words[5] == 0xFFFF)):
        head = "::ffff:" if run == 5 else "::"
        return head + str(ipaddress.IPv4Address(raw[12:]))
    return str(ipaddress.IPv6Address(raw))


def _points(b: bytes, pos: int, count: int) -> list[str]:
    values = struct.unpack_from(f">{2 * count}d", b, pos)
    return [f"({float_text(values[2 * i])},{float_text(values[2 * i + 1])})" for i in range(count)]


def _point(b: bytes) -> str:
    if len(b) != 16:
        raise ValueError(f"a point of {len(b)} bytes")
    return _points(b, 0, 1)[0]


def _line(b: bytes) -> str:
    return "{" + ",".join(float_text(v) for v in struct.unpack(">3d", b)) + "}"


def _lseg(b: bytes) -> str:
    if len(b) != 32:
        raise ValueError(f"a line segment of {len(b)} bytes")
    return "[" + ",".join(_points(b, 0, 2)) + "]"


def _box(b: bytes) -> str:
    if len(b) != 32:
        raise ValueError(f"a box of {len(b)} bytes")
    return ",".join(_points(b, 0, 2))  # high corner, then low corner: as Postgres prints it


def _path(b: bytes) -> str:
    closed = b[0]
    (count,) = _I32.unpack_from(b, 1)
    if len(b) != 5 + 16 * count:
        raise ValueError(f"a path of {count} points in {len(b)} bytes")
    inner = ",".join(_points(b, 5, count))
    return f"({inner})" if closed else f"[{inner}]"


def _polygon(b: bytes) -> str:
    (count,) = _I32.unpack_from(b)
    if len(b) != 4 + 16 * count:
        raise ValueError(f"a polygon of {count} points in {len(b)} bytes")
    return "(" + ",".join(_points(b, 4, count)) + ")"


def _circle(b: bytes) -> str:
    x, y, r = struct.unpack(">3d", b)
    return f"<({float_text(x)},{float_text(y)}),{float_text(r)}>"


def _tsvector(b: bytes) -> str:
    """``'lexeme':1A,2 'other'``: lexemes quoted (``'`` and ``\\`` doubled), positions
    with their weight letter (D, the default, is not printed)."""
    (count,) = _I32.unpack_from(b)
    pos, out = 4, []
    for _ in range(count):
        end = b.index(b"\x00", pos)
        lexeme = b[pos:end].decode().replace("\\", "\\\\").replace("'", "''")
        (npos,) = struct.unpack_from(">H", b, end + 1)
        entries = struct.unpack_from(f">{npos}H", b, end + 3)
        pos = end + 3 + 2 * npos
        text = f"'{lexeme}'"
        if npos:
            text += ":" + ",".join(
                f"{e & 0x3FFF}{'DCBA'[e >> 14] if e >> 14 else ''}" for e in entries
            )
        out.append(text)
    if pos != len(b):
        raise ValueError("trailing bytes after a tsvector")
    return " ".join(out)


#: text renderers of built-in types, by type OID
TEXT: Final[dict[int, Render]] = {
    16: _bool, 17: _bytea, 18: char, 19: _utf8, 20: _int(_I64), 21: _int(_I16), 22: _vector,
    23: _int(_I32), 25: _utf8, 26: _int(_U32), 27: _tid, 28: _int(_U32), 29: _int(_U32),
    30: _vector, 114: _utf8, 142: _utf8, 600: _point, 601: _lseg, 602: _path, 603: _box,
    604: _polygon, 628: _line, 650: lambda b: inet_text(b, cidr=True), 700: _float4,
    701: _float8, 718: _circle, 774: _macaddr, 829: _macaddr, 869: inet_text, 1042: _utf8,
    1043: _utf8, 1082: _date, 1083: _time, 1114: _timestamp, 1184: _timestamptz,
    1186: _interval, 1266: _timetz, 1560: bits, 1562: bits, 1700: _numeric, 1790: _utf8,
    2950: _uuid, 2970: _snapshot, 3220: _pg_lsn, 3614: _tsvector, 3802: _jsonb, 4072: _jsonb,
    5038: _snapshot, 5069: _int(_U64),
}  # fmt: skip
