"""Value codecs of binlog row images: MySQL's packed forms in, Python values or Avro bytes out.

Readers of the binlog's binary forms (decimal2bin, TIME2, DATETIME2, DATE,
BIT, ``inet6``/``uuid``) into the Python values :class:`RowEncoder`
(fastavro) takes: ints for date / time / timestamps (days and
microseconds), ``Decimal`` for decimals, ``str``/``bytes``; and writers of
Avro bytes (longs, decimals, strings, arrays) for the transcoders. Zero
dates (``0000-00-00``) have no Avro value: readers return None for them.

The generated decoders and transcoders (:mod:`._decoder`,
:mod:`._transcoder`) do not import these: they get them bound by name in
their environment, :data:`HELPERS` and :data:`ENCODERS`.

All pure functions; :data:`_DAYS` is a cache shared by every transcoder
(see there).
"""

from __future__ import annotations

import decimal
import ipaddress
import struct
import uuid
from typing import Any, Final

from changebus.schemas import AVRO_PRESENT_SMALL, avro_long, avro_present_long

__all__ = ["DIG2BYTES", "ENCODERS", "HELPERS", "decimal_expr", "decimal_size", "row_loop_head"]

#: bytes of the leftover decimal digits (0..9) of a packed decimal
DIG2BYTES: Final = (0, 1, 1, 2, 2, 3, 3, 4, 4, 4)
_DATETIME_OFS: Final = 0x8000000000
_TIME_OFS: Final = 0x800000


def _days_from_civil(year: int, month: int, day: int) -> int:
    y = year - 1 if month <= 2 else year
    era = y // 400
    yoe = y - era * 400
    mp = month - 3 if month > 2 else month + 9
    doy = (153 * mp + 2) // 5 + day - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


def _decimal(raw: bytes, precision: int, scale: int) -> decimal.Decimal:
    """A binlog packed DECIMAL (MySQL's decimal2bin format) as a Decimal of ``scale``."""
    n = _unscaled(raw, precision, scale)
    # from text: exact at any precision (scaleb would round to the context's 28 digits)
    return decimal.Decimal(f"{n}E-{scale}")


def _unscaled(raw: bytes, precision: int, scale: int) -> int:
    """A binlog packed DECIMAL as its unscaled integer (the value times ``10**scale``)."""
    intg = precision - scale
    intg0, intg_x = divmod(intg, 9)
    frac0, frac_x = divmod(scale, 9)
    negative = not raw[0] & 0x80
    data = bytearray(raw)
    data[0] ^= 0x80
    if negative:
        data = bytearray(b ^ 0xFF for b in data)
    pos = 0
    digits = 0
    size = DIG2BYTES[intg_x]
    if size:
        digits = int.from_bytes(data[pos : pos + size], "big")
        pos += size
    for _ in range(intg0):
        digits = digits * 1_000_000_000 + int.from_bytes(data[pos : pos + 4], "big")
        pos += 4
    for _ in range(frac0):
        digits = digits * 1_000_000_000 + int.from_bytes(data[pos : pos + 4], "big")
        pos += 4
    size = DIG2BYTES[frac_x]
    if size:
        digits = digits * 10**frac_x + int.from_bytes(data[pos : pos + size], "big")
    return -digits if negative else digits


def decimal_size(precision: int, scale: int) -> int:
    intg = precision - scale
    return intg // 9 * 4 + DIG2BYTES[intg % 9] + scale // 9 * 4 + DIG2BYTES[scale % 9]


def _time_micros(packed: int) -> int:
    """Signed microseconds of a MySQL packed TIME value (``intpart << 24 | frac``)."""
    sign = 1
    if packed < 0:
        sign, packed = -1, -packed
    hms, frac = packed >> 24, packed & 0xFFFFFF
    seconds = ((hms >> 12) & 0x3FF) * 3600 + ((hms >> 6) & 0x3F) * 60 + (hms & 0x3F)
    return sign * (seconds * 1_000_000 + frac)


