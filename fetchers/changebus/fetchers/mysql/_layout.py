"""Table layouts from TABLE_MAP events, and their compiled row decoders.

With ``binlog_row_metadata=FULL`` every TABLE_MAP event describes the table
as it was when the rows that follow were written: column names, binlog
types with their metadata (lengths, precision, fractional seconds),
signedness, character sets, enum and set labels, nullability and the
primary key. :func:`layout_from_table_map` turns one into a
:class:`TableLayout`; the binlog cannot tell a few declared types apart
(``uuid``/``inet6`` from ``binary(16)``, ``json`` from ``longtext``,
``tinyint(1)`` from ``tinyint``), so declared type texts tracked from DDL
(:mod:`._ddl`) refine a column when they agree with its binlog type, and are
ignored when they do not.

:func:`compile_decoder` generates, per layout, one straight-line Python
function that reads row images from the raw bytes of a rows event and
returns rows with values of the Python types :class:`RowEncoder` (fastavro)
takes for the column's Avro type: ints for date / time / timestamps
(days and microseconds), ``Decimal`` for decimals, ``str``/``bytes``.
Zero dates (``0000-00-00``) have no Avro value: the column is listed as not
sent. That is the fetcher's own decoder: about 4-8x faster than
mysql-replication's generic per-column reader (docs/benchmarks.md).

Layouts and decoders are immutable; decoders are pure functions and may be
shared between threads.
"""

from __future__ import annotations

import decimal
import ipaddress
import re
import struct
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from changebus.schemas import (
    AVRO_PRESENT_SMALL,
    AvroType,
    Column,
    SourceConfigError,
    TableSchema,
    avro_long,
    avro_present_long,
    mysql_avro_type,
)

__all__ = [
    "ColumnLayout",
    "RowsDecoder",
    "RowsTranscoder",
    "TableLayout",
    "compile_decoder",
    "compile_transcoder",
    "layout_from_table_map",
]

# binlog column type codes (MySQL's enum_field_types)
T_DECIMAL, T_TINY, T_SHORT, T_LONG, T_FLOAT, T_DOUBLE = 0, 1, 2, 3, 4, 5
T_TIMESTAMP, T_LONGLONG, T_INT24, T_DATE, T_TIME, T_DATETIME, T_YEAR = 7, 8, 9, 10, 11, 12, 13
T_VARCHAR, T_BIT, T_TIMESTAMP2, T_DATETIME2, T_TIME2 = 15, 16, 17, 18, 19
T_JSON, T_NEWDECIMAL, T_ENUM, T_SET = 245, 246, 247, 248
T_TINY_BLOB, T_MEDIUM_BLOB, T_LONG_BLOB, T_BLOB = 249, 250, 251, 252
T_VAR_STRING, T_STRING, T_GEOMETRY = 253, 254, 255

_INT_SIZES: Final = {T_TINY: 1, T_SHORT: 2, T_INT24: 3, T_LONG: 4, T_LONGLONG: 8}
_INT_NAMES: Final = {
    T_TINY: "tinyint",
    T_SHORT: "smallint",
    T_INT24: "mediumint",
    T_LONG: "int",
    T_LONGLONG: "bigint",
}
_DIG2BYTES: Final = (0, 1, 1, 2, 2, 3, 3, 4, 4, 4)
_CODECS: Final = {
    "utf8": "utf-8",
    "utf8mb4": "utf-8",
    "utf8mb3": "utf-8",
    "latin1": "cp1252",
    "ascii": "ascii",
    "ucs2": "utf-16-be",
    "utf16": "utf-16-be",
    "utf32": "utf-32-be",
}
_DECLARED: Final = re.compile(r"\s*([a-z0-9_ ]+?)\s*(?:\(|$| unsigned| signed| zerofill)")


@dataclass(frozen=True, slots=True)
class ColumnLayout:
    """One column as the binlog describes it, plus its declared type when known.

    ``meta`` holds the type's binlog metadata: ``length`` (bytes of a
    length prefix, or the maximum byte length of a char/binary column),
    ``fsp``, ``precision``/``scale``, ``bits``, ``size`` (enum/set bytes).
    ``codec`` is the Python codec of a text column, ``""`` for binary data.
    """

    name: str
    binlog_type: int
    nullable: bool
    unsigned: bool
    codec: str
    labels: tuple[str, ...]
    meta: tuple[tuple[str, int], ...]
    source_type: str
    avro: AvroType

    def m(self, key: str) -> int:
        return dict(self.meta)[key]


