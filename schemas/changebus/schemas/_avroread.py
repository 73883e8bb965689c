"""Generated Avro readers: Python source written per schema, faster than a generic reader.

A generic Avro reader (fastavro's ``schemaless_reader`` included) walks the
schema for every value it reads: it looks up each field's type, dispatches
on it, checks for a logical type, builds the record. For a table's row
record all of that is known in advance, so :func:`compile_change_reader`
writes, once per schema, a Python function that does only the reading:
one straight line of code per field, varints decoded inline (one byte is
the common case), strings sliced and decoded in place, logical types
converted without a lookup, the record built as one dict display. Column
names (not Avro field names) are the dict keys, so renamed fields cost
nothing either.

The values are those fastavro returns for the same bytes and writer schema:
the same Python types, the same logical-type conversions (the less common
ones call fastavro's own ``LOGICAL_READERS`` functions), and
``tests/schemas/test_avroread.py`` checks the two readers value for value on
every type the type mappers produce. Resolution to a reader schema is done
here for what schema evolution usually brings (columns added as nullable,
columns dropped); anything else (type promotions, aliases, recursive named
types, types nested deeper than generated Python code can be) makes
:func:`compile_change_reader` return ``None``, and the caller keeps using
fastavro.

Errors: malformed input raises whatever Python raises while reading
(``IndexError`` past the end, ``UnicodeDecodeError``, ``struct.error``,
``ValueError``); the caller wraps them (see
:class:`~changebus.schemas.ChangeDecoder`). Every record must end exactly
at its stop offset, and a block of an array or map may not count more items
than bytes are left before that offset (every item takes one at least: array
items of zero bytes, which table schemas refuse, are left to fastavro), so a
few bytes cannot make a list of millions. A decimal whose unscaled value takes
more bytes than its precision needs (:func:`decimal_max_bytes`) is corrupt
too: ``Decimal(int)`` takes time quadratic in its digits. Values within that
length read as fastavro reads them (rounded to the precision).

Thread-safety: generated functions keep no state and may be shared.
"""

from __future__ import annotations

import decimal
import functools
import json
import math
import struct
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, date, datetime, timedelta
from typing import Any, Final, NamedTuple

from fastavro.read import LOGICAL_READERS

from .errors import CorruptEventError

__all__ = ["ChangeReader", "compile_change_reader"]

ChangeReader = Callable[[bytes, Sequence[int], Sequence[int]], list[Any]]
"""``(buf, starts, stops) -> [(after, before, after_not_sent, before_not_sent), ...]``."""

_PRIMITIVES: Final = frozenset(
    ("null", "boolean", "int", "long", "float", "double", "bytes", "string")
)
_DAYS_TO_ORDINAL: Final = date(1970, 1, 1).toordinal()
#: arrays and maps nested in each other at most (two loops each): Python compiles
#: at most 20 nested loops (the batch loop is one)
_MAX_NESTED_BLOCKS: Final = 8
#: indentation levels of generated code at most (Python's limit is 100)
_MAX_INDENT: Final = 64
#: what compiling generated code may raise for a schema it cannot take (too deep for
#: Python's parser or compiler, a decimal context Python refuses, ...): the caller
#: falls back to fastavro
_CANNOT_COMPILE: Final = (SyntaxError, RecursionError, ValueError, OverflowError)


class _Unsupported(Exception):
    """The schema uses something the generator does not handle."""


def takes_no_bytes(
    schema: Any, named: Mapping[str, Any], seen: frozenset[str] = frozenset()
) -> bool:
    """Whether every value of ``schema`` is zero bytes long (``null``, an empty record,
    ``fixed`` of size 0, records of such): as array items or map values, a few bytes
    of counts would stand for any number of them."""
    if isinstance(schema, str):
        if schema in named and schema not in seen:
            return takes_no_bytes(named[schema], named, seen | {schema})
        return schema == "null"
    if not isinstance(schema, dict):
        return False  # a union: a branch index, one byte at least
    kind = schema.get("type")
    if kind in ("record", "error"):
        inner = seen | {schema["name"]} if isinstance(schema.get("name"), str) else seen
        return all(takes_no_bytes(f.get("type"), named, inner) for f in schema.get("fields", ()))
    if kind == "fixed":
        return schema.get("size") == 0
    if isinstance(kind, str | dict):
        return kind not in ("enum", "array", "map") and takes_no_bytes(kind, named, seen)
    return False


