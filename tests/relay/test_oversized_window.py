"""A window larger than the partition's ``max_window_bytes`` is a DATA_LOSS window, never a gap.

The synthetic source (one event per window: upserts of 3 KB rows, deletes of
a key) runs into a relay whose windows may hold at most 1 KiB: every upsert
window is stored as one DATA_LOSS window at its own SCN, the deletes pass
whole, and a consumer sees every SCN in order -- the lost ones as DATA_LOSS
(raised by default, delivered on request).

Regression: the first window announces the tables (SCHEMA_CHANGE events) and
is itself too large. Its DATA_LOSS window keeps those announcements; without
them the relay knew no table and every later window was undecodable.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from changebus.client import Consumer, ConsumerConfig, DataLossDetectedError, Window
from changebus.fetchers import ResumePoint, create_fetcher
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig

SOURCE: dict[str, Any] = {
    "windows_per_s": 0,
    "max_windows": 40,
    "events_per_window": 1,
    "row_bytes": 3000,
    "keys": 5,
    "update_ratio": 0.2,
    "delete_ratio": 0.5,
}
LIMIT = 1024


async def source_windows() -> list[tuple[int, int]]:
    """``(scn, bytes)`` of every window the synthetic source produces (it is deterministic)."""
    fetcher = create_fetcher("synthetic", "syn", 1, SOURCE)
    await fetcher.start(ResumePoint(-1, "", ()))
    return [(w.scn, len(w.data)) async for w in fetcher.windows()]


async def read(url: str, n: int, **options: Any) -> list[Window]:
    cfg = ConsumerConfig(relays=(url,), partition="syn", wait_s=0.5, **options)
    got: list[Window] = []
    async with Consumer(cfg) as consumer, asyncio.timeout(30):
        async for window in consumer:
            got.append(window)
            if len(got) == n:
                break
    return got


async def test_an_oversized_window_becomes_a_data_loss_window(tmp_path: Path) -> None:
    expected = await source_windows()
    oversized = {scn for scn, size in expected if size > LIMIT}
    assert oversized and len(oversized) < len(expected)  # both kinds
    config = RelayConfig(
        data_dir=tmp_path / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "syn",
                1,
                capacity_bytes=1 << 20,
                max_window_bytes=LIMIT,
                fetcher=FetcherConfig("synthetic", SOURCE),
            ),
        ),
        flush_interval_s=0,
    )
    async with Relay(config) as relay:
        host = relay.hosts["syn"]
        async with asyncio.timeout(20):
            while host.state != "finished":
                await asyncio.sleep(0.01)
        assert host.stats["windows_data_loss"] == len(oversized)
        got = await read(relay.url, len(expected), on_data_loss="deliver", yield_empty_windows=True)
        assert [w.scn for w in got] == [scn for scn, _ in expected]  # every SCN, in order
        for w in got:
            if w.scn in oversized:
                assert w.data_loss is not None and not w.events
                assert (w.data_loss.from_scn, w.data_loss.to_scn) == (w.scn, w.scn)
                assert "exceeds the buffer limit" in w.data_loss.reason
            else:
                assert w.data_loss is None and len(w.events) == 1
        # by default the consumer stops at the first lost window
        with pytest.raises(DataLossDetectedError) as info:
            await read(relay.url, len(expected))
        assert info.value.window_scn == min(oversized)
