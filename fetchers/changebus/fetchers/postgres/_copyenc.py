"""``COPY ... TO STDOUT (FORMAT binary)`` rows straight to INSERT events: the seeder's fast path.

The bootstrap server's Postgres seeder reads each chunk of a table with a
binary COPY. The general way to encode those rows is to dress each row up
as a pgoutput ``Insert`` message and feed it through an
:class:`~._assembler.Assembler` window (Begin, the messages, Commit), then
split the window back into events: per row a message built, a transcoder
call, a framing call and a re-split. :class:`CopyEncoder` does the same
work in one generated function per table (one straight-line block per
column, as :class:`~._transcode.Transcoder` does, from the same per-type
snippets) that walks the COPY rows of a whole chunk and writes each row's
event -- header, key, change record -- in the same loop.

Exactness: every event is byte for byte what the Assembler path writes for
the same row at the same SCN, ``seq`` and timestamp (the framing is
:meth:`changebus.schemas.RowEncoder.frame`'s; ``tests/bootstrap/
test_snapshot_encode.py`` compares both paths over every supported type).
Whatever the transcoder would hand to the general path (NULL key columns,
infinities, out-of-range dates, numeric NaN or a scale other than the
column's, arrays deeper than declared, malformed data) raises
:class:`~._transcode.Fallback` here, and the caller encodes that chunk the
general way.

Thread-safety: immutable after construction (the timestamp memo is a cache);
one per table schema version, used by one seeder thread.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any, Final

from changebus.schemas import (
    HEADER_SIZE,
    MAGIC,
    VERSION,
    RowEncoder,
    avro_long,
    crc32,
    key_hash,
)

from .._policy import ColumnRule
from ._cellwalk import RUN_FORMATS, CellFormat, key_expr, name_p, nullable_key, walk_lines
from ._transcode import _SNIPPETS, _general_column, _rule, walker_env
from ._types import ColumnType

__all__ = ["CopyEncoder"]

#: the event header before its CRC (changebus.schemas' envelope layout, checked by the tests)
_HEAD: Final = struct.Struct("<HBBIQqQQIIIHHHH")
_U32: Final = struct.Struct("<I")
#: a COPY field's length (-1: NULL)
_I32: Final = struct.Struct(">i")
assert _HEAD.size + 4 == HEADER_SIZE
_NULL_FIELD: Final = b"\xff\xff\xff\xff"
_INSERT: Final = 1


def _varint(z: int) -> bytes:
    """The varint bytes of the zig-zag value ``z`` (that of the long ``(z >> 1) ^ -(z & 1)``)."""
    return avro_long((z >> 1) ^ -(z & 1))


#: varint bytes of a zig-zag value ``z < 2**14`` by ``z``, and the same after the union's
#: value branch; the low 14 bits of a larger one as two continuation bytes
_ZS: Final = tuple(_varint(z) for z in range(0x4000))
_PZ: Final = tuple(b"\x02" + v for v in _ZS)
_LOW14: Final = tuple(bytes(((z & 0x7F) | 0x80, (z >> 7) | 0x80)) for z in range(0x4000))
_PLOW14: Final = tuple(b"\x02" + v for v in _LOW14)
#: a zig-zag value ``z`` as varint bytes: up to 2**56 in 14-bit table lookups, no call
_Z_EXPR: Final = (
    "(ZS[z] if z < 16384 else L14[z & 16383] + (ZS[z >> 14] if z < 268435456 else "
    "L14[(z >> 14) & 16383] + (ZS[z >> 28] if z < 4398046511104 else "
    "L14[(z >> 28) & 16383] + (ZS[z >> 42] if z < 72057594037927936 else z_big(z >> 42)))))"
)
_PZ_EXPR: Final = (
    "(PZ[z] if z < 16384 else PL14[z & 16383] + (ZS[z >> 14] if z < 268435456 else "
    "L14[(z >> 14) & 16383] + (ZS[z >> 28] if z < 4398046511104 else "
    "L14[(z >> 28) & 16383] + (ZS[z >> 42] if z < 72057594037927936 else z_big(z >> 42)))))"
)


def _z_big(z: int) -> bytes:
    """The varint of a zig-zag value (any size; :data:`_Z_EXPR` calls it for ``z >> 42``
    of a value of 2**56 or more)."""
    return _ZS[z] if z < 0x4000 else _varint(z)


#: the transcoder's snippets with their zig-zag calls inlined as table lookups (most values
#: are small) and without its timestamp memo (COPY rows rarely share one): the same bytes
_INLINE: Final = (
    ("p = pzz(n) + v", "p = (PZ[n + n] if n < 8192 else pzz(n)) + v"),
    ("e = zz(n) + v", "e = (ZS[n + n] if n < 8192 else zz(n)) + v"),
    ("p = pzz(x)", "z = (x << 1) ^ (x >> 63)\np = " + _PZ_EXPR),
    ("e = zz(x)", "z = (x << 1) ^ (x >> 63)\ne = " + _Z_EXPR),
    (
        "p = TS.get(x)\nif p is None: p = present_ts(x)",
        "if x < US_MIN or x > US_MAX: raise Fallback\nz = x + PG_EPOCH_US\n"
        "z = (z << 1) ^ (z >> 63)\np = " + _PZ_EXPR,
    ),
)


def _inline(code: str) -> str:
    for old, new in _INLINE:
        code = code.replace(old, new)
    return code


#: ``rows(buf, pos, scn, ts, seq) -> (events, end, last_row_start, next_seq)``
RowsFn = Callable[[bytes, int, int, int, int], tuple[list[bytes], int, int, int]]


def _field_lines(
    rule: str | None, i: int, is_key: bool, indent: str, ctype: ColumnType
) -> list[str]:
    """Lines reading column i's COPY field at ``pos`` into ``p<i>`` (and ``k<i>``)."""
    width = 0
    code_p: str | None = None
    if rule is None:
        code = f"e = general{i}(v)"
    elif rule == "decimal":
        avro = ctype.avro
        assert isinstance(avro, dict)
        args = f"v, {int(avro['scale'])}, {10 ** int(avro['precision'])}"
        code = f"e = decimal_bytes({args})"
        code_p = f"p = pdecimal_bytes({args})"
    else:
        width, code, code_p = _SNIPPETS[rule]
    code = _inline(code)
    code_p = None if code_p is None else _inline(code_p)
    if is_key or code_p is None:
        body = [*code.split("\n"), f"p{i} = b'\\x02' + e"]
        if is_key:
            body.append(f"k{i} = e")
    else:
        body = name_p(code_p, i).split("\n")
    out: list[str]
    if width:  # the length and the value in one comparison and one slice
        out = [
            f"if buf[pos:pos + 4] == {width.to_bytes(4, 'big')!r}:",
            f"    v = buf[pos + 4:pos + {4 + width}]",
            f"    pos += {4 + width}",
        ]
        out += ["    " + line for line in body]
        if not is_key:  # a NULL key column: the general path
            out += [
                f"elif buf[pos:pos + 4] == {_NULL_FIELD!r}:",
                f"    p{i} = b'\\x00'",
                "    pos += 4",
            ]
        out += ["else:", "    raise Fallback"]
    else:
        out = [
            "n = I32(buf, pos)[0]",
            "pos += 4",
            "if n >= 0:",
            "    v = buf[pos:pos + n]",
            "    if len(v) != n: raise Fallback",
            "    pos += n",
        ]
        out += ["    " + line for line in body]
        if not is_key:
            out += ["elif n == -1:", f"    p{i} = b'\\x00'"]
        out += ["else:", "    raise Fallback"]
    return [indent + line for line in out]