@dataclass(frozen=True, slots=True)
class TableLayout:
    """The layout of one table at one binlog position (see the module docstring)."""

    database: str
    table: str
    columns: tuple[ColumnLayout, ...]
    key: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.database}.{self.table}"

    def table_schema(self) -> TableSchema:
        return TableSchema(
            self.name,
            tuple(
                Column(c.name, c.avro, nullable=c.nullable, source_type=c.source_type)
                for c in self.columns
            ),
            self.key,
        )


def _codec(column: Any) -> str:
    charset = (getattr(column, "character_set_name", None) or "").lower()
    if charset == "binary":
        return ""
    return _CODECS.get(charset, charset or "utf-8")


def _base(declared: str) -> str:
    m = _DECLARED.match(declared.lower())
    return m.group(1).strip() if m else ""


def _agrees(declared: str, binlog_type: int, codec: str, meta: dict[str, int]) -> bool:
    """Whether a declared type text can be the type a binlog column was written with."""
    base = _base(declared)
    if binlog_type == T_TINY:
        return base in ("tinyint", "bool", "boolean")
    if binlog_type in (T_STRING, T_VAR_STRING) and not codec:
        return (base == "uuid" and meta.get("length") == 16) or (
            base in ("inet6", "inet4", "binary")
            and meta.get("length") == {"inet6": 16, "inet4": 4}.get(base, meta.get("length"))
        )
    if binlog_type in (T_BLOB, T_JSON) and codec:
        return base in ("json", "longtext", "text", "mediumtext", "tinytext")
    return False


def _width(col: Any) -> int:
    """Bytes per character of a text column's character set (for the declared length)."""
    collation = (getattr(col, "collation_name", None) or "").lower()
    for prefix, width in (("utf8mb4", 4), ("utf8", 3), ("ucs2", 2), ("utf16", 4), ("utf32", 4)):
        if collation.startswith(prefix):
            return width
    return 1


def _synthesised(col: Any, codec: str) -> str:
    """A COLUMN_TYPE-like text for a binlog column (when no declared type applies)."""
    t = col.type
    sign = " unsigned" if col.unsigned else ""
    if t in _INT_NAMES:
        return _INT_NAMES[t] + sign
    if t == T_NEWDECIMAL:
        return f"decimal({col.precision},{col.decimals})"
    if t == T_FLOAT:
        return "float"
    if t == T_DOUBLE:
        return "double"
    if t == T_BIT:
        return f"bit({col.bits})"
    if t == T_YEAR:
        return "year"
    if t == T_DATE:
        return "date"
    if t == T_TIME2:
        return f"time({col.fsp})" if col.fsp else "time"
    if t == T_DATETIME2:
        return f"datetime({col.fsp})" if col.fsp else "datetime"
    if t == T_TIMESTAMP2:
        return f"timestamp({col.fsp})" if col.fsp else "timestamp"
    if t in (T_ENUM, T_SET):
        labels = col.enum_values[1:] if t == T_ENUM else col.set_values
        quoted = ",".join("'" + v.replace("'", "''") + "'" for v in labels or ())
        return f"{'enum' if t == T_ENUM else 'set'}({quoted})"
    if t == T_VARCHAR:
        return (
            f"varchar({col.max_length // _width(col)})" if codec else f"varbinary({col.max_length})"
        )
    if t in (T_STRING, T_VAR_STRING):
        return f"char({col.max_length // _width(col)})" if codec else f"binary({col.max_length})"
    if t in (T_BLOB, T_JSON):
        kind = {1: "tiny", 2: "", 3: "medium", 4: "long"}.get(col.length_size, "long")
        return f"{kind}text" if codec else f"{kind}blob"
    if t == T_GEOMETRY:
        return "geometry"
    return f"binlog_type_{t}"


