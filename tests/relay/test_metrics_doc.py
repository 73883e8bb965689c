"""docs/metrics.md names exactly the metric families a relay and a bootstrap server export.

A relay (one synthetic partition) and a bootstrap server following it run;
every metric the page names appears in one of their ``/metrics``, and every
family they export has a row on the page.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from metrics_util import families, scrape

from changebus.bootstrap import (
    BootstrapConfig,
    BootstrapServer,
    HttpConfig as BootstrapHttp,
    StoreConfig,
)
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from waiting import wait_until

pytestmark = pytest.mark.usefixtures("no_blocking")

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
NAME = re.compile(r"`(changebus_(?:relay|bootstrap)_[a-z_]+)")


def documented() -> tuple[set[str], set[str]]:
    """(every metric named on the page, the names with a table row of their own)."""
    text = DOC.read_text()
    named = set(NAME.findall(text))
    rows = {m.group(1) for m in re.finditer(r"^\| `([a-z_]+)` \|", text, re.MULTILINE)}
    return named, {r for r in rows if r.startswith("changebus_")}


async def test_docs_name_every_exported_family_and_nothing_else(tmp_path: Path) -> None:
    source = {"windows_per_s": 500, "max_windows": 50}
    cfg = RelayConfig(
        data_dir=tmp_path / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "syn", 1, capacity_bytes=1 << 20, fetcher=FetcherConfig("synthetic", source)
            ),
        ),
        flush_interval_s=0,
    )
    async with Relay(cfg) as relay:
        boot_cfg = BootstrapConfig(
            relays=(relay.url,),
            partitions=("syn",),
            data_dir=tmp_path / "boot",
            store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
            http=BootstrapHttp(port=0),
        )
        async with BootstrapServer(boot_cfg) as boot:
            await wait_until(lambda: boot.service.ready, what="the bootstrap server streams")
            relay_text = await scrape(relay.url)
            boot_text = await scrape(boot.url)
    exported = families(relay_text) | families(boot_text)
    named, rows = documented()
    assert named - exported == set(), "docs/metrics.md names metrics that are not exported"
    assert exported - rows == set(), "exported families without a row in docs/metrics.md"
    # the operator metrics dashboards and alerts are built on (DESIGN: exact names)
    for name in (
        "changebus_relay_ready",
        "changebus_relay_fetcher_state",
        "changebus_relay_source_lag_seconds",
        "changebus_relay_source_idle_seconds",
        "changebus_relay_source_retained_wal_bytes",
        "changebus_relay_source_binlog_distance_bytes",
        "changebus_relay_consumer_lag_scn",
        "changebus_relay_consumer_lag_seconds",
        "changebus_relay_data_loss_events_total",
        "changebus_relay_consumers_fell_off_total",
        "changebus_bootstrap_ready",
        "changebus_bootstrap_data_loss_events_total",
    ):
        assert name in exported and name in rows, name
