"""The synced watermark of a buffer (``durability = "fsync"``): ``synced.dat``.

One job: remember, on disk, the published state the syncer (:mod:`._syncer`)
last made durable, so that recovery (:mod:`._recovery`) can tell the two
kinds of damage an OS crash leaves apart:

* damage in windows **at or below** the watermark: their bytes were on
  disk, and the source was acknowledged for them (it no longer holds them),
  so the only way they changed is an eviction's newer bytes written over the
  oldest windows (or a flipped bit): those count as evicted, and every intact
  window after them is kept;
* damage **above** it: windows that were never synced, hence never
  acknowledged: the source still holds them and sends them again, so they
  are trimmed, never jumped over.

The syncer stores the state ``T`` of a sync after ``msync`` of the ring,
the tables and ``meta.dat`` and before it sets ``synced_scn`` (the
acknowledgements follow it): the stored watermark never names a byte that
was not on disk, and is never below what the source was acknowledged for.

Two slots of 64 bytes, each with a sequence number and a CRC, written
alternately (``pwrite`` + ``fdatasync``, no GIL held while the disk works):
a write torn by the crash leaves the other, older one, which is still true.
Only buffers with ``durability = "fsync"`` have the file (another mode
removes a stale one at open: its acknowledgements did not wait for it).

Thread-safety: :meth:`SyncedMark.store` is called by recovery (before the
syncer starts) and then by the syncer thread only.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from changebus.schemas.files import open_private

__all__ = ["Synced", "SyncedMark"]

_SLOT: Final = 64
_MAGIC: Final = 0x4D575243  # "CRWM"
_FORMAT: Final = 1
# magic, format, seq, tail_event, tail_pos, last_scn, crc
_STRUCT: Final = struct.Struct("<IIQQQqQ")
assert _STRUCT.size <= _SLOT
_datasync = getattr(os, "fdatasync", os.fsync)


@dataclass(frozen=True, slots=True)
class Synced:
    """A synced state: events before ``tail_event`` (bytes before ``tail_pos``, windows
    up to ``last_scn``) were on disk, and nothing after them was acknowledged."""

    tail_event: int
    tail_pos: int
    last_scn: int


class SyncedMark:
    """``synced.dat``: the newest synced state, in two CRC-protected slots."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = open_private(path, os.O_RDWR | os.O_CREAT)
        self._seq = 0
        self._synced: Synced | None = None
        data = os.pread(self._fd, 2 * _SLOT, 0)
        for slot in range(2):
            raw = data[slot * _SLOT : slot * _SLOT + _STRUCT.size]
            if len(raw) < _STRUCT.size:
                continue
            magic, fmt, seq, tail_event, tail_pos, last_scn, crc = _STRUCT.unpack(raw)
            if magic != _MAGIC or fmt != _FORMAT or zlib.crc32(raw[:-8]) != crc:
                continue
            if seq >= self._seq:
                self._seq = seq
                self._synced = Synced(tail_event, tail_pos, last_scn)

    def load(self) -> Synced | None:
        """The newest intact watermark (None: none was stored)."""
        return self._synced

    def store(self, synced: Synced) -> None:
        """Write ``synced`` into the older slot and sync it (the other one stays)."""
        self._seq += 1
        body = _STRUCT.pack(
            _MAGIC, _FORMAT, self._seq, synced.tail_event, synced.tail_pos, synced.last_scn, 0
        )[:-8]
        record = body + struct.pack("<Q", zlib.crc32(body))
        os.pwrite(self._fd, record, (self._seq % 2) * _SLOT)
        _datasync(self._fd)
        self._synced = synced

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
