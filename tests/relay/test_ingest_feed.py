"""The ingest reads a fetcher's ``window_feed()`` directly, and ``windows()`` through a pump.

Both ways the buffer ends up with every window, in order; a fetcher with a
feed runs no pump task, and a fetcher with only ``windows()`` (a third-party
plugin) still works.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from changebus.fetchers import ResumePoint, Window, create_fetcher, register_fetcher
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import Op, parse_stream
from waiting import wait_until


class _IteratorOnly:
    """The synthetic fetcher seen through ``windows()`` only (no ``window_feed``)."""

    def __init__(self, name: str, partition_id: int, options: Mapping[str, Any]) -> None:
        self.name = name
        self._inner = create_fetcher("synthetic", name, partition_id, options)

    async def start(self, resume: ResumePoint) -> int:
        return await self._inner.start(resume)

    async def windows(self) -> AsyncIterator[Window]:
        async for window in self._inner.windows():
            yield window

    async def acknowledge(self, scn: int) -> None:
        await self._inner.acknowledge(scn)

    async def close(self) -> None:
        await self._inner.close()

    def status(self) -> dict[str, Any]:
        return self._inner.status()


def _config(tmp: Path, kind: str, **options: Any) -> RelayConfig:
    options = {
        "windows_per_s": 0,
        "tables": 2,
        "events_per_window": 3,
        "max_windows": 3000,
        **options,
    }
    return RelayConfig(
        data_dir=tmp / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig("p", 1, capacity_bytes=16 << 20, fetcher=FetcherConfig(kind, options)),
        ),
        flush_interval_s=0,
    )


@pytest.mark.parametrize("kind", ["synthetic", "iterator-only"])
async def test_every_window_arrives_in_order_with_or_without_a_feed(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from changebus.fetchers import _base

    monkeypatch.setattr(_base, "_REGISTERED", dict(_base._REGISTERED))
    register_fetcher("iterator-only", _IteratorOnly)
    async with Relay(_config(tmp_path, kind)) as relay:
        host = relay.hosts["p"]
        pumps: set[bool] = set()

        def look() -> bool:
            pumps.add(any(t.get_name() == "pump-p" for t in asyncio.all_tasks()))
            return host.state == "finished"

        await wait_until(look, 60, "the fetcher's 3,000 windows")
        assert (True in pumps) == (kind == "iterator-only")  # a pump ran only without a feed
        sel = host.buffer.select(-1, -1, 1 << 30)
        assert sel is not None
        data = b"".join(bytes(v) for v in sel.views)
        host.buffer.release(sel)
    _, headers = parse_stream(data)
    ends = [i for i, op in enumerate(headers["op"].tolist()) if op == Op.END_OF_WINDOW]
    window_scns = [int(headers["scn"][i]) for i in ends]
    assert len(window_scns) == 3000
    assert window_scns == list(range(window_scns[0], window_scns[0] + 3000))


async def test_a_failing_wake_listener_does_not_stop_the_ingest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(tmp_path, "synthetic", windows_per_s=500, max_windows=0)
    calls = 0

    def broken() -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("listener bug")

    async with Relay(config) as relay:
        host = relay.hosts["p"]
        host.add_wake_listener(broken)
        start = host.buffer.meta.windows
        await wait_until(lambda: host.buffer.meta.windows >= start + 200, 30, "200 more windows")
        assert host.state == "streaming"
    assert calls >= 10
    assert any("a wake-up listener failed" in r.getMessage() for r in caplog.records)
