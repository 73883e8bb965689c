"""pgoutput binary tuples straight to Avro bytes: the assembler's fast path.

The general path turns every cell into a Python value (:mod:`._values`), the
row into a dict and the dict into Avro with fastavro: about 30 µs of Python
per 10-column row. Most of that work is undone again, since the Avro binary
of most Postgres types is a short rewrite of the pgoutput binary form: a
``text`` value is a length and UTF-8 bytes in both, an ``int8`` a big-endian
integer that becomes a zig-zag varint, a ``timestamptz`` a count of
microseconds with another epoch.

:class:`Transcoder` holds, for one table schema version, a function
generated from the column types (one straight-line block per column, no
per-cell dispatch) that walks a pgoutput tuple and writes the row record's
Avro bytes (every field ``["null", T]``: branch byte, then T) and the key
record's bytes (the key columns' T bytes in key order). :meth:`Transcoder.change`
frames a whole Insert / Update / Delete message as ``key + change record``,
the body :meth:`changebus.schemas.RowEncoder.frame` turns into an event.

Exactness: the output is byte-for-byte what the general path writes for the
same message. Whatever the fast path is not sure of raises :class:`Fallback`
and the caller runs the general path on that message: text-format cells,
NULL or unchanged key columns, infinities and values outside Python's date
and time ranges, numeric NaN / Infinity or a scale other than the column's,
malformed data (the general path then raises its own clear error). Types
without a fast rule (arrays, inet, money, timetz, unconstrained numeric,
the types mapped to their text form, ...) are decoded by their column type's
decoder (:meth:`._types.ColumnType.decode`) and written by fastavro, one
column at a time, with the general path's checks (an array deeper than
declared falls back). ``tests/fetchers/test_pg_transcode.py`` compares both
paths over every type, NULLs and unchanged-TOAST markers.

Thread-safety: immutable after construction; one per table schema version.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable, Sequence
from typing import Any, Final

import fastavro

from changebus.schemas import AVRO_PRESENT_SMALL, avro_long, avro_present_long

from .._policy import ColumnRule
from ._cellwalk import RUN_FORMATS, CellFormat, key_expr, name_p, walk_lines
from ._types import ColumnType
from ._values import OUT_OF_RANGE, contains_out_of_range, non_finite

__all__ = ["Fallback", "Transcoder", "walker_env", "zigzag"]


class Fallback(Exception):
    """This message needs the general path (see the module docstring)."""


#: Avro ``int``/``long`` bytes, and the same after the union's value branch ``0x02``
zigzag = avro_long
present_zigzag = avro_present_long


_I32: Final = struct.Struct(">i")
_F4BE: Final = struct.Struct(">f")
_F4LE: Final = struct.Struct("<f")
_INTERVAL: Final = struct.Struct(">qii")
_NUMERIC: Final = struct.Struct(">hhHh")
#: readers of numeric base-10000 digit groups, by count
_DIGITS: Final = tuple(struct.Struct(f">{k}H").unpack_from for k in range(64))
_BOOL: Final = {b"\x00": b"\x00", b"\x01": b"\x01"}
_PBOOL: Final = {b"\x00": b"\x02\x00", b"\x01": b"\x02\x01"}
_PG_EPOCH_DAYS: Final = 10_957  # 1970-01-01 -> 2000-01-01
_PG_EPOCH_US: Final = 946_684_800_000_000
#: Postgres dates / timestamps (relative to 2000-01-01) that Python's date and datetime hold
_DAY_MIN: Final = -730_119  # 0001-01-01
_DAY_MAX: Final = 2_921_939  # 9999-12-31
_US_MIN: Final = _DAY_MIN * 86_400_000_000
_US_MAX: Final = (_DAY_MAX + 1) * 86_400_000_000 - 1
_DAY_US: Final = 86_400_000_000

_POW10: Final = tuple(10**k for k in range(200))
#: timestamps remembered per transcoder (see _present_timestamp)
_TS_MEMO: Final = 4096

#: types whose binary form is the UTF-8 text (for a ColumnType not made by the resolver)
_STRING_OIDS: Final = frozenset({19, 25, 114, 142, 1042, 1043})


def _decimal_bytes(v: bytes, scale: int, limit: int) -> bytes:
    """Avro ``bytes``/decimal(p, scale) of a binary numeric, as fastavro writes it."""
    return _present_decimal_bytes(v, scale, limit)[1:]


def _present_decimal_bytes(v: bytes, scale: int, limit: int) -> bytes:
    """``0x02`` (the union's value branch), then :func:`_decimal_bytes`."""
    ndigits, weight, sign, dscale = _NUMERIC.unpack_from(v)
    if (sign != 0 and sign != 0x4000) or dscale != scale or len(v) != 8 + 2 * ndigits:
        raise Fallback
    n: int
    if ndigits == 2:  # the common case (up to 8 significant digits), unrolled
        hi, lo = _DIGITS[2](v, 8)
        n = hi * 10_000 + lo
    else:
        n = 0
        for d in (
            _DIGITS[ndigits](v, 8) if ndigits < 64 else struct.unpack_from(f">{ndigits}H", v, 8)
        ):
            n = n * 10_000 + d
    exp = 4 * (weight - ndigits + 1) + scale
    if exp >= 0:
        n *= _POW10[exp] if exp < len(_POW10) else 10**exp
    else:
        n, rest = divmod(n, _POW10[-exp] if -exp < len(_POW10) else 10**-exp)
        if rest:
            raise Fallback
    if n >= limit:  # more digits than the precision: fastavro refuses it
        raise Fallback
    size = (n.bit_length() + 8) // 8
    return AVRO_PRESENT_SMALL[size] + (-n if sign else n).to_bytes(size, "big", signed=True)


def _present_timestamp(memo: dict[int, bytes]) -> Callable[[int], bytes]:
    """``0x02`` + the Avro µs since 1970 of a Postgres timestamp ``x``, remembered.

    Rows of one transaction often share a timestamp (``now()``), and a long
    varint costs ~0.8 µs; the generated code looks ``x`` up in ``memo``
    first and calls this only on a miss. Out-of-range values are not
    remembered (they raise :class:`Fallback`); the memo is cleared when full.
    """

    def encode(x: int) -> bytes:
        if x < _US_MIN or x > _US_MAX:
            raise Fallback
        p = present_zigzag(x + _PG_EPOCH_US)
        if len(memo) >= _TS_MEMO:
            memo.clear()
        memo[x] = p
        return p

    return encode


def _uuid(v: bytes) -> bytes:
    if len(v) != 16:
        raise Fallback
    h = v.hex()
    return b"\x48" + f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}".encode()