def _long(buf: bytes, pos: int) -> tuple[int, int]:
    """A zig-zag varint of more than one byte at ``pos``: (value, next position).

    Unrolled up to 8 bytes (timestamps in microseconds take 8), then a loop.
    """
    z = buf[pos] & 0x7F
    b = buf[pos + 1]
    z |= (b & 0x7F) << 7
    if b < 0x80:
        return (z >> 1) ^ -(z & 1), pos + 2
    b = buf[pos + 2]
    z |= (b & 0x7F) << 14
    if b < 0x80:
        return (z >> 1) ^ -(z & 1), pos + 3
    b = buf[pos + 3]
    z |= (b & 0x7F) << 21
    if b < 0x80:
        return (z >> 1) ^ -(z & 1), pos + 4
    b = buf[pos + 4]
    z |= (b & 0x7F) << 28
    if b < 0x80:
        return (z >> 1) ^ -(z & 1), pos + 5
    b = buf[pos + 5]
    z |= (b & 0x7F) << 35
    if b < 0x80:
        return (z >> 1) ^ -(z & 1), pos + 6
    b = buf[pos + 6]
    z |= (b & 0x7F) << 42
    if b < 0x80:
        return (z >> 1) ^ -(z & 1), pos + 7
    b = buf[pos + 7]
    z |= (b & 0x7F) << 49
    if b < 0x80:
        return (z >> 1) ^ -(z & 1), pos + 8
    shift = 56
    pos += 8
    while True:
        b = buf[pos]
        pos += 1
        z |= (b & 0x7F) << shift
        if b < 0x80:
            if z >> 64:  # a tenth byte above 1: more than the 64 bits an Avro long has
                raise CorruptEventError("varint out of the long range in payload")
            return (z >> 1) ^ -(z & 1), pos
        shift += 7
        if shift > 63:
            raise CorruptEventError("varint too long in payload")


def _size(buf: bytes, pos: int) -> tuple[int, int]:
    """A length (a non-negative long) at ``pos``."""
    n, pos = _long(buf, pos) if buf[pos] >= 0x80 else ((buf[pos] >> 1) ^ -(buf[pos] & 1), pos + 1)
    if n < 0:
        raise CorruptEventError(f"negative length {n} in payload")
    return n, pos


def _string_array(buf: bytes, pos: int) -> tuple[tuple[str, ...], int]:
    """An Avro ``array<string>`` at ``pos`` (the not-sent column lists)."""
    out: list[str] = []
    while True:
        count, pos = (
            _long(buf, pos) if buf[pos] >= 0x80 else ((buf[pos] >> 1) ^ -(buf[pos] & 1), pos + 1)
        )
        if count == 0:
            return tuple(out), pos
        if count < 0:  # a block with its byte size, not needed here
            count = -count
            _, pos = _size(buf, pos)
        for _ in range(count):
            n, pos = _size(buf, pos)
            end = pos + n
            if end > len(buf):
                raise CorruptEventError("truncated string in payload")
            out.append(buf[pos:end].decode())
            pos = end


def _bad_branch(byte: int, where: str) -> CorruptEventError:
    return CorruptEventError(f"bad union branch byte 0x{byte:02x} in {where}")


def _block_past_end(count: int, left: int) -> CorruptEventError:
    return CorruptEventError(
        f"a block of {count} items in the {max(left, 0)} bytes left of its record"
    )


@functools.lru_cache(maxsize=256)
def decimal_max_bytes(precision: int) -> int:
    """The most bytes the unscaled value of a decimal of ``precision`` digits takes
    (big-endian two's complement, as Avro writes it: ``±(10**precision - 1)``)."""
    if precision <= 4000:
        top: int = 10**precision - 1
        bits = top.bit_length()
    else:  # (an over-estimate, without the number itself)
        bits = math.ceil(precision * math.log2(10)) + 1
    return bits // 8 + 1  # with the sign bit


def _decimal_too_long(data: bytes, limit: int, precision: int) -> None:
    """The rare path of a decimal of more than ``limit`` bytes: refused unless its
    value fits them (a writer may pad with sign bytes)."""
    value = int.from_bytes(data, "big", signed=True)  # (linear in the bytes)
    if (value if value >= 0 else ~value).bit_length() >= 8 * limit:
        raise CorruptEventError(
            f"a decimal of {len(data)} bytes, more than its precision {precision} takes"
        )


