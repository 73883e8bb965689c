"""Regressions found by the chaos harness (bench/chaos.py), relay side.

* A relay whose ``http.max_wait_s`` is below a client's ``wait`` answered 400 (not
  retriable): a follower relay chaining with its default ``wait_s`` (10 s) from a
  leader configured with ``max_wait_s = 5`` failed for good ("fetcher failed for
  good: parameter wait must be within 0.0..5.0"), and so did every default consumer.
  Now a longer wait is shortened to ``max_wait_s``.
* A cluster follower that fell off the leader (restarted after the leader's small
  ring had moved on) appended a DATA_LOSS window: every consumer reading it stopped
  (``DataLossDetectedError``: ``changebus replicate`` exited with status 3) and the
  bootstrap server recorded a gap and seeded everything again -- though nothing was
  lost at the source. A follower (``on_fell_off = "restart"``, what the cluster
  configures) now starts its buffer again where the upstream's is complete: a
  consumer behind it gets 410 and reads another member or bootstraps.
* A fetcher that failed retriably while streaming was never closed (the ingest
  closed it only when it failed before streaming): every restart leaked it, e.g. a
  chain fetcher's HTTP session. Every failed attempt's fetcher is now closed.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

import aiohttp
import pytest

from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import ConfigError, Op, parse_stream
from waiting import wait_until

pytestmark = pytest.mark.usefixtures("no_blocking")


PART = "pg"


def chain(upstream: str, **options: Any) -> FetcherConfig:
    opts = {"upstream": [upstream], "wait_s": 1.0, "backoff_initial_s": 0.02, **options}
    return FetcherConfig("relay", opts, retry_initial_s=0.05, retry_max_s=0.5)


def last_scn(r: Relay) -> int:
    return r.hosts[PART].buffer.meta.last_scn


async def stream_bytes(http: aiohttp.ClientSession, r: Relay, scn: int) -> bytes:
    params = {"partition": PART, "scn": str(scn), "max_bytes": str(64 << 20)}
    async with http.get(f"{r.url}/v1/stream", params=params) as resp:
        assert resp.status in (200, 204), await resp.text()
        return await resp.read()


def window_scns(body: bytes) -> list[int]:
    _, headers = parse_stream(body)
    return [int(h["scn"]) for h in headers if int(h["op"]) == int(Op.END_OF_WINDOW)]


def count_data_losses(body: bytes) -> int:
    _, headers = parse_stream(body)
    return sum(int(h["op"]) == int(Op.DATA_LOSS) for h in headers)


def _config(
    data: Path,
    fetcher: FetcherConfig,
    max_wait_s: float,
    *,
    capacity: int = 1 << 20,
    name: str = "p",
) -> RelayConfig:
    return RelayConfig(
        data_dir=data,
        http=HttpConfig(port=0, max_wait_s=max_wait_s),
        partitions=(PartitionConfig(name, 1, capacity_bytes=capacity, fetcher=fetcher),),
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


async def test_a_follower_that_fell_off_restarts_its_buffer_instead_of_a_data_loss(
    tmp_path: Path,
) -> None:
    syn = FetcherConfig(
        "synthetic",
        {"windows_per_s": 1000, "max_windows": 4000, "events_per_window": 3, "row_bytes": 100},
    )
    async with (
        Relay(_config(tmp_path / "leader", syn, 10.0, capacity=256 << 10, name=PART)) as leader,
        aiohttp.ClientSession() as http,
    ):
        follow = chain(leader.url, on_fell_off="restart")
        async with Relay(
            _config(tmp_path / "f", follow, 10.0, capacity=4 << 20, name=PART)
        ) as follower:
            await wait_until(lambda: last_scn(follower) >= 1100, 30, "the follower")
            host = follower.hosts[PART]
        stopped_at = host.buffer.meta.last_scn
        await wait_until(lambda: last_scn(leader) == 4999, 60, "the leader's windows")
        upstream = leader.hosts[PART].buffer.meta
        assert upstream.prev_scn > stopped_at  # what the follower needs is gone upstream

        async with Relay(
            _config(tmp_path / "f", follow, 10.0, capacity=4 << 20, name=PART)
        ) as follower:
            await wait_until(lambda: last_scn(follower) == 4999, 30, "the follower's tail")
            meta = follower.hosts[PART].buffer.meta
            assert meta.prev_scn == upstream.prev_scn  # complete exactly where the leader is
            # with the leader's position after it (the 410 said it): were this member
            # elected before its first window, its source is checked against it
            assert meta.prev_pos == upstream.prev_pos == f"synthetic:{upstream.prev_scn}"
            body = await stream_bytes(http, follower, upstream.prev_scn)
            assert count_data_losses(body) == 0
            assert body == await stream_bytes(http, leader, upstream.prev_scn)
            assert window_scns(body)[-1] == 4999
            status = follower.hosts[PART].status()["fetcher"]
            assert status["data_loss_windows"] == 0
            # a consumer at the old position is told it is older than kept: 410
            params = {"partition": PART, "scn": str(stopped_at)}
            async with http.get(f"{follower.url}/v1/stream", params=params) as resp:
                assert resp.status == 410, await resp.text()
                assert (await resp.json())["prev_position"] == meta.prev_pos


def test_on_fell_off_is_checked() -> None:
    from changebus.relay.chain import ChainConfig

    assert ChainConfig(upstream=("http://x",), on_fell_off="restart").on_fell_off == "restart"
    with pytest.raises(ConfigError, match="on_fell_off"):
        ChainConfig(upstream=("http://x",), on_fell_off="ignore")


class _Flaky:
    """A synthetic fetcher that fails retriably after a few windows; counts its closes."""

    instances: ClassVar[list[_Flaky]] = []

    def __init__(self, name: str, partition_id: int, options: Any) -> None:
        from changebus.fetchers import create_fetcher

        self.name = name
        self.inner = create_fetcher("synthetic", name, partition_id, {"windows_per_s": 200})
        self.closed = 0
        _Flaky.instances.append(self)

    async def start(self, resume: Any) -> int:
        return int(await self.inner.start(resume))

    async def windows(self) -> AsyncIterator[Any]:
        from changebus.schemas import SourceError

        n = 0
        async for window in self.inner.windows():
            yield window
            n += 1
            if n == 5:
                raise SourceError("the source went away (test)")

    async def acknowledge(self, scn: int) -> None:
        await self.inner.acknowledge(scn)

    async def close(self) -> None:
        self.closed += 1
        await self.inner.close()

    def status(self) -> dict[str, Any]:
        return {"kind": "flaky"}


async def test_a_fetcher_that_failed_while_streaming_is_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from changebus.fetchers import _base, register_fetcher

    monkeypatch.setattr(_base, "_REGISTERED", dict(_base._REGISTERED))
    register_fetcher("flaky", _Flaky)
    _Flaky.instances.clear()
    fetcher = FetcherConfig("flaky", {}, retry_initial_s=0.05, retry_max_s=0.05)
    config = RelayConfig(
        data_dir=tmp_path,
        http=HttpConfig(port=0),
        partitions=(PartitionConfig("f", 1, capacity_bytes=1 << 20, fetcher=fetcher),),
        flush_interval_s=0,
    )
    async with Relay(config) as relay:
        host = relay.hosts["f"]
        await wait_until(lambda: host.stats["fetcher_restarts"] >= 3)
    failed = _Flaky.instances[:3]
    assert [f.closed for f in failed] == [1, 1, 1]
