"""A filtered read through one huge window is scanned in bounded steps.

A consumer whose filter keeps little of a big transaction (a bulk load of
other keys) made one selection scan the whole window: on the event loop and
under the buffer's lock, so every other consumer and the writer waited
(131 ms at 4M events). Now a selection reads at most about
:data:`MAX_SCAN_EVENTS` events: what the filter kept so far goes out as a
part of the window, and when it kept nothing the request's handler lets the
event loop run and selects again, going on where the scan stopped (the
buffer remembers it, for every consumer at that position).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig, _buffer
from changebus.relay._reader import MAX_SCAN_EVENTS, SCAN_CHUNK
from changebus.schemas import FIRST_CONTROL_OP, Op, parse_stream

_EVENTS = 600_000  # one window, more than two scans' worth
#: rows one selection reads at most: a scan's events, read again as its chunk doubles
_SCAN_BOUND = 2 * MAX_SCAN_EVENTS + SCAN_CHUNK


@pytest.fixture
def scans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Event-table rows each selection read (``select_events`` calls, in order)."""
    read: list[int] = []
    real = _buffer.select_events  # type: ignore[attr-defined]

    def counted(events: Any, *args: Any) -> Any:
        rows = [0]
        get = events.get

        def counting_get(a: int, b: int, field: str | None = None) -> Any:
            rows[0] += b - a
            return get(a, b, field)

        events.get = counting_get
        try:
            return real(events, *args)
        finally:
            del events.get  # (the instance attribute: the class's method again)
            read.append(rows[0])

    monkeypatch.setattr(_buffer, "select_events", counted)
    return read


async def _relay(tmp: Path, **extra: Any) -> Relay:
    options = {
        "windows_per_s": 0,
        "max_windows": 1,
        **extra,
        "events_per_window": _EVENTS,
        "row_bytes": 8,
        "tables": 1,
    }
    cfg = RelayConfig(
        data_dir=tmp / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "syn", 1, capacity_bytes=256 << 20, fetcher=FetcherConfig("synthetic", options)
            ),
        ),
        flush_interval_s=0,
    )
    return Relay(cfg)


def _hashes(relay: Relay) -> np.ndarray:
    host = relay.hosts["syn"]
    sel = host.buffer.select(-1, -1, 1 << 30)
    assert sel is not None
    data = b"".join(bytes(v) for v in sel.views)
    assert host.buffer.release(sel)
    _, headers = parse_stream(data)
    data_ops = headers["op"] < FIRST_CONTROL_OP
    return np.sort(headers["key_hash"][data_ops].astype(np.uint64))


async def test_a_filter_keeping_nothing_of_a_huge_window_is_scanned_in_steps(
    tmp_path: Path, scans: list[int]
) -> None:
    async with await _relay(tmp_path) as relay, aiohttp.ClientSession() as http:
        await _one_window(relay)
        hashes = _hashes(relay)
        assert hashes.size == _EVENTS
        gap = int(np.argmax(np.diff(hashes)))  # the widest range of hashes no key has
        lo, hi = int(hashes[gap]) + 1, int(hashes[gap + 1])
        assert hi > lo
        scans.clear()
        answers, ops = await _read(http, relay.url, f"range:{lo}:{hi}")
        # the scan record keeps a filter's text, not the filter (a mod filter's object
        # holds its bucket table: 1,024 of 64 KiB each were pinned outside every budget)
        kept = list(relay.hosts["syn"].buffer._scanned)
        assert kept and all(k[1].startswith("range:") for k in kept)
    # the window's control events only (no row matched), the end last
    assert not any(op < FIRST_CONTROL_OP for op in ops) and ops[-1] == int(Op.END_OF_WINDOW)
    # found over more selections than answers (a handler selected again, the event loop
    # running meanwhile), none of which read the whole window (before: one read it twice)
    assert len(scans) > answers
    assert max(scans) <= _SCAN_BOUND < _EVENTS, scans


async def test_what_a_filter_keeps_of_a_huge_window_comes_in_parts(
    tmp_path: Path, scans: list[int]
) -> None:
    async with await _relay(tmp_path) as relay, aiohttp.ClientSession() as http:
        await _one_window(relay)
        hashes = _hashes(relay)
        lo, hi = int(hashes[100]), int(hashes[160])  # a few keys of 100,000
        want = int(((hashes >= lo) & (hashes < hi)).sum())
        assert 40 <= want <= 80
        scans.clear()
        answers, ops = await _read(http, relay.url, f"range:{lo}:{hi}")
    assert sum(1 for op in ops if op < FIRST_CONTROL_OP) == want
    assert answers >= 2 and max(scans) <= _SCAN_BOUND < _EVENTS, scans


async def test_a_consumer_gets_the_kept_rows_of_a_huge_window_as_one_window(
    tmp_path: Path,
) -> None:
    """The client library puts the parts together: one window, the kept rows, in order."""
    from changebus.client import Consumer, ConsumerConfig

    async with await _relay(tmp_path) as relay:
        await _one_window(relay)
        hashes = _hashes(relay)
        lo, hi = int(hashes[5000]), int(hashes[5060])
        want = int(((hashes >= lo) & (hashes < hi)).sum())
        cfg = ConsumerConfig(
            relays=(relay.url,), partition="syn", start="earliest", filter=f"range:{lo}:{hi}"
        )
        async with Consumer(cfg) as consumer:
            window = await asyncio.wait_for(consumer.__anext__(), 60)
        assert window.scn == relay.hosts["syn"].buffer.meta.last_scn
    assert len(window.events) == want > 0  # (the relay's filter chose them: see above)