def _interval(v: bytes) -> bytes:
    micros, days, months = _INTERVAL.unpack(v)
    return zigzag(months) + zigzag(days) + zigzag(micros)


def _float4(v: bytes) -> bytes:
    return _F4LE.pack(_F4BE.unpack(v)[0])


def _depth(value: Any) -> int:
    depth = 0
    while isinstance(value, list) and value:
        depth += 1
        value = value[0]
    return depth


def _general_column(
    ctype: ColumnType, adapt: Callable[[Any], Any] | None, rule: ColumnRule | None = None
) -> Callable[[bytes], bytes]:
    """T bytes of one value through the general decoder and fastavro.

    With a column ``rule`` (hash, truncate) the decoded value goes through
    it, and a hashed value is written as the string it becomes.
    """
    schema = fastavro.parse_schema("string" if rule and rule.action == "hash" else ctype.avro)
    policy = None if rule is None else rule.apply
    write = fastavro.schemaless_writer
    decode, is_array, dims = ctype.decode, ctype.is_array, ctype.dims

    def encode(v: bytes) -> bytes:
        value = decode(v)
        if is_array and value and _depth(value) != dims:
            raise Fallback
        if value is OUT_OF_RANGE or (is_array and contains_out_of_range(value)):
            raise Fallback
        if adapt is None and non_finite(value):
            raise Fallback
        if adapt is not None:
            value = adapt(value)
        if policy is not None:
            value = policy(value)
        bio = io.BytesIO()
        write(bio, schema, value)
        return bio.getvalue()

    return encode


