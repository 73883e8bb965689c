"""Parsing pgoutput messages (logical replication protocol version 1).

Each CopyData payload of a logical replication stream (or each ``data`` row
of ``pg_logical_slot_peek_binary_changes``) is one message, identified by
its first byte. :func:`parse_message` turns it into one of the frozen
dataclasses below; integers are big-endian, strings NUL-terminated.

Tuple data: a tuple is a sequence of cells. A cell is ``None`` (SQL NULL),
:data:`UNCHANGED` (an unchanged TOASTed value the server did not send),
``bytes`` (a value in binary format, when the stream was started with
``binary 'true'``) or ``str`` (a value in text format: types without a binary
send function, or a text-mode stream). Turning cells into Python values is
the job of :mod:`._values`, which knows the column types from the Relation
message.

Timestamps are converted to nanoseconds since the Unix epoch.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

from changebus.schemas import CorruptEventError

__all__ = [
    "UNCHANGED",
    "Begin",
    "Cell",
    "Commit",
    "Delete",
    "Insert",
    "LogicalMessage",
    "Message",
    "Origin",
    "Relation",
    "RelationColumn",
    "Truncate",
    "TypeInfo",
    "Update",
    "parse_message",
    "pg_micros_to_unix_ns",
]

#: microseconds between 1970-01-01 and 2000-01-01 (Postgres' epoch)
PG_EPOCH_OFFSET_US: Final = 946_684_800_000_000


class _Unchanged:
    """An unchanged TOASTed value: the server did not send it."""

    _instance: _Unchanged | None = None

    def __new__(cls) -> _Unchanged:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED: Final = _Unchanged()
Cell = bytes | str | None | _Unchanged


def pg_micros_to_unix_ns(us: int) -> int:
    """A Postgres timestamp (µs since 2000-01-01) as ns since the Unix epoch."""
    return (us + PG_EPOCH_OFFSET_US) * 1000


@dataclass(frozen=True, slots=True)
class Begin:
    final_lsn: int
    commit_ts_ns: int
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_ts_ns: int


@dataclass(frozen=True, slots=True)
class Origin:
    lsn: int
    name: str


@dataclass(frozen=True, slots=True)
class RelationColumn:
    name: str
    type_oid: int
    typmod: int
    key: bool


@dataclass(frozen=True, slots=True)
class Relation:
    oid: int
    namespace: str
    name: str
    replica_identity: str  # 'd' default, 'n' nothing, 'f' full, 'i' index
    columns: tuple[RelationColumn, ...]


@dataclass(frozen=True, slots=True)
class TypeInfo:
    oid: int
    namespace: str
    name: str


@dataclass(frozen=True, slots=True)
class Insert:
    relation_oid: int
    new: tuple[Cell, ...]


@dataclass(frozen=True, slots=True)
class Update:
    relation_oid: int
    old_kind: str | None  # 'K' key only, 'O' whole old row (REPLICA IDENTITY FULL), None
    old: tuple[Cell, ...] | None
    new: tuple[Cell, ...]


@dataclass(frozen=True, slots=True)
class Delete:
    relation_oid: int
    old_kind: str  # 'K' or 'O'
    old: tuple[Cell, ...]


@dataclass(frozen=True, slots=True)
class Truncate:
    relation_oids: tuple[int, ...]
    cascade: bool
    restart_identity: bool


@dataclass(frozen=True, slots=True)
class LogicalMessage:
    transactional: bool
    lsn: int
    prefix: str
    content: bytes


Message = (
    Begin
    | Commit
    | Origin
    | Relation
    | TypeInfo
    | Insert
    | Update
    | Delete
    | Truncate
    | LogicalMessage
)

_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_U32 = struct.Struct(">I")
_BEGIN = struct.Struct(">QqI")
_COMMIT = struct.Struct(">BQQq")
_LSN = struct.Struct(">Q")
_COL = struct.Struct(">Ii")


class _Reader:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes | memoryview) -> None:
        self.buf = memoryview(buf)
        self.pos = 1

    def need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise CorruptEventError("pgoutput message ends early")

    def string(self) -> str:
        buf = self.buf
        end = self.pos
        size = len(buf)
        while end < size and buf[end] != 0:
            end += 1
        if end >= size:
            raise CorruptEventError("unterminated string in pgoutput message")
        text = bytes(buf[self.pos : end]).decode()
        self.pos = end + 1
        return text

    def byte(self) -> int:
        self.need(1)
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def i16(self) -> int:
        self.need(2)
        (v,) = _I16.unpack_from(self.buf, self.pos)
        self.pos += 2
        return int(v)

    def u32(self) -> int:
        self.need(4)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return int(v)

    def tuple_data(self) -> tuple[Cell, ...]:
        ncols = self.i16()
        buf = self.buf
        cells: list[Cell] = []
        append = cells.append
        unpack = _I32.unpack_from
        pos = self.pos
        size = len(buf)
        for _ in range(ncols):
            if pos >= size:
                raise CorruptEventError("pgoutput tuple ends early")
            kind = buf[pos]
            pos += 1
            if kind == 0x6E:  # 'n'
                append(None)
            elif kind == 0x75:  # 'u'
                append(UNCHANGED)
            elif kind in (0x62, 0x74):  # 'b', 't'
                if pos + 4 > size:
                    raise CorruptEventError("pgoutput tuple ends early")
                (n,) = unpack(buf, pos)
                pos += 4
                if n < 0 or pos + n > size:
                    raise CorruptEventError("bad value length in pgoutput tuple")
                value = bytes(buf[pos : pos + n])
                pos += n
                append(value if kind == 0x62 else value.decode())
            else:
                raise CorruptEventError(f"unknown tuple cell kind {kind!r}")
        self.pos = pos
        return tuple(cells)


def parse_message(data: bytes | memoryview) -> Message:
    """Parse one pgoutput message (see the module docstring)."""
    if not data:
        raise CorruptEventError("empty pgoutput message")
    r = _Reader(data)
    kind = r.buf[0]
    try:
        if kind == 0x42:  # 'B'
            r.need(_BEGIN.size)
            lsn, ts, xid = _BEGIN.unpack_from(r.buf, 1)
            return Begin(lsn, pg_micros_to_unix_ns(ts), xid)
        if kind == 0x43:  # 'C'
            r.need(_COMMIT.size)
            flags, commit_lsn, end_lsn, ts = _COMMIT.unpack_from(r.buf, 1)
            return Commit(flags, commit_lsn, end_lsn, pg_micros_to_unix_ns(ts))
        if kind == 0x49:  # 'I'
            oid = r.u32()
            if r.byte() != 0x4E:
                raise CorruptEventError("insert without a new tuple")
            return Insert(oid, r.tuple_data())
        if kind == 0x55:  # 'U'
            oid = r.u32()
            marker = r.byte()
            old_kind: str | None = None
            old = None
            if marker in (0x4B, 0x4F):  # 'K', 'O'
                old_kind = chr(marker)
                old = r.tuple_data()
                marker = r.byte()
            if marker != 0x4E:
                raise CorruptEventError("update without a new tuple")
            return Update(oid, old_kind, old, r.tuple_data())
        if kind == 0x44:  # 'D'
            oid = r.u32()
            marker = r.byte()
            if marker not in (0x4B, 0x4F):
                raise CorruptEventError("delete without an old tuple")
            return Delete(oid, chr(marker), r.tuple_data())
        if kind == 0x52:  # 'R'
            oid = r.u32()
            namespace = r.string()
            name = r.string()
            identity = chr(r.byte())
            ncols = r.i16()
            cols = []
            for _ in range(ncols):
                flags = r.byte()
                col_name = r.string()
                r.need(_COL.size)
                type_oid, typmod = _COL.unpack_from(r.buf, r.pos)
                r.pos += _COL.size
                cols.append(RelationColumn(col_name, type_oid, typmod, bool(flags & 1)))
            return Relation(oid, namespace, name, identity, tuple(cols))
        if kind == 0x59:  # 'Y'
            oid = r.u32()
            return TypeInfo(oid, r.string(), r.string())
        if kind == 0x54:  # 'T'
            nrels = r.u32()
            options = r.byte()
            oids = tuple(r.u32() for _ in range(nrels))
            return Truncate(oids, bool(options & 1), bool(options & 2))
        if kind == 0x4D:  # 'M'
            flags = r.byte()
            r.need(8)
            (lsn,) = _LSN.unpack_from(r.buf, r.pos)
            r.pos += 8
            prefix = r.string()
            size = r.u32()
            r.need(size)
            content = bytes(r.buf[r.pos : r.pos + size])
            return LogicalMessage(bool(flags & 1), lsn, prefix, content)
        if kind == 0x4F:  # 'O'
            r.need(8)
            (lsn,) = _LSN.unpack_from(r.buf, 1)
            r.pos = 9
            return Origin(lsn, r.string())
    except (struct.error, UnicodeDecodeError) as exc:
        raise CorruptEventError(f"malformed pgoutput message {chr(kind)!r}: {exc}") from exc
    raise CorruptEventError(f"unknown pgoutput message type {chr(kind)!r}")
