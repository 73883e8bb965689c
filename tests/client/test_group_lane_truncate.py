"""A consumer group's lane splits a window by key bucket; a TRUNCATE goes to every unit.

A TRUNCATE has no key: the bucket of its hash (the empty key's) is one unit's,
but it empties the table for every unit. Sent to that one unit only, the other
units of the group kept the table's rows for ever.
"""

from __future__ import annotations

import time

import aiohttp

from changebus.client import ChangeEvent, ChangeOp, ConsumerConfig, Window
from changebus.client._assembler import WindowAssembler
from changebus.client._group_lane import Lane
from changebus.client._queue import BoundedQueue
from changebus.schemas import (
    Column,
    EndOfWindow,
    Op,
    RowEncoder,
    TableSchema,
    Unit,
    encode_control,
    key_hash,
)

T = TableSchema("app.t", (Column("id", "long", nullable=False),), ("id",), 1)
BUCKETS = 4


def bucket(enc: RowEncoder, key: int) -> int:
    return key_hash(enc.key_bytes({"id": key})) % BUCKETS


async def test_every_unit_of_a_lane_gets_the_truncate() -> None:
    enc = RowEncoder(T, source_id=1)
    ts = time.time_ns()
    # two rows in two different buckets, none in the empty key's bucket
    empty = key_hash(b"") % BUCKETS
    keys = [k for k in range(100) if bucket(enc, k) != empty]
    a = keys[0]
    b = next(k for k in keys if bucket(enc, k) != bucket(enc, a))
    body = b"".join(
        [
            enc.encode(Op.INSERT, 50, 0, ts, {"id": a}),
            enc.encode(Op.TRUNCATE, 50, 1, ts, None),
            enc.encode(Op.INSERT, 50, 2, ts, {"id": b}),
            encode_control(EndOfWindow(3), 50, 3, ts),
        ]
    )
    (raw,) = WindowAssembler(49).feed(body)

    def event(seq: int, op: ChangeOp, key: int | None) -> ChangeEvent:
        row = {"id": key} if key is not None else None
        return ChangeEvent(
            scn=50, seq=seq, op=op, table=T.name, key=row or {}, after=row, before=None, schema=T
        )

    events = (
        event(0, ChangeOp.INSERT, a),
        event(1, ChangeOp.TRUNCATE, None),
        event(2, ChangeOp.INSERT, b),
    )
    window = Window(scn=50, timestamp_ns=ts, partition="p", events=events)
    config = ConsumerConfig(relays=("http://127.0.0.1:9",), partition="p")
    async with aiohttp.ClientSession() as http:
        units = [Unit("p", i) for i in range(BUCKETS)]
        lane = Lane(config, http, BoundedQueue(10, 1 << 20), units, None, BUCKETS, 0)
        batch = lane.split(window, raw)
    got = {unit.bucket: [(e.op, e.key.get("id")) for e in w.events] for unit, w in batch.windows}
    assert set(got) == set(range(BUCKETS))  # every unit: at least the truncate
    for unit_bucket, evs in got.items():
        want: list[tuple[ChangeOp, int | None]] = [(ChangeOp.TRUNCATE, None)]
        if unit_bucket == bucket(enc, a):
            want = [(ChangeOp.INSERT, a), *want]
        if unit_bucket == bucket(enc, b):
            want = [*want, (ChangeOp.INSERT, b)]
        assert evs == want, (unit_bucket, evs)
