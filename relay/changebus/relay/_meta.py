"""The buffer's metadata record, double-buffered in a memory-mapped file.

The writer publishes the buffer's state (head, tail, SCNs, ...) after every
window by writing the next of two fixed slots, each with a sequence number
and a CRC. A process killed at any instant (even ``kill -9``) leaves at least
one intact slot in the page cache: the one with the highest sequence number
whose CRC matches is the last published state. Nothing here calls fsync on
the hot path; :meth:`MetaFile.flush` (msync) runs on clean shutdown and
periodically, for the case where the whole machine goes down, and with
``durability = "fsync"`` the syncer msyncs the slots after the ring bytes
they name (:mod:`._syncer`).

Thread-safety: only the writer thread calls :meth:`MetaFile.publish`.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

import numpy as np

from changebus.schemas.files import open_private

__all__ = ["POSITION_BYTES", "BufferMeta", "MetaFile", "kept_position"]

log = logging.getLogger("changebus.relay.buffer")

_SLOT: Final = 512
#: the slots of formats 1 to 3 (a file of two is rewritten in format 4 when opened)
_OLD_SLOT: Final = 256
_MAGIC: Final = 0x4D425243  # "CRBM"
_FORMAT: Final = 4
#: room for ``prev_pos`` (UTF-8); a longer position is stored as "" (not known). A
#: MySQL position names its binlog file twice with an XA transaction open, and a
#: host-named binlog (``mariadb-primary-0-bin``) after a failover's SCN base already
#: passed the 88 bytes of format 3
POSITION_BYTES: Final = 352
# magic, format, seq, capacity, event_slots, index_slots,
# head_event, tail_event, head_pos, tail_pos, prev_scn, last_scn, min_scn,
# index_head, index_tail, first_ts, last_ts, windows, evicted, prev_ts, prev_pos, crc
_STRUCT: Final = struct.Struct(f"<IIQQQQQQQQqqqQQqqQQq{POSITION_BYTES}sQ")
#: formats 3 (``prev_pos`` of 88 bytes), 2 (before ``prev_pos``) and 1 (before
#: ``evicted``), in 256-byte slots: read, never written
_STRUCT_3: Final = struct.Struct("<IIQQQQQQQQqqqQQqqQQq88sQ")
_STRUCT_2: Final = struct.Struct("<IIQQQQQQQQqqqQQqqQQqQ")
_STRUCT_1: Final = struct.Struct("<IIQQQQQQQQqqqQQqqQQ")
_LAYOUTS: Final = {1: _STRUCT_1, 2: _STRUCT_2, 3: _STRUCT_3, _FORMAT: _STRUCT}
assert _STRUCT.size <= _SLOT
assert _STRUCT_3.size <= _OLD_SLOT


@dataclass(frozen=True, slots=True)
class BufferMeta:
    """The published state of an event buffer.

    Positions are *virtual*: bytes ever written (``tail_pos``) or events ever
    written (``tail_event``), so they only grow; physical offsets are taken
    modulo the capacities. ``[head_event, tail_event)`` are the live events,
    ``[head_pos, tail_pos)`` the live bytes; both hold whole windows only.
    ``prev_scn`` is the SCN of the newest window ever evicted (-1: none), so a
    consumer whose checkpoint is ``>= prev_scn`` has missed nothing.
    ``evicted`` is 1 when windows before ``prev_scn`` were evicted or lost (a
    crash, a follower restarted after its upstream's eviction), 0 when
    ``prev_scn`` is only where the buffer started (nothing older was ever in
    it); a buffer of format 1 did not say, and counts as 1. ``prev_ts`` is
    the commit time of the window at ``prev_scn`` when an eviction set it (0:
    not known). ``first_ts`` / ``last_ts`` are those of the oldest and the
    newest kept window. ``prev_pos`` is the source position in the
    END_OF_WINDOW of the window at ``prev_scn`` ("" when not known: a buffer
    of an older format, a window that did not say, a position longer than
    :data:`POSITION_BYTES`); for an empty buffer it is where its source
    resumes, and what the source's own gap check compares with (a Postgres
    slot confirmed beyond it: DATA_LOSS).
    """

    capacity: int
    event_slots: int
    index_slots: int
    head_event: int = 0
    tail_event: int = 0
    head_pos: int = 0
    tail_pos: int = 0
    prev_scn: int = -1
    last_scn: int = -1
    min_scn: int = -1
    index_head: int = 0
    index_tail: int = 0
    first_ts: int = 0
    last_ts: int = 0
    windows: int = 0
    evicted: int = 0
    prev_ts: int = 0
    prev_pos: str = ""


class MetaFile:
    """Two CRC-protected metadata slots in a small memory-mapped file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if path.exists() and path.stat().st_size == 2 * _OLD_SLOT:
            _upgrade(path)
        created = not path.exists() or path.stat().st_size != 2 * _SLOT
        self._map = np.memmap(
            path, dtype=np.uint8, mode="w+" if created else "r+", shape=(2 * _SLOT,)
        )
        # a plain ndarray view: slicing an np.memmap runs Python code (__array_finalize__)
        self._slots = self._map.view(np.ndarray)
        self._seq = 0
        self.created = created

    def load(self) -> BufferMeta | None:
        """The newest intact slot, or None when neither slot is valid."""
        best = _newest(bytes(self._slots), _SLOT)
        if best is None:
            return None
        self._seq = best[0]
        return best[1]

    def publish(self, meta: BufferMeta) -> None:
        """Write ``meta`` into the older slot (never the one last written)."""
        self._seq += 1
        record = _record(meta, self._seq)
        start = (self._seq % 2) * _SLOT
        self._slots[start : start + len(record)] = np.frombuffer(record, dtype=np.uint8)

    def mapping(self) -> tuple[int, int]:
        """``(address, bytes)`` of the slots' mapping (the syncer msyncs it)."""
        return int(self._map.ctypes.data), int(self._map.nbytes)

    def flush(self) -> None:
        """msync the slots to disk."""
        self._map.flush()

    def close(self) -> None:
        self.flush()
        mm = getattr(self._map, "_mmap", None)
        if mm is not None:
            mm.close()