def _skip_lines(indent: str) -> list[str]:
    """Lines stepping over a field at ``pos`` (an excluded column, or an extra field)."""
    out = [
        "n = I32(buf, pos)[0]",
        "pos += 4 if n < 0 else 4 + n",
    ]
    return [indent + line for line in out]


class CopyEncoder:
    """INSERT events of one table's binary COPY rows (see the module docstring).

    ``names``, ``types``, ``adapters``, ``key`` (column indexes in key
    order) and ``rules`` (the column policy's, None: no policy) are the
    table's as the Assembler holds them; ``encoder`` frames its events
    (source id, partition, schema fingerprint and version). Each COPY row
    holds the table's columns, then ``extra`` fields the caller selected
    after them (stepped over; :meth:`rows` says where the last row starts).
    """

    def __init__(
        self,
        names: Sequence[str],
        types: Sequence[ColumnType],
        adapters: Sequence[Callable[[Any], Any] | None],
        key: Sequence[int],
        rules: Sequence[ColumnRule | None] | None,
        encoder: RowEncoder,
        extra: int = 0,
    ) -> None:
        self.names = tuple(names)
        self.extra = extra
        self._rules = tuple(rules) if rules is not None else (None,) * len(self.names)
        self.rows: RowsFn = self._generate(types, adapters, tuple(key), encoder)

    def _generate(
        self,
        types: Sequence[ColumnType],
        adapters: Sequence[Callable[[Any], Any] | None],
        key: tuple[int, ...],
        encoder: RowEncoder,
    ) -> RowsFn:
        """Python source of this table's chunk walker, compiled.

        Runs of fixed-width integer-like columns are read with one
        ``struct`` call when all of them are present (the usual case).
        """
        env = walker_env(self.names)
        env.update(
            HEAD=_HEAD.pack,
            I32=_I32.unpack_from,
            U32=_U32.pack,
            crc=crc32,
            hash_=key_hash,
            join=b"".join,
            ZS=_ZS,
            PZ=_PZ,
            z_big=_z_big,
            L14=_LOW14,
            PL14=_PLOW14,
        )
        nfields = len(self.names) + self.extra
        table = encoder.table
        lines = [
            "def rows(buf, pos, scn, ts, seq):",
            "    out = []",
            "    add = out.append",
            "    size = len(buf)",
            "    last = -1",
            "    while True:",
            "        h = buf[pos:pos + 2]",
            f"        if h != {nfields.to_bytes(2, 'big')!r}:",
            "            if h == b'\\xff\\xff': return out, pos + 2, last, seq",
            "            raise Fallback",
            "        last = pos",
            "        pos += 2",
        ]
        policy = self._rules
        rules = [_rule(t) if r is None else None for t, r in zip(types, policy, strict=True)]
        ind = "        "
        lines += walk_lines(
            _COPY,
            types,
            policy,
            rules,
            key,
            env,
            ind,
            lambda i: _general_column(types[i], adapters[i], policy[i]),
        )
        for _ in range(self.extra):
            lines += _skip_lines(ind)
        keys = key_expr(key, nullable_key(key, table))
        excluded = {c for c, r in enumerate(policy) if r is not None and r.action == "exclude"}
        pieces = "".join(f"p{c}, " for c in range(len(types)) if c not in excluded)
        fixed = (
            f"{MAGIC}, {VERSION}, {_INSERT}, 64 + n, scn, ts, hash_(k), {table.fingerprint}, "
            f"n - kl, crc(body), seq, {encoder.source_id}, {encoder.partition}, "
            f"{table.version}, kl"
        )
        lines += [
            f"{ind}k = {keys}",
            f"{ind}body = join((k, b'\\x02', {pieces}b'\\x00\\x00\\x00'))",
            f"{ind}n = len(body)",
            f"{ind}kl = len(k)",
            f"{ind}if kl > 65535: raise Fallback  # the general path says why",
            f"{ind}if n > MAX_BODY: raise Fallback",
            f"{ind}head = HEAD({fixed})",
            f"{ind}add(join((head, U32(crc(head)), body)))",
            f"{ind}seq += 1",
        ]
        env["MAX_BODY"] = 0xFFFFFFFF - HEADER_SIZE
        self.source = "\n".join(lines)
        exec(self.source, env)  # the code is built from the fixed snippets here
        fn: RowsFn = env["rows"]
        return fn


#: COPY's cells: a 4-byte length before a value ("i" in a run; -1: NULL)
_COPY: Final = CellFormat(
    head_code="i",
    head=lambda rule: str(RUN_FORMATS[rule][1]),
    min_run=2,
    inline=_inline,
    cell=_field_lines,
    skip=_skip_lines,
)
