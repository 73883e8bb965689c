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

Decoding (:class:`ChangeDecoder`) lives in :mod:`._payload_read`.

Thread-safety: encoders and decoders hold only immutable state (parsed
schemas) and may be shared between threads.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, NamedTuple

import fastavro

from ._crc import crc32
from ._envelope import HEADER_BODY, HEADER_SIZE, MAGIC, MAX_EVENT_SIZE, VERSION, Op
from ._partition import key_hash
from ._payload_read import ChangeDecoder as ChangeDecoder, DecodedChange as DecodedChange
from ._table import TableSchema
from ._varint import avro_long
from .errors import EventTooLargeError, SchemaError

__all__ = ["ChangeDecoder", "DecodedChange", "RowChange", "RowEncoder"]

#: the most key bytes an event holds (its header's u16 ``key_length``)
MAX_KEY_BYTES = 0xFFFF

_HEAD: Final = HEADER_BODY
_U32: Final = struct.Struct("<I")
_crc32 = crc32
_write_row = fastavro.schemaless_writer
_TWO_EMPTY_ARRAYS: Final = b"\x00\x00"
_NULL_AND_TWO_EMPTY_ARRAYS: Final = b"\x00\x00\x00"
_HEADER_GAP: Final = bytes(HEADER_SIZE)
_CRC_AT: Final = 60
_NULL: Final = b"\x00"
_PRESENT: Final = b"\x02"
_EMPTY_ARRAY: Final = b"\x00"


_zigzag = avro_long


def _avro_string(s: str) -> bytes:
    data = s.encode()
    return _zigzag(len(data)) + data


def _avro_bytes(b: bytes) -> bytes:
    return _zigzag(len(b)) + bytes(b)


def _string_array(items: Sequence[str]) -> bytes:
    if not items:
        return _EMPTY_ARRAY
    return _zigzag(len(items)) + b"".join(_avro_string(s) for s in items) + _EMPTY_ARRAY


_FAST_KEY: Final[dict[str, Callable[[Any], bytes]]] = {
    "int": _zigzag,
    "long": _zigzag,
    "string": _avro_string,
    "bytes": _avro_bytes,
}


