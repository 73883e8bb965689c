"""Filter push-down of batch reads: exactly the right rows, and less read from the relay.

A scripted relay (two tables, 1-7 changes per window) is read by a real local
Spark with ``spark.sql.python.filterPushdown.enabled``; the rows of each
filtered query are compared with the relay's content filtered in Python, and
the relay's ``changebus_relay_streamed_events_total`` counter shows how many
events the query's tasks fetched (with small responses, ``maxBytesPerRequest``:
a task stops at the first window past its range, and the response holding it
may carry more). Filters the source does not take (or only
partly) stay with Spark: the results are right either way, also with the
setting off (Spark's default), when nothing is pushed.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import urllib.request
from typing import Any

import pytest
from pyspark.sql.datasource import (
    EqualTo,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    IsNotNull,
    LessThan,
    LessThanOrEqual,
    StringStartsWith,
)
from spark_source_support import COLS, as_changes, project, scripted, truth  # noqa: F401

from changebus.client.spark._pushdown import MAX_SCN_RANGES, Pushed, split_filters

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]

_PUSHDOWN = "spark.sql.python.filterPushdown.enabled"


def test_split_filters_and_scn_sub_ranges() -> None:
    scn = ("_commit_scn",)
    taken = [
        GreaterThan(scn, 100),
        GreaterThanOrEqual(scn, 150),
        LessThan(scn, 400),
        LessThanOrEqual(scn, 390),
        In(("_source",), ("a.t", "b.t")),
        EqualTo(("_source",), "a.t"),
        EqualTo(("_partition",), "p"),
        IsNotNull(scn),
    ]
    left = [
        EqualTo(("qty",), 3),
        GreaterThan(scn, 1.5),  # not an integer: Spark compares as double
        In(scn, (1, "x")),
        StringStartsWith(("_source",), "a"),
        GreaterThan(("_commit_scn", "x"), 1),
    ]
    pushed, rest = split_filters([*taken, *left])
    assert rest == left
    assert pushed == Pushed(149, 390, None, frozenset({"a.t"}), frozenset({"p"}))
    assert pushed.bounds(0, 1000) == [(149, 390)]
    assert pushed.bounds(200, 300) == [(200, 300)]
    assert pushed.bounds(390, 1000) == []
    # with a bootstrap server the SCN filters stay with Spark
    pushed, rest = split_filters(taken, scn=False)
    assert pushed.after is None and pushed.upto is None
    assert [f for f in rest if getattr(f, "attribute", None) == scn] == taken[:4]
    # = / IN: one sub-range per value, at most MAX_SCN_RANGES (the widest gaps cut)
    values = [10 * i for i in range(1, 41)] + [1000]
    pushed, rest = split_filters([In(scn, tuple(values)), LessThanOrEqual(scn, 1000)])
    assert not rest
    ranges = pushed.bounds(0, 2000)
    assert len(ranges) == MAX_SCN_RANGES and ranges[-1] == (999, 1000)
    assert all(any(a < v <= b for a, b in ranges) for v in values)
    assert sorted(ranges) == ranges and all(b < c for (_, b), (c, _) in itertools.pairwise(ranges))
    few, _ = split_filters([In(scn, (5, 7, 30)), EqualTo(scn, 7)])
    assert few.bounds(0, 100) == [(6, 7)]
    assert few.bounds(7, 100) == []


def _streamed(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    m = re.search(r'^changebus_relay_streamed_events_total\{partition="syn"\} (\S+)$', text, re.M)
    assert m, "no streamed-events counter"
    return float(m.group(1))


def _key(c: tuple[Any, ...]) -> tuple[Any, ...]:
    return c[0], c[1], c[2]


def test_pushed_filters_read_less_and_give_the_same_rows(spark: Any, scripted: Any) -> None:  # noqa: F811
    from pyspark.sql import functions as F

    relay, sizes = scripted(60, seed=21)
    everything = project(truth(relay.url), COLS)
    scns = sorted(sizes)

    def run(where: Any, *, numbered: int = 1) -> tuple[list[tuple[Any, ...]], float]:
        before = _streamed(relay.url)
        df = (
            spark.read.format("changebus")
            .option("relays", relay.url)
            .option("numPartitions", str(numbered))
            .option("maxBytesPerRequest", "1024")  # a response overshoots the end by less
            .load()
        )
        rows = df.where(where).collect() if where is not None else df.collect()
        return sorted(as_changes(rows, COLS), key=_key), _streamed(relay.url) - before

    def want(keep: Any) -> list[tuple[Any, ...]]:
        return sorted((c for c in everything if keep(c)), key=_key)

    spark.conf.set(_PUSHDOWN, "true")
    try:
        got, full = run(None)
        assert got == sorted(everything, key=_key) and full > 0
        lo, hi = scns[20], scns[29]
        scn = F.col("_commit_scn")
        # a range: about a sixth of the windows read
        got, read = run((scn > lo) & (scn <= hi))
        assert got == want(lambda c: lo < c[0] <= hi) and got
        assert read < full / 3, (read, full)
        # the same with key-hash slices (each slice fetches every window's end marker)
        got, _ = run((scn >= lo) & (scn < hi), numbered=2)
        assert got == want(lambda c: lo <= c[0] < hi)
        # = / IN: only those windows
        picked = [scns[3], scns[31], scns[55]]
        got, read = run(scn.isin(picked))
        assert got == want(lambda c: c[0] in picked) and got
        assert read < full / 4, (read, full)
        got, _ = run(scn == scns[40])
        assert got == want(lambda c: c[0] == scns[40]) and got
        # a table: the other one's events are not sent
        src = F.col("_source")
        got, read = run(src == "shop.items")
        items = want(lambda c: c[3] == "shop.items")
        assert got == items and len(items) < len(everything)
        assert read < full, (read, full)
        got, _ = run(src.isin("shop.orders", "no.such"))
        assert got == want(lambda c: c[3] == "shop.orders")
        got, read = run(src == "no.such")
        assert got == [] and read == 0
        got, _ = run((F.col("_partition") == "syn") & (scn <= scns[5]))
        assert got == want(lambda c: c[0] <= scns[5]) and got
        assert run(F.col("_partition") == "other")[0] == []
        # pushed and unpushed together: Spark applies the rest
        got, read = run((scn > lo) & (F.col("qty") > 3) & (src == "shop.orders"))
        assert got == want(lambda c: lo < c[0] and c[3] == "shop.orders" and (c[4]["qty"] or 0) > 3)
        assert got and read < full
        # nothing pushable (a disjunction, an expression): every window read, rows still right
        got, read = run((scn < scns[2]) | (scn > scns[57]))
        assert got == want(lambda c: c[0] < scns[2] or c[0] > scns[57]) and got
        assert read == full
        got, _ = run(scn % 20 == 0)
        assert got == want(lambda c: c[0] % 20 == 0) and got
    finally:
        spark.conf.unset(_PUSHDOWN)
    # the setting off (Spark's default): no push-down, no error, the same rows
    got, read = run((scn > lo) & (scn <= hi))
    assert got == want(lambda c: lo < c[0] <= hi) and read == full


async def test_a_bounded_consumer_read_stops_at_its_end(make_relay: Any) -> None:
    """``until_scn``: the iterator ends after the window reaching it, nothing more is fetched."""
    from changebus.client import Consumer, ConsumerConfig

    async with make_relay(max_windows=400, events_per_window=3) as relay:
        first = relay.hosts["syn"].buffer.meta.min_scn
        common: dict[str, Any] = {
            "relays": (relay.url,),
            "partition": "syn",
            "follow": False,
            "wait_s": 0.2,
            "max_bytes": 2048,
        }
        async with Consumer(
            ConsumerConfig(**common, start=str(first + 19), until_scn=first + 29)
        ) as c:
            got = [w.scn async for w in c]
            await asyncio.sleep(0.3)  # a fetcher still running would fetch on meanwhile
            stats = c.stats()
        assert got == list(range(first + 20, first + 30))
        assert stats["windows_fetched"] < 40  # one small response past the end at most
        # an end between window SCNs: the first window past it ends the read
        config = ConsumerConfig(**common, start=str(first - 1), until_scn=first + 4)
        async with Consumer(config) as c:
            assert [w.scn async for w in c] == list(range(first, first + 5))
