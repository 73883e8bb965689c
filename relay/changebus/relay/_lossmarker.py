"""The window that stands for a window the relay cannot store (never a silent gap).

A window over the partition's size limit (``max_window_bytes``), or with
more events than the event table holds, is replaced by a window at the same
SCN holding the SCHEMA_CHANGE events of the lost window (small, and needed:
a table announced there would otherwise be unknown to every later window
that uses it), one DATA_LOSS event for that SCN, and its END_OF_WINDOW with
the lost window's source position (so the fetcher resumes after it).
:func:`schema_changes` is also how the writer registers the tables a window
announces.

Called in the partition's writer thread; pure function, no shared state.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from changebus.fetchers import Window
from changebus.schemas import (
    HEADER_SIZE,
    ChangebusError,
    DataLoss,
    EndOfWindow,
    Op,
    SchemaChange,
    decode_control,
    encode_control,
    parse_stream,
)

__all__ = ["loss_marker", "schema_changes"]

_SCHEMA_CHANGE = int(Op.SCHEMA_CHANGE)
_SCHEMA_CHANGE_BYTE = bytes([_SCHEMA_CHANGE])


def loss_marker(window: Window, reason: str, partition_id: int) -> bytes:
    """The encoded window recording that ``window`` (its SCN) was lost (module docstring)."""
    scn, ts = window.scn, window.timestamp_ns
    events = [
        encode_control(change, scn, seq, ts, partition=partition_id)
        for seq, change in enumerate(_schema_changes(window.data))
    ]
    events.append(
        encode_control(DataLoss(scn, scn, reason), scn, len(events), ts, partition=partition_id)
    )
    # (a chained window comes with its position in its own END_OF_WINDOW only: the
    # marker carried "" and a MySQL leader elected after it lost its binlog position)
    position = window.source_position or _end_position(window.data)
    events.append(
        encode_control(EndOfWindow(0, position), scn, len(events), ts, partition=partition_id)
    )
    return b"".join(events)


def _end_position(data: bytes | memoryview) -> str:
    """The source position of an encoded window's END_OF_WINDOW ("" when it has none)."""
    try:
        offsets, headers = parse_stream(data)
        if not len(offsets) or int(headers["op"][-1]) != int(Op.END_OF_WINDOW):
            return ""
        start = int(offsets[-1])
        payload = bytes(data[start + HEADER_SIZE : start + int(headers["total_length"][-1])])
        end = decode_control(Op.END_OF_WINDOW, payload)
    except ChangebusError:
        return ""
    return end.source_position if isinstance(end, EndOfWindow) else ""


def schema_changes(
    data: bytes | memoryview,
    offsets: npt.NDArray[np.int64],
    ops: npt.NDArray[np.uint8],
    lengths: npt.NDArray[Any],
) -> Iterator[SchemaChange]:
    """The SCHEMA_CHANGE events of located events, in order.

    ``offsets``, ``ops`` and ``lengths`` (whole event sizes) are columns of
    the same events: ``parse_stream``'s headers or the writer's validated
    event table.
    """
    if _SCHEMA_CHANGE_BYTE not in ops.tobytes():  # the common case, without numpy's per-call cost
        return
    for i in np.flatnonzero(ops == _SCHEMA_CHANGE).tolist():
        start = int(offsets[i])
        payload = bytes(data[start + HEADER_SIZE : start + int(lengths[i])])
        change = decode_control(Op.SCHEMA_CHANGE, payload)
        assert isinstance(change, SchemaChange)
        yield change


def _schema_changes(data: bytes | memoryview) -> list[SchemaChange]:
    """The SCHEMA_CHANGE events of an encoded window, in order (none when it does not parse)."""
    try:
        offsets, headers = parse_stream(data)
        return list(schema_changes(data, offsets, headers["op"], headers["total_length"]))
    except ChangebusError:
        return []  # a damaged window: the loss is recorded all the same