class _Writer:
    """Accumulates the generated source and the constants it refers to."""

    def __init__(self, named: Mapping[str, Any]) -> None:
        self.named = named
        self.lines: list[str] = []
        self.consts: dict[str, Any] = {
            "_long": _long,
            "_size": _size,
            "_string_array": _string_array,
            "_bad_branch": _bad_branch,
            "_block_past_end": _block_past_end,
            "_decimal_too_long": _decimal_too_long,
            "_Corrupt": CorruptEventError,
            "_f32": struct.Struct("<f").unpack_from,
            "_f64": struct.Struct("<d").unpack_from,
            "_epoch": datetime(1970, 1, 1, tzinfo=UTC),
            "_epoch_naive": datetime(1970, 1, 1),
            "_td": timedelta,
            "_fromordinal": date.fromordinal,
            "_uuid": uuid.UUID,
            "_Decimal": decimal.Decimal,
            "_from_bytes": int.from_bytes,
        }
        self._n = 0
        self._open: set[str] = set()
        self._blocks = 0  # arrays and maps open around the code being emitted

    def compile(self, function: str, filename: str) -> Any:
        """The generated ``function``; may raise what :data:`_CANNOT_COMPILE` lists."""
        namespace = dict(self.consts)
        code = compile("\n".join(self.lines) + "\n", filename, "exec")
        exec(code, namespace)  # our own generated source: schema names appear only as literals
        return namespace[function]

    def name(self, prefix: str = "v") -> str:
        self._n += 1
        return f"{prefix}{self._n}"

    def const(self, value: Any, prefix: str = "_c") -> str:
        ref = self.name(prefix)
        self.consts[ref] = value
        return ref

    def emit(self, indent: int, line: str) -> None:
        self.lines.append("    " * indent + line)

    # ---- values ---------------------------------------------------------------

    def varint(self, target: str, ind: int) -> None:
        """A zig-zag varint: one and two bytes inline, longer ones by a call."""
        self.emit(ind, "b = buf[pos]")
        self.emit(ind, "if b < 0x80:")
        self.emit(ind + 1, f"{target} = (b >> 1) ^ -(b & 1)")
        self.emit(ind + 1, "pos += 1")
        self.emit(ind, "elif buf[pos + 1] < 0x80:")
        self.emit(ind + 1, "b = (b & 0x7F) | (buf[pos + 1] << 7)")
        self.emit(ind + 1, f"{target} = (b >> 1) ^ -(b & 1)")
        self.emit(ind + 1, "pos += 2")
        self.emit(ind, "else:")
        self.emit(ind + 1, f"{target}, pos = _long(buf, pos)")

    def length(self, target: str, ind: int) -> None:
        """A length (non-negative): one and two bytes inline."""
        self.emit(ind, f"{target} = buf[pos]")
        self.emit(ind, f"if {target} < 0x80 and not {target} & 1:")
        self.emit(ind + 1, f"{target} >>= 1")
        self.emit(ind + 1, "pos += 1")
        self.emit(ind, f"elif {target} >= 0x80 and buf[pos + 1] < 0x80 and not {target} & 1:")
        self.emit(ind + 1, f"{target} = (({target} & 0x7F) | (buf[pos + 1] << 7)) >> 1")
        self.emit(ind + 1, "pos += 2")
        self.emit(ind, "else:")
        self.emit(ind + 1, f"{target}, pos = _size(buf, pos)")

    def value(self, schema: Any, target: str, ind: int) -> None:
        """Emit code reading one value of ``schema`` at ``pos`` into ``target``."""
        if ind > _MAX_INDENT:
            raise _Unsupported("types nested too deeply")
        if isinstance(schema, list):
            self.union(schema, target, ind)
        elif isinstance(schema, str):
            if schema in _PRIMITIVES:
                self.primitive(schema, target, ind)
            elif schema in self.named:
                if schema in self._open:
                    raise _Unsupported(f"recursive type {schema}")
                self._open.add(schema)
                self.value(self.named[schema], target, ind)
                self._open.discard(schema)
            else:
                raise _Unsupported(f"unknown type {schema!r}")
        elif isinstance(schema, dict):
            self.complex(schema, target, ind)
        else:
            raise _Unsupported(f"bad schema {schema!r}")

    def primitive(self, kind: str, target: str, ind: int) -> str | None:
        """Emit code reading a value of a primitive type; the name of the variable with
        its length for bytes and string (None for the others)."""
        if kind == "null":
            self.emit(ind, f"{target} = None")
        elif kind == "boolean":
            self.emit(ind, f"{target} = buf[pos] != 0")
            self.emit(ind, "pos += 1")
        elif kind in ("int", "long"):
            self.varint(target, ind)
        elif kind == "float":
            self.emit(ind, f"{target} = _f32(buf, pos)[0]")
            self.emit(ind, "pos += 4")
        elif kind == "double":
            self.emit(ind, f"{target} = _f64(buf, pos)[0]")
            self.emit(ind, "pos += 8")
        else:  # bytes, string
            n = self.name("n")
            self.length(n, ind)
            # no bounds check: a value running past its event makes the record
            # miss its stop offset, which read_changes checks
            self.emit(ind, f"end = pos + {n}")
            self.emit(ind, f"{target} = buf[pos:end]" + (".decode()" if kind == "string" else ""))
            self.emit(ind, "pos = end")
            return n
        return None

    def union(self, branches: list[Any], target: str, ind: int) -> None:
        """A union: the branch index, then that branch (non-null branches tested first)."""
        if len(branches) > 63:
            raise _Unsupported("a union of more than 63 branches")
        # an index below 64 is one varint byte: the zig-zag of i is 2 * i
        idx = self.name("u")
        self.emit(ind, f"{idx} = buf[pos]")
        self.emit(ind, "pos += 1")
        order = sorted(range(len(branches)), key=lambda i: branches[i] == "null")
        for n, i in enumerate(order):
            self.emit(ind, f"{'if' if n == 0 else 'elif'} {idx} == {2 * i}:")
            self.value(branches[i], target, ind + 1)
        self.emit(ind, "else:")
        self.emit(ind + 1, f"raise _bad_branch({idx}, 'a value')")

    def complex(self, schema: dict[str, Any], target: str, ind: int) -> None:
        kind = schema.get("type")
        logical = schema.get("logicalType")
        length = None  # (bytes) the variable holding the value's length
        size = None  # (fixed) the size
        if kind == "record" or kind == "error":
            self.record(schema, target, ind, None)
        elif kind == "enum":
            symbols = self.const(tuple(schema["symbols"]), "_sym")
            i = self.name("e")
            self.varint(i, ind)
            self.emit(ind, f"{target} = {symbols}[{i}]")
        elif kind == "fixed":
            size = schema.get("size")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise _Unsupported(f"fixed of size {size!r}")  # (refused in table schemas)
            self.emit(ind, f"{target} = buf[pos:pos + {size}]")
            self.emit(ind, f"pos += {size}")
        elif kind == "array":
            self.blocks(schema["items"], None, target, ind)
        elif kind == "map":
            self.blocks(schema["values"], "string", target, ind)
        elif isinstance(kind, str) and kind in _PRIMITIVES:
            length = self.primitive(kind, target, ind)
        elif isinstance(kind, str | list | dict):
            self.value(kind, target, ind)
        else:
            raise _Unsupported(f"bad schema {schema!r}")
        if logical is None:
            return
        base = kind if isinstance(kind, str) else ""
        key = f"{base}-{logical}"
        # (timedelta's arguments by position: the same value, a third faster than by keyword)
        if key == "long-timestamp-micros":
            self.emit(ind, f"{target} = _epoch + _td(0, 0, {target})")
        elif key == "long-local-timestamp-micros":
            self.emit(ind, f"{target} = _epoch_naive + _td(0, 0, {target})")
        elif key in ("bytes-decimal", "fixed-decimal") and "precision" in schema:
            # fastavro's reader in two calls, with a context of the column's own (fastavro
            # sets the precision of one shared context at every value: 1.0 against 0.5 us,
            # and racy between threads); the same value, exponent and rounding
            precision = int(schema["precision"])
            context = self.const(decimal.Context(prec=precision), "_dc")
            scale = int(schema.get("scale", 0))
            # Decimal(int) takes time quadratic in the digits (8 s for 200 KB): an
            # unscaled value longer than the precision allows is refused first (one
            # compare of the length; a fixed no longer than that needs none)
            limit = decimal_max_bytes(precision)
            if length is not None:
                self.emit(ind, f"if {length} > {limit}:")
                self.emit(ind + 1, f"_decimal_too_long({target}, {limit}, {precision})")
            elif size is None or size > limit:
                self.emit(ind, f"_decimal_too_long({target}, {limit}, {precision})")
            self.emit(
                ind,
                f"{target} = _Decimal(_from_bytes({target}, 'big', signed=True))"
                f".scaleb({-scale}, {context})",
            )
        elif key == "int-date":
            self.emit(ind, f"{target} = _fromordinal({target} + {_DAYS_TO_ORDINAL})")
        elif key == "string-uuid":
            self.emit(ind, f"{target} = _uuid({target})")
        elif key in LOGICAL_READERS:
            fn = self.const(LOGICAL_READERS[key], "_lr")
            sch = self.const(schema, "_ls")
            self.emit(ind, f"{target} = {fn}({target}, {sch}, None)")

    def blocks(self, item: Any, key: str | None, target: str, ind: int) -> None:
        """An array (``key`` None) or a map: blocks of items until a zero count."""
        if key is None and takes_no_bytes(item, self.named):
            # (refused in table schemas) a count alone would stand for any number of them
            raise _Unsupported("array items of zero bytes")
        if self._blocks >= _MAX_NESTED_BLOCKS:
            raise _Unsupported("arrays or maps nested too deeply")
        count, k, v = self.name("k"), self.name("mk"), self.name("it")
        self.emit(ind, f"{target} = {{}}" if key else f"{target} = []")
        self.emit(ind, "while True:")
        self.varint(count, ind + 1)
        self.emit(ind + 1, f"if {count} == 0:")
        self.emit(ind + 2, "break")
        self.emit(ind + 1, f"if {count} < 0:")
        self.emit(ind + 2, f"{count} = -{count}")
        self.emit(ind + 2, "_, pos = _size(buf, pos)")
        # every item (every map entry: its key) takes a byte at least, so a count past
        # the bytes left is corrupt: refused before a list of that many is built
        self.emit(ind + 1, f"if {count} > stop - pos:")
        self.emit(ind + 2, f"raise _block_past_end({count}, stop - pos)")
        self.emit(ind + 1, f"for _ in range({count}):")
        if key:
            self.primitive(key, k, ind + 2)
        self._blocks += 1
        self.value(item, v, ind + 2)
        self._blocks -= 1
        self.emit(ind + 2, f"{target}[{k}] = {v}" if key else f"{target}.append({v})")

    def record(
        self,
        schema: dict[str, Any],
        target: str,
        ind: int,
        names: Mapping[str, str] | None,
        resolve: _Resolution | None = None,
    ) -> None:
        """A record as one dict display; ``names`` renames top-level fields.

        With ``resolve`` (top level only) the dict has the reader's fields:
        writer fields the reader lacks are read and dropped, reader fields
        the writer lacks get None; keys in fastavro's order (the writer's
        fields first).
        """
        parts = []
        for f in schema["fields"]:
            var = self.name()
            self.value(f["type"], var, ind)
            if resolve is not None and f["name"] in resolve.dropped:
                continue
            key = f["name"] if names is None else names.get(f["name"], f["name"])
            parts.append(f"{key!r}: {var}")
        for name in resolve.added if resolve is not None else ():
            key = name if names is None else names.get(name, name)
            parts.append(f"{key!r}: None")
        self.emit(ind, f"{target} = {{{', '.join(parts)}}}")