def layout_from_table_map(
    event: Any,
    declared: Mapping[str, str] | None = None,
    *,
    tinyint1_as_boolean: bool = False,
) -> TableLayout:
    """The layout a TableMapEvent describes (``declared``: column name -> declared type)."""
    names = [c.name for c in event.columns]
    if any(n is None or n.startswith("UNKNOWN_COL") for n in names):
        raise SourceConfigError(
            f"the binlog has no column names for {event.schema}.{event.table}: "
            "set binlog_row_metadata = FULL on the server (SET GLOBAL binlog_row_metadata = FULL)"
        )
    nullmask = int.from_bytes(bytes(event.null_bitmask), "little")
    declared = {k.lower(): v for k, v in (declared or {}).items()}
    pk = list(getattr(event.optional_metadata, "simple_primary_key_list", []) or [])
    if not pk and getattr(event.optional_metadata, "primary_keys_with_prefix", None):
        pk = list(event.optional_metadata.primary_keys_with_prefix)
    columns = []
    for i, col in enumerate(event.columns):
        t = col.type
        codec = _codec(col) if t in (T_VARCHAR, T_STRING, T_VAR_STRING, T_BLOB, T_JSON) else ""
        if t == T_JSON:
            codec = "utf-8"
        meta: dict[str, int] = {}
        if t in (T_VARCHAR, T_STRING, T_VAR_STRING):
            meta["length"] = col.max_length
        elif t in (T_BLOB, T_GEOMETRY, T_JSON):
            meta["length"] = col.length_size
        elif t in (T_TIME2, T_DATETIME2, T_TIMESTAMP2):
            meta["fsp"] = col.fsp
        elif t == T_NEWDECIMAL:
            meta["precision"], meta["scale"] = col.precision, col.decimals
        elif t == T_BIT:
            meta["bits"] = col.bits
        elif t in (T_ENUM, T_SET):
            meta["size"] = col.size
        labels: tuple[str, ...] = ()
        if t == T_ENUM:
            labels = tuple(col.enum_values or ())[1:]
        elif t == T_SET:
            labels = tuple(col.set_values or ())
        source_type = _synthesised(col, codec)
        hint = declared.get(col.name.lower())
        if hint is not None and _agrees(hint, t, codec, meta):
            base = _base(hint)
            if t == T_TINY:
                source_type = (
                    hint.lower()
                    .replace("bool", "tinyint(1)")
                    .replace("tinyint(1)ean", "tinyint(1)")
                )
            elif base in ("uuid", "inet6", "inet4", "json"):
                source_type = base
        avro = mysql_avro_type(source_type, tinyint1_as_boolean=tinyint1_as_boolean)
        columns.append(
            ColumnLayout(
                col.name,
                t,
                bool(nullmask >> i & 1) and i not in pk,
                bool(col.unsigned),
                codec,
                labels,
                tuple(sorted(meta.items())),
                source_type,
                avro,
            )
        )
    return TableLayout(
        event.schema, event.table, tuple(columns), tuple(names[i] for i in pk if i < len(names))
    )


# ---- the generated decoder -------------------------------------------------

#: (raw event bytes, start, end, images per row) -> list of (row, not_sent) per image
RowsDecoder = Callable[[bytes, int, int, int], list[tuple[dict[str, Any], list[str] | None]]]

_DATETIME_OFS: Final = 0x8000000000
_TIME_OFS: Final = 0x800000
_EPOCH_DAYS: Final = 719_163  # date(1970, 1, 1).toordinal()


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
    size = _DIG2BYTES[intg_x]
    if size:
        digits = int.from_bytes(data[pos : pos + size], "big")
        pos += size
    for _ in range(intg0):
        digits = digits * 1_000_000_000 + int.from_bytes(data[pos : pos + 4], "big")
        pos += 4
    for _ in range(frac0):
        digits = digits * 1_000_000_000 + int.from_bytes(data[pos : pos + 4], "big")
        pos += 4
    size = _DIG2BYTES[frac_x]
    if size:
        digits = digits * 10**frac_x + int.from_bytes(data[pos : pos + size], "big")
    return -digits if negative else digits


def _decimal_size(precision: int, scale: int) -> int:
    intg = precision - scale
    return intg // 9 * 4 + _DIG2BYTES[intg % 9] + scale // 9 * 4 + _DIG2BYTES[scale % 9]


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