# per-type code: `v` holds the value bytes, `n` their length. The value as a
# union branch goes to `p` (0x02 + T bytes), the T bytes alone (key columns)
# to `e`: (fixed width or 0, code setting e, code setting p without e or None)
_INT = "x = from_bytes(v, 'big', signed=True)\n"
_SNIPPETS: Final[dict[str, tuple[int, str, str | None]]] = {
    "int2": (2, _INT + "e = zz(x)", _INT + "p = pzz(x)"),
    "int4": (4, _INT + "e = zz(x)", _INT + "p = pzz(x)"),
    "int8": (8, _INT + "e = zz(x)", _INT + "p = pzz(x)"),
    "oid": (4, "e = zz(from_bytes(v, 'big'))", "p = pzz(from_bytes(v, 'big'))"),
    "bool": (1, "e = BOOL[v]", "p = PBOOL[v]"),
    "string": (
        0,
        "if not v.isascii(): v.decode()\ne = zz(n) + v",
        "if not v.isascii(): v.decode()\np = pzz(n) + v",
    ),
    "bytea": (0, "e = zz(n) + v", "p = pzz(n) + v"),
    "float4": (4, "e = float4(v)", None),
    "float8": (8, "e = v[::-1]", None),
    "date": (
        4,
        _INT + "if x < DAY_MIN or x > DAY_MAX: raise Fallback\ne = zz(x + PG_EPOCH_DAYS)",
        _INT + "if x < DAY_MIN or x > DAY_MAX: raise Fallback\np = pzz(x + PG_EPOCH_DAYS)",
    ),
    "time": (8, _INT + "if x < 0 or x > DAY_US: raise Fallback\ne = zz(x)", None),
    "timestamp": (
        8,
        _INT + "if x < US_MIN or x > US_MAX: raise Fallback\ne = zz(x + PG_EPOCH_US)",
        _INT + "p = TS.get(x)\nif p is None: p = present_ts(x)",
    ),
    "interval": (16, "e = interval(v)", None),
    "uuid": (16, "e = uuid_(v)", None),
    "jsonb": (
        0,
        "if n < 1 or v[0] != 1: raise Fallback\nw = v[1:]\nw.decode()\ne = zz(n - 1) + w",
        None,
    ),
}
_BY_OID: Final = {
    20: "int8", 21: "int2", 23: "int4", 26: "oid", 16: "bool", 17: "bytea", 700: "float4",
    701: "float8", 1082: "date", 1083: "time", 1114: "timestamp", 1184: "timestamp",
    1186: "interval", 2950: "uuid", 3802: "jsonb",
}  # fmt: skip


#: the Avro base type each rule writes (checked against the column's, or no rule)
_AVRO_OF: Final = {
    "int2": "int", "int4": "int", "int8": "long", "oid": "long", "bool": "boolean",
    "string": "string", "bytea": "bytes", "float4": "float", "float8": "double", "date": "int",
    "time": "long", "timestamp": "long", "interval": "record", "uuid": "string",
    "jsonb": "string", "decimal": "bytes",
}  # fmt: skip


def _rule(ctype: ColumnType) -> str | None:
    """The fast rule for a column type, or None (general column encoder)."""
    if ctype.is_array:
        return None
    oid = ctype.decode_oid
    avro = ctype.avro
    rule: str | None
    if ctype.utf8 or (ctype.decoder is None and oid in _STRING_OIDS):  # UTF-8 text (enums...)
        rule = "string"
    elif oid == 1700:
        decimal_ = isinstance(avro, dict) and avro.get("logicalType") == "decimal"
        rule = "decimal" if decimal_ else None
    else:
        rule = _BY_OID.get(oid)
    base = avro.get("type") if isinstance(avro, dict) else avro
    if rule is None or base != _AVRO_OF[rule]:
        return None
    return rule