def _time2(buf: bytes, pos: int, fsp: int) -> int:
    intpart = int.from_bytes(buf[pos : pos + 3], "big") - _TIME_OFS
    if fsp == 0:
        return _time_micros(intpart << 24)
    if fsp <= 2:
        frac = buf[pos + 3]
        if intpart < 0 and frac:
            intpart += 1
            frac -= 0x100
        return _time_micros((intpart << 24) + frac * 10000)
    if fsp <= 4:
        frac = int.from_bytes(buf[pos + 3 : pos + 5], "big")
        if intpart < 0 and frac:
            intpart += 1
            frac -= 0x10000
        return _time_micros((intpart << 24) + frac * 100)
    return _time_micros(int.from_bytes(buf[pos : pos + 6], "big") - 0x800000000000)


def _frac(buf: bytes, pos: int, fsp: int) -> int:
    if fsp <= 2:
        return buf[pos] * 10000
    if fsp <= 4:
        return int.from_bytes(buf[pos : pos + 2], "big") * 100
    return int.from_bytes(buf[pos : pos + 3], "big")


def _datetime2(buf: bytes, pos: int, fsp: int) -> int | None:
    """Microseconds since the epoch (local time) of a DATETIME2; None for a zero date."""
    intpart = int.from_bytes(buf[pos : pos + 5], "big") - _DATETIME_OFS
    ymd = intpart >> 17
    ym = ymd >> 5
    day = ymd & 31
    year, month = divmod(ym, 13)
    if month == 0 or day == 0:
        return None
    hms = intpart & 0x1FFFF
    seconds = (hms >> 12) * 3600 + ((hms >> 6) & 63) * 60 + (hms & 63)
    micros = (_days_from_civil(year, month, day) * 86400 + seconds) * 1_000_000
    return micros + (_frac(buf, pos + 5, fsp) if fsp else 0)


def _date(v: int) -> int | None:
    day, month, year = v & 31, (v >> 5) & 15, v >> 9
    if month == 0 or day == 0:
        return None
    return _days_from_civil(year, month, day)


def _inet6(raw: bytes) -> str:
    addr = ipaddress.IPv6Address(raw)
    if addr.ipv4_mapped is not None:
        return f"::ffff:{addr.ipv4_mapped}"
    return str(addr)


def _uuid(raw: bytes) -> str:
    return str(uuid.UUID(bytes=raw))


def _bit(raw: bytes) -> int:
    n = int.from_bytes(raw, "big")
    return n - (1 << 64) if n >= 1 << 63 else n


HELPERS: Final[dict[str, Any]] = {
    "_decimal": _decimal,
    "_unscaled": _unscaled,
    "_time2": _time2,
    "_datetime2": _datetime2,
    "_date": _date,
    "_frac": _frac,
    "_inet6": _inet6,
    "_uuid": _uuid,
    "_bit": _bit,
    "_ip4": lambda raw: str(ipaddress.IPv4Address(raw)),
    "_dec": decimal.Decimal,
    "_f32": struct.Struct("<f").unpack_from,
    "_f64": struct.Struct("<d").unpack_from,
    "_i8": struct.Struct("<b").unpack_from,
    "_i16": struct.Struct("<h").unpack_from,
    "_u16": struct.Struct("<H").unpack_from,
    "_i32": struct.Struct("<i").unpack_from,
    "_u32": struct.Struct("<I").unpack_from,
    "_i64": struct.Struct("<q").unpack_from,
    "_u64": struct.Struct("<Q").unpack_from,
    "_from": int.from_bytes,
}


# ---- Avro writers (the transcoders' environment) ---------------------------------

_F32: Final = struct.Struct("<f")
_F64: Final = struct.Struct("<d")


#: Avro ``int``/``long`` bytes (table-driven: see :func:`changebus.schemas.avro_long`)
_long = avro_long


