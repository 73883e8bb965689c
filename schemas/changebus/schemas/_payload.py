"""Encode and decode the key and payload of data events.

The payload of a data event is the Avro binary encoding of the table's
*change record* (:attr:`TableSchema.change_schema`)::

    record Change {
        union {null, Row} after;
        union {null, Row} before;
        array<string>     after_not_sent;   // columns with no value in `after`
        array<string>     before_not_sent;  // columns with no value in `before`
    }

The key is the Avro binary encoding of the key record (the key columns).

Asking fastavro to write the union ``{null, Row}`` makes it validate the row
against every branch, which costs more than writing the row itself. Avro
binary of a union is just the branch index (zig-zag varint: ``0x00`` for
null, ``0x02`` for the record) followed by the value, and an empty array is
the single byte ``0x00``; so :class:`RowEncoder` writes the row with fastavro
and frames the rest itself. The bytes are identical to what a generic Avro
library writes for the change record, and any Avro reader can decode them.

Thread-safety: encoders and decoders hold only immutable state (parsed
schemas) and may be shared between threads.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import fastavro

from ._envelope import Op, encode_event
from ._partition import key_hash
from ._table import TableSchema
from .errors import CorruptEventError, SchemaError

__all__ = ["ChangeDecoder", "DecodedChange", "RowEncoder"]

_NULL: Final = b"\x00"
_PRESENT: Final = b"\x02"
_EMPTY_ARRAY: Final = b"\x00"


def _zigzag(n: int) -> bytes:
    """Avro ``long``: zig-zag then little-endian base-128 varint."""
    z = (n << 1) ^ (n >> 63)
    if z < 0x80:
        return bytes((z,))
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def _avro_string(s: str) -> bytes:
    data = s.encode()
    return _zigzag(len(data)) + data


def _avro_bytes(b: bytes) -> bytes:
    return _zigzag(len(b)) + bytes(b)


def _string_array(items: Sequence[str]) -> bytes:
    if not items:
        return _EMPTY_ARRAY
    return _zigzag(len(items)) + b"".join(_avro_string(s) for s in items) + _EMPTY_ARRAY


def _read_long(bio: io.BytesIO) -> int:
    shift = 0
    z = 0
    while True:
        b = bio.read(1)
        if not b:
            raise CorruptEventError("payload ends inside a varint")
        byte = b[0]
        z |= (byte & 0x7F) << shift
        if byte < 0x80:
            return (z >> 1) ^ -(z & 1)
        shift += 7
        if shift > 63:
            raise CorruptEventError("varint too long in payload")


def _read_string_array(bio: io.BytesIO) -> tuple[str, ...]:
    out: list[str] = []
    while True:
        count = _read_long(bio)
        if count == 0:
            return tuple(out)
        if count < 0:  # a block with its byte size; the size is not needed here
            count = -count
            _read_long(bio)
        for _ in range(count):
            size = _read_long(bio)
            data = bio.read(size)
            if size < 0 or len(data) != size:
                raise CorruptEventError("truncated string in payload")
            out.append(data.decode())


_FAST_KEY: Final[dict[str, Callable[[Any], bytes]]] = {
    "int": _zigzag,
    "long": _zigzag,
    "string": _avro_string,
    "bytes": _avro_bytes,
}


class RowEncoder:
    """Encodes the data events of one table schema version.

    ``source_id`` and ``partition`` go into every header. Rows are mappings
    from column name to value, with values of the Python types fastavro
    expects for the column's Avro type (see the type mappers).
    """

    def __init__(self, table: TableSchema, *, source_id: int, partition: int = 0) -> None:
        if table.version <= 0:
            raise SchemaError(f"table schema {table.name!r} must be registered before encoding")
        self.table = table
        self.source_id = source_id
        self.partition = partition
        self._row = fastavro.parse_schema(table.row_schema)
        self._key_schema = fastavro.parse_schema(table.key_schema)
        self._schema_id = table.fingerprint
        self._rename = {c: f for f, c in table.column_for_field.items()}
        field_for = {c.name: self._rename.get(c.name, c.name) for c in table.columns}
        self._key_fields = tuple(field_for[k] for k in table.key)
        types = {c.name: c.type for c in table.columns}
        fast = [
            _FAST_KEY.get(t) if isinstance(t, str) else None for t in (types[k] for k in table.key)
        ]
        self._fast_key: tuple[Callable[[Any], bytes], ...] | None = (
            tuple(f for f in fast if f is not None) if all(f is not None for f in fast) else None
        )

    def _fields(self, row: Mapping[str, Any]) -> Mapping[str, Any]:
        if not self._rename:
            return row
        return {self._rename.get(k, k): v for k, v in row.items()}

    def _row_bytes(self, row: Mapping[str, Any]) -> bytes:
        bio = io.BytesIO()
        fastavro.schemaless_writer(bio, self._row, row)
        return bio.getvalue()

    def encode_key(self, row: Mapping[str, Any]) -> bytes:
        """The key bytes of ``row`` (a row keyed by *field* names)."""
        if not self._key_fields:
            return b""
        try:
            if self._fast_key is not None:
                return b"".join(
                    enc(row[f]) for enc, f in zip(self._fast_key, self._key_fields, strict=True)
                )
            bio = io.BytesIO()
            fastavro.schemaless_writer(bio, self._key_schema, {f: row[f] for f in self._key_fields})
            return bio.getvalue()
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SchemaError(
                f"cannot encode the key of a {self.table.name!r} row: {exc!r}"
            ) from exc

    def encode(
        self,
        op: Op,
        scn: int,
        seq: int,
        timestamp_ns: int,
        after: Mapping[str, Any] | None,
        before: Mapping[str, Any] | None = None,
        *,
        after_not_sent: Sequence[str] = (),
        before_not_sent: Sequence[str] = (),
    ) -> bytes:
        """Encode one data event (header + key + change record payload).

        The key comes from ``after``, or from ``before`` when there is no
        after-image (a delete). TRUNCATE events have neither and no key.
        """
        after_f = None if after is None else self._fields(after)
        before_f = None if before is None else self._fields(before)
        image = after_f if after_f is not None else before_f
        key = b"" if image is None else self.encode_key(image)
        try:
            parts = (
                _NULL if after_f is None else _PRESENT + self._row_bytes(after_f),
                _NULL if before_f is None else _PRESENT + self._row_bytes(before_f),
                _string_array(after_not_sent),
                _string_array(before_not_sent),
            )
        except (TypeError, ValueError, AttributeError) as exc:
            raise SchemaError(f"cannot encode a {self.table.name!r} row: {exc!r}") from exc
        return encode_event(
            op,
            scn,
            seq,
            timestamp_ns,
            key,
            b"".join(parts),
            key_hash=key_hash(key),
            source_id=self.source_id,
            partition=self.partition,
            schema_id=self._schema_id,
            schema_version=self.table.version,
        )


@dataclass(frozen=True, slots=True)
class DecodedChange:
    """The decoded payload of one data event (rows keyed by column name)."""

    after: dict[str, Any] | None
    before: dict[str, Any] | None
    after_not_sent: tuple[str, ...]
    before_not_sent: tuple[str, ...]


class ChangeDecoder:
    """Decodes payloads written with ``writer`` as rows of ``reader``.

    With ``reader`` None (or equal to the writer) rows come back as written;
    otherwise Avro schema resolution applies (added columns get null,
    dropped columns disappear, int widens to long, ...).
    """

    def __init__(self, writer: TableSchema, reader: TableSchema | None = None) -> None:
        self.writer = writer
        self.reader = reader or writer
        self._w = fastavro.parse_schema(writer.row_schema)
        self._r = (
            None
            if reader is None or reader.fingerprint == writer.fingerprint
            else fastavro.parse_schema(reader.row_schema)
        )
        self._wkey = fastavro.parse_schema(writer.key_schema)
        self._rename = dict(self.reader.column_for_field)

    def _read_row(self, bio: io.BytesIO) -> dict[str, Any] | None:
        branch = bio.read(1)
        if branch == _NULL:
            return None
        if branch != _PRESENT:
            raise CorruptEventError(f"bad union branch {branch!r} in change payload")
        row = cast(dict[str, Any], fastavro.schemaless_reader(bio, self._w, self._r))
        if self._rename:
            row = {self._rename.get(k, k): v for k, v in row.items()}
        return row

    def decode(self, payload: bytes | memoryview) -> DecodedChange:
        """Decode one change record."""
        bio = io.BytesIO(payload)
        try:
            after = self._read_row(bio)
            before = self._read_row(bio)
            after_ns = _read_string_array(bio)
            before_ns = _read_string_array(bio)
        except CorruptEventError:
            raise
        except Exception as exc:
            raise CorruptEventError(
                f"undecodable {self.writer.name!r} v{self.writer.version} payload: {exc!r}"
            ) from exc
        return DecodedChange(after, before, after_ns, before_ns)

    def decode_key(self, key: bytes | memoryview) -> dict[str, Any]:
        """Decode key bytes into ``{column: value}``."""
        try:
            row = cast(
                dict[str, Any], fastavro.schemaless_reader(io.BytesIO(key), self._wkey, None)
            )
        except Exception as exc:
            raise CorruptEventError(f"undecodable {self.writer.name!r} key: {exc!r}") from exc
        if self.writer.column_for_field:
            row = {self.writer.column_for_field.get(k, k): v for k, v in row.items()}
        return row