class _Resolution(NamedTuple):
    """What reading a writer's row record as a reader's takes (:func:`_plan`)."""

    dropped: frozenset[str]  # writer fields the reader does not have
    added: tuple[str, ...]  # reader fields the writer does not have (null by default)


def _expanded(schema: Any, named: Mapping[str, Any], seen: frozenset[str] = frozenset()) -> Any:
    """``schema`` with every named-type reference replaced by its definition."""
    if isinstance(schema, str):
        if schema in named and schema not in seen:
            return _expanded(named[schema], named, seen | {schema})
        return schema
    if isinstance(schema, list):
        return [_expanded(b, named, seen) for b in schema]
    if isinstance(schema, dict):
        inner = seen | {schema["name"]} if "name" in schema else seen
        out = dict(schema)
        for k in ("type", "items", "values"):
            if k in out:
                out[k] = _expanded(out[k], named, inner)
        if "fields" in out:
            out["fields"] = [
                {**f, "type": _expanded(f["type"], named, inner)} for f in out["fields"]
            ]
        return out
    return schema


def _plan(writer: Mapping[str, Any], reader: Mapping[str, Any]) -> _Resolution:
    """The resolution the generated reader can do itself, or :class:`_Unsupported`.

    Supported: fields dropped, and fields added that are nullable with a
    null default, the rest alike in type. Anything else (type promotions,
    aliases, other defaults, nested changes) stays with fastavro.
    """
    wnamed = writer.get("__named_schemas", {})
    rnamed = reader.get("__named_schemas", {})
    wfields = {f["name"]: f for f in writer["fields"]}
    rfields = {f["name"]: f for f in reader["fields"]}
    if writer.get("name") != reader.get("name"):
        raise _Unsupported("renamed record")
    added = []
    for name, rf in rfields.items():
        if rf.get("aliases"):
            raise _Unsupported("field aliases")
        wf = wfields.get(name)
        if wf is None:
            rtype = rf["type"]
            if not (
                isinstance(rtype, list) and rtype[:1] == ["null"] and rf.get("default", 0) is None
            ):
                raise _Unsupported(f"added field {name!r} without a null default")
            added.append(name)
            continue
        same = json.dumps(_expanded(wf["type"], wnamed), sort_keys=True) == json.dumps(
            _expanded(rf["type"], rnamed), sort_keys=True
        )
        if not same:
            raise _Unsupported(f"field {name!r} changed type")
    return _Resolution(frozenset(wfields) - frozenset(rfields), tuple(added))