#: days since the epoch of a packed DATETIME2 date part (``year * 13 + month << 5 | day``);
#: bounded (cleared when full); None for a zero date. Shared by every transcoder of
#: the process: entries never change, and a racing clear only costs a recomputation.
_DAYS: dict[int, int | None] = {}


def _ymd_days(ymd: int) -> int | None:
    ym, day = ymd >> 5, ymd & 31
    year, month = divmod(ym, 13)
    days = None if month == 0 or day == 0 else _days_from_civil(year, month, day)
    if len(_DAYS) > 65536:
        _DAYS.clear()
    _DAYS[ymd] = days
    return days


def decimal_expr(precision: int, scale: int, x: str) -> str:
    """An expression for the unscaled value of the magnitude ``x`` of a packed decimal
    (its bytes as one big-endian integer, sign bit and negation already undone)."""
    intg = precision - scale
    chunks: list[tuple[int, int]] = []  # (bytes, decimal digits), most significant first
    if DIG2BYTES[intg % 9]:
        chunks.append((DIG2BYTES[intg % 9], intg % 9))
    chunks += [(4, 9)] * (intg // 9) + [(4, 9)] * (scale // 9)
    if DIG2BYTES[scale % 9]:
        chunks.append((DIG2BYTES[scale % 9], scale % 9))
    terms = []
    shift = sum(b for b, _ in chunks) * 8
    digits_after = sum(d for _, d in chunks)
    for size, digits in chunks:
        shift -= size * 8
        digits_after -= digits
        term = (
            f"(({x} >> {shift}) & {(1 << size * 8) - 1})"
            if shift
            else f"({x} & {(1 << size * 8) - 1})"
        )
        terms.append(f"{term} * {10**digits_after}" if digits_after else term)
    return " + ".join(terms) or "0"


def _avro_decimal(n: int) -> bytes:
    """Avro ``bytes`` of a decimal's unscaled value: big-endian two's complement, shortest."""
    raw = n.to_bytes((n.bit_length() + 8) // 8, "big", signed=True)
    return _long(len(raw)) + raw


def _avro_present_decimal(n: int) -> bytes:
    """``0x02`` (the union's value branch), then :func:`_avro_decimal` of ``n``."""
    size = (n.bit_length() + 8) // 8
    return AVRO_PRESENT_SMALL[size] + n.to_bytes(size, "big", signed=True)


def _avro_string(v: str) -> bytes:
    raw = v.encode()
    return _long(len(raw)) + raw


def _avro_bytes(v: bytes) -> bytes:
    return _long(len(v)) + v


def _avro_strings(items: list[str]) -> bytes:
    if not items:
        return b"\x00"
    return _long(len(items)) + b"".join(_avro_string(x) for x in items) + b"\x00"


ENCODERS: Final[dict[str, Any]] = {
    "_DAYS": _DAYS,
    "_MISS": object(),
    "_ymd_days": _ymd_days,
    "_long": _long,
    "_plong": avro_present_long,
    "_adec": _avro_decimal,
    "_padec": _avro_present_decimal,
    "_astr": _avro_string,
    "_abytes": _avro_bytes,
    "_astrs": _avro_strings,
    "_pf32": _F32.pack,
    "_pf64": _F64.pack,
}


def row_loop_head(signature: str, nbytes: int) -> list[str]:
    """The first lines of a generated row loop: ``def signature:``, the output list, and
    the null bitmap of ``nbytes`` bytes read at ``pos`` (shared by both code generators)."""
    return [
        f"def {signature}:",
        "    out = []",
        "    append = out.append",
        "    while pos < end:",
        "        nulls = buf[pos]"
        if nbytes == 1
        else f"        nulls = _from(buf[pos:pos + {nbytes}], 'little')",
        f"        pos += {nbytes}",
        "        ns = None",
    ]
