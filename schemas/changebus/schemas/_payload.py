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

import datetime
import io
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any, Final, NamedTuple, cast

import fastavro

from ._avroread import ChangeReader, compile_change_reader
from ._crc import crc32
from ._envelope import HEADER_BODY, HEADER_SIZE, MAGIC, MAX_EVENT_SIZE, VERSION, Op
from ._partition import key_hash
from ._table import TableSchema
from ._varint import avro_long
from .errors import CorruptEventError, EventTooLargeError, SchemaError

__all__ = ["ChangeDecoder", "DecodedChange", "RowChange", "RowEncoder"]

_HEAD: Final = HEADER_BODY
_U32: Final = struct.Struct("<I")
_crc32 = crc32
_write_row = fastavro.schemaless_writer
_read_row: Callable[..., Any] = fastavro.schemaless_reader
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
            _FAST_KEY.get(t) if isinstance(t, str) else None for t in (types[k] for k in table.key)
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
        if self._rename:
            after = None if after is None else self._fields(after)
            before = None if before is None else self._fields(before)
        image = after if after is not None else before
        try:
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


#: logical types whose values can lie outside Python's date and datetime (years 1-9999)
_WIDE_LOGICAL: Final = frozenset({"date", "timestamp-micros", "local-timestamp-micros"})
_DAYS_TO_ORDINAL: Final = 719_163  # date(1970, 1, 1).toordinal()
_EPOCH_UTC: Final = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_EPOCH_NAIVE: Final = datetime.datetime(1970, 1, 1)