def _column_lines(
    rule: str | None, i: int, is_key: bool, indent: str, ctype: ColumnType | None = None
) -> list[str]:
    """Lines reading column i's cell at ``pos`` into ``p<i>`` (and ``k<i>``)."""
    width = 0
    code_p: str | None = None
    if rule is None:
        code = f"e = general{i}(v)"
    elif rule == "decimal":
        assert ctype is not None
        avro = ctype.avro
        assert isinstance(avro, dict)
        args = f"v, {int(avro['scale'])}, {10 ** int(avro['precision'])}"
        code = f"e = decimal_bytes({args})"
        code_p = f"p = pdecimal_bytes({args})"
    else:
        width, code, code_p = _SNIPPETS[rule]
    if is_key or code_p is None:
        body = [*code.split("\n"), f"p{i} = b'\\x02' + e"]
        if is_key:
            body.append(f"k{i} = e")
    else:
        body = name_p(code_p, i).split("\n")
    out: list[str] = []
    if width:  # kind 'b' and the length in one comparison
        head = b"b" + width.to_bytes(4, "big")
        out += [
            f"if buf[pos:pos + 5] == {head!r}:",
            f"    v = buf[pos + 5:pos + {5 + width}]",
            f"    pos += {5 + width}",
        ]
    else:
        out += [
            "if buf[pos] == 98:",
            "    n = from_bytes(buf[pos + 1:pos + 5], 'big')",
            "    pos += 5",
            "    v = buf[pos:pos + n]",
            "    if len(v) != n: raise Fallback",
            "    pos += n",
        ]
    out += ["    " + line for line in body]
    if not is_key:  # a NULL or unchanged key column: the general path
        out += [
            "elif buf[pos] == 110:",
            f"    p{i} = b'\\x00'",
            "    pos += 1",
            "elif buf[pos] == 117:",
            f"    p{i} = b'\\x00'",
            "    pos += 1",
            "    if ns is None: ns = []",
            f"    ns.append(names[{i}])",
        ]
    out += ["else:", "    raise Fallback"]
    return [indent + line for line in out]


def _skip_lines(indent: str) -> list[str]:
    """Lines stepping over a cell at ``pos`` (an excluded column: no ``p<i>``)."""
    out = [
        "if buf[pos] == 98:",
        "    pos += 5 + from_bytes(buf[pos + 1:pos + 5], 'big')",
        "elif buf[pos] == 110 or buf[pos] == 117:",
        "    pos += 1",
        "else:",
        "    raise Fallback",
    ]
    return [indent + line for line in out]


#: pgoutput's cells: kind ``b`` and a 4-byte length before a value ("5s" in a run)
_PGOUTPUT: Final = CellFormat(
    head_code="5s",
    head=lambda rule: repr(b"b" + RUN_FORMATS[rule][1].to_bytes(4, "big")),
    min_run=1,
    inline=lambda code: code,
    cell=_column_lines,
    skip=_skip_lines,
)


def walker_env(names: tuple[str, ...]) -> dict[str, Any]:
    """The names generated walkers use (this module's and :mod:`._copyenc`'s)."""
    ts_memo: dict[int, bytes] = {}
    return {
        "Fallback": Fallback,
        "zz": zigzag,
        "pzz": present_zigzag,
        "PBOOL": _PBOOL,
        "from_bytes": int.from_bytes,
        "BOOL": _BOOL,
        "BOOL_BY_INT": (b"\x00", b"\x01"),
        "PBOOL_BY_INT": (b"\x02\x00", b"\x02\x01"),
        "float4": _float4,
        "interval": _interval,
        "uuid_": _uuid,
        "decimal_bytes": _decimal_bytes,
        "pdecimal_bytes": _present_decimal_bytes,
        "TS": ts_memo,
        "present_ts": _present_timestamp(ts_memo),
        "names": names,
        "DAY_MIN": _DAY_MIN,
        "DAY_MAX": _DAY_MAX,
        "DAY_US": _DAY_US,
        "US_MIN": _US_MIN,
        "US_MAX": _US_MAX,
        "PG_EPOCH_DAYS": _PG_EPOCH_DAYS,
        "PG_EPOCH_US": _PG_EPOCH_US,
    }


