"""Vectorised decoding of change records: one numpy pass per field over a whole batch.

The generated column reader (``changebus.schemas._avrocols``) reads record
after record, value after value, in Python. Avro values have no fixed
positions, but the records of one writer schema all have the same fields in
the same order, so a batch can be read *field by field*: every record's
position sits in one numpy array, and reading a field moves all of them at
once. Per field that is a handful of numpy operations over the whole batch
(a varint: gather up to 10 bytes per record, find the first byte without the
continuation bit, assemble and un-zig-zag; a string: its length, then one
gather of every record's bytes into an Arrow string buffer) instead of ~20
bytecodes per value, and the values land in Arrow buffers without a Python
object each.

Handled: top-level fields of the primitive types (``int``, ``long``,
``float``, ``double``, ``boolean``, ``string``, ``bytes``), each optionally
in a union with ``null``, and the logical types the type mappers produce on
them: timestamps and local timestamps (micros, millis), ``date``,
``time-micros`` / ``time-millis``, ``uuid`` (canonical lower-case text) and
``decimal`` on ``bytes`` up to precision 18; columns added or dropped by
schema resolution. :func:`vector_reader` returns ``None`` for a schema with
anything else (records, arrays, maps, enums, fixed, wide decimals, type
promotions), and :meth:`VectorReader.read` raises :class:`Fallback` for a
batch holding a value it does not take as it is (a non-canonical UUID, a
decimal longer than 8 bytes or beyond its precision, an int beyond 32 bits):
the caller then uses the generated reader, which decides. Malformed input
raises :class:`~changebus.schemas.CorruptEventError`.

The values equal the generated reader's (``tests/client/test_spark_columns.py``
checks both paths against the row path for every type).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from changebus.schemas import ChangeDecoder, CorruptEventError
from changebus.schemas.avroplan import (
    UnsupportedSchema,
    expanded_type,
    read_string_array,
    resolution_plan,
)

__all__ = ["Fallback", "VectorReader", "vector_reader"]

_I64 = npt.NDArray[np.int64]
_PAD = 16  # zero bytes after the buffer: gathers never index past it
_SHIFTS = (7 * np.arange(10, dtype=np.uint64)).astype(np.uint64)


class Fallback(Exception):
    """This batch holds a value the vectorised reader leaves to the generated one."""


class _Field:
    """How to read one writer field: its kind, union layout and Arrow type."""

    __slots__ = ("branch", "kind", "nullable", "scale", "slot", "type", "width")

    def __init__(self, avro: Any, slot: int | None) -> None:
        self.slot = slot  # output column, None: dropped by resolution (read, not kept)
        self.nullable = False
        self.branch = 0  # with a null union: the byte of the value branch (2 x index)
        self.scale = 1  # millis -> micros
        self.width = 0
        if isinstance(avro, list):
            if len(avro) != 2 or "null" not in avro:
                raise UnsupportedSchema("a union other than [null, T]")
            self.nullable = True
            self.branch = 2 * (1 - avro.index("null"))
            avro = avro[1 - avro.index("null")]
        if isinstance(avro, str):
            base, logical = avro, None
        elif isinstance(avro, dict) and isinstance(avro.get("type"), str):
            base, logical = avro["type"], avro.get("logicalType")
        else:
            raise UnsupportedSchema("nested type")
        key = f"{base}-{logical}" if logical else str(base)
        spec = _KINDS.get(key)
        if spec is None:
            raise UnsupportedSchema(f"type {key}")
        self.kind, self.type, self.scale = spec
        if key == "bytes-decimal":
            assert isinstance(avro, dict)
            precision, scale = int(avro.get("precision", 0)), int(avro.get("scale", 0))
            if not 0 < precision <= 18:
                raise UnsupportedSchema("decimal wider than 18 digits")
            self.type = pa.decimal128(precision, scale)
            self.width = precision


#: Avro type (``base-logical``) -> (reading, Arrow type, factor)
_KINDS: dict[str, tuple[str, pa.DataType, int]] = {
    "int": ("int", pa.int32(), 1),
    "long": ("long", pa.int64(), 1),
    "float": ("float", pa.float32(), 1),
    "double": ("double", pa.float64(), 1),
    "boolean": ("bool", pa.bool_(), 1),
    "string": ("string", pa.string(), 1),
    "bytes": ("bytes", pa.binary(), 1),
    "long-timestamp-micros": ("long", pa.timestamp("us", tz="UTC"), 1),
    "long-timestamp-millis": ("long", pa.timestamp("us", tz="UTC"), 1000),
    "long-local-timestamp-micros": ("long", pa.timestamp("us"), 1),
    "long-local-timestamp-millis": ("long", pa.timestamp("us"), 1000),
    "int-date": ("int", pa.date32(), 1),
    "long-time-micros": ("long", pa.int64(), 1),
    "int-time-millis": ("int", pa.int64(), 1000),
    "string-uuid": ("uuid", pa.string(), 1),
    "bytes-decimal": ("decimal", pa.null(), 1),
}


def padded_bytes(buf: bytes) -> npt.NDArray[np.uint8]:
    """``buf`` and :data:`_PAD` zero bytes as uint8 (the gathers never index past them)."""
    return np.frombuffer(buf + bytes(_PAD), np.uint8)


class VectorReader:
    """Reads batches of one writer schema's change records (module docstring)."""

    def __init__(self, parsed_row: dict[str, Any], reader: dict[str, Any] | None) -> None:
        named = parsed_row.get("__named_schemas", {})
        resolve = None if reader is None else resolution_plan(parsed_row, reader)
        out = [f["name"] for f in (reader or parsed_row)["fields"]]
        index = {name: i for i, name in enumerate(out)}
        dropped = resolve.dropped if resolve is not None else frozenset()
        self.fields = [
            _Field(
                expanded_type(f["type"], named), None if f["name"] in dropped else index[f["name"]]
            )
            for f in parsed_row["fields"]
        ]
        self.ncols = len(out)

    def read(
        self,
        buf: bytes,
        starts: Sequence[int] | _I64,
        stops: Sequence[int] | _I64,
        padded: npt.NDArray[np.uint8] | None = None,
    ) -> tuple[list[pa.Array | None], list[pa.Array | None], _I64, list[Any]]:
        """``(after, before, present, not_sent)`` of the records ``buf[starts[i]:stops[i]]``.

        ``padded``: :func:`padded_bytes` of ``buf``, when the caller reads the
        same buffer for several schemas (it is made here otherwise).

        ``after`` / ``before``: per output column an array of one value per
        record (null where the image is absent), or None for a column the
        writer lacks (all null). ``present`` and ``not_sent`` as the
        generated reader returns them (``changebus.schemas._avrocols``).
        """
        try:
            return self._read(buf, starts, stops, padded)
        except IndexError:
            # a record cut short reads past the padding (the ends are checked once its
            # fields are read): the error the row path gives, not numpy's (review)
            raise CorruptEventError("a change record ends before its fields") from None

    def _read(
        self,
        buf: bytes,
        starts: Sequence[int] | _I64,
        stops: Sequence[int] | _I64,
        padded: npt.NDArray[np.uint8] | None,
    ) -> tuple[list[pa.Array | None], list[pa.Array | None], _I64, list[Any]]:
        u8 = padded_bytes(buf) if padded is None else padded
        size = len(buf)
        pos = np.asarray(starts, np.int64).copy()
        stop = np.asarray(stops, np.int64)
        n = len(pos)
        images: list[list[pa.Array | None]] = []
        present = np.zeros(n, np.int64)
        for flag in (1, 2):
            b = u8[pos]
            if ((b != 0) & (b != 2)).any():
                bad = int(b[(b != 0) & (b != 2)][0])
                raise CorruptEventError(f"bad union branch byte 0x{bad:02x} in a change record")
            pos += 1
            have = np.flatnonzero(b == 2)
            present[have] |= flag
            cols: list[pa.Array | None] = [None] * self.ncols
            if not len(have):  # no record has this image: every column null
                images.append(cols)
                continue
            p = pos[have]
            for f in self.fields:
                arr, p = _read_field(f, u8, p, size)
                if f.slot is not None:
                    cols[f.slot] = arr
            pos[have] = p
            images.append([None if c is None else _spread(c, have, n) for c in cols])
        if (pos > stop - 2).any() or (stop > size).any():
            raise CorruptEventError("change record does not end where its event ends")
        plain = (u8[pos] == 0) & (u8[pos + 1] == 0) & (pos + 2 == stop)
        not_sent: list[Any] = []
        for i in np.flatnonzero(~plain).tolist():
            after_ns, at = read_string_array(buf, int(pos[i]))
            before_ns, at = read_string_array(buf, at)
            if at != int(stop[i]):
                raise CorruptEventError("change record does not end where its event ends")
            if after_ns or before_ns:
                not_sent.append((i, after_ns, before_ns))
        return images[0], images[1], present, not_sent


