"""Control events: every kind round-trips; garbage is rejected."""

from __future__ import annotations

import io

import fastavro
import pytest
from hypothesis import given, strategies as st

from changebus.schemas import (
    CONTROL_SCHEMAS,
    CheckpointMarker,
    CorruptEventError,
    DataLoss,
    EndOfWindow,
    Heartbeat,
    LogicalMessage,
    Op,
    SchemaChange,
    control_schema_id,
    decode_control,
    encode_control,
    end_of_window_position,
    event_at,
    verify_event,
)

text = st.text(max_size=50)
payloads = st.one_of(
    st.builds(EndOfWindow, st.integers(0, 2**40), text),
    st.builds(Heartbeat, text),
    st.builds(
        SchemaChange,
        st.integers(0, 65535),
        text,
        st.integers(1, 2**31 - 1),
        st.integers(0, 2**64 - 1),
        text,
    ),
    st.builds(
        lambda a, b, reason: DataLoss(min(a, b), max(a, b), reason),
        st.integers(0, 2**62),
        st.integers(0, 2**62),
        text,
    ),
    st.builds(CheckpointMarker, text),
    st.builds(LogicalMessage, text, st.binary(max_size=50), st.booleans()),
)


@given(payloads, st.integers(0, 2**63 - 1), st.integers(0, 2**32 - 1))
def test_round_trip(payload, scn: int, seq: int) -> None:
    data = encode_control(payload, scn, seq, 1_000, partition=3)
    h = verify_event(data)
    assert h.op.is_control
    # a schema change carries its table's source id (subscriptions filter it), others 0
    sid = payload.source_id if isinstance(payload, SchemaChange) else 0
    assert (h.scn, h.seq, h.partition, h.source_id, h.key_length, h.key_hash) == (
        scn,
        seq,
        3,
        sid,
        0,
        0,
    )
    assert h.schema_id == control_schema_id(h.op)
    _, body = event_at(data, 0, h)
    assert decode_control(h.op, bytes(body)) == payload


def test_schema_ids_differ_per_op() -> None:
    ids = {control_schema_id(op) for op in Op if op.is_control}
    assert len(ids) == len([op for op in Op if op.is_control])


def test_garbage_payload_is_rejected() -> None:
    with pytest.raises(CorruptEventError):
        decode_control(Op.END_OF_WINDOW, b"\xff\xff\xff")
    with pytest.raises(CorruptEventError, match="not a control op"):
        decode_control(Op.INSERT, b"")


def _avro(op: Op, record: dict[str, object]) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(CONTROL_SCHEMAS[op]), record)
    return out.getvalue()


_MESSAGE = {"prefix": "p", "content": b"x", "transactional": True}
_CHANGE = {"source_id": 7, "source": "s", "version": 1, "fingerprint": -1, "schema": "{}"}


@pytest.mark.parametrize(
    ("op", "payload", "needle"),
    [
        (Op.MESSAGE, _avro(Op.MESSAGE, _MESSAGE)[:-1] + b"\x07", "transactional byte 0x07"),
        (Op.MESSAGE, _avro(Op.MESSAGE, _MESSAGE)[:-1] + b"\xff", "transactional byte 0xff"),
        (Op.MESSAGE, _avro(Op.MESSAGE, _MESSAGE) + b"JUNK", r"trailing bytes \(4\)"),
        (Op.END_OF_WINDOW, _avro(Op.END_OF_WINDOW, {"event_count": 1, "source_position": ""})
         + b"\x00", r"trailing bytes \(1\)"),
        (Op.SCHEMA_CHANGE, _avro(Op.SCHEMA_CHANGE, {**_CHANGE, "source_id": 2**42}),
         "source id 4398046511104"),
        (Op.SCHEMA_CHANGE, _avro(Op.SCHEMA_CHANGE, {**_CHANGE, "source_id": 65536}),
         "source id 65536"),
        (Op.SCHEMA_CHANGE, _avro(Op.SCHEMA_CHANGE, {**_CHANGE, "source_id": -1}), "source id -1"),
        (Op.DATA_LOSS, _avro(Op.DATA_LOSS, {"from_scn": -1, "to_scn": -2, "reason": ""}),
         r"SCN range -1\.\.-2"),
        (Op.DATA_LOSS, _avro(Op.DATA_LOSS, {"from_scn": 5, "to_scn": 4, "reason": ""}),
         r"SCN range 5\.\.4"),
        (Op.DATA_LOSS, _avro(Op.DATA_LOSS, {"from_scn": -1, "to_scn": 4, "reason": ""}),
         r"SCN range -1\.\.4"),
    ],
)  # fmt: skip
def test_payloads_avro_reads_but_the_fields_cannot_hold_are_refused(
    op: Op, payload: bytes, needle: str
) -> None:
    with pytest.raises(CorruptEventError, match=f"{op.name} payload: {needle}"):
        decode_control(op, payload)


def test_the_edges_of_the_ranges_are_accepted() -> None:
    for op, record in [
        (Op.MESSAGE, {**_MESSAGE, "transactional": False}),
        (Op.SCHEMA_CHANGE, {**_CHANGE, "source_id": 65535}),
        (Op.SCHEMA_CHANGE, {**_CHANGE, "source_id": 0}),
        (Op.DATA_LOSS, {"from_scn": 0, "to_scn": 0, "reason": ""}),
        (Op.DATA_LOSS, {"from_scn": 2**63 - 1, "to_scn": 2**63 - 1, "reason": ""}),
    ]:
        decode_control(op, memoryview(_avro(op, record)))


@given(st.integers(-(2**63), 2**63 - 1), st.text(max_size=300))
def test_the_fast_end_of_window_position_reads_what_the_avro_reader_does(
    count: int, position: str
) -> None:
    """The relay reads the position at every eviction without fastavro."""
    data = encode_control(EndOfWindow(count, position), 1, 0, 0)
    payload = event_at(data, 0, verify_event(data, 0))[1]
    assert end_of_window_position(payload) == position
    eow = decode_control(Op.END_OF_WINDOW, payload)
    assert isinstance(eow, EndOfWindow) and eow.source_position == position


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x80",
        b"\x02",
        b"\x02\x0a",
        b"\x02\x04\xff\xfe",
        b"\x02\x01",
        b"\x80" * 11,
        b"\x02\x02xJ",  # a byte after the record, as decode_control refuses it
    ],
)
def test_the_fast_end_of_window_position_refuses_garbage(payload: bytes) -> None:
    with pytest.raises(CorruptEventError):
        end_of_window_position(payload)
