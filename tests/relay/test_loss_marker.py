"""The DATA_LOSS marker a relay appends for a window it cannot hold (over its limit).

A chained window carries its source position only in its own END_OF_WINDOW
(``Window.source_position`` is empty): the marker carried "", and a MySQL
leader elected after it found no binlog position to resume at (review).
"""

from __future__ import annotations

from typing import Any

from changebus.fetchers import Window
from changebus.relay._lossmarker import loss_marker
from changebus.schemas import (
    HEADER_SIZE,
    DataLoss,
    EndOfWindow,
    Op,
    decode_control,
    encode_control,
    parse_stream,
)


def _controls(data: bytes) -> list[Any]:
    offsets, headers = parse_stream(data)
    out = []
    for i, off in enumerate(offsets.tolist()):
        op = Op(int(headers["op"][i]))
        payload = data[off + HEADER_SIZE : off + int(headers["total_length"][i])]
        out.append(decode_control(op, payload))
    return out


def test_the_marker_keeps_the_position_of_a_chained_windows_end() -> None:
    end = encode_control(EndOfWindow(0, "mysql-bin.000007:4321"), 500, 0, 9, partition=1)
    chained = Window(500, 9, end, 1)  # (as a relay fetcher hands it: no source_position)
    events = _controls(loss_marker(chained, "too big", 1))
    assert isinstance(events[0], DataLoss) and events[0].from_scn == 500
    assert events[-1] == EndOfWindow(0, "mysql-bin.000007:4321")
    # a fetcher's own position wins, and a window that does not parse gives ""
    own = Window(500, 9, end, 1, source_position="mysql-bin.000008:4")
    assert _controls(loss_marker(own, "too big", 1))[-1] == EndOfWindow(0, "mysql-bin.000008:4")
    broken = Window(500, 9, b"\x00" * 10, 1)
    assert _controls(loss_marker(broken, "too big", 1))[-1] == EndOfWindow(0, "")