def _spread(values: pa.Array, have: _I64, n: int) -> pa.Array:
    """``values`` of the records ``have`` as ``n`` values, null for the other records."""
    if len(have) == n:
        return values
    where = np.full(n, -1, np.int64)
    where[have] = np.arange(len(have), dtype=np.int64)
    return values.take(pa.array(where, mask=where < 0))


def _varint(u8: npt.NDArray[np.uint8], p: _I64, limit: int = 10) -> tuple[_I64, _I64]:
    """Zig-zag varints at ``p``: (values, positions after them)."""
    if not len(p):
        return np.zeros(0, np.int64), p
    first = u8[p]
    if not (first & 0x80).any():  # one byte each: the common case
        z = first.astype(np.int64)
        return (z >> 1) ^ -(z & 1), p + 1
    grid = u8[p[:, None] + np.arange(limit)]
    more = grid >= 0x80
    length = np.argmin(more, axis=1) + 1
    if more.all(axis=1).any():
        raise CorruptEventError("varint too long in payload")
    if limit == 10 and (grid[length == 10, 9] > 1).any():  # past the 64 bits of a long
        raise CorruptEventError("varint out of the long range in payload")
    used = np.arange(limit) < length[:, None]
    parts = (grid & 0x7F).astype(np.uint64) << _SHIFTS[:limit]
    z = np.bitwise_or.reduce(np.where(used, parts, np.uint64(0)), axis=1)
    value = (z >> np.uint64(1)).astype(np.int64) ^ -(z & np.uint64(1)).astype(np.int64)
    return value, p + length


