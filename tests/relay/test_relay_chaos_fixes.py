"""Regressions found by the chaos harness (bench/chaos.py), relay side.

* A relay whose ``http.max_wait_s`` is below a client's ``wait`` answered 400 (not
  retriable): a follower relay chaining with its default ``wait_s`` (10 s) from a
  leader configured with ``max_wait_s = 5`` failed for good ("fetcher failed for
  good: parameter wait must be within 0.0..5.0"), and so did every default consumer.
  Now a longer wait is shortened to ``max_wait_s``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from waiting import wait_until

pytestmark = pytest.mark.usefixtures("no_blocking")


def _config(data: Path, fetcher: FetcherConfig, max_wait_s: float) -> RelayConfig:
    return RelayConfig(
        data_dir=data,
        http=HttpConfig(port=0, max_wait_s=max_wait_s),
        partitions=(PartitionConfig("p", 1, capacity_bytes=1 << 20, fetcher=fetcher),),
        flush_interval_s=0,
    )


def _synthetic(**options: Any) -> FetcherConfig:
    return FetcherConfig(
        "synthetic",
        {"windows_per_s": 0, "max_windows": 50, "events_per_window": 2, "row_bytes": 50, **options},
    )


async def test_a_wait_above_max_wait_is_shortened_not_refused(tmp_path: Path) -> None:
    async with (
        Relay(_config(tmp_path / "r", FetcherConfig("none"), 0.5)) as relay,
        aiohttp.ClientSession() as http,
    ):
        t0 = time.monotonic()
        params = {"partition": "p", "from": "latest", "wait": "10"}
        async with http.get(f"{relay.url}/v1/stream", params=params) as resp:
            assert resp.status == 204, await resp.text()
        assert time.monotonic() - t0 < 5  # held max_wait_s (0.5 s), not 10 s
        # absurd values are still bad requests
        params["wait"] = "1e9"
        async with http.get(f"{relay.url}/v1/stream", params=params) as resp:
            assert resp.status == 400


async def test_a_follower_with_a_longer_wait_chains_from_a_short_max_wait_relay(
    tmp_path: Path,
) -> None:
    async with Relay(_config(tmp_path / "up", _synthetic(), 1.0)) as up:
        chain = FetcherConfig(
            "relay",
            {"upstream": [up.url], "wait_s": 10.0, "backoff_initial_s": 0.02},
            retry_initial_s=0.05,
            retry_max_s=0.5,
        )
        async with Relay(_config(tmp_path / "down", chain, 10.0)) as down:
            host = down.hosts["p"]
            await wait_until(
                lambda: host.buffer.meta.windows >= 50 or host.state == "failed",
                30,
                "the follower holding the upstream's windows",
            )
            assert host.state == "streaming"
            assert host.buffer.meta.last_scn == up.hosts["p"].buffer.meta.last_scn
