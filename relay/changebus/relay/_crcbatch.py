"""Checking the CRCs of many events with a few large CRC calls (recovery only).

One job: find the first event whose header CRC or payload CRC does not
match, for a million events, without one Python-level CRC call per event.
Both checks rest on one property of CRC-32: the CRC of a message followed
by its own CRC (4 bytes, little-endian) is a constant, :data:`RESIDUE`,
whatever the message.

* **Headers** (:func:`first_bad_header`): a header is 60 bytes followed by
  their CRC, so the CRC of ``k`` intact headers back to back depends on
  ``k`` alone; it is compared with that of ``k`` template headers, 4096
  headers per call.
* **Payloads** (:func:`first_bad_payload`): an event's payload CRC sits in its
  header, before the payload. Events that lie back to back in the ring are
  copied, a few megabytes at a time, into a scratch buffer in which each
  event's 64 header bytes (between two payloads) are replaced by the
  previous event's payload CRC, 56 zero bytes and 4 *reset* bytes
  (:data:`_RESET`), chosen so that the CRC state after "an intact payload,
  its CRC, 56 zeros, reset" is the initial state again. The CRC of the
  whole copy is then :data:`RESIDUE` exactly when every payload in it is
  intact.

A batch that fails is checked again event by event to name the first bad
one. A damaged batch passes only by a 2**-32 chance (two errors that cancel
out). Pure functions; not for the hot path.
"""

from __future__ import annotations

import struct
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from changebus.schemas import HEADER_SIZE, crc32

__all__ = ["RESIDUE", "first_bad_header", "first_bad_payload"]

#: the CRC-32 of any message followed by its own CRC (little-endian)
RESIDUE: Final = 0x2144DF1C
#: offset of the header CRC in a header (it covers the bytes before it)
_HCRC_AT: Final = 60
#: headers per header-CRC call
_HEADER_BATCH: Final = 4096
#: payload bytes per payload-CRC call (the scratch buffer's size)
_PAYLOAD_BATCH: Final = 4 << 20
_ZEROS: Final = bytes(HEADER_SIZE - 8)


def _template_headers(count: int) -> bytes:
    body = bytes(_HCRC_AT)
    return (body + struct.pack("<I", crc32(body))) * count


_TEMPLATE: Final = _template_headers(_HEADER_BATCH)
_TEMPLATE_CRC: Final = crc32(_TEMPLATE)


def _reset_bytes(start: int) -> bytes:
    """The 4 bytes that take CRC value ``start`` back to the initial value 0.

    ``crc32(x, start)`` is affine in the 32 bits of ``x``: solve it for 0 by
    Gaussian elimination over GF(2).
    """
    base = crc32(bytes(4), start)
    # rows: (image of a unit vector, the unit vector)
    rows = [(crc32((1 << j).to_bytes(4, "little"), start) ^ base, 1 << j) for j in range(32)]
    pivots: list[tuple[int, int]] = []
    for image, unit in rows:
        for p_image, p_unit in pivots:
            if image ^ p_image < image:
                image, unit = image ^ p_image, unit ^ p_unit
        if image:
            pivots.append((image, unit))
            pivots.sort(reverse=True)
    target, solution = base, 0
    for p_image, p_unit in pivots:
        if target ^ p_image < target:
            target, solution = target ^ p_image, solution ^ p_unit
    assert target == 0, "CRC-32 appends are invertible"
    reset = solution.to_bytes(4, "little")
    assert crc32(reset, start) == 0
    return reset


_RESET: Final = _reset_bytes(crc32(_ZEROS, RESIDUE))


def first_bad_header(headers: npt.NDArray[Any]) -> int:
    """The first header whose CRC does not match (``len(headers)``: none)."""
    blocks = headers.view(np.uint8).reshape(-1, HEADER_SIZE)
    n = len(blocks)
    for start in range(0, n, _HEADER_BATCH):
        chunk = blocks[start : start + _HEADER_BATCH]
        want = _TEMPLATE_CRC if len(chunk) == _HEADER_BATCH else crc32(_TEMPLATE[: chunk.size])
        if crc32(chunk) == want:
            continue
        stored = headers["header_crc"][start : start + _HEADER_BATCH].tolist()
        for i, (row, crc) in enumerate(zip(chunk, stored, strict=True)):
            if crc32(row[:_HCRC_AT]) != crc:
                return start + i
    return n


def first_bad_payload(
    ring: memoryview, phys: npt.NDArray[np.int64], headers: npt.NDArray[Any]
) -> int:
    """The first event whose payload CRC (key + payload) does not match.

    ``phys`` are the events' offsets in ``ring``; they must be well formed
    (their lengths checked) and lie inside it.
    """
    n = len(phys)
    if n == 0:
        return 0
    total = headers["total_length"].astype(np.int64)
    crcs = headers["payload_crc"].astype("<u4")
    ends = phys + total
    # batches: runs of events back to back in the file, of at most _PAYLOAD_BATCH bytes
    cuts = np.flatnonzero(phys[1:] != ends[:-1]) + 1
    size = np.cumsum(total)
    by_size = np.flatnonzero(np.diff(size // _PAYLOAD_BATCH)) + 1
    starts: list[int] = np.union1d(np.union1d(cuts, by_size), [0]).tolist()
    stops = [*starts[1:], n]
    raw = np.frombuffer(ring, dtype=np.uint8)
    scratch = np.empty(_PAYLOAD_BATCH + (1 << 16) + 4, dtype=np.uint8)
    for a, b in zip(starts, stops, strict=True):
        first = int(phys[a]) + HEADER_SIZE
        last = int(ends[b - 1])
        if last - first + 4 <= scratch.size and _batch_ok(
            raw, scratch, phys[a:b], first, last, crcs[a:b]
        ):
            continue  # (a run with an event larger than the scratch buffer: one by one)
        bad = _first_bad_each(ring, phys[a:b], total[a:b], crcs[a:b])
        if bad < b - a:
            return a + bad
    return n


def _batch_ok(
    raw: npt.NDArray[np.uint8],
    scratch: npt.NDArray[np.uint8],
    phys: npt.NDArray[np.int64],
    first: int,
    last: int,
    crcs: npt.NDArray[np.uint32],
) -> bool:
    """Whether every payload of a run of back-to-back events is intact (see the module doc)."""
    size = last - first
    scratch[:size] = raw[first:last]
    if len(phys) > 1:
        heads = np.empty((len(phys) - 1, HEADER_SIZE), dtype=np.uint8)
        heads[:, 4:60] = 0
        heads[:, 60:] = np.frombuffer(_RESET, dtype=np.uint8)
        heads[:, :4] = crcs[:-1].view(np.uint8).reshape(-1, 4)
        rows = np.lib.stride_tricks.as_strided(
            scratch, shape=(size - HEADER_SIZE + 1, HEADER_SIZE), strides=(1, 1)
        )
        rows[phys[1:] - first] = heads
    scratch[size : size + 4] = crcs[-1:].view(np.uint8)
    return bool(crc32(scratch[: size + 4]) == RESIDUE)


def _first_bad_each(
    ring: memoryview,
    phys: npt.NDArray[np.int64],
    total: npt.NDArray[np.int64],
    crcs: npt.NDArray[np.uint32],
) -> int:
    """The first bad payload, one CRC call per event."""
    starts = (phys + HEADER_SIZE).tolist()
    ends = (phys + total).tolist()
    for i, (a, b, want) in enumerate(zip(starts, ends, crcs.tolist(), strict=True)):
        if crc32(ring[a:b]) != want:
            return i
    return len(starts)