class Transcoder:
    """Turns pgoutput row messages of one table into event bodies (module docstring).

    ``names`` and ``types`` are the table's columns in Relation order,
    ``key`` the indexes of the key columns in key order, ``key_flags`` the
    columns pgoutput marks as replica identity (a key-only before-image has
    the others as not sent), ``adapters`` the general path's value adapters,
    ``rules`` the column policy's rule per column (None: no policy): an
    excluded column is stepped over, a hashed or truncated one goes through
    its rule (:mod:`changebus.fetchers._policy`); the others are untouched.
    ``nullable_key``: the key columns the table schema has as nullable (their
    key bytes are ``["null", T]``, see :func:`~._cellwalk.key_expr`).
    """

    def __init__(
        self,
        names: Sequence[str],
        types: Sequence[ColumnType],
        adapters: Sequence[Callable[[Any], Any] | None],
        key: Sequence[int],
        key_flags: Sequence[bool],
        rules: Sequence[ColumnRule | None] | None = None,
        nullable_key: frozenset[int] = frozenset(),
    ) -> None:
        self.names = tuple(names)
        self.ncols = len(self.names)
        self._rules = tuple(rules) if rules is not None else (None,) * self.ncols
        self._nullable_key = nullable_key
        self._tuple = self._generate(types, adapters, tuple(key))
        #: a kept column's index among the tuple walker's pieces (excluded columns have none)
        self._piece = {
            n: i
            for i, n in enumerate(
                n
                for n, r in zip(self.names, self._rules, strict=True)
                if not (r is not None and r.action == "exclude")
            )
        }
        self._key_only_not_sent = _string_array(
            [
                n
                for n, k, r in zip(self.names, key_flags, self._rules, strict=True)
                if not k and not (r is not None and r.action == "exclude")
            ]
        )

    def _generate(
        self,
        types: Sequence[ColumnType],
        adapters: Sequence[Callable[[Any], Any] | None],
        key: tuple[int, ...],
    ) -> Callable[[bytes, int], tuple[tuple[bytes, ...], bytes, list[str] | None, int]]:
        """Python source for this table's tuple walker, compiled.

        ``p<i>`` gets column i's union bytes (``0x00``, or ``0x02`` + T),
        ``k<i>`` a key column's T bytes. Runs of fixed-width integer-like
        columns are read with one ``struct`` call when all of them are
        present (the usual case); otherwise column by column.
        """
        env = walker_env(self.names)
        lines = [
            "def tuple_(buf, pos):",
            f"    if buf[pos:pos + 2] != {self.ncols.to_bytes(2, 'big')!r}: raise Fallback",
            "    pos += 2",
            "    size = len(buf)",
            "    ns = None",
        ]
        policy = self._rules
        rules = [_rule(t) if r is None else None for t, r in zip(types, policy, strict=True)]
        lines += walk_lines(
            _PGOUTPUT,
            types,
            policy,
            rules,
            key,
            env,
            "    ",
            lambda i: _general_column(types[i], adapters[i], policy[i]),
        )
        excluded = {c for c, r in enumerate(policy) if r is not None and r.action == "exclude"}
        kept = [c for c in range(len(types)) if c not in excluded]
        pieces = ", ".join(f"p{c}" for c in kept)
        keys = key_expr(key, self._nullable_key)
        lines.append(f"    return ({pieces}{',' if len(kept) == 1 else ''}), {keys}, ns, pos")
        exec("\n".join(lines), env)  # the code is built from the fixed snippets here
        fn: Callable[[bytes, int], tuple[tuple[bytes, ...], bytes, list[str] | None, int]]
        fn = env["tuple_"]
        return fn

    def change(
        self, buf: bytes, pos: int, end: int = -1
    ) -> tuple[int, bytes, bytes, tuple[bytes, bytes] | None]:
        """``(op, key, body, old)`` of the I/U/D message ``buf[pos:end]`` (body = key +
        record); ``old`` is ``(old key, body)`` of the DELETE that follows an update
        changing its row's key (the general path's, see the assembler), else None.

        ``end`` < 0: the message runs to the end of ``buf``. A message whose
        tuples would run past ``end`` is malformed (or truncated): raises
        :class:`Fallback`, as it does whenever the general path must do it.
        """
        if end < 0:
            end = len(buf)
        kind = buf[pos]
        pos += 5  # kind, relation oid
        marker = buf[pos]
        if kind == 0x49:  # 'I'
            if marker != 0x4E:
                raise Fallback
            after, key, ns, pos = self._tuple(buf, pos + 1)
            if pos > end:
                raise Fallback
            tail = b"\x00\x00\x00" if ns is None else b"\x00" + _string_array(ns) + b"\x00"
            return 1, key, b"".join([key, b"\x02", *after, tail]), None
        if kind == 0x55:  # 'U'
            if marker == 0x4E:
                after, key, ns, pos = self._tuple(buf, pos + 1)
                if pos > end:
                    raise Fallback
                tail = b"\x00\x00\x00" if ns is None else b"\x00" + _string_array(ns) + b"\x00"
                return 2, key, b"".join([key, b"\x02", *after, tail]), None
            if marker != 0x4B and marker != 0x4F:
                raise Fallback
            before, old_key, bns, pos = self._tuple(buf, pos + 1)
            if pos >= end or buf[pos] != 0x4E:
                raise Fallback
            after, key, ns, pos = self._tuple(buf, pos + 1)
            if pos > end:
                raise Fallback
            if ns is not None and marker == 0x4F:
                after, ns = self._fill_unsent(after, ns, before, bns)
            before_ns = self._key_only_not_sent if marker == 0x4B else _string_array(bns)
            body = b"".join([key, b"\x02", *after, b"\x02", *before, _string_array(ns), before_ns])
            if old_key == key:
                return 2, key, body, None
            return (
                2,
                key,
                body,
                (old_key, b"".join([old_key, b"\x00\x02", *before, b"\x00", before_ns])),
            )
        if kind == 0x44:  # 'D'
            if marker != 0x4B and marker != 0x4F:
                raise Fallback
            before, key, bns, pos = self._tuple(buf, pos + 1)
            if pos > end:
                raise Fallback
            before_ns = self._key_only_not_sent if marker == 0x4B else _string_array(bns)
            return 3, key, b"".join([key, b"\x00\x02", *before, b"\x00", before_ns]), None
        raise Fallback

    def _fill_unsent(
        self,
        after: tuple[bytes, ...],
        ns: list[str],
        before: tuple[bytes, ...],
        bns: list[str] | None,
    ) -> tuple[tuple[bytes, ...], list[str] | None]:
        """The new row's unchanged TOASTed values taken from the whole old row (FULL
        identity), as the general path does: ``(after, the columns still not sent)``."""
        filled = list(after)
        left: list[str] = []
        for name in ns:
            if bns is not None and name in bns:
                left.append(name)
            else:
                i = self._piece[name]
                filled[i] = before[i]
        return tuple(filled), left or None


def _string_array(items: Sequence[str] | None) -> bytes:
    """Avro ``array<string>``: one block, then the empty block."""
    if not items:
        return b"\x00"
    parts = [zigzag(len(items))]
    for s in items:
        data = s.encode()
        parts += (zigzag(len(data)), data)
    parts.append(b"\x00")
    return b"".join(parts)
