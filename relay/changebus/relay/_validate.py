"""Validation of appended windows: raw bytes in, the records the buffer commits out.

One job: decide whether a group of windows (back to back in ``data``) may
enter the buffer, and locate its events. The rules are the same on every
path; a group that breaks one is refused whole:

* every event is well formed: magic, version, a known op,
  ``total_length == HEADER_SIZE + key_length + payload_length``, and it
  lies inside the group;
* each window ends with exactly one END_OF_WINDOW event, and no other event
  ends a window;
* all events of a window carry the window's SCN, and their seq numbers are
  ``0, 1, 2, ...``; window SCNs increase within the group (the order against
  the buffer's newest window is checked by the buffer, at commit);
* no window has more events than the event table has slots
  (:class:`EventTooLargeError`).

Three ways to locate and check the events, chosen by :func:`validate`:

* **small groups** (up to ``_SCALAR_PARSE_BYTES``): one scalar pass, event by
  event, the window rules checked in the same pass (numpy's cost per call
  would dominate these);
* **large groups**: :func:`~changebus.schemas.parse_stream` (scan, bulk
  structure checks, every CRC), then :func:`check_windows`;
* **large trusted groups** (event sizes given for every window, see
  :meth:`~._buffer.EventBuffer.append_windows`): the events are located from
  the sizes (no scan), their headers checked in bulk *without* recomputing the
  CRCs the encoder in this process computed, then :func:`check_windows`.

Trusted sizes are checked on every path: they must add up to their windows
(:func:`check_sizes_add_up`) and match the lengths in the event headers. A
small trusted group skips the CRCs and nothing else.

The result is a :data:`PARSED_DTYPE` array, one record per event, with the
event's offset in ``data`` and the fields the buffer stores (plus ``ts`` and
``first``: the event opens a window), the offsets, and the parsed headers
(None from the scalar pass; the buffer gathers them only if a hook needs
them). Pure functions without state: the buffer calls them from its writer
thread.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from changebus.schemas import (
    HEADER_SIZE,
    MAGIC,
    CorruptEventError,
    EventTooLargeError,
    Op,
    crc32,
    headers_at,
    parse_stream,
)
from changebus.schemas.errors import BadRequestError

__all__ = ["PARSED_DTYPE", "Parsed", "check_sizes_add_up", "check_windows", "validate"]

#: groups up to this size are validated event by event, larger ones in bulk
_SCALAR_PARSE_BYTES: Final = 32 * 1024
_FULL_HEADER: Final = struct.Struct("<HBBIQqQQIIIHHHHI")
_OPS: Final = frozenset(int(op) for op in Op)
_VALID_OP = np.zeros(256, dtype=bool)
_VALID_OP[sorted(_OPS)] = True
_EOW: Final = int(Op.END_OF_WINDOW)

PARSED_DTYPE: Final = np.dtype(
    [
        ("off", "<i8"),  # offset of the event in the group's data
        ("scn", "<i8"),
        ("key_hash", "<u8"),
        ("length", "<i8"),
        ("op", "u1"),
        ("source_id", "<u2"),
        ("ts", "<i8"),
        ("first", "?"),  # the event opens a window
    ]
)

#: ``(records, offsets, headers or None)``
Parsed = tuple[npt.NDArray[Any], npt.NDArray[np.int64], npt.NDArray[Any] | None]

# one wording per rule, whichever path finds the break
_UNCLOSED: Final = "each window must end with exactly one END_OF_WINDOW event"
_EOW_INSIDE: Final = "END_OF_WINDOW may only close a window"
_MIXED_SCN: Final = "all events of a window must carry the window's SCN"
_BAD_SEQ: Final = "event seq numbers of a window must be 0, 1, 2, ..."
_SCN_ORDER: Final = "window SCNs must increase"


def validate(
    windows: Sequence[bytes | memoryview],
    data: bytes | memoryview,
    sizes: Sequence[Sequence[int]],
    slots: int,
) -> Parsed:
    """Check a group (``data``: ``windows`` back to back) and locate its events.

    ``sizes`` has one entry per window: its event sizes (trusted), or empty.
    The group is trusted only when every window has sizes. ``slots`` is the
    event table's size (the most events one window may have).
    """
    trusted = all(sizes)
    if len(data) <= _SCALAR_PARSE_BYTES:  # numpy's per-call cost would dominate
        parsed = _parse_small(windows, data, slots, check_crc=not trusted)
        if trusted:
            check_sizes_add_up(windows, sizes)
            if list(itertools.chain.from_iterable(sizes)) != parsed[0]["length"].tolist():
                raise CorruptEventError("event sizes do not match the event headers")
        return parsed
    if trusted:
        return _parse_trusted(windows, sizes, data, slots)
    offsets, headers = parse_stream(data)
    return check_windows(windows, offsets, headers, slots)


def check_sizes_add_up(
    windows: Sequence[bytes | memoryview], sizes: Sequence[Sequence[int]]
) -> None:
    """The event sizes of each trusted window must add up to its length."""
    if list(map(sum, sizes)) != list(map(len, windows)):
        raise BadRequestError("event sizes do not add up to their windows")


def _too_many_events(slots: int) -> EventTooLargeError:
    return EventTooLargeError(f"a window has more events than the event table ({slots})")


def _parse_small(
    windows: Sequence[bytes | memoryview],
    data: bytes | memoryview,
    slots: int,
    *,
    check_crc: bool,
) -> Parsed:
    """Validate a small group event by event (no per-call numpy overhead).

    ``check_crc`` False (trusted windows) skips the two CRCs per event.
    """
    mv = memoryview(data)
    size = len(mv)
    bounds = list(itertools.accumulate(len(w) for w in windows))
    rows: list[tuple[int, int, int, int, int, int, int, int]] = []
    unpack = _FULL_HEADER.unpack_from
    pos = wi = seq_next = 0
    win_scn = last = -1
    while pos < size:
        if pos + HEADER_SIZE > size:
            raise CorruptEventError(f"{size - pos} stray bytes after the last event")
        (
            magic,
            version,
            op,
            total,
            scn,
            ts,
            khash,
            _sid,
            plen,
            pcrc,
            seq,
            source,
            _part,
            _ver,
            klen,
            hcrc,
        ) = unpack(mv, pos)
        if magic != MAGIC or version != 1 or op not in _OPS:
            raise CorruptEventError(f"malformed event header at offset {pos}")
        end = pos + total
        if total != HEADER_SIZE + klen + plen or end > size:
            raise CorruptEventError(f"inconsistent event lengths at offset {pos}")
        if check_crc:
            if crc32(mv[pos : pos + 60]) != hcrc:
                raise CorruptEventError(f"header checksum mismatch at offset {pos}")
            if crc32(mv[pos + HEADER_SIZE : end]) != pcrc:
                raise CorruptEventError(f"payload checksum mismatch at offset {pos}")
        if seq_next == 0:
            if scn <= last:
                raise BadRequestError(_SCN_ORDER)
            win_scn = scn
        elif scn != win_scn:
            raise BadRequestError(_MIXED_SCN)
        if seq != seq_next:
            raise BadRequestError(_BAD_SEQ)
        boundary = wi < len(bounds) and end == bounds[wi]
        if (op == _EOW) != boundary:
            raise BadRequestError(_EOW_INSIDE if op == _EOW else _UNCLOSED)
        rows.append((pos, scn, khash, total, op, source, ts, seq_next == 0))
        if op == _EOW:
            if seq_next >= slots:  # (a window's events; a group's more: the writer splits it)
                raise _too_many_events(slots)
            wi += 1
            seq_next = 0
            last = scn
        else:
            seq_next += 1
        pos = end
    if not rows or wi != len(windows):
        raise BadRequestError(_UNCLOSED)
    ev = np.array(rows, dtype=PARSED_DTYPE)
    return ev, ev["off"], None


def _parse_trusted(
    windows: Sequence[bytes | memoryview],
    sizes: Sequence[Sequence[int]],
    data: bytes | memoryview,
    slots: int,
) -> Parsed:
    """Locate and check the events of trusted windows (no scan, no CRCs)."""
    check_sizes_add_up(windows, sizes)
    lens = np.fromiter(itertools.chain.from_iterable(sizes), dtype=np.int64)
    ends = np.cumsum(lens)
    offsets = ends - lens
    headers = headers_at(data, offsets)
    if (
        (headers["magic"] != MAGIC)
        | (headers["version"] != 1)
        | ~_VALID_OP[headers["op"]]
        | (headers["total_length"] != lens)
        | (
            headers["key_length"].astype(np.int64)
            + headers["payload_length"].astype(np.int64)
            + HEADER_SIZE
            != lens
        )
    ).any():
        raise CorruptEventError("malformed event header in a trusted window")
    return check_windows(windows, offsets, headers, slots)


def check_windows(
    windows: Sequence[bytes | memoryview],
    offsets: npt.NDArray[np.int64],
    headers: npt.NDArray[Any],
    slots: int,
) -> Parsed:
    """The window rules over located, well-formed events, in numpy."""
    n = len(offsets)
    ops = headers["op"]
    scns = headers["scn"].astype(np.int64)
    eows = np.flatnonzero(ops == _EOW)
    if n == 0 or eows.size != len(windows) or eows[-1] != n - 1:
        raise BadRequestError(_UNCLOSED)
    ends = offsets[eows] + headers["total_length"][eows].astype(np.int64)
    if (ends != np.cumsum([len(w) for w in windows])).any():
        raise BadRequestError(_EOW_INSIDE)
    starts = np.concatenate(([0], eows[:-1] + 1))
    counts = np.diff(np.concatenate((starts, [n])))
    window_of = np.repeat(np.arange(len(windows)), counts)
    if (scns != scns[eows][window_of]).any():
        raise BadRequestError(_MIXED_SCN)
    if (headers["seq"].astype(np.int64) != np.arange(n) - starts[window_of]).any():
        raise BadRequestError(_BAD_SEQ)
    if (np.diff(scns[eows]) <= 0).any():
        raise BadRequestError(_SCN_ORDER)
    if int(counts.max()) > slots:
        raise _too_many_events(slots)
    ev = np.empty(n, dtype=PARSED_DTYPE)
    ev["off"] = offsets
    ev["scn"] = scns
    ev["key_hash"] = headers["key_hash"]
    ev["length"] = headers["total_length"]
    ev["op"] = ops
    ev["source_id"] = headers["source_id"]
    ev["ts"] = headers["timestamp_ns"]
    ev["first"] = False
    ev["first"][starts] = True
    return ev, offsets, headers
