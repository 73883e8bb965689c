"""Event envelope: round trips, bulk parsing and corruption detection."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from changebus.schemas import (
    HEADER_DTYPE,
    HEADER_SIZE,
    CorruptEventError,
    EventTooLargeError,
    Op,
    check_headers,
    decode_header,
    encode_event,
    event_at,
    headers_at,
    parse_stream,
    scan_offsets,
    verify_event,
    verify_payloads,
)

u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, 2**64 - 1)

events = st.fixed_dictionaries(
    {
        "op": st.sampled_from(list(Op)),
        "scn": st.integers(0, 2**63 - 1),
        "seq": u32,
        "timestamp_ns": st.integers(-(2**63), 2**63 - 1),
        "key": st.binary(max_size=40),
        "payload": st.binary(max_size=300),
        "key_hash": u64,
        "source_id": u16,
        "partition": u16,
        "schema_id": u64,
        "schema_version": u16,
    }
)


def _encode(ev: dict[str, Any]) -> bytes:
    return encode_event(
        ev["op"],
        ev["scn"],
        ev["seq"],
        ev["timestamp_ns"],
        ev["key"],
        ev["payload"],
        key_hash=ev["key_hash"],
        source_id=ev["source_id"],
        partition=ev["partition"],
        schema_id=ev["schema_id"],
        schema_version=ev["schema_version"],
    )


@given(events)
def test_round_trip(ev: dict[str, Any]) -> None:
    data = _encode(ev)
    assert len(data) == HEADER_SIZE + len(ev["key"]) + len(ev["payload"])
    h = verify_event(data)
    for name in ("op", "scn", "seq", "timestamp_ns", "key_hash", "source_id", "partition"):
        assert getattr(h, name) == ev[name], name
    assert (h.schema_id, h.schema_version) == (ev["schema_id"], ev["schema_version"])
    key, payload = event_at(data, 0, h)
    assert bytes(key) == ev["key"]
    assert bytes(payload) == ev["payload"]


@given(st.lists(events, min_size=1, max_size=30), st.binary(max_size=7))
def test_bulk_headers_match_scalar_decode(evs: list[dict[str, Any]], prefix: bytes) -> None:
    blobs = [_encode(ev) for ev in evs]
    buf = prefix + b"".join(blobs)
    offsets = scan_offsets(buf, len(prefix))
    assert offsets.tolist() == [len(prefix) + sum(map(len, blobs[:i])) for i in range(len(blobs))]
    headers = headers_at(buf, offsets)
    assert headers.dtype == HEADER_DTYPE
    check_headers(buf, offsets, headers)
    verify_payloads(buf, offsets, headers)
    for off, rec, ev in zip(offsets.tolist(), headers, evs, strict=True):
        scalar = decode_header(buf, off)
        assert int(rec["scn"]) == scalar.scn == ev["scn"]
        assert int(rec["op"]) == ev["op"]
        assert int(rec["key_hash"]) == ev["key_hash"]
        assert int(rec["total_length"]) == scalar.total_length


def test_header_dtype_is_a_view_over_contiguous_headers() -> None:
    ev = encode_event(Op.INSERT, 7, 0, 1, b"k", b"")
    arr = np.frombuffer(ev[:HEADER_SIZE] * 3, dtype=HEADER_DTYPE)
    assert arr["scn"].tolist() == [7, 7, 7]
    assert arr["magic"].tolist() == [0x4243] * 3


def test_every_single_byte_corruption_is_detected() -> None:
    data = encode_event(
        Op.UPDATE,
        123456789,
        3,
        1_700_000_000_000_000_000,
        b"key!",
        b"payload bytes" * 3,
        key_hash=0xDEADBEEF,
        source_id=5,
        partition=2,
        schema_id=99,
        schema_version=4,
    )
    for pos in range(len(data)):
        for xor in range(1, 256):
            bad = bytearray(data)
            bad[pos] ^= xor
            with pytest.raises(CorruptEventError):
                verify_event(bytes(bad))
            with pytest.raises(CorruptEventError):
                parse_stream(bytes(bad))


@settings(max_examples=200)
@given(st.lists(events, min_size=1, max_size=8), st.data())
def test_corruption_in_a_stream_is_detected(evs: list[dict[str, Any]], data: st.DataObject) -> None:
    buf = bytearray(b"".join(_encode(ev) for ev in evs))
    pos = data.draw(st.integers(0, len(buf) - 1))
    buf[pos] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CorruptEventError):
        parse_stream(bytes(buf))


def test_truncated_stream_is_rejected() -> None:
    buf = encode_event(Op.INSERT, 1, 0, 0, b"a", b"b") + encode_event(
        Op.INSERT, 1, 1, 0, b"a", b"c"
    )
    with pytest.raises(CorruptEventError, match="stray bytes"):
        parse_stream(buf[:-1])
    with pytest.raises(CorruptEventError, match="truncated"):
        decode_header(buf[:10])


def test_limits_and_bad_values() -> None:
    with pytest.raises(EventTooLargeError):
        encode_event(Op.INSERT, 1, 0, 0, b"k" * 70000, b"")
    with pytest.raises(ValueError, match="header"):
        encode_event(Op.INSERT, -1, 0, 0, b"", b"")
    with pytest.raises(ValueError, match="header"):
        encode_event(99, 1, 0, 0, b"", b"")


def test_control_ops_are_flagged() -> None:
    assert not Op.DELETE.is_control
    assert Op.END_OF_WINDOW.is_control
    assert Op.MESSAGE.is_control
