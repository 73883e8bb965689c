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


def _window_sizes(url: str, sources: str) -> dict[int, tuple[int, int]]:
    """``{window scn: (data events, their bytes)}`` of the relay's partition ``syn``."""
    import urllib.parse
    import urllib.request

    import numpy as np

    from changebus.schemas import FIRST_CONTROL_OP, Op, parse_stream

    out: dict[int, tuple[int, int]] = {}
    scn, offset = -1, -1
    while True:
        query = urllib.parse.urlencode(
            {"partition": "syn", "scn": scn, "offset": offset, "wait": 0, "sources": sources}
        )
        with urllib.request.urlopen(f"{url}/v1/stream?{query}", timeout=10) as resp:
            body = resp.read()
            if resp.status == 204 or not body:
                return out
            scn = int(resp.headers["X-Changebus-Next-Scn"])
            offset = int(resp.headers["X-Changebus-Next-Offset"])
        _, headers = parse_stream(body)
        for s in np.unique(headers["scn"]).tolist():
            mine = (headers["scn"] == s) & (headers["op"] < FIRST_CONTROL_OP)
            events, size = out.get(s, (0, 0))
            assert (headers["op"][headers["scn"] == s] == int(Op.END_OF_WINDOW)).any()
            out[s] = (
                events + int(mine.sum()),
                size + int(headers["total_length"][mine].sum()),
            )