def compile_change_reader(
    parsed_row: Mapping[str, Any],
    rename: Mapping[str, str],
    new: Callable[[tuple[Any, ...]], Any],
    reader: Mapping[str, Any] | None = None,
) -> ChangeReader | None:
    """A reader of change records whose row record is ``parsed_row``.

    ``parsed_row`` is the row schema as ``fastavro.parse_schema`` returns it
    (named types by full name); ``reader``, when given, the (parsed) row
    schema rows are to be resolved to; ``rename`` maps the fields of the
    rows returned to the column names they are keyed by; ``new`` builds one
    decoded change from the tuple ``(after, before, after_not_sent,
    before_not_sent)``. ``None`` when the schemas hold something the
    generator does not handle.
    """
    named = dict(parsed_row.get("__named_schemas", {}))
    w = _Writer(named)
    w.consts["_new"] = new
    try:
        resolve = None if reader is None else _plan(parsed_row, reader)
        # the row reader (used for before-images), then the batch loop with
        # the after-image's code inline
        w.emit(0, "def read_row(buf, pos, stop):")
        w.record(dict(parsed_row), "row", 1, rename, resolve)
        w.emit(1, "return row, pos")
        w.emit(0, "def read_changes(buf, starts, stops):")
        w.emit(1, "out = []")
        w.emit(1, "append = out.append")
        w.emit(1, "for pos, stop in zip(starts, stops):")
        w.emit(2, "b = buf[pos]")
        w.emit(2, "pos += 1")
        w.emit(2, "if b == 2:")
        w.record(dict(parsed_row), "after", 3, rename, resolve)
        w.emit(2, "elif b == 0:")
        w.emit(3, "after = None")
        w.emit(2, "else:")
        w.emit(3, "raise _bad_branch(b, 'a change record')")
        w.emit(2, "b = buf[pos]")
        w.emit(2, "pos += 1")
        w.emit(2, "if b == 2:")
        w.emit(3, "before, pos = read_row(buf, pos, stop)")
        w.emit(2, "elif b == 0:")
        w.emit(3, "before = None")
        w.emit(2, "else:")
        w.emit(3, "raise _bad_branch(b, 'a change record')")
        w.emit(2, "if pos + 2 == stop and buf[pos] == 0 and buf[pos + 1] == 0:")
        w.emit(3, "append(_new((after, before, (), ())))")
        w.emit(3, "continue")
        w.emit(2, "after_ns, pos = _string_array(buf, pos)")
        w.emit(2, "before_ns, pos = _string_array(buf, pos)")
        w.emit(2, "if pos != stop:")
        w.emit(3, "raise _Corrupt('change record does not end where its event ends')")
        w.emit(2, "append(_new((after, before, after_ns, before_ns)))")
        w.emit(1, "return out")
        compiled: ChangeReader = w.compile(
            "read_changes", f"<changebus reader {parsed_row.get('name')}>"
        )
    except (_Unsupported, *_CANNOT_COMPILE):
        return None
    return compiled
