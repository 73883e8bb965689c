"""Split points: ``/v1/splits`` cuts an SCN range into sub-ranges of similar volume."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from test_buffer import make_window
from test_http import relay_config, wait_windows

from changebus.relay import Relay, _index
from changebus.relay._buffer import BufferConfig, EventBuffer
from changebus.relay._http import MAX_SPLIT_PARTS

pytestmark = pytest.mark.usefixtures("no_blocking")


def fill(buf: EventBuffer, scns: list[int], sizes: list[list[int]]) -> list[int]:
    """Append one window per SCN; returns each window's event count (its end marker included)."""
    for scn, s in zip(scns, sizes, strict=True):
        buf.append_window(make_window(scn, s))
    return [len(s) + 1 for s in sizes]


def spans(since: int, until: int, cuts: list[int], scns: list[int], events: list[int]) -> list[int]:
    """Events in each sub-range of ``(since, until]`` cut at ``cuts``."""
    points = [since, *cuts, until]
    return [
        sum(n for s, n in zip(scns, events, strict=True) if a < s <= b)
        for a, b in itertools.pairwise(points)
    ]


@pytest.fixture(params=["exact", "indexed"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Cut from the event table (short ranges) or from the SCN index alone (long ones)."""
    if request.param == "indexed":
        monkeypatch.setattr(_index, "EXACT_CUT_EVENTS", 0)
    return str(request.param)


def test_cuts_follow_events_not_scn_distance(tmp_path: Path, way: str) -> None:
    """Sparse SCNs then dense ones: an even SCN cut would put nearly everything in one part."""
    buf = EventBuffer(tmp_path / "b", BufferConfig(capacity_bytes=4 << 20, block_bytes=256))
    buf.set_start(0)
    try:
        # 40 windows 10,000 SCNs apart, then 400 consecutive ones; all of one size
        scns = [10_000 * (i + 1) for i in range(40)] + [400_001 + i for i in range(400)]
        events = fill(buf, scns, [[200, 200]] * len(scns))
        since, until = 0, scns[-1]
        cuts = buf.split_points(since, until, 4)
        assert len(cuts) == 3 and cuts == sorted(set(cuts))
        assert all(since < c < until for c in cuts)
        got = spans(since, until, cuts, scns, events)
        assert sum(got) == sum(events)
        # exact: within a window of a quarter; indexed: within a few (one window a block)
        assert max(got) - min(got) <= (3 if way == "exact" else 8 * 3), got
        even = [since + (until - since) * i // 4 for i in range(1, 4)]
        assert max(spans(since, until, even, scns, events)) > 0.9 * sum(events)  # what it fixes
        # a sub-range of it, and more parts than windows in it
        sub = buf.split_points(scns[100], scns[110], 50)
        assert sub == sorted(set(sub)) and all(scns[100] < c < scns[110] for c in sub)
        assert len(sub) <= 9
        # nothing to cut
        assert buf.split_points(since, until, 1) == []
        assert buf.split_points(scns[5], scns[6], 4) == []  # one window
        assert buf.split_points(until, until + 100, 4) == []  # past the newest window
    finally:
        buf.close()


def test_cuts_count_only_the_sources_asked_for(tmp_path: Path) -> None:
    """Source 1 writes the first 100 windows, source 2 the next 300: cut for source 1 alone."""
    buf = EventBuffer(tmp_path / "b", BufferConfig(capacity_bytes=4 << 20, block_bytes=256))
    buf.set_start(0)
    try:
        for scn in range(1, 401):
            buf.append_window(make_window(scn, [100, 100], source_id=1 if scn <= 100 else 2))
        everything = buf.split_points(0, 400, 4)
        assert everything == [100, 200, 300]  # 400 windows of one size: 100 each
        mine = buf.split_points(0, 400, 4, frozenset({1}))
        assert mine == [25, 50, 75]  # the last part also holds every window of source 2
        assert buf.split_points(0, 400, 4, frozenset({2})) == [175, 250, 325]
        assert buf.split_points(0, 400, 4, frozenset({9})) == []  # nothing of it: no cut
    finally:
        buf.close()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    gaps=st.lists(st.integers(1, 5000), min_size=1, max_size=120),
    sizes=st.lists(st.lists(st.integers(0, 900), max_size=5), min_size=1, max_size=120),
    parts=st.integers(1, 12),
    lo=st.integers(0, 100),
    hi=st.integers(0, 100),
)
def test_cuts_are_ordered_inside_the_range_and_lose_nothing(
    tmp_path_factory: pytest.TempPathFactory,
    way: str,
    gaps: list[int],
    sizes: list[list[int]],
    parts: int,
    lo: int,
    hi: int,
) -> None:
    n = min(len(gaps), len(sizes))
    scns = list(itertools.accumulate(gaps[:n]))
    buf = EventBuffer(
        tmp_path_factory.mktemp("b"), BufferConfig(capacity_bytes=256 << 10, block_bytes=512)
    )
    buf.set_start(0)
    try:
        events = fill(buf, scns, sizes[:n])
        m = buf.meta
        kept = [(s, e) for s, e in zip(scns, events, strict=True) if s >= m.min_scn]
        since = scns[min(lo, n - 1)] if lo % 3 else -1
        until = scns[min(hi, n - 1)] + (hi % 2)
        if until < since:
            since, until = until, since
        cuts = buf.split_points(since, until, parts)
        assert cuts == sorted(set(cuts))
        assert all(since < c < until for c in cuts)
        assert len(cuts) <= parts - 1
        # every kept window of the range lies in exactly one part, and no part is empty
        points = [since, *cuts, until]
        inside = [s for s, _ in kept if since < s <= until]
        for s in inside:
            assert sum(a < s <= b for a, b in itertools.pairwise(points)) == 1
        for a, b in itertools.pairwise(points if cuts else []):
            assert any(a < s <= b for s in inside), (a, b, points)
    finally:
        buf.close()


@pytest.fixture
async def relay(tmp_path: Path) -> AsyncIterator[Relay]:
    async with Relay(relay_config(tmp_path)) as r:
        yield r


async def test_http_splits_and_bad_requests(relay: Relay) -> None:
    await wait_windows(relay, 300)
    m = relay.hosts["syn"].buffer.meta
    async with aiohttp.ClientSession() as http:
        params = {"partition": "syn", "since": str(m.prev_scn), "until": str(m.last_scn)}
        async with http.get(f"{relay.url}/v1/splits", params={**params, "parts": "3"}) as resp:
            assert resp.status == 200, await resp.text()
            doc = await resp.json()
        assert doc["partition"] == "syn" and len(doc["cuts"]) == 2
        assert m.prev_scn < doc["cuts"][0] < doc["cuts"][1] < m.last_scn
        # windows of one size: each third holds about a third of them
        thirds = [b - a for a, b in itertools.pairwise([m.prev_scn, *doc["cuts"], m.last_scn])]
        assert max(thirds) - min(thirds) <= 30, thirds
        bad = [
            ({**params}, "parts is required"),
            ({**params, "parts": "0"}, "parts"),
            ({**params, "parts": str(MAX_SPLIT_PARTS + 1)}, "parts"),
            ({**params, "parts": "2", "since": "x"}, "since"),
            (
                {**params, "parts": "2", "until": str(m.prev_scn), "since": str(m.last_scn)},
                "before",
            ),
            ({**params, "parts": "2", "bogus": "1"}, "unknown parameter"),
        ]
        for query, needle in bad:
            async with http.get(f"{relay.url}/v1/splits", params=query) as resp:
                assert resp.status == 400, query
                assert needle in (await resp.json())["message"], query
        async with http.get(
            f"{relay.url}/v1/splits", params={**params, "parts": "2", "partition": "nope"}
        ) as resp:
            assert resp.status == 404
        # only the sources named count; a source the partition lacks is 404
        one = {**params, "parts": "2", "sources": "synthetic.t0"}
        async with http.get(f"{relay.url}/v1/splits", params=one) as resp:
            assert resp.status == 200 and len((await resp.json())["cuts"]) == 1
        nope = {**params, "parts": "2", "sources": "synthetic.nope"}
        async with http.get(f"{relay.url}/v1/splits", params=nope) as resp:
            assert resp.status == 404
        # an empty partition has nothing to cut
        idle = {"partition": "idle", "since": "-1", "until": "1000", "parts": "4"}
        async with http.get(f"{relay.url}/v1/splits", params=idle) as resp:
            assert resp.status == 200 and (await resp.json())["cuts"] == []