async def test_followers_waiting_at_the_tail_get_a_huge_window_scanned_once_for_all(
    tmp_path: Path, scans: list[int]
) -> None:
    """Follow streams parked at the tail (the broadcast) get the next window, a huge one
    their filter keeps nothing of: the broadcast scans it for the group over several
    passes, and no stream scans it on its own."""
    # a small window first, then the huge one 2 s later (the source's pace: 0.5 a second)
    async with (
        await _relay(tmp_path, max_windows=2, windows_per_s=0.5) as relay,
        aiohttp.ClientSession() as http,
    ):
        buffer = relay.hosts["syn"].buffer
        await _one_window(relay)
        assert buffer.meta.windows == 1
        first = buffer.meta.last_scn
        # (the huge window's keys are not known yet: a range no 64-bit hash is likely in)
        lo, hi = 2**64 - 2**20, 2**64 - 2**19
        followers = [
            asyncio.create_task(_follow_until_end(http, relay.url, first, f"range:{lo}:{hi}"))
            for _ in range(3)
        ]
        await asyncio.sleep(0.3)  # parked at the tail
        scans.clear()
        got = await asyncio.wait_for(asyncio.gather(*followers), 120)
        counted = list(scans)
        hashes = _hashes(relay)
    assert not ((hashes >= lo) & (hashes < hi)).any()  # (the range was empty indeed)
    for ops in got:
        assert ops and ops[-1] == int(Op.END_OF_WINDOW)
        assert not any(op < FIRST_CONTROL_OP for op in ops)
    # one scan of the window for the three streams: each part of it read once, by one select
    assert len(counted) >= 3 and max(counted) <= _SCAN_BOUND, counted
    assert sum(counted) < 2.5 * _EVENTS, counted


async def _follow_until_end(
    http: aiohttp.ClientSession, url: str, scn: int, filter_text: str
) -> list[int]:
    """Follow from ``scn`` until the next window's end; the ops received."""
    params = {"partition": "syn", "scn": str(scn), "follow": "1", "wait": "60"}
    params["filter"] = filter_text
    body = b""
    async with http.get(f"{url}/v1/stream", params=params) as resp:
        assert resp.status == 200
        async for data, end_of_chunk in resp.content.iter_chunks():
            body += data
            if end_of_chunk and body:
                _, heads = parse_stream(body)
                if heads.size and heads["op"][-1] == int(Op.END_OF_WINDOW):
                    return [int(o) for o in heads["op"]]
    raise AssertionError("the follow stream ended before the window's end")


async def _one_window(relay: Relay) -> None:
    for _ in range(600):
        if relay.hosts["syn"].buffer.meta.windows >= 1:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the synthetic window never came")


async def _read(http: aiohttp.ClientSession, url: str, filter_text: str) -> tuple[int, list[int]]:
    """Read the window through ``filter_text`` as a client does, part after part (never
    an empty one); returns the number of answers and the ops received."""
    scn, offset, answers, ops = -1, -1, 0, []
    while True:
        params = {"partition": "syn", "scn": str(scn), "offset": str(offset), "filter": filter_text}
        async with http.get(f"{url}/v1/stream", params=params) as resp:
            assert resp.status == 200
            body = await resp.read()
            scn = int(resp.headers["X-Changebus-Next-Scn"])
            offset = int(resp.headers["X-Changebus-Next-Offset"])
        _, heads = parse_stream(body)
        assert heads.size > 0
        ops += heads["op"].tolist()
        answers += 1
        if offset < 0:
            return answers, ops


def test_more_long_scans_at_once_than_the_buffer_remembers_all_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The buffer remembers where the scans of long windows got to in a bounded table.
    With more such requests at once than it holds, taking turns, each one evicted the
    others' entries and none got past its first scan: the handlers spun for ever
    (found by review). Each request now carries its own position (``skip_to``).
    Scaled down: scans of 1,024 events, a table of 4, 5 requests."""
    from test_buffer import make_window

    from changebus.relay import _reader
    from changebus.relay._buffer import BufferConfig, EventBuffer
    from changebus.schemas import PartitionFilter

    monkeypatch.setattr(_reader, "MAX_SCAN_EVENTS", 1024)
    monkeypatch.setattr(_reader, "SCAN_CHUNK", 256)
    monkeypatch.setattr(_buffer, "_SCANNED_MAX", 4)
    buf = EventBuffer(tmp_path / "b", BufferConfig(capacity_bytes=8 << 20, event_slots=16384))
    try:
        buf.set_start(0)
        buf.append_window(make_window(1, [10] * 5000))  # one window of 5,000 events
        # hash ranges keeping none of its keys: every request scans it all
        filters = [PartitionFilter(lo=i, hi=i + 1) for i in range(5)]
        resume = [-1] * len(filters)
        done = [False] * len(filters)
        turns = 0
        while not all(done) and turns < 50:  # round robin, as handlers after sleep(0)
            turns += 1
            for i, f in enumerate(filters):
                if done[i]:
                    continue
                sel = buf.select(0, -1, 1 << 20, key_filter=f, skip_to=resume[i])
                assert sel is not None
                resume[i] = sel.resume_at
                buf.release(sel)
                if sel.resume_at < 0:
                    done[i] = True
                    assert sel.next_scn == 1 and sel.events <= 1  # past it (its end marker)
    finally:
        buf.close()
    assert all(done) and turns <= 6  # 5,000 events in scans of 1,024
