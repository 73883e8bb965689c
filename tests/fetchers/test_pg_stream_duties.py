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


async def test_windows_waiting_for_their_acknowledgement_are_bounded() -> None:
    """A relay cluster's fence holds acknowledgements back while a follower is down: the
    fetcher kept one entry per window emitted meanwhile, for hours (review). Past
    MAX_PENDING every other entry goes; an acknowledgement then confirms the end of
    the newest kept window at or below it: later, never sooner."""
    from changebus.fetchers import Window
    from changebus.fetchers.postgres import PostgresConfig
    from changebus.fetchers.postgres._fetcher import MAX_PENDING, PostgresFetcher
    from changebus.schemas import scn_to_lsn

    fetcher = PostgresFetcher("pg", 1, PostgresConfig(dsn="host=127.0.0.1"))
    emitted: list[int] = []
    n = 3 * MAX_PENDING
    for scn in range(1000, 1000 + n):  # window scn ends at lsn scn + 10
        window = Window(scn, 0, b"", 0, source_position=scn_to_lsn(scn + 10))
        fetcher._emit(window, lambda w: emitted.append(w.scn))
    assert len(emitted) == n
    assert len(fetcher._pending) <= MAX_PENDING
    scns = [s for s, _ in fetcher._pending]
    assert scns == sorted(scns) and scns[-1] == 999 + n
    # an acknowledgement never confirms past what it covers, and the newest is exact
    for acked in (1000, 1000 + n // 2, 1000 + n - 2):
        await fetcher.acknowledge(acked)
        assert fetcher._acked_end_lsn <= acked + 10
    assert fetcher._acked_end_lsn >= 1000 + n // 2  # (it moved)
    await fetcher.acknowledge(999 + n)
    assert fetcher._acked_end_lsn == 999 + n + 10 and not fetcher._pending
