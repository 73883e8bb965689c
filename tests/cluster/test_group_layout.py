"""The consumer-group znode codecs: round trips, and garbage is a clear error naming the node."""

from __future__ import annotations

import contextlib
import json
import random

import pytest

from changebus.cluster import CoordinationError
from changebus.cluster._group_layout import (
    Assignment,
    GroupMeta,
    UnitRecord,
    assignment_path,
    checkpoint_path,
    decode_assignment,
    decode_member_record,
    decode_meta,
    decode_owner,
    decode_unit_record,
    encode_assignment,
    encode_member_record,
    encode_meta,
    encode_owner,
    encode_unit_record,
    group_root,
    member_seq,
    owner_path,
)
from changebus.schemas import ConfigError, PartitionCheckpoint, Unit

DECODERS = [decode_meta, decode_member_record, decode_assignment, decode_owner, decode_unit_record]


def test_paths() -> None:
    assert group_root("g1") == "/changebus/groups/g1"
    assert assignment_path("g1") == "/changebus/groups/g1/assignment"
    assert owner_path("g1", Unit("orders", 7)) == "/changebus/groups/g1/owners/orders.7"
    assert checkpoint_path("g1", Unit("a.b", 0)) == "/changebus/groups/g1/checkpoints/a.b.0"
    for bad in ("", "a/b", "..", "x" * 129):
        with pytest.raises(ConfigError):
            group_root(bad)
    assert Unit.parse("a.b.17") == Unit("a.b", 17)
    for bad in ("orders.\u00b2", "orders.\u0661\u0662", "orders.x", "orders"):  # ², Arabic 12
        with pytest.raises(ConfigError, match=r"is not <partition>\.<bucket>"):
            Unit.parse(bad)  # (str.isdigit() let ² through: int() raised ValueError)
    assert member_seq("m-0000000042") == 42
    assert member_seq("c-0000000042") == member_seq("m-") == member_seq("m-12x") == -1


def test_round_trips() -> None:
    meta = GroupMeta(64, ("orders", "users"))
    assert decode_meta(encode_meta(meta), "n") == meta
    assert json.loads(encode_meta(meta))["version"] == 1
    record = decode_member_record(encode_member_record("w1", "h", 42, 7), "n")
    assert record == {"name": "w1", "host": "h", "pid": 42, "started_ns": 7}
    units = (Unit("orders", 0), Unit("orders", 10))
    assignment = Assignment(3, "m-0000000001", {"m-0000000001": units, "m-0000000002": ()})
    assert decode_assignment(encode_assignment(assignment), "n") == assignment
    assert decode_assignment(b"", "n") == Assignment()
    assert decode_owner(encode_owner("m-0000000002"), "n") == "m-0000000002"
    for checkpoint in (None, PartitionCheckpoint(window_scn=5, prev_scn=5, timestamp_ns=9)):
        unit = UnitRecord(checkpoint, "m-0000000001", 4, 123)
        assert decode_unit_record(encode_unit_record(unit), "n") == unit


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff\xfe",
        b"null",
        b"[]",
        b"42",
        b'{"buckets": -1, "partitions": []}',
        b'{"buckets": true, "partitions": []}',
        b'{"buckets": 3, "partitions": "orders"}',
        b'{"generation": 1, "members": {"m-1": ["orders"]}}',
        b'{"generation": 1, "members": {"m-1": [7]}}',
        b'{"generation": 1, "members": []}',
        b'{"member": 7}',
        b'{"checkpoint": {"window_scn": "x"}, "owner": "m", "generation": 1}',
        b'{"checkpoint": {"bogus": 1}, "owner": "m", "generation": 1}',
        b'{"checkpoint": 5, "owner": "m", "generation": 1}',
        b'{"checkpoint": null, "owner": 5, "generation": 1}',
        b'{"checkpoint": null, "owner": "m", "generation": "1"}',
        b'{"pid": "x"}',
        b"[" * 100_000,
    ],
)
def test_garbage_is_a_coordination_error_naming_the_node(data: bytes) -> None:
    for decode in DECODERS:
        if decode is decode_assignment and data == b"":
            continue  # an empty assignment node is the empty assignment
        try:
            decode(data, "/changebus/groups/g/node")
        except CoordinationError as exc:
            assert "/changebus/groups/g/node" in str(exc)
            assert not exc.retriable


def test_random_bytes_never_crash_a_decoder() -> None:
    rng = random.Random(18)
    samples = [rng.randbytes(rng.randint(0, 40)) for _ in range(300)]
    good = [encode_meta(GroupMeta(4, ("p",))), encode_unit_record(UnitRecord(None, "m", 1, 1))]
    for blob in good:  # truncations and bit flips of valid nodes
        samples += [blob[:i] for i in range(len(blob))]
        for _ in range(50):
            at = rng.randrange(len(blob))
            samples.append(blob[:at] + bytes([blob[at] ^ (1 << rng.randrange(8))]) + blob[at + 1 :])
    for blob in samples:
        for decode in DECODERS:
            with contextlib.suppress(CoordinationError):
                decode(blob, "node")