def _frac_expr(fsp: int, at: str) -> str:
    """:func:`_frac` inlined into generated code (a function call less per value)."""
    if fsp <= 2:
        return f"buf[{at}] * 10000"
    if fsp <= 4:
        return f"_from(buf[{at}:{at} + 2], 'big') * 100"
    return f"_from(buf[{at}:{at} + 3], 'big')"


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


_HELPERS: Final[dict[str, Any]] = {
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


def _value_code(c: ColumnLayout, i: int) -> list[str]:
    """Statements that read column ``c`` at ``pos`` into ``@v`` and advance ``pos``."""
    t = c.binlog_type
    base = _base(c.source_type)
    if t in _INT_SIZES:
        size = _INT_SIZES[t]
        if size == 3:
            code = ["@v = _from(buf[pos:pos + 3], 'little', signed=%s)" % (not c.unsigned)]
        else:
            fn = {1: "8", 2: "16", 4: "32", 8: "64"}[size]
            if size == 1:
                code = ["@v = buf[pos]" if c.unsigned else "@v = _i8(buf, pos)[0]"]
            else:
                code = [f"@v = _{'u' if c.unsigned else 'i'}{fn}(buf, pos)[0]"]
        if t == T_LONGLONG and c.unsigned:
            code.append("@v = _dec(@v)")
        if c.avro == "boolean":
            code.append("@v = @v != 0")
        return [*code, f"pos += {size}"]
    if t == T_FLOAT:
        return ["@v = _f32(buf, pos)[0]", "pos += 4"]
    if t == T_DOUBLE:
        return ["@v = _f64(buf, pos)[0]", "pos += 8"]
    if t == T_YEAR:
        return ["@v = buf[pos]", "@v = @v + 1900 if @v else 0", "pos += 1"]
    if t == T_NEWDECIMAL:
        p, s = c.m("precision"), c.m("scale")
        n = _decimal_size(p, s)
        return [f"@v = _decimal(buf[pos:pos + {n}], {p}, {s})", f"pos += {n}"]
    if t == T_DATE:
        return [
            "@v = _date(buf[pos] | buf[pos + 1] << 8 | buf[pos + 2] << 16)",
            "pos += 3",
            f"if @v is None: ns = (ns or []) + [_name{i}]",
        ]
    if t == T_TIME2:
        fsp = c.m("fsp")
        return [f"@v = _time2(buf, pos, {fsp})", f"pos += {3 + (fsp + 1) // 2}"]
    if t == T_DATETIME2:
        fsp = c.m("fsp")
        return [
            f"@v = _datetime2(buf, pos, {fsp})",
            f"pos += {5 + (fsp + 1) // 2}",
            f"if @v is None: ns = (ns or []) + [_name{i}]",
        ]
    if t == T_TIMESTAMP2:
        fsp = c.m("fsp")
        frac = f" + _frac(buf, pos + 4, {fsp})" if fsp else ""
        return [
            "@v = _from(buf[pos:pos + 4], 'big')",
            f"@v = @v * 1000000{frac} if @v else None",
            f"pos += {4 + (fsp + 1) // 2}",
            f"if @v is None: ns = (ns or []) + [_name{i}]",
        ]
    if t == T_BIT:
        n = (c.m("bits") + 7) // 8
        return [f"@v = _bit(buf[pos:pos + {n}])", f"pos += {n}"]
    if t == T_ENUM:
        n = c.m("size")
        idx = "buf[pos]" if n == 1 else "_u16(buf, pos)[0]"
        return [f"@v = {idx}", f"@v = _labels{i}[@v - 1] if @v else ''", f"pos += {n}"]
    if t == T_SET:
        n = c.m("size")
        return [
            f"bits = _from(buf[pos:pos + {n}], 'little')",
            f"@v = sorted(s for b, s in enumerate(_labels{i}) if bits >> b & 1)",
            f"pos += {n}",
        ]
    if t in (T_VARCHAR, T_STRING, T_VAR_STRING):
        n = c.m("length")
        if n > 255:
            code = ["ln = _u16(buf, pos)[0]", "pos += 2"]
        else:
            code = ["ln = buf[pos]", "pos += 1"]
        if c.codec:
            code.append(f"@v = buf[pos:pos + ln].decode(_codec{i})")
        elif base == "uuid":
            code.append("@v = _uuid(buf[pos:pos + ln].ljust(16, b'\\0'))")
        elif base == "inet6":
            code.append("@v = _inet6(buf[pos:pos + ln].ljust(16, b'\\0'))")
        elif base == "inet4":
            code.append("@v = _ip4(buf[pos:pos + ln].ljust(4, b'\\0'))")
        elif t == T_STRING:
            # BINARY(n) is padded with zero bytes; the binlog strips trailing ones
            code.append(f"@v = buf[pos:pos + ln].ljust({n}, b'\\0')")
        else:
            code.append("@v = buf[pos:pos + ln]")
        return [*code, "pos += ln"]
    if t in (T_BLOB, T_GEOMETRY, T_JSON):
        n = c.m("length")
        code = [f"ln = _from(buf[pos:pos + {n}], 'little')", f"pos += {n}"]
        if c.codec:
            code.append(f"@v = buf[pos:pos + ln].decode(_codec{i})")
        else:
            code.append("@v = buf[pos:pos + ln]")
        return [*code, "pos += ln"]
    raise SourceConfigError(
        f"column {c.name!r} has binlog type {t}, which the mysql fetcher cannot decode "
        "(old pre-5.6 temporal formats: ALTER TABLE ... FORCE rebuilds them)"
    )


def compile_decoder(layout: TableLayout) -> RowsDecoder:
    """A decoder for the row images of ``layout`` (see the module docstring).

    The returned function takes ``(buf, start, end, images)``: the event
    bytes, the span holding the row images, and the images per row (1, or
    2 for updates: before, after). All columns must be present (FULL image).
    """
    cols = layout.columns
    nbytes = (len(cols) + 7) // 8
    lines = [
        "def decode(buf, pos, end, images):",
        "    out = []",
        "    append = out.append",
        "    while pos < end:",
        "        nulls = buf[pos]"
        if nbytes == 1
        else f"        nulls = _from(buf[pos:pos + {nbytes}], 'little')",
        f"        pos += {nbytes}",
        "        ns = None",
    ]
    env = dict(_HELPERS)
    for i, c in enumerate(cols):
        env[f"_labels{i}"], env[f"_name{i}"], env[f"_codec{i}"] = c.labels, c.name, c.codec
        lines.append(f"        if nulls >> {i} & 1:")
        lines.append(f"            v{i} = None")
        lines.append("        else:")
        lines.extend("            " + s.replace("@v", f"v{i}") for s in _value_code(c, i))
    # keys are names bound in the environment: no outside text in the generated code
    row = ", ".join(f"_name{i}: v{i}" for i in range(len(cols)))
    lines.append(f"        append(({{{row}}}, ns))")
    lines.append("    return out")
    source = "\n".join(lines)
    code = compile(source, f"<changebus mysql decoder {layout.name}>", "exec")
    exec(code, env)  # generated from the layout alone: no outside text in the code
    decoder: RowsDecoder = env["decode"]
    return decoder


# ---- the generated transcoder: binlog row images straight to Avro ------------------

#: (raw event bytes, start, end) -> list of (key, row, not_sent) per image: the Avro
#: bytes of the key record and of the row record, the columns not sent (or None)
RowsTranscoder = Callable[[bytes, int, int], list[tuple[bytes, bytes, list[str] | None]]]

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


def _decimal_expr(precision: int, scale: int, x: str) -> str:
    """An expression for the unscaled value of the magnitude ``x`` of a packed decimal
    (its bytes as one big-endian integer, sign bit and negation already undone)."""
    intg = precision - scale
    chunks: list[tuple[int, int]] = []  # (bytes, decimal digits), most significant first
    if _DIG2BYTES[intg % 9]:
        chunks.append((_DIG2BYTES[intg % 9], intg % 9))
    chunks += [(4, 9)] * (intg // 9) + [(4, 9)] * (scale // 9)
    if _DIG2BYTES[scale % 9]:
        chunks.append((_DIG2BYTES[scale % 9], scale % 9))
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


_ENCODERS: Final[dict[str, Any]] = {
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


def _avro_kind(avro: AvroType) -> str:
    """The Avro physical type of a column type (with ``decimal`` for the logical one)."""
    if isinstance(avro, dict):
        if avro.get("logicalType") == "decimal":
            return "decimal"
        return str(avro["type"])
    return str(avro)


#: values remembered per column by a transcoder (datetimes)
_MEMO_ENTRIES: Final = 4096


def _transcode_code(c: ColumnLayout, i: int) -> list[str]:
    """Statements that read column ``c`` at ``pos`` into ``@e`` (its Avro bytes, or None
    when the value has no Avro form: listed as not sent) and advance ``pos``."""
    t = c.binlog_type
    kind = _avro_kind(c.avro)
    # the hot types, without a Python value in between where the bytes allow it
    if t in (T_VARCHAR, T_STRING, T_VAR_STRING, T_BLOB, T_JSON) and c.codec == "utf-8":
        if t in (T_BLOB, T_JSON):
            n = c.m("length")
            head = [f"ln = _from(buf[pos:pos + {n}], 'little')", f"pos += {n}"]
        elif c.m("length") > 255:
            head = ["ln = _u16(buf, pos)[0]", "pos += 2"]
        else:
            head = ["ln = buf[pos]", "pos += 1"]
        return [*head, "@e = _long(ln) + buf[pos:pos + ln]", "pos += ln"]
    if t == T_NEWDECIMAL:
        p, sc = c.m("precision"), c.m("scale")
        n = _decimal_size(p, sc)
        # the sign is the top bit, inverted; a negative value has every byte inverted
        return [
            f"x = _from(buf[pos:pos + {n}], 'big')",
            f"neg = x >> {8 * n - 1} == 0",
            f"x ^= {1 << (8 * n - 1)}",
            f"if neg: x ^= {(1 << 8 * n) - 1}",
            f"u = {_decimal_expr(p, sc, 'x')}",
            "@e = _adec(-u if neg else u)",
            f"pos += {n}",
        ]
    if t == T_DATETIME2:
        # rows of a transaction often share a datetime (NOW()): the Avro bytes are
        # remembered by the packed value (_dtm<i>, cleared when full)
        fsp = c.m("fsp")
        width = 5 + (fsp + 1) // 2
        frac = f" + {_frac_expr(fsp, 'pos + 5')}" if fsp else ""
        return [
            f"r = buf[pos:pos + {width}]",
            f"@e = _dtm{i}.get(r, _MISS)",
            "if @e is _MISS:",
            "    x = _from(r[:5], 'big') - 0x8000000000",
            "    dd = _DAYS.get(x >> 17, _MISS)",
            "    if dd is _MISS: dd = _ymd_days(x >> 17)",
            "    if dd is None: @e = None",
            "    else:",
            "        h = x & 0x1FFFF",
            "        @e = _long((dd * 86400 + (h >> 12) * 3600 + ((h >> 6) & 63) * 60 + (h & 63))"
            f" * 1000000{frac})",
            f"    if len(_dtm{i}) >= {_MEMO_ENTRIES}: _dtm{i}.clear()",
            f"    _dtm{i}[r] = @e",
            f"pos += {width}",
        ]
    if t == T_DOUBLE and kind == "double":
        return ["@e = buf[pos:pos + 8]", "pos += 8"]
    if t == T_FLOAT and kind == "float":
        return ["@e = buf[pos:pos + 4]", "pos += 4"]
    # the decoder's own not-sent bookkeeping is done by the caller here
    code = [line for line in _value_code(c, i) if not line.startswith("if @v is None: ns")]
    if t == T_LONGLONG and c.unsigned and kind == "decimal":
        code = [line for line in code if line != "@v = _dec(@v)"]
        enc = "_adec(@v)"
    elif kind in ("int", "long"):
        enc = "_long(@v)"
    elif kind == "boolean":
        enc = "(b'\\x01' if @v else b'\\x00')"
    elif kind == "float":
        enc = "_pf32(@v)"
    elif kind == "double":
        enc = "_pf64(@v)"
    elif kind == "string":
        enc = "_astr(@v)"
    elif kind == "bytes":
        enc = "_abytes(@v)"
    elif kind == "array":
        enc = "_astrs(@v)"
    else:
        raise SourceConfigError(f"column {c.name!r}: no Avro encoding for {c.avro!r}")
    # a value without an Avro form (a zero date) is None here and listed as not sent
    return [*code, f"@e = None if @v is None else {enc}"]


#: value encoders and their forms with the union's value branch in front
_WITH_BRANCH: Final = (
    ("@e = None if @v is None else _long(@v)", "@e = None if @v is None else _plong(@v)"),
    ("@e = _long(", "@e = _plong("),
    ("@e = _adec(", "@e = _padec("),
)


def _with_branch(code: list[str]) -> tuple[list[str], bool]:
    """``code`` writing ``0x02`` + the value into ``@e``, when every assignment allows it."""
    out: list[str] = []
    for line in code:
        stripped = line.lstrip()
        if stripped.startswith("@e ="):
            for plain, branch in _WITH_BRANCH:
                if stripped.startswith(plain):
                    line = line.replace(plain, branch, 1)
                    break
            else:
                return code, False
        out.append(line)
    return out, True


def compile_transcoder(layout: TableLayout) -> RowsTranscoder:
    """A function from row images to Avro bytes for ``layout`` (the row record of
    ``layout.table_schema()``: every field ``["null", T]``, in column order; the key
    record: the key columns' ``T`` in key order).

    Same values as :func:`compile_decoder` followed by fastavro, without the Python
    row in between: UTF-8 text, doubles and floats are copied as they are in the
    binlog, decimals go from their packed form to Avro's two's complement directly.
    """
    cols = layout.columns
    nbytes = (len(cols) + 7) // 8
    index = {c.name: i for i, c in enumerate(cols)}
    key = [index[k] for k in layout.key]
    lines = [
        "def transcode(buf, pos, end):",
        "    out = []",
        "    append = out.append",
        "    while pos < end:",
        "        nulls = buf[pos]"
        if nbytes == 1
        else f"        nulls = _from(buf[pos:pos + {nbytes}], 'little')",
        f"        pos += {nbytes}",
        "        ns = None",
    ]
    env = dict(_HELPERS)
    env.update(_ENCODERS)
    for i, c in enumerate(cols):
        env[f"_labels{i}"], env[f"_name{i}"], env[f"_codec{i}"] = c.labels, c.name, c.codec
        env[f"_dtm{i}"] = {}
        # NOT NULL columns skip the null bit; only temporal types can lack an Avro value
        pad = "            " if c.nullable else "        "
        if c.nullable:
            lines.append(f"        if nulls >> {i} & 1:")
            lines.append(f"            e{i} = b'\\x00'")
            lines.append("        else:")
        lines_i = _transcode_code(c, i)
        present = i not in key
        if present:  # write the union's value branch with the value: one concatenation less
            lines_i, present = _with_branch(lines_i)
        body = [s.replace("@e", f"e{i}").replace("@v", f"v{i}") for s in lines_i]
        lines.extend(pad + s for s in body)
        if c.binlog_type in (T_DATE, T_DATETIME2, T_TIMESTAMP2):
            lines.append(f"{pad}if e{i} is None:")
            lines.append(f"{pad}    e{i} = b'\\x00'")
            lines.append(f"{pad}    ns = (ns or []) + [_name{i}]")
            if present:
                continue
            lines.append(f"{pad}else:")
            pad += "    "
        if i in key:
            lines.append(f"{pad}k{i} = e{i}")
        if not present:
            lines.append(f"{pad}e{i} = b'\\x02' + e{i}")
    if key:
        keyexpr = (
            f"k{key[0]}" if len(key) == 1 else f"b''.join(({', '.join(f'k{i}' for i in key)},))"
        )
    else:
        keyexpr = "b''"
    row = ", ".join(f"e{i}" for i in range(len(cols)))
    lines.append(f"        append(({keyexpr}, b''.join(({row},)), ns))")
    lines.append("    return out")
    source = "\n".join(lines)
    code = compile(source, f"<changebus mysql transcoder {layout.name}>", "exec")
    exec(code, env)  # generated from the layout alone: no outside text in the code
    transcoder: RowsTranscoder = env["transcode"]
    return transcoder
