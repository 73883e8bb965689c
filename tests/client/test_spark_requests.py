"""The Spark source's planning asks the relays about many partitions in one request per
set of relays: the schema guard listed every partition's sources once per partition, per
trigger (300 requests of 52 MB in all at 300 partitions of 10 tables), and the bounds of
a cluster's partitions were one ``/v1/status`` per partition."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas.server import HTTP_METRICS

SMALL = {"windows_per_s": 0, "max_windows": 5, "events_per_window": 2, "row_bytes": 50}


def _relay_config(tmp: Path, parts: list[str], options: dict[str, Any] = SMALL) -> RelayConfig:
    """A relay of synthetic partitions ``parts`` (``options``: the synthetic fetcher's)."""
    return RelayConfig(
        data_dir=tmp / "relay",
        http=HttpConfig(port=0),
        partitions=tuple(
            PartitionConfig(
                name, i + 1, capacity_bytes=1 << 20, fetcher=FetcherConfig("synthetic", options)
            )
            for i, name in enumerate(parts)
        ),
        flush_interval_s=0,
    )


def _in_flight(monkeypatch: pytest.MonkeyPatch, method: str) -> list[int]:
    """Count the calls of ``RelayInfo.<method>`` running at once: ``[now, most]``."""
    from changebus.client._info import RelayInfo

    counts = [0, 0]
    real = getattr(RelayInfo, method)

    async def counted(self: RelayInfo, *args: Any) -> Any:
        counts[0] += 1
        counts[1] = max(counts[1], counts[0])
        try:
            return await real(self, *args)
        finally:
            counts[0] -= 1

    monkeypatch.setattr(RelayInfo, method, counted)
    return counts


async def test_the_guard_lists_sources_once_for_partitions_that_share_relays(
    tmp_path: Path,
) -> None:
    from changebus.client.spark._evolution import SchemaGuard
    from changebus.client.spark._options import SourceOptions

    parts = [f"p{i}" for i in range(6)]
    cfg = _relay_config(tmp_path, parts)
    async with Relay(cfg) as relay:
        stats = relay.server.app[HTTP_METRICS]
        guard = SchemaGuard(SourceOptions.parse({"relays": relay.url}), {})
        newer = await guard._newer_versions(parts)
        assert newer == {}  # (no schema known to the query: nothing newer to compare)
        assert stats.requests[("/v1/sources", 200)] == 1


async def test_a_clusters_bounds_are_one_status_request_per_set_of_relays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from changebus.client._info import PartitionStatus
    from changebus.client.spark import _relay
    from changebus.client.spark._options import SourceOptions

    parts = [f"p{i}" for i in range(50)]
    routes: dict[str, tuple[str, ...]] = {
        p: (("http://127.0.0.1:1",) if i % 2 else ("http://127.0.0.1:2",))
        for i, p in enumerate(parts)
    }
    asked: list[tuple[str, ...]] = []

    async def cluster_routes(_opts: Any) -> dict[str, tuple[str, ...]]:
        return routes

    async def ask(_opts: Any, urls: tuple[str, ...], _call: Any, what: str = "") -> Any:
        asked.append(urls)
        return {
            p: PartitionStatus(p, 1, "streaming", 5, 9, 4, 0, None, {})
            for p, served in routes.items()
            if served == urls
        }

    monkeypatch.setattr(_relay, "cluster_routes", cluster_routes)
    monkeypatch.setattr(_relay, "_ask", ask)
    opts = SourceOptions.parse({"zookeeper": "127.0.0.1:1", "cluster": "c"})
    bounds = await _relay.partition_bounds(opts)
    assert sorted(bounds) == sorted(parts) and all(b.max_scn == 9 for b in bounds.values())
    assert sorted(asked) == [("http://127.0.0.1:1",), ("http://127.0.0.1:2",)]  # (not 50)


async def test_a_readers_start_asks_for_table_schemas_several_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One ``/v1/schemas/{source}`` per table, asked one after the other: a query of
    3,000 tables waited 3,000 round trips before it started. Now PARALLEL_REQUESTS go at
    once, and the answer is the same (every table, in the relay's order)."""
    from changebus.client.spark import _relay
    from changebus.client.spark._options import SourceOptions

    tables = 40
    options = {**SMALL, "tables": tables, "events_per_window": tables}
    cfg = _relay_config(tmp_path, ["p"], options)
    counts = _in_flight(monkeypatch, "schemas")
    async with Relay(cfg) as relay:
        stats = relay.server.app[HTTP_METRICS]
        opts = SourceOptions.parse({"relays": relay.url})
        for _ in range(100):
            known = await _relay.table_schemas(opts, ["p"])
            if len(known) == tables:
                break
        registry = relay.hosts["p"].registry
        names = [name for _id, name in sorted(registry.sources())]
        newest = {name: registry.latest(name) for name in names}
        asked = sum(n for (path, _code), n in stats.requests.items() if "schemas" in path)
    assert sorted(known) == sorted(names) and len(names) == tables
    assert known == newest
    assert 1 < counts[1] <= _relay.PARALLEL_REQUESTS
    assert asked >= tables


async def test_planning_asks_for_the_partitions_split_points_several_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every trigger's plan asks each partition's relay for split points: one after the
    other, 300 partitions were 300 round trips per trigger. They go PARALLEL_REQUESTS at
    a time now, with the same answer as one at a time."""
    from changebus.client.spark import _relay
    from changebus.client.spark._options import SourceOptions

    parts = [f"p{i}" for i in range(24)]
    options = {**SMALL, "max_windows": 40}
    cfg = _relay_config(tmp_path, parts, options)
    counts = _in_flight(monkeypatch, "splits")
    async with Relay(cfg) as relay:
        for name in parts:
            buffer = relay.hosts[name].buffer
            for _ in range(500):
                if buffer.meta.windows >= 40:
                    break
                await asyncio.sleep(0.01)
        ranges = {n: (-1, relay.hosts[n].buffer.meta.last_scn) for n in parts}
        opts = SourceOptions.parse({"relays": relay.url})
        together = await _relay.split_points(opts, ranges, 4)
        concurrent = counts[1]
        monkeypatch.setattr(_relay, "PARALLEL_REQUESTS", 1)
        counts[1] = 0
        alone = await _relay.split_points(opts, ranges, 4)
    assert together == alone and sorted(together) == sorted(parts)
    assert all(len(cuts) == 3 for cuts in together.values())
    assert 1 < concurrent <= 16 and counts[1] == 1
