"""Decode the payload of data events: the reading half of :mod:`._payload`.

:class:`ChangeDecoder` reads change records (see :mod:`._payload` for their
layout) written with one writer :class:`TableSchema`, as rows of a reader
schema: generated readers (:mod:`._avroread`) for the common cases, fastavro
for the other resolutions, and a second try that keeps dates and timestamps
outside Python's range as their Avro ints instead of failing. Decimals longer
than their precision takes are refused on every path (fastavro's schemas name
a logical type of this module's, whose reader checks that first).

Thread-safety: decoders hold only immutable state (parsed schemas and
compiled readers; the columnar reader is compiled on first use, which two
threads may both do, with the same result) and may be shared between threads.
"""

from __future__ import annotations

import datetime
import io
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Final, NamedTuple, cast

import fastavro
from fastavro.read import LOGICAL_READERS

from ._avrocols import ColumnReader, compile_column_reader
from ._avroread import ChangeReader, _decimal_too_long, compile_change_reader, decimal_max_bytes
from ._table import TableSchema
from .errors import CorruptEventError

__all__ = ["ChangeDecoder", "DecodedChange"]

_read_row: Callable[..., Any] = fastavro.schemaless_reader
_NULL: Final = b"\x00"
_PRESENT: Final = b"\x02"

#: fastavro reads decimals with ``Decimal(int)``, quadratic in the digits (8 s for a
#: value of 200 KB), whatever the precision: the schemas it reads with (the fallback
#: for rows, keys) name this logical type instead, whose reader refuses a value
#: longer than its precision allows first, as the generated readers do
_DECIMAL: Final = "changebus.decimal"
_fastavro_decimal: Final[Callable[..., Any]] = LOGICAL_READERS["bytes-decimal"]


def _read_decimal(data: Any, writer_schema: Any, reader_schema: Any = None) -> Any:
    precision = writer_schema["precision"]
    limit = decimal_max_bytes(precision)
    if len(data) > limit:
        _decimal_too_long(data, limit, precision)
    return _fastavro_decimal(data, writer_schema, reader_schema)


# (fastavro's documented way to read a logical type of one's own)
LOGICAL_READERS[f"bytes-{_DECIMAL}"] = _read_decimal
LOGICAL_READERS[f"fixed-{_DECIMAL}"] = _read_decimal


def _guarded(schema: Any) -> Any:
    """``schema`` with every ``decimal`` logical type read by :func:`_read_decimal`."""
    if isinstance(schema, list):
        return [_guarded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _guarded(v) if k in ("type", "items", "values") else v for k, v in schema.items()}
    if out.get("logicalType") == "decimal":
        out["logicalType"] = _DECIMAL
    if "fields" in schema:
        out["fields"] = [{**f, "type": _guarded(f["type"])} for f in schema["fields"]]
    return out


def _parse_guarded(schema: dict[str, Any], parsed: Any) -> Any:
    """:func:`_guarded` ``schema`` parsed (``parsed``, the schema's own, without decimals)."""
    guarded = _guarded(schema)
    return parsed if guarded == schema else fastavro.parse_schema(guarded)


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
            if z >> 64:  # a tenth byte above 1: more than the 64 bits an Avro long has
                raise CorruptEventError("varint out of the long range in payload")
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


