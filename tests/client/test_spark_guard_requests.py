"""The Spark source's schema guard asks the relays about many partitions in one listing
per set of relays (it listed every partition's sources once per partition, per trigger:
300 requests of 52 MB in all at 300 partitions of 10 tables)."""

from __future__ import annotations

from pathlib import Path

from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas.server import HTTP_METRICS

SMALL = {"windows_per_s": 0, "max_windows": 5, "events_per_window": 2, "row_bytes": 50}


async def test_the_guard_lists_sources_once_for_partitions_that_share_relays(
    tmp_path: Path,
) -> None:
    from changebus.client.spark._evolution import SchemaGuard
    from changebus.client.spark._options import SourceOptions

    parts = [f"p{i}" for i in range(6)]
    cfg = RelayConfig(
        data_dir=tmp_path / "relay",
        http=HttpConfig(port=0),
        partitions=tuple(
            PartitionConfig(
                name, i + 1, capacity_bytes=1 << 20, fetcher=FetcherConfig("synthetic", SMALL)
            )
            for i, name in enumerate(parts)
        ),
        flush_interval_s=0,
    )
    async with Relay(cfg) as relay:
        stats = relay.server.app[HTTP_METRICS]
        guard = SchemaGuard(SourceOptions.parse({"relays": relay.url}), {})
        newer = await guard._newer_versions(parts)
        assert newer == {}  # (no schema known to the query: nothing newer to compare)
        assert stats.requests[("/v1/sources", 200)] == 1