def _plain(schema: Any) -> Any:
    """``schema`` with the wide logical types dropped (their values read as plain ints)."""
    if isinstance(schema, list):
        return [_plain(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _plain(v) for k, v in schema.items() if k != "logicalType"}
    if schema.get("logicalType") not in _WIDE_LOGICAL and "logicalType" in schema:
        out["logicalType"] = schema["logicalType"]
    if "fields" in schema:
        out["fields"] = [{**f, "type": _plain(f["type"])} for f in schema["fields"]]
    return out


def _widen(logical: str) -> Callable[[int], Any]:
    """An int of a wide logical type to what fastavro gives, or the int outside Python's range."""
    if logical == "date":

        def date(n: int) -> Any:
            try:
                return datetime.date.fromordinal(n + _DAYS_TO_ORDINAL)
            except (ValueError, OverflowError):
                return n

        return date
    epoch = _EPOCH_UTC if logical == "timestamp-micros" else _EPOCH_NAIVE

    def timestamp(n: int) -> Any:
        try:
            return epoch + datetime.timedelta(microseconds=n)
        except OverflowError:
            return n

    return timestamp


def _converter(schema: Any) -> Callable[[Any], Any] | None:
    """For a value read with :func:`_plain`: turn the wide logical ints back (None: nothing to do)."""
    if isinstance(schema, list):
        branches = [c for c in (_converter(s) for s in schema) if c is not None]
        if not branches:
            return None
        inner = branches[0]  # a changebus union is ["null", T]
        return lambda v: None if v is None else inner(v)
    if isinstance(schema, dict):
        if schema.get("logicalType") in _WIDE_LOGICAL:
            return _widen(str(schema["logicalType"]))
        if schema.get("type") == "array":
            item = _converter(schema["items"])
            if item is not None:
                return lambda v: [item(x) for x in v]
        if schema.get("type") == "record":
            fields = [(f["name"], _converter(f["type"])) for f in schema["fields"]]
            todo = [(n, c) for n, c in fields if c is not None]
            if todo:

                def record(v: dict[str, Any]) -> dict[str, Any]:
                    for name, conv in todo:
                        if name in v:
                            v[name] = conv(v[name])
                    return v

                return record
    return None


class _PlainReader:
    """The second try for rows with dates or timestamps outside Python's years 1-9999.

    fastavro raises when it builds such a ``date`` / ``datetime``; this
    reader reads the row with the wide logical types dropped, then converts
    every value in range as fastavro would and leaves the others as the Avro
    int itself (days, or µs, since 1970-01-01).
    """

    def __init__(self, writer: dict[str, Any], reader: dict[str, Any] | None) -> None:
        self.writer = fastavro.parse_schema(_plain(writer))
        self.reader = None if reader is None else fastavro.parse_schema(_plain(reader))
        convert = _converter(reader if reader is not None else writer)
        self.convert: Callable[[Any], Any] = convert if convert is not None else (lambda v: v)

    def read(self, bio: io.BytesIO) -> Any:
        return self.convert(_read_row(bio, self.writer, self.reader))


class DecodedChange(NamedTuple):
    """The decoded payload of one data event (rows keyed by column name)."""

    after: dict[str, Any] | None
    before: dict[str, Any] | None
    after_not_sent: tuple[str, ...]
    before_not_sent: tuple[str, ...]


# tuple.__new__ directly: a NamedTuple's own __new__ is Python code, and this
# is once per decoded event
_new_change: Callable[[tuple[Any, ...]], DecodedChange] = partial(tuple.__new__, DecodedChange)


class ChangeDecoder:
    """Decodes payloads written with ``writer`` as rows of ``reader``.

    With ``reader`` None (or equal to the writer) rows come back as written;
    otherwise Avro schema resolution applies (added columns get null,
    dropped columns disappear, int widens to long, ...).

    Values of logical type ``date``, ``timestamp-micros`` and
    ``local-timestamp-micros`` come back as ``date`` / ``datetime`` objects,
    except those outside Python's years 1-9999 (a Postgres BC date, a year
    10000 timestamp), which Python cannot represent: they come back as the
    Avro int itself (days since 1970-01-01, microseconds since
    1970-01-01T00:00 UTC), never as an error.
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
        # a generated reader (see _avroread); it does the common resolutions
        # (columns added or dropped) itself and leaves the rest to fastavro
        self._fast: ChangeReader | None = (
            compile_change_reader(
                self._w, self._rename, _new_change, None if self._r is None else self._r
            )
            if isinstance(self._w, dict) and (self._r is None or isinstance(self._r, dict))
            else None
        )
        self._plain_row: _PlainReader | None = None
        self._plain_key: _PlainReader | None = None

    def decode(self, payload: bytes | memoryview) -> DecodedChange:
        """Decode one change record (see :meth:`decode_many` for batches)."""
        return self.decode_many(payload, (0,), (len(payload),))[0]

    def decode_many(
        self, buf: bytes | bytearray | memoryview, starts: Sequence[int], stops: Sequence[int]
    ) -> list[DecodedChange]:
        """Decode the change records ``buf[starts[i]:stops[i]]`` (already verified).

        One pass over the whole buffer instead of one per event: the batch
        form of :meth:`decode` for a response's worth of events.
        """
        if self._fast is not None:
            data = buf if isinstance(buf, bytes) else bytes(buf)
            try:
                return self._fast(data, starts, stops)
            except CorruptEventError:
                raise
            except (ValueError, OverflowError):
                pass  # maybe a value Python cannot hold (a date past 9999): the generic path decides
            except Exception as exc:
                raise self._undecodable(exc) from exc
        bio = io.BytesIO(buf)
        read, seek, tell = bio.read, bio.seek, bio.tell
        w, r, rename = self._w, self._r, self._rename
        out: list[DecodedChange] = []
        append = out.append
        try:
            for start, stop in zip(starts, stops, strict=True):
                seek(start)
                try:
                    branch = read(1)
                    after = _read_row(bio, w, r) if branch == _PRESENT else None
                    if after is None and branch != _NULL:
                        raise CorruptEventError(f"bad union branch {branch!r} in change payload")
                    branch = read(1)
                    before = _read_row(bio, w, r) if branch == _PRESENT else None
                    if before is None and branch != _NULL:
                        raise CorruptEventError(f"bad union branch {branch!r} in change payload")
                except (ValueError, OverflowError):
                    # a date or timestamp outside Python's range: read it again as ints
                    after, before = self._plain_images(bio, start)
                pos = tell()
                if stop - pos == 2 and buf[pos] == 0 and buf[pos + 1] == 0:
                    after_ns: tuple[str, ...] = ()
                    before_ns: tuple[str, ...] = ()
                else:
                    after_ns = _read_string_array(bio)
                    before_ns = _read_string_array(bio)
                    if tell() != stop:
                        raise CorruptEventError("change record does not end where its event ends")
                if rename:
                    if after is not None:
                        after = {rename.get(k, k): v for k, v in after.items()}
                    if before is not None:
                        before = {rename.get(k, k): v for k, v in before.items()}
                append(_new_change((after, before, after_ns, before_ns)))
        except CorruptEventError:
            raise
        except Exception as exc:
            raise self._undecodable(exc) from exc
        return out

    def _undecodable(self, exc: Exception) -> CorruptEventError:
        return CorruptEventError(
            f"undecodable {self.writer.name!r} v{self.writer.version} payload: {exc!r}"
        )

    def _plain_images(
        self, bio: io.BytesIO, start: int
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """Both images of the change record at ``start``, through :class:`_PlainReader`."""
        plain = self._plain_row
        if plain is None:
            reader = None if self._r is None else self.reader.row_schema
            plain = self._plain_row = _PlainReader(self.writer.row_schema, reader)
        bio.seek(start)
        images: list[dict[str, Any] | None] = []
        for _ in range(2):
            branch = bio.read(1)
            if branch == _PRESENT:
                images.append(plain.read(bio))
            elif branch == _NULL:
                images.append(None)
            else:
                raise CorruptEventError(f"bad union branch {branch!r} in change payload")
        return images[0], images[1]

    def decode_key(self, key: bytes | memoryview) -> dict[str, Any]:
        """Decode key bytes into ``{column: value}``.

        Dates and timestamps outside Python's years 1-9999 come back as their
        Avro ints (days, or µs, since 1970-01-01), as in :meth:`decode_many`.
        """
        try:
            try:
                row = cast(
                    dict[str, Any], fastavro.schemaless_reader(io.BytesIO(key), self._wkey, None)
                )
            except (ValueError, OverflowError):
                if self._plain_key is None:
                    self._plain_key = _PlainReader(self.writer.key_schema, None)
                row = cast(dict[str, Any], self._plain_key.read(io.BytesIO(key)))
        except Exception as exc:
            raise CorruptEventError(f"undecodable {self.writer.name!r} key: {exc!r}") from exc
        if self.writer.column_for_field:
            row = {self.writer.column_for_field.get(k, k): v for k, v in row.items()}
        return row
