"""The seed's pacing: :class:`Throttle` with a clock of the test's (no waiting, no server)."""

from __future__ import annotations

import pytest

from changebus.bootstrap._pacing import ChunkSizer, Throttle
from changebus.schemas import ConfigError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run(throttle: Throttle, clock: Clock, rows: int, busy_s: float) -> float:
    """A chunk of ``rows`` read in ``busy_s``, then the pause asked for, waited."""
    clock.now += busy_s
    wait = throttle.pause(rows, busy_s)
    clock.now += wait
    return wait


def test_the_rate_is_held_over_steady_chunks() -> None:
    clock = Clock()
    throttle = Throttle(rows_per_s=1000, clock=clock)
    start = clock.now
    waits = [run(throttle, clock, 500, 0.1) for _ in range(10)]
    assert waits == pytest.approx([0.4] * 10)
    assert 5000 / (clock.now - start) == pytest.approx(1000)


def test_time_standing_still_earns_no_burst() -> None:
    """Paced as an average since the first chunk, a seed that stood still (a long sweep,
    a refill waiting for the applier) then read at full speed until the average caught
    up: 600k rows at once after 5 minutes at 2,000 rows/s (review)."""
    clock = Clock()
    throttle = Throttle(rows_per_s=2000, clock=clock)
    for _ in range(3):
        run(throttle, clock, 1000, 0.1)
    clock.now += 300.0  # the seed stood still
    waits = [run(throttle, clock, 1000, 0.1) for _ in range(5)]
    assert waits == pytest.approx([0.4] * 5)  # the rate at once, no catching up


def test_a_slow_chunk_is_not_paused_after() -> None:
    clock = Clock()
    throttle = Throttle(rows_per_s=1000, clock=clock)
    assert run(throttle, clock, 500, 2.0) == 0.0  # slower than the rate by itself
    assert run(throttle, clock, 500, 0.1) == pytest.approx(0.4)


def test_the_source_time_budget() -> None:
    clock = Clock()
    throttle = Throttle(time_budget=0.25, clock=clock)
    assert run(throttle, clock, 500, 0.2) == pytest.approx(0.6)  # busy a quarter
    both = Throttle(rows_per_s=10_000, time_budget=0.5, clock=clock)
    assert run(both, clock, 500, 0.2) == pytest.approx(0.2)  # the larger of the two


def test_bad_budgets_are_refused() -> None:
    with pytest.raises(ConfigError, match="max_rows_per_s"):
        Throttle(rows_per_s=-1)
    with pytest.raises(ConfigError, match="source_time_budget"):
        Throttle(time_budget=0)


def test_wide_rows_make_small_chunks_and_narrow_ones_grow_back() -> None:
    """5,000 rows of 2 MB made one 10 GB chunk, held a few times over (review): a table
    starts at 256 rows with a byte budget, and each chunk aims at 70 % of it."""
    sizer = ChunkSizer(5000, max_bytes=64 << 20)
    assert sizer.limit == 5000 and sizer.start_table() == 256
    # 2 MB rows: 256 of them are 512 MB; the next chunks fit 70 % of 64 MiB
    assert sizer.after(256, -1.0, 256 * (2 << 20)) == 22
    assert sizer.after(22, -1.0, 22 * (2 << 20)) == 22
    # a 60 MB row: one a chunk
    assert sizer.after(22, -1.0, 22 * (60 << 20)) == 1
    # a narrow table: from 256, doubling to chunk_rows
    assert sizer.start_table() == 256
    limits = [sizer.after(sizer.limit, -1.0, sizer.limit * 500) for _ in range(6)]
    assert limits == [512, 1024, 2048, 4096, 5000, 5000]
    # the time rule still holds alongside; without a budget the table starts at once
    both = ChunkSizer(5000, max_txn_s=1.0, max_bytes=64 << 20)
    both.start_table()
    assert both.after(256, 10.0, 256 * 500) == 100  # too slow: the time floor
    plain = ChunkSizer(5000)
    assert plain.start_table() == 5000 and plain.after(5000, -1.0, 5000 << 20) == 5000
    with pytest.raises(ConfigError, match="max_chunk_bytes"):
        ChunkSizer(5000, max_bytes=-1)