def _validity(valid: npt.NDArray[np.bool_] | None) -> pa.Buffer | None:
    if valid is None or valid.all():
        return None
    return pa.py_buffer(np.packbits(valid, bitorder="little"))


def _read_field(f: _Field, u8: npt.NDArray[np.uint8], p: _I64, size: int) -> tuple[pa.Array, _I64]:
    """One field of every record at ``p``: (its values as Arrow, the positions after)."""
    m = len(p)
    valid: npt.NDArray[np.bool_] | None = None
    at = p
    if f.nullable:
        b = u8[p]
        valid = b == f.branch
        if (~valid & (b != 2 - f.branch)).any():
            bad = int(b[~valid & (b != 2 - f.branch)][0])
            raise CorruptEventError(f"bad union branch byte 0x{bad:02x} in a value")
        p = p + 1
        at = p[valid]
    kind = f.kind
    if kind in ("int", "long"):
        values, end = _varint(u8, at, 5 if kind == "int" else 10)
        if kind == "int" and ((values < -(2**31)) | (values >= 2**31)).any():
            raise Fallback("an int beyond 32 bits")
        values = values * f.scale if f.scale != 1 else values
        data = _full(
            values, valid, m, np.int32 if f.type in (pa.int32(), pa.date32()) else np.int64
        )
        arr = pa.Array.from_buffers(f.type, m, [_validity(valid), pa.py_buffer(data)])
    elif kind in ("float", "double"):
        width = 4 if kind == "float" else 8
        raw = u8[at[:, None] + np.arange(width)]
        values = raw.view("<f4" if width == 4 else "<f8").reshape(-1)
        end = at + width
        arr = pa.Array.from_buffers(
            f.type, m, [_validity(valid), pa.py_buffer(_full(values, valid, m, values.dtype))]
        )
    elif kind == "bool":
        values = u8[at] != 0
        end = at + 1
        full = _full(values, valid, m, np.bool_)
        arr = pa.Array.from_buffers(
            f.type, m, [_validity(valid), pa.py_buffer(np.packbits(full, bitorder="little"))]
        )
    else:  # string, bytes, uuid, decimal: a length, then the bytes
        length, first = _varint(u8, at)
        if (length < 0).any():
            raise CorruptEventError("negative length in payload")
        end = first + length
        if len(end) and int(end.max()) > size:
            raise CorruptEventError("truncated string in payload")
        if kind == "decimal":
            arr = _decimal(f, u8, first, length, valid, m)
        else:
            arr = _binary(f, u8, first, length, valid, m)
    if valid is None:
        return arr, end
    after = p.copy()
    after[valid] = end
    return arr, after


