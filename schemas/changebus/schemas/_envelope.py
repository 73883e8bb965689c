"""The event envelope: one change (or control signal) as bytes.

Layout
======
An event is a fixed 64-byte header, then ``key_length`` key bytes, then
``payload_length`` payload bytes. All integers are little-endian (the native
order of every machine we run on, so numpy reads headers without swapping)::

    offset size type  field           meaning
    ------ ---- ----  --------------  ------------------------------------------
       0    2   u16   magic           0x4243 ("CB" on the wire)
       2    1   u8    version         1
       3    1   u8    op              see :class:`Op`
       4    4   u32   total_length    64 + key_length + payload_length
       8    8   u64   scn             window SCN (the source's commit clock)
      16    8   i64   timestamp_ns    commit time, ns since the Unix epoch
      24    8   u64   key_hash        partition hash of the key bytes (0: no key)
      32    8   u64   schema_id       64-bit fingerprint of the writer schema
      40    4   u32   payload_length  bytes of payload
      44    4   u32   payload_crc     CRC-32 of key bytes + payload bytes
      48    4   u32   seq             0-based position of the event in its window
      52    2   u16   source_id       logical source (table) id; 0 for control
      54    2   u16   partition       physical partition id
      56    2   u16   schema_version  version of the writer schema (0: none)
      58    2   u16   key_length      bytes of key
      60    4   u32   header_crc      CRC-32 of bytes [0, 60)

CRC-32 is zlib's (polynomial 0xEDB88320). The header CRC covers every header
byte before it, including ``payload_crc``; the payload CRC covers the key
and the payload. So any change to any single byte of an event is detected: a
header byte breaks the header CRC, a key or payload byte breaks the payload
CRC, and a damaged CRC field no longer matches what it protects.

Bulk access
===========
:data:`HEADER_DTYPE` is a numpy structured dtype with exactly this layout.
Given the start offsets of events inside a buffer, :func:`headers_at` gathers
all their headers in one vectorised step; :func:`scan_offsets` finds the
offsets of back-to-back events (the only per-event Python work is reading
one length field). The relay keeps offsets in its index and never scans.

Thread-safety: everything here is a pure function over immutable inputs.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from ._crc import crc32
from .errors import CorruptEventError, EventTooLargeError

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "HEADER_DTYPE",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_EVENT_SIZE",
    "MAX_KEY_SIZE",
    "VERSION",
    "EventHeader",
    "Op",
    "check_headers",
    "decode_header",
    "encode_event",
    "event_at",
    "headers_at",
    "pack_header",
    "parse_small",
    "parse_stream",
    "scan_offsets",
    "verify_event",
    "verify_payloads",
]

MAGIC: Final = 0x4243
VERSION: Final = 1
HEADER_SIZE: Final = 64
MAX_KEY_SIZE: Final = 0xFFFF
#: Hard format limit; daemons configure a much lower operational limit.
MAX_EVENT_SIZE: Final = 0xFFFFFFFF


class Op(enum.IntEnum):
    """What an event says. Values below 16 are data events, the rest control."""

    INSERT = 1
    UPDATE = 2
    DELETE = 3
    TRUNCATE = 4
    # control events (source_id 0, no key)
    END_OF_WINDOW = 16
    HEARTBEAT = 17
    SCHEMA_CHANGE = 18
    DATA_LOSS = 19
    CHECKPOINT = 20
    MESSAGE = 21

    @property
    def is_control(self) -> bool:
        return self >= FIRST_CONTROL_OP


FIRST_CONTROL_OP: Final = 16

HEADER_DTYPE: Final = np.dtype(
    [
        ("magic", "<u2"),
        ("version", "u1"),
        ("op", "u1"),
        ("total_length", "<u4"),
        ("scn", "<u8"),
        ("timestamp_ns", "<i8"),
        ("key_hash", "<u8"),
        ("schema_id", "<u8"),
        ("payload_length", "<u4"),
        ("payload_crc", "<u4"),
        ("seq", "<u4"),
        ("source_id", "<u2"),
        ("partition", "<u2"),
        ("schema_version", "<u2"),
        ("key_length", "<u2"),
        ("header_crc", "<u4"),
    ]
)
assert HEADER_DTYPE.itemsize == HEADER_SIZE

#: bytes [0, 60) of the header: everything the header CRC covers
HEADER_BODY: Final = struct.Struct("<HBBIQqQQIIIHHHH")
_BODY = HEADER_BODY
_U32 = struct.Struct("<I")
_START = struct.Struct("<HBBI")  # magic, version, op, total_length: 8 bytes
_CRC_AT: Final = 60
_VALID_OPS: Final = np.zeros(256, dtype=bool)
_VALID_OPS[[int(op) for op in Op]] = True
_OP_SET: Final = frozenset(int(op) for op in Op)
#: the whole header, field for field in HEADER_DTYPE's order
_FULL = struct.Struct("<HBBIQqQQIIIHHHHI")
assert _FULL.size == HEADER_SIZE


@dataclass(frozen=True, slots=True)
class EventHeader:
    """One decoded header (the scalar twin of a :data:`HEADER_DTYPE` record)."""

    op: Op
    total_length: int
    scn: int
    timestamp_ns: int
    key_hash: int
    schema_id: int
    payload_length: int
    payload_crc: int
    seq: int
    source_id: int
    partition: int
    schema_version: int
    key_length: int


def encode_event(
    op: Op | int,
    scn: int,
    seq: int,
    timestamp_ns: int,
    key: bytes,
    payload: bytes,
    *,
    key_hash: int = 0,
    source_id: int = 0,
    partition: int = 0,
    schema_id: int = 0,
    schema_version: int = 0,
) -> bytes:
    """Encode one event; returns its bytes (header + key + payload).

    ``key_hash`` is normally :func:`changebus.schemas.key_hash` of ``key``; it
    is taken as given so callers that already know it do not hash twice.
    """
    klen = len(key)
    plen = len(payload)
    if klen > MAX_KEY_SIZE:
        raise EventTooLargeError(f"event key is {klen} bytes; the limit is {MAX_KEY_SIZE}")
    total = HEADER_SIZE + klen + plen
    if total > MAX_EVENT_SIZE:
        raise EventTooLargeError(f"event is {total} bytes; the format limit is {MAX_EVENT_SIZE}")
    out = bytearray(total)
    out[HEADER_SIZE : HEADER_SIZE + klen] = key
    out[HEADER_SIZE + klen :] = payload
    pack_header(
        out,
        op,
        scn,
        seq,
        timestamp_ns,
        klen,
        plen,
        crc32(memoryview(out)[HEADER_SIZE:]),
        key_hash=key_hash,
        source_id=source_id,
        partition=partition,
        schema_id=schema_id,
        schema_version=schema_version,
    )
    return bytes(out)


def pack_header(
    out: bytearray | memoryview,
    op: Op | int,
    scn: int,
    seq: int,
    timestamp_ns: int,
    key_length: int,
    payload_length: int,
    payload_crc: int,
    *,
    key_hash: int = 0,
    source_id: int = 0,
    partition: int = 0,
    schema_id: int = 0,
    schema_version: int = 0,
    offset: int = 0,
) -> None:
    """Write a complete header (with its CRC) into ``out`` at ``offset``.

    For encoders that build key and payload in place behind a reserved
    64-byte gap; ``payload_crc`` is the CRC-32 of key + payload.
    """
    if int(op) not in _OPS:
        raise ValueError(f"cannot encode event header: unknown op {op!r}")
    try:
        _BODY.pack_into(
            out,
            offset,
            MAGIC,
            VERSION,
            int(op),
            HEADER_SIZE + key_length + payload_length,
            scn,
            timestamp_ns,
            key_hash,
            schema_id,
            payload_length,
            payload_crc,
            seq,
            source_id,
            partition,
            schema_version,
            key_length,
        )
    except struct.error as exc:
        raise ValueError(f"cannot encode event header: {exc}") from exc
    _U32.pack_into(out, offset + _CRC_AT, crc32(memoryview(out)[offset : offset + _CRC_AT]))


_OPS: Final = frozenset(int(op) for op in Op)


def decode_header(buf: Buffer, offset: int = 0) -> EventHeader:
    """Decode and verify the header of the event starting at ``offset``.

    Raises :class:`CorruptEventError` on a bad magic, version, op or header
    CRC, or when the buffer ends inside the header.
    """
    mv = memoryview(buf)
    if offset < 0 or offset + HEADER_SIZE > len(mv):
        raise CorruptEventError(f"truncated event header at offset {offset}")
    fields = _BODY.unpack_from(mv, offset)
    magic, version, op = fields[0], fields[1], fields[2]
    if magic != MAGIC or version != VERSION:
        raise CorruptEventError(
            f"not a changebus v{VERSION} event at offset {offset} "
            f"(magic 0x{magic:04x}, version {version})"
        )
    if crc32(mv[offset : offset + _CRC_AT]) != _U32.unpack_from(mv, offset + _CRC_AT)[0]:
        raise CorruptEventError(f"header checksum mismatch at offset {offset}")
    try:
        op_e = Op(op)
    except ValueError:
        raise CorruptEventError(f"unknown op {op} at offset {offset}") from None
    header = EventHeader(op_e, *fields[3:])
    if header.total_length != HEADER_SIZE + header.key_length + header.payload_length:
        raise CorruptEventError(f"inconsistent lengths in event header at offset {offset}")
    return header


def verify_event(buf: Buffer, offset: int = 0) -> EventHeader:
    """Verify the whole event at ``offset`` (header and payload CRCs)."""
    header = decode_header(buf, offset)
    mv = memoryview(buf)
    end = offset + header.total_length
    if end > len(mv):
        raise CorruptEventError(f"truncated event at offset {offset}")
    if crc32(mv[offset + HEADER_SIZE : end]) != header.payload_crc:
        raise CorruptEventError(f"payload checksum mismatch at offset {offset}")
    return header


def event_at(buf: Buffer, offset: int, header: EventHeader) -> tuple[memoryview, memoryview]:
    """Return ``(key, payload)`` views of a verified event (no copies)."""
    mv = memoryview(buf)
    kstart = offset + HEADER_SIZE
    pstart = kstart + header.key_length
    return mv[kstart:pstart], mv[pstart : pstart + header.payload_length]


def scan_offsets(buf: Buffer, start: int = 0, end: int | None = None) -> npt.NDArray[np.int64]:
    """Offsets of the back-to-back events in ``buf[start:end]``.

    Stops at the first position where no complete event fits (a trailing
    partial event is not included). Only magic, version and lengths are
    checked here; use :func:`check_headers` and :func:`verify_payloads` to
    validate what was found.
    """
    mv = memoryview(buf)
    stop = len(mv) if end is None else end
    offsets: list[int] = []
    append = offsets.append
    pos = start
    unpack = _START.unpack_from
    limit = stop - HEADER_SIZE
    while pos <= limit:
        magic, version, _op, total = unpack(mv, pos)
        if magic != MAGIC or version != VERSION:
            raise CorruptEventError(f"no event at offset {pos} (magic 0x{magic:04x})")
        if total < HEADER_SIZE:
            raise CorruptEventError(f"impossible event length {total} at offset {pos}")
        if pos + total > stop:
            break
        append(pos)
        pos += total
    return np.asarray(offsets, dtype=np.int64)


def headers_at(buf: Buffer, offsets: npt.NDArray[np.integer[Any]]) -> npt.NDArray[Any]:
    """Gather the headers at ``offsets`` into a :data:`HEADER_DTYPE` array.

    One vectorised gather of whole rows from a sliding 64-byte window view of
    the buffer (no copy; only the headers are copied out, with no byte-index
    array in between); no validation (see :func:`check_headers`).
    """
    raw = np.frombuffer(buf, dtype=np.uint8)  # type: ignore[call-overload]
    offs = np.asarray(offsets, dtype=np.int64)
    if offs.size == 0:
        return np.empty(0, dtype=HEADER_DTYPE)
    if int(offs.min()) < 0 or int(offs.max()) + HEADER_SIZE > raw.size:
        raise CorruptEventError("event offset outside the buffer")
    rows = np.lib.stride_tricks.as_strided(
        raw, shape=(raw.size - HEADER_SIZE + 1, HEADER_SIZE), strides=(1, 1), writeable=False
    )
    result: npt.NDArray[Any] = rows[offs].view(HEADER_DTYPE).reshape(-1)
    return result


def check_headers(
    buf: Buffer, offsets: npt.NDArray[np.integer[Any]], headers: npt.NDArray[Any]
) -> None:
    """Vectorised structural checks plus every header CRC.

    Checks magic, version, op, length consistency and that each event lies
    inside the buffer, all in numpy; then one CRC per header. Raises
    :class:`CorruptEventError` naming the first bad offset.
    """
    _check_structure(buf, offsets, headers)
    offs = np.asarray(offsets, dtype=np.int64)
    mv = memoryview(buf)
    stored = headers["header_crc"].tolist()
    for off, want in zip(offs.tolist(), stored, strict=True):
        if crc32(mv[off : off + _CRC_AT]) != want:
            raise CorruptEventError(f"header checksum mismatch at offset {off}")


def _check_structure(
    buf: Buffer, offsets: npt.NDArray[np.integer[Any]], headers: npt.NDArray[Any]
) -> None:
    if headers.size == 0:
        return
    offs = np.asarray(offsets, dtype=np.int64)
    total = headers["total_length"].astype(np.int64)
    bad = (
        (headers["magic"] != MAGIC)
        | (headers["version"] != VERSION)
        | ~_VALID_OPS[headers["op"]]
        | (
            total
            != HEADER_SIZE
            + headers["key_length"].astype(np.int64)
            + headers["payload_length"].astype(np.int64)
        )
        | (offs + total > len(memoryview(buf)))
    )
    if bad.any():
        first = int(offs[int(np.argmax(bad))])
        raise CorruptEventError(f"malformed event header at offset {first}")


def verify_payloads(
    buf: Buffer, offsets: npt.NDArray[np.integer[Any]], headers: npt.NDArray[Any]
) -> None:
    """Check the payload CRC (key + payload) of every event."""
    mv = memoryview(buf)
    for off, total, want in zip(
        np.asarray(offsets, dtype=np.int64).tolist(),
        headers["total_length"].tolist(),
        headers["payload_crc"].tolist(),
        strict=True,
    ):
        if crc32(mv[off + HEADER_SIZE : off + total]) != want:
            raise CorruptEventError(f"payload checksum mismatch at offset {off}")


def parse_stream(
    buf: Buffer,
    *,
    verify_payload: bool = True,
    offsets: npt.NDArray[np.int64] | None = None,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[Any]]:
    """Split a buffer of back-to-back events and validate all of them.

    Returns ``(offsets, headers)``. The events must fill the buffer exactly:
    trailing bytes that are not a whole event raise :class:`CorruptEventError`
    (a response cut short, or a corrupted length). Structural checks are
    vectorised; the CRCs (header, and payload unless ``verify_payload`` is
    false) are computed in one pass. ``offsets``, when given, are what
    :func:`scan_offsets` returned for ``buf`` (the scan is not repeated;
    everything else is checked as usual).
    """
    if offsets is None:
        offsets = scan_offsets(buf)
    headers = headers_at(buf, offsets)
    _check_structure(buf, offsets, headers)
    end = int(offsets[-1]) + int(headers["total_length"][-1]) if offsets.size else 0
    mv = memoryview(buf)
    if end != len(mv):
        raise CorruptEventError(f"{len(mv) - end} stray bytes after the last event")
    if verify_payload:
        for off, total, hcrc, pcrc in zip(
            offsets.tolist(),
            headers["total_length"].tolist(),
            headers["header_crc"].tolist(),
            headers["payload_crc"].tolist(),
            strict=True,
        ):
            if crc32(mv[off : off + _CRC_AT]) != hcrc:
                raise CorruptEventError(f"header checksum mismatch at offset {off}")
            if crc32(mv[off + HEADER_SIZE : off + total]) != pcrc:
                raise CorruptEventError(f"payload checksum mismatch at offset {off}")
    else:
        for off, hcrc in zip(offsets.tolist(), headers["header_crc"].tolist(), strict=True):
            if crc32(mv[off : off + _CRC_AT]) != hcrc:
                raise CorruptEventError(f"header checksum mismatch at offset {off}")
    return offsets, headers


def parse_small(
    buf: Buffer, offsets: list[int], *, verify_payload: bool = True
) -> tuple[npt.NDArray[np.int64], npt.NDArray[Any], list[tuple[int, ...]]]:
    """:func:`parse_stream` for a few events, with each header unpacked as a tuple too.

    ``offsets`` are what :func:`scan_offsets` found (as a list). The same
    checks in the same order as :func:`parse_stream` (offsets, then every
    header's structure, stray bytes, then the CRCs event by event), so the
    same first error; the tuples hold the fields in :data:`HEADER_DTYPE`'s
    order. For a handful of events this is several times cheaper than the
    vectorised checks, whose numpy calls cost microseconds each.
    """
    mv = memoryview(buf)
    size = len(mv)
    unpack = _FULL.unpack_from
    rows: list[tuple[int, ...]] = []
    bad = -1
    if offsets and (min(offsets) < 0 or max(offsets) + HEADER_SIZE > size):
        raise CorruptEventError("event offset outside the buffer")
    for off in offsets:
        row = unpack(mv, off)
        if bad < 0 and (
            row[0] != MAGIC
            or row[1] != VERSION
            or row[2] not in _OP_SET
            or row[3] != HEADER_SIZE + row[14] + row[8]
            or off + row[3] > size
        ):
            bad = off
        rows.append(row)
    if bad >= 0:
        raise CorruptEventError(f"malformed event header at offset {bad}")
    end = offsets[-1] + rows[-1][3] if offsets else 0
    if end != size:
        raise CorruptEventError(f"{size - end} stray bytes after the last event")
    for off, row in zip(offsets, rows, strict=True):
        if crc32(mv[off : off + _CRC_AT]) != row[15]:
            raise CorruptEventError(f"header checksum mismatch at offset {off}")
        if verify_payload and crc32(mv[off + HEADER_SIZE : off + row[3]]) != row[9]:
            raise CorruptEventError(f"payload checksum mismatch at offset {off}")
    gathered = bytearray(b"".join([mv[off : off + HEADER_SIZE] for off in offsets]))
    headers: npt.NDArray[Any] = np.frombuffer(gathered, dtype=HEADER_DTYPE)
    return np.array(offsets, dtype=np.int64), headers, rows
