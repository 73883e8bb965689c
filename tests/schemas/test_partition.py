"""The portable key hash and the mod / range / slice partition filters."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, strategies as st

from changebus.schemas import (
    HASH_SPACE,
    HEADER_DTYPE,
    UNATTACHED,
    BadRequestError,
    LogicalMessage,
    Op,
    PartitionFilter,
    SchemaChange,
    decode_header,
    encode_control,
    event_mask,
    key_hash,
    source_table,
)

hashes = st.integers(0, HASH_SPACE - 1)


def test_key_hash_is_xxh3_64() -> None:
    # fixed vectors (also in docs/protocol.md) so other languages can check theirs
    assert key_hash(b"") == 0x2D06800538D394C2
    assert key_hash(b"\x02") == 0xC9F42E6C9E93DFFF  # Avro long 1
    assert key_hash(b"\x06abc") == 0x7A65300C20E0EC76  # Avro string "abc"
    assert key_hash(b"abc") != key_hash(b"abd")


@given(st.integers(1, 64), st.lists(hashes, min_size=1, max_size=200))
def test_mod_filters_partition_the_stream_exactly_once(n: int, hs: list[int]) -> None:
    arr = np.array(hs, dtype=np.uint64)
    counts = np.zeros(len(hs), dtype=int)
    for b in range(n):
        f = PartitionFilter.mod(n, b)
        m = f.mask(arr)
        assert m.tolist() == [f.matches(h) for h in hs]
        counts += m
    assert (counts == 1).all()


@given(st.integers(1, 64), st.lists(hashes, min_size=1, max_size=200))
def test_slices_partition_the_stream_exactly_once(n: int, hs: list[int]) -> None:
    arr = np.array(hs, dtype=np.uint64)
    counts = np.zeros(len(hs), dtype=int)
    for i in range(n):
        f = PartitionFilter.slice(i, n)
        m = f.mask(arr)
        assert m.tolist() == [f.matches(h) for h in hs]
        counts += m
    assert (counts == 1).all()


def test_range_edges() -> None:
    f = PartitionFilter.range(10, 20)
    arr = np.array([9, 10, 19, 20, HASH_SPACE - 1], dtype=np.uint64)
    assert f.mask(arr).tolist() == [False, True, True, False, False]
    top = PartitionFilter.range(HASH_SPACE - 1)
    assert top.mask(arr).tolist() == [False, False, False, False, True]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("mod:4:0,2-3", PartitionFilter.mod(4, {0, 2, 3})),
        ("mod:1:0", PartitionFilter.mod(1, 0)),
        ("range:0x10:max", PartitionFilter.range(16)),
        ("range:5:17", PartitionFilter.range(5, 17)),
        ("slice:1/4", PartitionFilter.range(HASH_SPACE // 4, HASH_SPACE // 2)),
    ],
)
def test_parse(text: str, expected: PartitionFilter) -> None:
    f = PartitionFilter.parse(text)
    assert f == expected
    assert PartitionFilter.parse(str(f)) == f


@pytest.mark.parametrize(
    "text",
    [
        "",
        "mod",
        "mod:0:0",
        "mod:4:4",
        "mod:4:",
        "mod:4:3-1",
        "mod:4:-1",
        "range:5:5",
        "range:9:3",
        "range:0:0x1ffffffffffffffff",
        "slice:4/4",
        "slice:0/0",
        "hash:1",
        "mod:4:1;drop table",
    ],
)
def test_parse_rejects_garbage(text: str) -> None:
    with pytest.raises(BadRequestError):
        PartitionFilter.parse(text)


@pytest.mark.parametrize(
    "text",
    [
        "mod:" + "9" * 5000 + ":0",  # int() would raise ValueError past 4,300 digits
        "range:" + "1" * 5000 + ":max",
        "slice:0/" + "7" * 5000,
        "mod:4:" + ",".join(["1"] * 3000),
        "range:0x" + "f" * 40 + ":max",
    ],
)
def test_parse_rejects_huge_numbers_as_bad_requests(text: str) -> None:
    with pytest.raises(BadRequestError) as info:
        PartitionFilter.parse(text)
    assert not info.value.retriable
    assert info.value.http_status == 400
    assert len(info.value.message) < 300


@pytest.mark.parametrize(
    "text",
    [
        "mod:3:" + "9" * 4000,  # under int()'s 4,300-digit limit: checked before converting
        "mod:3:0-" + "9" * 4000,
        "mod:3:" + "9" * 2000 + "-" + "9" * 2000,
        "mod:" + "9" * 4000 + ":0",
        "range:" + "1" * 4000 + ":max",
        "range:0:0x" + "f" * 4000,
        "slice:" + "7" * 4000 + "/9",
        "mod:65536:" + ",".join(["1"] * 1025),  # more bucket list items than allowed
    ],
)
def test_numbers_and_bucket_lists_are_bounded(text: str) -> None:
    with pytest.raises(BadRequestError) as info:
        PartitionFilter.parse(text)
    assert info.value.http_status == 400
    assert len(info.value.message) < 300


def test_the_costliest_mod_filter_parses_in_milliseconds() -> None:
    """An 8 KB request of full ranges once took 1.7 s; tables are built with numpy now."""
    text = "mod:65536:" + ",".join(["0-65535"] * 511)
    assert len(text) > 4000
    t0 = time.perf_counter()
    f = PartitionFilter.parse(text)
    parse_s = time.perf_counter() - t0
    assert f == PartitionFilter.mod(65536, set(range(65536)))
    assert str(f) == "mod:65536:0-65535"  # runs print as ranges: the text parses again
    hashes = np.arange(16384, dtype=np.uint64)
    t0 = time.perf_counter()
    assert f.mask(hashes).all()
    mask_s = time.perf_counter() - t0
    assert parse_s < 0.2, parse_s
    assert mask_s < 0.02, mask_s  # the bucket table is built once, not per mask() call
    every_other = PartitionFilter.parse("mod:16:0-3,6,8-9,15")
    assert str(every_other) == "mod:16:0-3,6,8-9,15"


def test_a_mod_filter_holds_its_table_not_a_set_of_buckets() -> None:
    """``mod:65536:0-65534``, 17 characters, was a set of 65,535 ints: about 4 MB held
    by each request that sent it, for as long as a long-poll or a follow stream lives
    (review). A filter is its bucket table now (at most 64 KiB); the set is built only
    when asked for."""
    import tracemalloc

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        f = PartitionFilter.parse("mod:65536:0-65534")
        f.mask(np.arange(1024, dtype=np.uint64))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 200_000, held
    assert f == PartitionFilter.parse("mod:65536:0-65533,65534")
    assert hash(f) == hash(PartitionFilter.parse("mod:65536:0-65533,65534"))
    assert f != PartitionFilter.parse("mod:65536:0-65533")
    assert f.matches(65534) and not f.matches(65535) and f.matches(65536 + 7)
    assert len(f.buckets) == 65535 and 65535 not in f.buckets  # (built on demand)
    small = PartitionFilter.mod(4, {1, 3})
    assert small.buckets == frozenset({1, 3}) and repr(small) == "PartitionFilter('mod:4:1,3')"
    with pytest.raises(BadRequestError):
        PartitionFilter.mod(4, {4})
    with pytest.raises(BadRequestError):
        PartitionFilter.mod(4, set())


def _headers(ops: list[int], hashes: list[int], sources: list[int]) -> np.ndarray:
    h = np.zeros(len(ops), dtype=HEADER_DTYPE)
    h["op"], h["key_hash"], h["source_id"] = ops, hashes, sources
    return h


def test_event_mask_keeps_control_events_and_subscribed_data() -> None:
    eow = int(Op.END_OF_WINDOW)
    h = _headers([1, 2, 3, eow, 1, eow], [4, 5, 6, 0, 8, 0], [1, 2, 1, 0, 3, 0])
    assert event_mask(h).tolist() == [True] * 6
    only_even = PartitionFilter.mod(2, 0)
    assert event_mask(h, only_even).tolist() == [True, False, True, True, True, True]
    assert event_mask(h, None, [1]).tolist() == [True, False, True, True, False, True]
    table = source_table([2, 3])
    assert event_mask(h, only_even, table).tolist() == [False, False, False, True, True, True]
    assert event_mask(h, None, []).tolist() == [False, False, False, True, False, True]
    with pytest.raises(BadRequestError):
        source_table([70000])


def test_schema_changes_and_messages_follow_the_source_subscription() -> None:
    """A schema change carries its table's source id and a message source id 0
    (UNATTACHED): a subscription to other sources, or a principal granted only some
    (the servers leave 0 out for them), receives neither; window ends always pass."""
    eow, sc, msg, hb = (
        int(o) for o in (Op.END_OF_WINDOW, Op.SCHEMA_CHANGE, Op.MESSAGE, Op.HEARTBEAT)
    )
    h = _headers([sc, sc, msg, 1, 1, hb, eow], [0, 0, 0, 4, 5, 0, 0], [1, 2, 0, 1, 2, 0, 0])
    assert event_mask(h).tolist() == [True] * 7
    # a key filter alone never drops a control event
    assert event_mask(h, PartitionFilter.mod(2, 1)).tolist() == [
        True,
        True,
        True,
        False,
        True,
        True,
        True,
    ]
    # the consumer's own choice of source 1 (the servers add UNATTACHED): its schema change, messages
    assert event_mask(h, None, [UNATTACHED, 1]).tolist() == [
        True,
        False,
        True,
        True,
        False,
        True,
        True,
    ]
    # a principal granted only source 2: neither table 1's definition nor any message
    assert event_mask(h, None, [2]).tolist() == [False, True, False, False, True, True, True]
    assert event_mask(h, None, []).tolist() == [False, False, False, False, False, True, True]


def test_a_schema_change_event_carries_its_tables_source_id() -> None:
    change = SchemaChange(7, "public.t", 1, 123, "{}")
    ev = encode_control(change, 10, 0, 0)
    assert decode_header(ev).source_id == 7
    assert decode_header(encode_control(LogicalMessage("p", b"x", True), 10, 1, 0)).source_id == 0


def test_every_share_of_the_keys_gets_the_truncates() -> None:
    """A TRUNCATE has no key: its hash is the empty key's, which a key filter kept
    for one share only; every other consumer (every lane of a group but one) kept
    the table's rows for ever."""
    eow, trunc = int(Op.END_OF_WINDOW), int(Op.TRUNCATE)
    empty = key_hash(b"")
    h = _headers([1, trunc, 1, eow], [4, empty, 5, 0], [1, 1, 2, 0])
    for n in (2, 3, 7):
        for i in range(n):
            keep = event_mask(h, PartitionFilter.slice(i, n)).tolist()
            assert keep[1] and keep[3], (i, n)
    # a source subscription still applies to it
    assert event_mask(h, PartitionFilter.mod(2, 0), [2]).tolist()[1] is False