def _full(
    values: npt.NDArray[Any], valid: npt.NDArray[np.bool_] | None, m: int, dtype: Any
) -> npt.NDArray[Any]:
    if valid is None:
        return values.astype(dtype, copy=False)
    out = np.zeros(m, dtype)
    out[valid] = values
    return out


def _binary(
    f: _Field,
    u8: npt.NDArray[np.uint8],
    first: _I64,
    length: _I64,
    valid: npt.NDArray[np.bool_] | None,
    m: int,
) -> pa.Array:
    lengths = _full(length, valid, m, np.int64)
    offsets = np.zeros(m + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    if total >= 2**31:  # pragma: no cover - a batch is far smaller
        raise Fallback("more than 2 GiB of strings")
    # every value's bytes, gathered in one go: value k's i-th byte is at first[k] + i
    starts = _full(first, valid, m, np.int64)
    idx = np.repeat(starts - offsets[:-1], lengths) + np.arange(total, dtype=np.int64)
    data = u8[idx]
    if f.kind == "uuid" and total:
        if (length != 36).any():
            raise Fallback("a UUID not in canonical form")
        text = data.reshape(-1, 36)
        dash = np.zeros(36, np.bool_)
        dash[[8, 13, 18, 23]] = True
        hexdigit = ((text >= 48) & (text <= 57)) | ((text >= 97) & (text <= 102))
        if not (np.where(dash, text == 45, hexdigit)).all():
            raise Fallback("a UUID not in canonical form")
    arr = pa.Array.from_buffers(
        pa.binary() if f.kind == "bytes" else pa.string(),
        m,
        [_validity(valid), pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data)],
    )
    if f.kind != "bytes":
        try:
            arr.validate(full=True)  # UTF-8
        except pa.ArrowInvalid as exc:
            raise CorruptEventError(f"a string is not UTF-8: {exc}") from exc
    return arr


def _decimal(
    f: _Field,
    u8: npt.NDArray[np.uint8],
    first: _I64,
    length: _I64,
    valid: npt.NDArray[np.bool_] | None,
    m: int,
) -> pa.Array:
    """Big-endian two's complement unscaled values (1-8 bytes) as decimal128."""
    k = len(first)
    if k and (((length < 1) | (length > 8)).any()):
        raise Fallback("a decimal of 0 or more than 8 bytes")
    cols = np.arange(8)
    pad = (8 - length)[:, None]
    idx = first[:, None] + cols - pad
    grid = u8[np.maximum(idx, 0)]
    sign = np.where(u8[first] >= 0x80, 0xFF, 0).astype(np.uint8)
    grid = np.where(cols < pad, sign[:, None], grid).astype(np.uint8)
    unscaled = grid.view(">i8").reshape(-1).astype(np.int64)
    # (as unsigned: the magnitude of -2**63 overflows int64 back to -2**63, which
    # passed the check: found by review)
    if k and (np.abs(unscaled).view(np.uint64) >= np.uint64(10**f.width)).any():
        raise Fallback("a decimal beyond its precision")
    values = _full(unscaled, valid, m, np.int64)
    pairs = np.empty((m, 2), np.int64)
    pairs[:, 0] = values
    pairs[:, 1] = values >> 63
    return pa.Array.from_buffers(f.type, m, [_validity(valid), pa.py_buffer(pairs)])


_READERS: weakref.WeakKeyDictionary[ChangeDecoder, VectorReader | None] = (
    weakref.WeakKeyDictionary()
)


def vector_reader(decoder: ChangeDecoder) -> VectorReader | None:
    """The vectorised reader of ``decoder``'s schemas, or None when it cannot read them."""
    try:
        return _READERS[decoder]
    except KeyError:
        pass
    w, r = decoder._w, decoder._r
    vec: VectorReader | None = None
    if isinstance(w, dict) and (r is None or isinstance(r, dict)):
        try:
            vec = VectorReader(w, r)
        except UnsupportedSchema:
            vec = None
    _READERS[decoder] = vec
    return vec