#: logical types whose values can lie outside Python's date, datetime and time (years
#: 1-9999; a time of 24:00:00, which Postgres has)
_WIDE_LOGICAL: Final = frozenset(
    {"date", "timestamp-micros", "local-timestamp-micros", "time-micros"}
)
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
        logical = schema["logicalType"]
        out["logicalType"] = _DECIMAL if logical == "decimal" else logical
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
    if logical == "time-micros":

        def time(n: int) -> Any:
            if not 0 <= n < 86_400_000_000:
                return n  # 24:00:00 (86400000000), the end of the day
            secs, micros = divmod(n, 1_000_000)
            return datetime.time(secs // 3600, secs // 60 % 60, secs % 60, micros)

        return time
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
    every value in range as fastavro would (by the writer's logical types) and
    leaves the others as the Avro int itself (days, or µs, since 1970-01-01).
    """

    def __init__(self, writer: dict[str, Any], reader: dict[str, Any] | None) -> None:
        self.writer = fastavro.parse_schema(_plain(writer))
        self.reader = None if reader is None else fastavro.parse_schema(_plain(reader))
        # the writer's logical types, as fastavro converts them (the reader's turned a
        # date read as a timestamp into microseconds in these rows only: found by review);
        # a field only the reader has holds its default (null), nothing to convert
        convert = _converter(writer)
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
    1970-01-01T00:00 UTC), never as an error. Likewise a ``time-micros``
    value of 24:00:00 (a Postgres ``time``), which ``datetime.time`` cannot
    hold, comes back as the int 86400000000 (µs since midnight).
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
        self._wkey = fastavro.parse_schema(_guarded(writer.key_schema))
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
        self._columnar: ColumnReader | None = None
        self._columnar_tried = False
        self._generic: tuple[Any, Any] | None = None  # fastavro's (writer, reader) schemas

    def _generic_schemas(self) -> tuple[Any, Any]:
        """The parsed writer and reader schemas fastavro reads rows with (made on first use)."""
        generic = self._generic
        if generic is None:
            w = _parse_guarded(self.writer.row_schema, self._w)
            r = None if self._r is None else _parse_guarded(self.reader.row_schema, self._r)
            generic = self._generic = (w, r)
        return generic

    @property
    def columns(self) -> tuple[str, ...]:
        """The column names of decoded rows, in order (the columns of :meth:`decode_columns`)."""
        return tuple(c.name for c in self.reader.columns)

    def decode_columns(
        self,
        buf: bytes | bytearray | memoryview,
        starts: Sequence[int],
        stops: Sequence[int],
        after: list[list[Any]],
        before: list[list[Any]],
    ) -> tuple[list[int], list[tuple[int, tuple[str, ...], tuple[str, ...]]]]:
        """Decode change records column by column: the bulk form of :meth:`decode_many`.

        ``after`` and ``before`` hold one list per column of :attr:`columns`;
        each record appends one value to every list of both (None where the
        image or the value is absent). Returns ``(present, not_sent)`` as
        described in :mod:`._avrocols`, whose generated reader is used when
        it handles the schemas: top-level timestamps, dates and times then
        come as Arrow's storage ints, UUIDs as text. Otherwise (and for
        values Python cannot hold) the rows of :meth:`decode_many` are split
        into the lists, values as :meth:`decode_many` gives them. On an
        error the lists may hold part of the batch.
        """
        if not self._columnar_tried:
            # compiled on first use; threads racing here compile it twice, harmlessly
            if isinstance(self._w, dict) and (self._r is None or isinstance(self._r, dict)):
                self._columnar = compile_column_reader(self._w, self._r)
            self._columnar_tried = True
        n0 = [len(c) for c in after], [len(c) for c in before]
        if self._columnar is not None:
            data = buf if isinstance(buf, bytes) else bytes(buf)
            try:
                return self._columnar(data, starts, stops, after, before)
            except CorruptEventError:
                raise
            except (ValueError, OverflowError):
                # maybe a value Python cannot hold: the row path decides
                for cols, lens in zip((after, before), n0, strict=True):
                    for c, n in zip(cols, lens, strict=True):
                        del c[n:]
            except Exception as exc:
                raise self._undecodable(exc) from exc
        names = self.columns
        present: list[int] = []
        not_sent: list[tuple[int, tuple[str, ...], tuple[str, ...]]] = []
        for i, (a, b, a_ns, b_ns) in enumerate(self.decode_many(buf, starts, stops)):
            for cols, image in ((after, a), (before, b)):
                if image is None:
                    for c in cols:
                        c.append(None)
                else:
                    get = image.get
                    for c, name in zip(cols, names, strict=True):
                        c.append(get(name))
            present.append((a is not None) | (b is not None) << 1)
            if a_ns or b_ns:
                not_sent.append((i, a_ns, b_ns))
        return present, not_sent

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
        (w, r), rename = self._generic_schemas(), self._rename
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
        """Decode key bytes (one key record exactly) into ``{column: value}``.

        Dates and timestamps outside Python's years 1-9999 come back as their
        Avro ints (days, or µs, since 1970-01-01), as in :meth:`decode_many`.
        """
        bio = io.BytesIO(key)
        try:
            try:
                row = cast(dict[str, Any], fastavro.schemaless_reader(bio, self._wkey, None))
            except (ValueError, OverflowError):
                if self._plain_key is None:
                    self._plain_key = _PlainReader(self.writer.key_schema, None)
                bio.seek(0)
                row = cast(dict[str, Any], self._plain_key.read(bio))
        except CorruptEventError:
            raise
        except Exception as exc:
            raise CorruptEventError(f"undecodable {self.writer.name!r} key: {exc!r}") from exc
        if bio.tell() != len(key):
            raise CorruptEventError(
                f"{self.writer.name!r} key: trailing bytes ({len(key) - bio.tell()})"
            )
        if self.writer.column_for_field:
            row = {self.writer.column_for_field.get(k, k): v for k, v in row.items()}
        return row
