"""The Postgres stream loop's status updates while it cannot read (no server needed)."""

from __future__ import annotations

import struct
from types import SimpleNamespace

from changebus.fetchers.postgres._stream import _StreamDuties


def test_keepalive_sends_a_status_update_per_interval_and_asks_no_reply() -> None:
    """Blocked handing a window over, the loop keeps the walsender's timeout at bay with
    plain status updates: a request for a reply would go unread and look like a silent
    server to the loop once it reads again."""
    sent: list[bytes] = []
    fetcher = SimpleNamespace(
        config=SimpleNamespace(status_interval_s=1.0, io_timeout_s=15.0),
        _acked_end_lsn=1000,
        _feed=None,
        stats={},
    )
    duties = _StreamDuties(fetcher, sent.append)  # type: ignore[arg-type]
    duties.keepalive(100.0, 5000)
    duties.keepalive(100.5, 6000)  # within the interval: nothing
    duties.keepalive(101.2, 7000)
    assert len(sent) == 2
    for message, written in zip(sent, (5000, 7000), strict=True):
        kind, write, flush, apply, _clock, reply = struct.unpack("!cQQQqB", message)
        assert kind == b"r" and (write, flush, apply) == (written, 1000, 1000)
        assert reply == 0
