"""The Spark stream reader's driver side against a real relay, without a Spark session."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest

from changebus.relay import Relay

MakeRelay = Callable[..., AbstractAsyncContextManager[Relay]]

pytest.importorskip("pyspark")


async def test_latest_offset_and_partitions_share_one_bounds_request(
    make_relay: MakeRelay, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pyspark.sql.pandas.types import from_arrow_schema
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    from changebus.client.spark import _source
    from changebus.client.spark._options import SourceOptions
    from changebus.client.spark._relay import partition_bounds as real

    calls: list[int] = []

    async def counted(opts: Any) -> Any:
        calls.append(1)
        return await real(opts)

    monkeypatch.setattr(_source, "partition_bounds", counted)
    async with make_relay() as relay:
        opts = SourceOptions.parse(
            {"relays": relay.url, "bootstrapUrl": "http://127.0.0.1:9"}, mode="stream"
        )

        def plan() -> tuple[dict[str, int], int, int, int]:
            schema = from_arrow_schema(_source.source_schema(opts), prefer_timestamp_ntz=True)
            reader = _source.ChangebusStreamReader(opts, schema)
            start = {"syn": 1100}
            before = len(calls)
            end = reader.latestOffset(start, ReadAllAvailable())
            parts = reader.partitions(dict(start), end)
            one_trigger = len(calls) - before
            before = len(calls)
            reader.partitions(start, end)  # a batch replayed after a restart: asks itself
            return end, one_trigger, len(calls) - before, len(parts)

        end, one_trigger, replayed, parts = await asyncio.to_thread(plan)
    assert end == {"syn": 1299} and parts >= 1
    assert one_trigger == 1 and replayed == 1
