"""The relay's operator metrics against a running relay (docs/metrics.md).

A synthetic source fills a small buffer (so windows are evicted) and another
partition whose windows are over its size limit (so they become data-loss
windows); consumers pull at different checkpoints. ``/metrics`` must then
show readiness, the fetcher state, the source lag, each consumer's lag (the
most lagging ones only, the rest folded into ``_other``), data loss by cause
and the pulls answered 410.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from metrics_util import samples, scrape, value

from changebus.relay import (
    FetcherConfig,
    HttpConfig,
    MetricsConfig,
    PartitionConfig,
    Relay,
    RelayConfig,
)
from changebus.schemas import ConfigError
from waiting import wait_until

pytestmark = pytest.mark.usefixtures("no_blocking")

#: 200 windows of ~1.2 KB at 400 windows/s: 0.5 s of source time, more than 64 KiB
SMALL = {"windows_per_s": 400, "max_windows": 200, "events_per_window": 4, "row_bytes": 200}
#: upserts of 3 KB rows into a partition that stores windows of at most 1 KiB
BIG = {
    "windows_per_s": 0,
    "max_windows": 12,
    "events_per_window": 1,
    "row_bytes": 3000,
    "keys": 5,
    "delete_ratio": 0.5,
}


def config(tmp: Path) -> RelayConfig:
    return RelayConfig(
        data_dir=tmp / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "syn", 1, capacity_bytes=64 << 10, fetcher=FetcherConfig("synthetic", SMALL)
            ),
            PartitionConfig(
                "big",
                2,
                capacity_bytes=64 << 10,
                max_window_bytes=1024,
                fetcher=FetcherConfig("synthetic", BIG),
            ),
        ),
        flush_interval_s=0,
        metrics=MetricsConfig(max_consumer_series=3),
    )


async def pull(url: str, scn: int, client: str) -> int:
    query = f"partition=syn&scn={scn}&client={client}&max_bytes=64"
    async with aiohttp.ClientSession() as http, http.get(f"{url}/v1/stream?{query}") as r:
        await r.read()
        return r.status


async def test_relay_operator_metrics(tmp_path: Path) -> None:
    async with Relay(config(tmp_path)) as relay:
        syn, big = relay.hosts["syn"], relay.hosts["big"]
        await wait_until(lambda: syn.state == "finished" and big.state == "finished")
        m = syn.buffer.meta
        assert m.prev_scn > 1000  # windows were evicted
        text = await scrape(relay.url)
        assert value(text, "changebus_relay_ready") == 1.0
        states = samples(text, "changebus_relay_fetcher_state")
        assert value(text, "changebus_relay_fetcher_state", partition="syn", state="finished") == 1
        assert sum(v for k, v in states.items() if ("partition", "syn") in k) == 1.0
        assert len(states) == 2 * 7  # every state of both partitions
        lag = value(text, "changebus_relay_source_lag_seconds", partition="syn")
        assert lag is not None and 0 <= lag < 5
        idle = value(text, "changebus_relay_source_idle_seconds", partition="syn")
        assert idle is not None and idle >= 0
        # neither a Postgres nor a MySQL source: no such figures, the families are there
        assert "# TYPE changebus_relay_source_retained_wal_bytes gauge" in text
        assert not samples(text, "changebus_relay_source_retained_wal_bytes")
        assert not samples(text, "changebus_relay_source_binlog_distance_bytes")

        # data loss by cause: every window over the limit
        lost = big.stats["windows_data_loss"]
        assert lost > 0
        assert (
            value(
                text,
                "changebus_relay_data_loss_events_total",
                partition="big",
                cause="window_too_large",
            )
            == lost
        )
        assert not samples(text, "changebus_relay_data_loss_events_total").keys() - {
            (("cause", "window_too_large"), ("partition", "big"))
        }

        # consumers: a (oldest kept), b (middle), d (just after b), c (caught up)
        mid = (m.min_scn + m.last_scn) // 2
        for scn, client in ((m.min_scn, "a"), (mid, "b"), (mid + 1, "d"), (m.last_scn, "c")):
            assert await pull(relay.url, scn, client) in (200, 204)
        text = await scrape(relay.url)
        lag_scn = {
            dict(k)["consumer"]: v
            for k, v in samples(text, "changebus_relay_consumer_lag_scn").items()
            if ("partition", "syn") in k
        }
        lag_s = {
            dict(k)["consumer"]: v
            for k, v in samples(text, "changebus_relay_consumer_lag_seconds").items()
            if ("partition", "syn") in k
        }
        # at most 3 consumer series: the most lagging, then _other (c: caught up)
        assert lag_scn == {
            "a": m.last_scn - m.min_scn,
            "b": m.last_scn - mid,
            "d": m.last_scn - mid - 1,
            "_other": 0,
        }
        assert lag_s["_other"] == 0
        # 400 windows/s: a lags by about its SCN distance / 400 s
        assert lag_s["a"] > lag_s["b"] >= lag_s["d"] > 0
        assert lag_s["a"] == pytest.approx((m.last_scn - m.min_scn - 1) / 400, abs=0.25)

        # a checkpoint older than the buffer keeps: 410, counted
        assert value(text, "changebus_relay_consumers_fell_off_total", partition="syn") == 0
        assert await pull(relay.url, m.prev_scn - 1, "late") == 410
        text = await scrape(relay.url)
        assert value(text, "changebus_relay_consumers_fell_off_total", partition="syn") == 1
        assert value(text, "changebus_relay_consumers_fell_off_total", partition="big") == 0


def test_max_consumer_series_is_bounded() -> None:
    with pytest.raises(ConfigError, match="max_consumer_series"):
        MetricsConfig(max_consumer_series=0)