async def test_max_bytes_and_rows_per_trigger_cut_whole_windows(make_relay: MakeRelay) -> None:
    """Every batch stays within maxBytesPerTrigger and maxRowsPerTrigger, or is one window."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxBytes

    from changebus.client.spark import _source
    from changebus.client.spark._options import SourceOptions

    async with make_relay(max_windows=120) as relay:
        sizes = await asyncio.to_thread(_window_sizes, relay.url, "synthetic.t0")
        scns = sorted(sizes)
        assert len(scns) == 120 and len({b for _, b in sizes.values()}) > 3  # uneven windows
        biggest = max(b for _, b in sizes.values())

        def plan(options: dict[str, str], limit: Any = None) -> list[tuple[int, int]]:
            """(start, end] of the batches from the first window to the last."""
            opts = SourceOptions.parse(
                {"relays": relay.url, "sources": "synthetic.t0", **options}, mode="stream"
            )
            reader = _source.ChangebusStreamReader(opts, _spark_schema(opts))
            start, batches = scns[0] - 1, []
            while start < scns[-1]:
                end = reader.latestOffset({"syn": start}, limit or reader.getDefaultReadLimit())[
                    "syn"
                ]
                assert end > start
                batches.append((start, end))
                start = end
            return batches

        def check(batches: list[tuple[int, int]], max_rows: int, max_bytes: int) -> None:
            for since, until in batches:
                inside = [s for s in scns if since < s <= until]
                assert inside, "an empty batch"
                events = sum(sizes[s][0] for s in inside)
                size = sum(sizes[s][1] for s in inside)
                if len(inside) > 1:  # more than one window: within the limits
                    assert events <= max_rows and size <= max_bytes
                after = [s for s in scns if s > until][:1]
                if after:  # and the next window would not have fitted (or a limit is reached)
                    more = (events + sizes[after[0]][0], size + sizes[after[0]][1])
                    assert (
                        more[0] > max_rows
                        or more[1] > max_bytes
                        or events >= max_rows
                        or size >= max_bytes
                    )

        limit = 3 * biggest
        by_bytes = await asyncio.to_thread(plan, {"maxBytesPerTrigger": str(limit)})
        check(by_bytes, 1 << 30, limit)
        assert len(by_bytes) >= sum(b for _, b in sizes.values()) // limit
        # a limit below one window: one window with changes per batch (a transaction is
        # never split; windows without changes of the table count for nothing)
        tiny = await asyncio.to_thread(plan, {"maxBytesPerTrigger": "1"})
        check(tiny, 1 << 30, 1)
        full = [[s for s in scns if a < s <= b and sizes[s][0]] for a, b in tiny]
        assert all(len(f) <= 1 for f in full)
        assert sum(len(f) for f in full) == len([s for s in scns if sizes[s][0]])
        # both limits: the rows limit is Spark's default one, the bytes limit applies too
        both = await asyncio.to_thread(
            plan, {"maxBytesPerTrigger": str(limit), "maxRowsPerTrigger": "4"}
        )
        check(both, 4, limit)
        assert len(both) > len(by_bytes)
        # a limit Spark passes wins over the option of its kind; ReadAllAvailable lifts them
        wider = await asyncio.to_thread(plan, {"maxBytesPerTrigger": "1"}, ReadMaxBytes(limit))
        assert wider == by_bytes
        everything = await asyncio.to_thread(plan, {"maxBytesPerTrigger": "1"}, ReadAllAvailable())
        assert everything == [(scns[0] - 1, scns[-1])]


def _spark_schema(opts: Any) -> Any:
    from pyspark.sql.pandas.types import from_arrow_schema

    from changebus.client.spark import _source

    return from_arrow_schema(_source.source_schema(opts), prefer_timestamp_ntz=True)


async def test_min_rows_per_trigger_waits_for_rows_or_the_delay(make_relay: MakeRelay) -> None:
    """Kafka's minOffsetsPerTrigger + maxTriggerDelay, on the driver's reader."""
    import time

    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMinRows

    from changebus.client.spark import _source
    from changebus.client.spark._options import SourceOptions

    async with make_relay(max_windows=100, events_per_window=3) as relay:
        scns = sorted(
            await asyncio.to_thread(_window_sizes, relay.url, "synthetic.t0,synthetic.t1")
        )

        def reader(options: dict[str, str]) -> Any:
            opts = SourceOptions.parse({"relays": relay.url, **options}, mode="stream")
            return _source.ChangebusStreamReader(opts, _spark_schema(opts))

        def run() -> None:
            r = reader({"minRowsPerTrigger": "10", "maxTriggerDelay": "1h"})
            limit = r.getDefaultReadLimit()
            assert limit == ReadMinRows(10)
            last = scns[-1]
            # the first trigger is never skipped (Kafka's too)
            assert r.latestOffset({"syn": scns[0] - 1}, limit) == {"syn": last}
            # 3 windows of 3 events: 9 < 10, skipped; 4 windows: 12 >= 10, taken whole
            assert r.latestOffset({"syn": scns[-4]}, limit) == {"syn": scns[-4]}
            assert r.latestOffset({"syn": scns[-5]}, limit) == {"syn": last}
            assert r.latestOffset({"syn": last}, limit) == {"syn": last}  # nothing new
            # Trigger.Once (ReadAllAvailable) reads what there is
            assert r.latestOffset({"syn": scns[-2]}, ReadAllAvailable()) == {"syn": last}
            # Trigger.AvailableNow never waits: it must reach its target and stop
            r.prepareForTriggerAvailableNow()
            assert r.latestOffset({"syn": scns[-2]}, limit) == {"syn": last}

            # maxTriggerDelay: a trigger after the delay takes what there is
            r = reader({"minRowsPerTrigger": "10", "maxTriggerDelay": "600ms"})
            assert r.latestOffset({"syn": scns[0] - 1}, limit) == {"syn": last}
            began = time.monotonic()
            skipped = r.latestOffset({"syn": scns[-2]}, limit)
            if time.monotonic() - began < 0.6:  # (a very slow machine may have waited enough)
                assert skipped == {"syn": scns[-2]}
            time.sleep(0.7)
            assert r.latestOffset({"syn": scns[-2]}, limit) == {"syn": last}

            # with maxRowsPerTrigger too: at least 10 rows, batches of at most 12
            r = reader({"minRowsPerTrigger": "10", "maxRowsPerTrigger": "12"})
            assert r.latestOffset({"syn": scns[0] - 1}, limit) == {"syn": scns[3]}
            assert r.latestOffset({"syn": scns[-3]}, limit) == {"syn": scns[-3]}

        await asyncio.to_thread(run)


async def test_the_held_first_batch_counts_as_the_first_trigger_for_min_rows(
    make_relay: MakeRelay,
) -> None:
    """A new query starting at ``latest`` holds its first batch empty (its start may
    move). That batch did not count as a trigger: the next one was the reader's first,
    never skipped, and took fewer rows than ``minRowsPerTrigger`` (seen as a flaky
    Spark test). It counts now: the next trigger waits for the rows."""
    from pyspark.sql.pandas.types import from_arrow_schema
    from pyspark.sql.streaming.datasource import ReadMinRows

    from changebus.client.spark import _source
    from changebus.client.spark._options import SourceOptions

    async with make_relay() as relay:
        opts = SourceOptions.parse(
            {"relays": relay.url, "minRowsPerTrigger": "1000000", "maxTriggerDelay": "1h"},
            mode="stream",
        )

        def plan() -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
            schema = from_arrow_schema(_source.source_schema(opts), prefer_timestamp_ntz=True)
            reader = _source.ChangebusStreamReader(opts, schema)
            first = reader.initialOffset()
            held = reader.latestOffset(first, ReadMinRows(1_000_000))
            older = dict.fromkeys(first, 1000)  # (rows after it, fewer than the minimum)
            return first, held, reader.latestOffset(older, ReadMinRows(1_000_000))

        first, held, waited = await asyncio.to_thread(plan)
    assert held == first  # the held first batch
    assert waited == dict.fromkeys(first, 1000)  # skipped: fewer rows than the minimum


async def test_the_read_limit_is_shared_by_the_partitions_with_something_new(
    make_relay: MakeRelay, monkeypatch: pytest.MonkeyPatch
) -> None:
    """maxRowsPerTrigger was divided by every partition, idle ones included, and their
    share went unused: with eight partitions and one busy, a batch read an eighth of the
    limit (review). The partitions with something new share it."""
    from pyspark.sql.pandas.types import from_arrow_schema
    from pyspark.sql.streaming.datasource import ReadMaxRows

    from changebus.client.spark import _source
    from changebus.client.spark._options import SourceOptions
    from changebus.client.spark._relay import PartitionBounds

    async with make_relay() as relay:
        opts = SourceOptions.parse({"relays": relay.url}, mode="stream")

        def make() -> Any:
            schema = from_arrow_schema(_source.source_schema(opts), prefer_timestamp_ntz=True)
            return _source.ChangebusStreamReader(opts, schema)

        reader = await asyncio.to_thread(make)
    reader._hold_first = False
    asked: dict[str, int] = {}

    async def bounds(_opts: Any) -> dict[str, PartitionBounds]:
        return {
            f"p{i}": PartitionBounds(f"p{i}", 1, 900 if i == 0 else 100, 0, 0) for i in range(8)
        }

    async def limited(name: str, since: int, head: int, rows: int, size: int) -> int:
        asked[name] = rows
        return since + rows

    async def unguarded(start: Any, end: dict[str, int], boot: Any) -> dict[str, int]:
        return end

    monkeypatch.setattr(_source, "partition_bounds", bounds)
    monkeypatch.setattr(reader, "_limited_end", limited)
    monkeypatch.setattr(reader._guard, "check", unguarded)
    start = {"p0": 100, **{f"p{i}": 100 for i in range(1, 8)}}  # only p0 has new windows
    end = await reader._latest(start, ReadMaxRows(800))
    assert asked == {"p0": 800}  # the whole limit, not 100
    assert end == {"p0": 900, **{f"p{i}": 100 for i in range(1, 8)}}


async def test_available_now_pins_an_empty_relay_at_where_it_is_complete_to(
    make_relay: MakeRelay, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relay whose buffer is empty says max_scn -1: AvailableNow pinned -1, so a query
    from nothing with a bootstrap server never got its snapshot batch and ended having
    read nothing (review). The pin is where the relay is complete to (prev_scn)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    from changebus.client.spark import _source
    from changebus.client.spark._options import SourceOptions
    from changebus.client.spark._relay import PartitionBounds

    async def empty(opts: Any) -> dict[str, PartitionBounds]:
        return {"syn": PartitionBounds("syn", -1, -1, 100, 0, evicted=False)}

    async with make_relay() as relay:
        opts = SourceOptions.parse({"relays": relay.url}, mode="stream")

        def pin() -> dict[str, int] | None:
            schema = from_arrow_schema(_source.source_schema(opts), prefer_timestamp_ntz=True)
            reader = _source.ChangebusStreamReader(opts, schema)
            monkeypatch.setattr(_source, "partition_bounds", empty)
            reader.prepareForTriggerAvailableNow()
            return reader._target

        target = await asyncio.to_thread(pin)
    assert target == {"syn": 100}


async def test_a_batch_rerouted_to_the_bootstrap_server_stops_at_the_available_now_target(
    make_relay: MakeRelay, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A limited batch whose range was evicted between the bounds and the cut goes through
    the bootstrap server; it was planned up to the relay's newest SCN, past the
    AvailableNow target the query must stop at (review). It ends at the target now."""
    from pyspark.sql.pandas.types import from_arrow_schema
    from pyspark.sql.streaming.datasource import ReadMaxRows

    from changebus.client import FellOffRelayError
    from changebus.client.spark import _source
    from changebus.client.spark._options import SourceOptions
    from changebus.client.spark._relay import PartitionBounds

    async with make_relay() as relay:
        opts = SourceOptions.parse(
            {"relays": relay.url, "bootstrapUrl": "http://127.0.0.1:9"}, mode="stream"
        )

        def make() -> Any:
            schema = from_arrow_schema(_source.source_schema(opts), prefer_timestamp_ntz=True)
            return _source.ChangebusStreamReader(opts, schema)

        reader = await asyncio.to_thread(make)
    reader._hold_first = False
    reader._target = {"p": 500}  # (prepareForTriggerAvailableNow pinned it)
    reads = [PartitionBounds("p", 101, 600, 100, 0), PartitionBounds("p", 801, 1000, 800, 0)]

    async def bounds(_opts: Any) -> dict[str, PartitionBounds]:
        return {"p": reads.pop(0) if len(reads) > 1 else reads[0]}

    async def evicted(name: str, since: int, head: int, rows: int, size: int) -> int:
        raise FellOffRelayError(
            "gone", partition=name, requested_scn=since, oldest_scn=801, prev_scn=800, relay=""
        )

    async def server_target(_opts: Any, _name: str) -> int:
        return 2000  # the bootstrap server has it all, and more

    async def unguarded(start: Any, end: dict[str, int], boot: Any) -> dict[str, int]:
        return end

    monkeypatch.setattr(_source, "partition_bounds", bounds)
    monkeypatch.setattr(_source, "bootstrap_target", server_target)
    monkeypatch.setattr(reader, "_limited_end", evicted)
    monkeypatch.setattr(reader._guard, "check", unguarded)
    end = await reader._latest({"p": 200}, ReadMaxRows(50))
    assert end == {"p": 500}