def _newest(data: bytes, slot_bytes: int) -> tuple[int, BufferMeta] | None:
    """``(seq, meta)`` of the intact slot of ``data`` with the highest sequence number."""
    best: tuple[int, BufferMeta] | None = None
    for slot in range(2):
        at = slot * slot_bytes
        fmt = int.from_bytes(data[at + 4 : at + 8], "little")
        layout = _LAYOUTS.get(fmt)
        if layout is None or layout.size > slot_bytes:
            continue
        raw = data[at : at + layout.size]
        fields = layout.unpack(raw)
        if fields[0] != _MAGIC or zlib.crc32(raw[: layout.size - 8]) != fields[-1]:
            continue
        seq = fields[2]
        values = list(fields[3:-1])
        if fmt >= 3:
            values[-1] = values[-1].rstrip(b"\0").decode("utf-8", "replace")
        meta = BufferMeta(*values)
        if fmt == 1 and meta.prev_scn >= 0:
            meta = replace(meta, evicted=1)  # (format 1 did not say: maybe)
        if best is None or seq > best[0]:
            best = (seq, meta)
    return best


def _upgrade(path: Path) -> None:
    """Rewrite a meta file of 256-byte slots (formats 1 to 3) in format 4, atomically.

    The newest intact slot is written into a new file beside it (the other
    slot empty), which is synced and renamed over the old one: a crash
    leaves either file whole. A file with no intact slot is left as it is
    (the buffer starts empty, as it did before).
    """
    best = _newest(path.read_bytes(), _OLD_SLOT)
    if best is None:
        return
    seq, meta = best
    record = _record(meta, seq)
    data = bytearray(2 * _SLOT)
    at = (seq % 2) * _SLOT
    data[at : at + len(record)] = record
    tmp = path.with_name(path.name + ".upgrade")
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.write(fd, bytes(data))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _record(meta: BufferMeta, seq: int) -> bytes:
    """One slot's bytes for ``meta`` at sequence number ``seq`` (format 4, with its CRC)."""
    body = _STRUCT.pack(
        _MAGIC,
        _FORMAT,
        seq,
        meta.capacity,
        meta.event_slots,
        meta.index_slots,
        meta.head_event,
        meta.tail_event,
        meta.head_pos,
        meta.tail_pos,
        meta.prev_scn,
        meta.last_scn,
        meta.min_scn,
        meta.index_head,
        meta.index_tail,
        meta.first_ts,
        meta.last_ts,
        meta.windows,
        meta.evicted,
        meta.prev_ts,
        _position_bytes(meta.prev_pos),
        0,
    )[: _STRUCT.size - 8]
    return body + struct.pack("<Q", zlib.crc32(body))


def _position_bytes(position: str) -> bytes:
    """``position`` as stored: UTF-8, or empty when it does not fit (not known)."""
    return kept_position(position).encode("utf-8")


#: a position too long to keep was logged (once a process: evictions come often)
_too_long_logged = False


def kept_position(position: str) -> str:
    """``position`` as the meta file keeps it ("" when too long): what a ``prev_pos``
    is set to, so the buffer says the same before and after a restart. The first
    position too long to keep is logged (a warning, once a process)."""
    size = len(position.encode("utf-8"))
    if size <= POSITION_BYTES:
        return position
    global _too_long_logged
    if not _too_long_logged:
        _too_long_logged = True
        log.warning(
            "a source position of %d bytes is longer than the %d the buffer's meta file "
            "keeps: the position before the oldest window is not known (a fetcher "
            "starting on an empty buffer resumes from the SCN alone, and chained relays "
            "get no position with a fall-off)",
            size,
            POSITION_BYTES,
        )
    return ""