class RowChange(NamedTuple):
    """One row change to encode (rows keyed by column name)."""

    op: Op | int
    after: Mapping[str, Any] | None
    before: Mapping[str, Any] | None = None
    after_not_sent: Sequence[str] = ()
    before_not_sent: Sequence[str] = ()


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
            None if table.nullable_key or not isinstance(t, str) else _FAST_KEY.get(t)
            for t in (types[k] for k in table.key)
        ]
        self._key_bytes = self._key_encoder(fast)

    def _key_encoder(
        self, fast: list[Callable[[Any], bytes] | None]
    ) -> Callable[[Mapping[str, Any]], bytes]:
        """A specialised key encoder: Avro of the key record, without fastavro when simple."""
        fields = self._key_fields
        if not fields:
            return lambda row: b""
        pairs = [(f, name) for f, name in zip(fast, fields, strict=True) if f is not None]
        if len(pairs) == len(fields):
            if len(pairs) == 1:
                enc, name = pairs[0]
                return lambda row: enc(row[name])
            return lambda row: b"".join([enc(row[name]) for enc, name in pairs])
        schema = self._key_schema

        def generic(row: Mapping[str, Any]) -> bytes:
            bio = io.BytesIO()
            fastavro.schemaless_writer(bio, schema, {f: row[f] for f in fields})
            return bio.getvalue()

        return generic

    def _fields(self, row: Mapping[str, Any]) -> Mapping[str, Any]:
        if not self._rename:
            return row
        return {self._rename.get(k, k): v for k, v in row.items()}

    def key_bytes(self, row: Mapping[str, Any]) -> bytes:
        """The event key of ``row`` (column name -> Avro value; the key columns suffice):
        the Avro binary of the key record, as :meth:`encode` writes it (empty: no key)."""
        return self._key_bytes(self._fields(row))

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
        key: bytes | None = None,
    ) -> bytes:
        """Encode one data event (header + key + change record payload).

        The key comes from ``after``, or from ``before`` when there is no
        after-image (a delete). TRUNCATE events have neither and no key.
        ``key``: the event key already encoded (:meth:`key_bytes` of a row
        whose key columns differ from the image's: a MySQL zero date, null
        in the image, has a key value of its own).
        """
        if self._rename:
            after = None if after is None else self._fields(after)
            before = None if before is None else self._fields(before)
        image = after if after is not None else before
        try:
            if key is None:
                key = b"" if image is None else self._key_bytes(image)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SchemaError(
                f"cannot encode the key of a {self.table.name!r} row: {exc!r}"
            ) from exc
        bio = io.BytesIO()
        write = bio.write
        try:
            if after is not None and before is None and not after_not_sent and not before_not_sent:
                # the common case (an insert, or an update without before-image)
                write(key + _PRESENT)
                _write_row(bio, self._row, after)
                write(_NULL_AND_TWO_EMPTY_ARRAYS)
            else:
                write(key)
                for image in (after, before):
                    if image is None:
                        write(_NULL)
                    else:
                        write(_PRESENT)
                        _write_row(bio, self._row, image)
                write(_string_array(after_not_sent))
                write(_string_array(before_not_sent))
        except (TypeError, ValueError, AttributeError, KeyError) as exc:
            raise SchemaError(f"cannot encode a {self.table.name!r} row: {exc!r}") from exc
        return self.frame(op, scn, seq, timestamp_ns, key, bio.getvalue())

    def _key_too_long(self, klen: int) -> SchemaError:
        """The error of a key past what an event's header holds (every framing path)."""
        table = self.table
        whole = table.nullable_key or len(table.key) == len(table.columns)
        return SchemaError(
            f"a {table.name!r} row has a key of {klen} bytes, more than an event holds "
            f"({MAX_KEY_BYTES}); "
            + (
                "the table is keyed by all its columns (no primary key): give it one"
                if whole
                else "use a shorter key"
            )
        )

    def frame(
        self, op: Op | int, scn: int, seq: int, timestamp_ns: int, key: bytes, body: bytes
    ) -> bytes:
        """One data event from its encoded parts: the header, then ``body``.

        ``body`` is the key bytes followed by the change record (Avro of
        :attr:`TableSchema.change_schema`), as written by an encoder that
        produces Avro itself (the Postgres fetcher's transcoder); ``key`` is
        that key again (for its length and hash). :meth:`encode` ends here.
        """
        klen = len(key)
        if klen > MAX_KEY_BYTES:
            raise self._key_too_long(klen)
        size = len(body)
        if size + HEADER_SIZE > MAX_EVENT_SIZE:
            raise EventTooLargeError(
                f"a {self.table.name!r} event of {size} bytes is over the format limit"
            )
        op_i = int(op)  # an IntEnum costs more in every comparison and in struct
        if not 1 <= op_i <= 4:
            raise ValueError(f"{op!r} is not a data op")
        try:
            head = _HEAD.pack(
                MAGIC,
                VERSION,
                op_i,
                HEADER_SIZE + size,
                scn,
                timestamp_ns,
                key_hash(key),
                self._schema_id,
                size - klen,
                _crc32(body),
                seq,
                self.source_id,
                self.partition,
                self.table.version,
                klen,
            )
        except struct.error as exc:
            raise ValueError(f"cannot encode event header: {exc}") from exc
        return b"".join((head, _U32.pack(_crc32(head)), body))

    def encode_many(
        self,
        changes: Iterable[tuple[Any, ...]],
        scn: int,
        timestamp_ns: int,
        *,
        first_seq: int = 0,
        sizes: list[int] | None = None,
    ) -> bytes:
        """Encode a run of changes of one window as back-to-back events.

        Equal to joining :meth:`encode` of each change with seq numbers
        ``first_seq, first_seq + 1, ...``, but built in one buffer: headers
        are patched in place once key and payload are written. The size of
        each event is appended to ``sizes`` when given (for
        :attr:`changebus.fetchers.Window.event_sizes`).
        """
        bio = io.BytesIO()
        write = bio.write
        tell = bio.tell
        row_schema = self._row
        key_bytes = self._key_bytes
        spans: list[tuple[int, int, int, int, bytes]] = []
        for op, after, before, after_ns, before_ns in changes:
            if not 1 <= op <= 4:
                raise ValueError(f"{op!r} is not a data op")
            if self._rename:
                after = None if after is None else self._fields(after)
                before = None if before is None else self._fields(before)
            image = after if after is not None else before
            start = tell()
            try:
                key = b"" if image is None else key_bytes(image)
                if after is not None and before is None and not after_ns and not before_ns:
                    write(_HEADER_GAP + key + _PRESENT)
                    _write_row(bio, row_schema, after)
                    write(_NULL_AND_TWO_EMPTY_ARRAYS)
                else:
                    write(_HEADER_GAP + key)
                    for img in (after, before):
                        if img is None:
                            write(_NULL)
                        else:
                            write(_PRESENT)
                            _write_row(bio, row_schema, img)
                    write(_string_array(after_ns))
                    write(_string_array(before_ns))
            except (TypeError, ValueError, AttributeError, KeyError) as exc:
                raise SchemaError(f"cannot encode a {self.table.name!r} row: {exc!r}") from exc
            spans.append((start, tell() - start, int(op), len(key), key))
        view = bio.getbuffer()
        try:
            self._frame(view, spans, scn, timestamp_ns, first_seq, sizes)
        finally:
            view.release()
        return bio.getvalue()

    def encode_many_encoded(
        self,
        changes: Iterable[
            tuple[int, bytes, bytes | None, bytes | None, Sequence[str], Sequence[str]]
        ],
        scn: int,
        timestamp_ns: int,
        *,
        first_seq: int = 0,
        sizes: list[int] | None = None,
    ) -> bytes:
        """:meth:`encode_many` for rows a source decoder wrote in Avro itself.

        Each change is ``(op, key, after, before, after_not_sent,
        before_not_sent)``: ``key`` the Avro bytes of the key record,
        ``after``/``before`` the Avro bytes of the row record (this
        encoder's table schema, field by field) or None. The result is the
        same bytes :meth:`encode_many` gives for the same rows; the caller
        owns the correctness of the row bytes (they are not parsed here).
        """
        parts: list[bytes] = []
        extend = parts.extend
        spans: list[tuple[int, int, int, int, bytes]] = []
        add = spans.append
        start = 0
        for op, key, after, before, after_ns, before_ns in changes:
            if not 1 <= op <= 4:
                raise ValueError(f"{op!r} is not a data op")
            if before is None and after is not None and not after_ns and not before_ns:
                extend((_HEADER_GAP, key, _PRESENT, after, _NULL_AND_TWO_EMPTY_ARRAYS))
                total = HEADER_SIZE + 4 + len(key) + len(after)
            else:
                body = b"".join(
                    (
                        key,
                        _NULL if after is None else _PRESENT + after,
                        _NULL if before is None else _PRESENT + before,
                        _string_array(after_ns),
                        _string_array(before_ns),
                    )
                )
                extend((_HEADER_GAP, body))
                total = HEADER_SIZE + len(body)
            add((start, total, op, len(key), key))
            start += total
        buf = bytearray(b"".join(parts))
        view = memoryview(buf)
        try:
            self._frame(view, spans, scn, timestamp_ns, first_seq, sizes)
        finally:
            view.release()
        return bytes(buf)

    def _frame(
        self,
        view: memoryview,
        spans: list[tuple[int, int, int, int, bytes]],
        scn: int,
        timestamp_ns: int,
        first_seq: int,
        sizes: list[int] | None = None,
    ) -> None:
        """Fill in the headers of back-to-back events in ``view``.

        ``spans`` holds each event's (start, total size, op, key length, key);
        its header's 64 bytes at ``start`` are overwritten.
        """
        pack = _HEAD.pack_into
        pack_crc = _U32.pack_into
        crc = _crc32
        hash_key = key_hash
        schema_id, source_id = self._schema_id, self.source_id
        partition, version = self.partition, self.table.version
        if sizes is not None:
            sizes += [span[1] for span in spans]
        seq = first_seq
        try:
            for start, total, op_i, klen, key in spans:
                if klen > MAX_KEY_BYTES:
                    raise self._key_too_long(klen)
                if total > MAX_EVENT_SIZE:
                    raise EventTooLargeError(
                        f"a {self.table.name!r} event of {total} bytes is over the format limit"
                    )
                pack(
                    view,
                    start,
                    MAGIC,
                    VERSION,
                    op_i,
                    total,
                    scn,
                    timestamp_ns,
                    hash_key(key),
                    schema_id,
                    total - HEADER_SIZE - klen,
                    crc(view[start + HEADER_SIZE : start + total]),
                    seq,
                    source_id,
                    partition,
                    version,
                    klen,
                )
                pack_crc(view, start + _CRC_AT, crc(view[start : start + _CRC_AT]))
                seq += 1
        except struct.error as exc:
            raise ValueError(f"cannot encode event header: {exc}") from exc
