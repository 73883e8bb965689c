"""The circular tables' binary searches: exact over wrapped ranges, and never a copy.

A field of a structured record is a strided view; ``numpy.searchsorted``
copies such an array whole before searching, which made every eviction of
a big buffer cost a copy of its event table's positions. The searches must
agree with a sorted reference wherever the live range wraps, and read only
a handful of records.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from changebus.relay import BufferConfig, EventBuffer
from changebus.relay._tables import EVENT_DTYPE, INDEX_DTYPE, CircularTable
from changebus.schemas import EndOfWindow, Op, encode_control, encode_event, parse_stream


def _filled(tmp: Path, slots: int, start: int, values: list[int]) -> CircularTable:
    table = CircularTable(tmp / f"t{slots}-{start}.dat", EVENT_DTYPE, slots, create=True)
    records = np.zeros(len(values), dtype=EVENT_DTYPE)
    records["pos"] = values
    table.put(start, records)
    return table


@settings(max_examples=200, deadline=None)
@given(
    slots=st.integers(1, 40),
    start=st.integers(0, 200),
    data=st.data(),
)
def test_searches_match_a_sorted_reference(
    tmp_path_factory: pytest.TempPathFactory, slots: int, start: int, data: st.DataObject
) -> None:
    n = data.draw(st.integers(0, slots))
    values = sorted(data.draw(st.lists(st.integers(0, 50), min_size=n, max_size=n)))
    table = _filled(tmp_path_factory.mktemp("t"), slots, start, values)
    probes = data.draw(st.lists(st.integers(-3, 55), min_size=1, max_size=12))
    ref = np.array(values, dtype=np.uint64)
    for side in ("left", "right"):
        for v in probes:
            want = start + int(np.searchsorted(ref, v, side=side))
            assert table.searchsorted(start, start + n, "pos", v, side) == want
        many = table.searchsorted_many(
            start, start + n, "pos", np.array(probes, dtype=np.int64), side
        )
        assert many.tolist() == [start + int(np.searchsorted(ref, v, side=side)) for v in probes]
    # many probes take the vectorised path: the same answers
    lots = np.array((probes * 1100)[:1100], dtype=np.int64)
    got = table.searchsorted_many(start, start + n, "pos", lots, "left")
    assert got.tolist() == [start + int(np.searchsorted(ref, v)) for v in lots.tolist()]


def test_a_search_of_a_big_table_reads_in_place(tmp_path: Path) -> None:
    """A million events: the search allocates next to nothing (a copy would be 8 MB)."""
    slots = 1 << 20
    table = CircularTable(tmp_path / "events.dat", EVENT_DTYPE, slots, create=True)
    records = np.zeros(slots, dtype=EVENT_DTYPE)
    records["pos"] = np.arange(slots, dtype=np.uint64) * 100
    start = 5 * slots + slots // 3  # the live range wraps
    table.put(start, records)
    index = CircularTable(tmp_path / "index.dat", INDEX_DTYPE, slots, create=True)
    entries = np.zeros(slots, dtype=INDEX_DTYPE)
    entries["event"] = np.arange(slots, dtype=np.uint64) * 7
    index.put(3, entries)
    tracemalloc.start()
    try:
        found = table.searchsorted(start, start + slots, "pos", 100 * (slots - 10))
        at = index.searchsorted_many(3, 3 + slots, "event", np.array([70, 7 * 9000]), "left")
        # (a Spark plan's cut points: up to 1,024 targets are bisected too)
        many = index.searchsorted_many(3, 3 + slots, "event", np.arange(1000) * 7000, "left")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert found == start + slots - 10
    assert at.tolist() == [3 + 10, 3 + 9000]
    assert many.tolist() == [3 + 1000 * i for i in range(1000)]
    assert peak < 64 * 1024, f"the search allocated {peak} bytes"


def test_resuming_inside_a_big_window_reads_in_place(tmp_path: Path) -> None:
    """A checkpoint inside a window of 200,000 events: finding it copies no SCN column."""
    buf = EventBuffer(tmp_path / "buf", BufferConfig(capacity_bytes=32 << 20, event_slots=1 << 19))
    try:
        buf.set_start(0)
        n = 200_000
        body = [encode_event(Op.INSERT, 7, i, 7000, b"k", b"") for i in range(n)]
        buf.append_window(b"".join([*body, encode_control(EndOfWindow(n, ""), 7, n, 7000)]))
        warm = buf.select(7, 150_000, 4096)  # (numpy's first calls allocate)
        assert warm is not None
        buf.release(warm)
        tracemalloc.start()
        try:
            sel = buf.select(7, 150_000, 4096)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert sel is not None and sel.events > 0
        _, headers = parse_stream(b"".join(bytes(v) for v in sel.views))
        assert int(headers["seq"][0]) == 150_000
        buf.release(sel)
        assert peak < 512 * 1024, f"resuming allocated {peak} bytes"  # (the SCN column: 1.6 MB)
    finally:
        buf.close()
