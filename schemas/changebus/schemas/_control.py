"""Control events: the envelope's signals that are not row changes.

Every control event has ``source_id`` 0, an empty key, ``key_hash`` 0 and an
Avro payload under one fixed schema per op (below; their 64-bit fingerprints
go into ``schema_id`` so a reader can tell a control payload apart at a
glance). Control events pass every partition filter.

======================  =====================================================
op                      payload fields
======================  =====================================================
END_OF_WINDOW (16)      event_count: long (data events in the window),
                        source_position: string (the source's own position
                        at commit: Postgres end LSN ``X/Y``; MySQL
                        ``gtid=D-S-N;file=NAME;pos=P``; may be empty)
HEARTBEAT (17)          source_position: string
SCHEMA_CHANGE (18)      source_id: int, source: string, version: int,
                        fingerprint: long (as signed 64-bit), schema: string
                        (the table schema JSON)
DATA_LOSS (19)          from_scn: long, to_scn: long (inclusive range of SCNs
                        known to be missing), reason: string
CHECKPOINT (20)         checkpoint: string (a checkpoint token)
MESSAGE (21)            prefix: string, content: bytes, transactional: boolean
======================  =====================================================

A window is the events of one source transaction followed by exactly one
END_OF_WINDOW whose ``seq`` equals the number of events before it.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Final

import fastavro

from ._crc import avro_fingerprint
from ._envelope import Op, encode_event
from .errors import CorruptEventError

__all__ = [
    "CONTROL_SCHEMAS",
    "CheckpointMarker",
    "ControlPayload",
    "DataLoss",
    "EndOfWindow",
    "Heartbeat",
    "LogicalMessage",
    "SchemaChange",
    "control_schema_id",
    "decode_control",
    "encode_control",
    "end_of_window_position",
]


@dataclass(frozen=True, slots=True)
class EndOfWindow:
    """Closes a window (one source transaction)."""

    event_count: int
    source_position: str = ""


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """The source is alive and has reached this SCN (an empty window)."""

    source_position: str = ""


@dataclass(frozen=True, slots=True)
class SchemaChange:
    """A table's schema changed; rows after this use the new version."""

    source_id: int
    source: str
    version: int
    fingerprint: int
    schema: str


@dataclass(frozen=True, slots=True)
class DataLoss:
    """SCNs ``from_scn..to_scn`` (inclusive) are known to be missing."""

    from_scn: int
    to_scn: int
    reason: str


@dataclass(frozen=True, slots=True)
class CheckpointMarker:
    """A checkpoint token injected into a stream (bootstrap progress)."""

    checkpoint: str


@dataclass(frozen=True, slots=True)
class LogicalMessage:
    """A message the application wrote into the source's log."""

    prefix: str
    content: bytes
    transactional: bool


ControlPayload = (
    EndOfWindow | Heartbeat | SchemaChange | DataLoss | CheckpointMarker | LogicalMessage
)


def _record(name: str, fields: list[tuple[str, str]]) -> dict[str, Any]:
    return {
        "type": "record",
        "name": name,
        "namespace": "changebus.control",
        "fields": [{"name": n, "type": t} for n, t in fields],
    }


_SPECS: Final[dict[Op, tuple[type[Any], dict[str, Any]]]] = {
    Op.END_OF_WINDOW: (
        EndOfWindow,
        _record("EndOfWindow", [("event_count", "long"), ("source_position", "string")]),
    ),
    Op.HEARTBEAT: (Heartbeat, _record("Heartbeat", [("source_position", "string")])),
    Op.SCHEMA_CHANGE: (
        SchemaChange,
        _record(
            "SchemaChange",
            [
                ("source_id", "int"),
                ("source", "string"),
                ("version", "int"),
                ("fingerprint", "long"),
                ("schema", "string"),
            ],
        ),
    ),
    Op.DATA_LOSS: (
        DataLoss,
        _record("DataLoss", [("from_scn", "long"), ("to_scn", "long"), ("reason", "string")]),
    ),
    Op.CHECKPOINT: (CheckpointMarker, _record("Checkpoint", [("checkpoint", "string")])),
    Op.MESSAGE: (
        LogicalMessage,
        _record(
            "Message", [("prefix", "string"), ("content", "bytes"), ("transactional", "boolean")]
        ),
    ),
}

#: The Avro schema (JSON) of each control op's payload.
CONTROL_SCHEMAS: Final = {op: spec[1] for op, spec in _SPECS.items()}
_PARSED: Final = {op: fastavro.parse_schema(schema) for op, schema in CONTROL_SCHEMAS.items()}
_BY_TYPE: Final = {spec[0]: op for op, spec in _SPECS.items()}
_FIELDS: Final = {
    op: [f["name"] for f in schema["fields"]] for op, schema in CONTROL_SCHEMAS.items()
}
_SIGN: Final = 1 << 63


def _fingerprint(schema: dict[str, Any]) -> int:
    canonical = fastavro.schema.to_parsing_canonical_form(schema)
    return avro_fingerprint(canonical)


_SCHEMA_IDS: Final = {op: _fingerprint(schema) for op, schema in CONTROL_SCHEMAS.items()}


def control_schema_id(op: Op) -> int:
    """The ``schema_id`` header value of a control op."""
    return _SCHEMA_IDS[op]


def _to_record(payload: ControlPayload) -> dict[str, Any]:
    record = {name: getattr(payload, name) for name in _FIELDS[_BY_TYPE[type(payload)]]}
    if isinstance(payload, SchemaChange):
        # Avro has no unsigned long: store the fingerprint's bit pattern signed.
        fp = payload.fingerprint
        record["fingerprint"] = fp - (1 << 64) if fp >= _SIGN else fp
    return record


def encode_control(
    payload: ControlPayload, scn: int, seq: int, timestamp_ns: int, *, partition: int = 0
) -> bytes:
    """Encode a control event carrying ``payload``.

    A schema change carries its table's source id in the header (so a
    subscription to other sources, or a principal not granted that table,
    does not receive it); every other control event source id 0.
    """
    op = _BY_TYPE[type(payload)]
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, _PARSED[op], _to_record(payload))
    return encode_event(
        op,
        scn,
        seq,
        timestamp_ns,
        b"",
        buf.getvalue(),
        partition=partition,
        schema_id=_SCHEMA_IDS[op],
        source_id=payload.source_id if isinstance(payload, SchemaChange) else 0,
    )


def decode_control(op: Op | int, payload: bytes | memoryview) -> ControlPayload:
    """Decode the payload of a control event of type ``op``.

    :class:`CorruptEventError` for a payload that is not one record of the op's
    schema exactly (bytes after it too), a boolean byte other than 0 or 1, a
    schema change's source id outside 0..65535, a data loss's SCN range that is
    not ``0 <= from_scn <= to_scn``.
    """
    try:
        cls, _schema = _SPECS[Op(op)]
    except (KeyError, ValueError):
        raise CorruptEventError(f"op {int(op)} is not a control op") from None
    name = Op(op).name
    bio = io.BytesIO(payload)
    try:
        record = fastavro.schemaless_reader(bio, _PARSED[Op(op)], None)
    except Exception as exc:  # fastavro raises assorted errors on garbage
        raise CorruptEventError(f"undecodable {name} payload: {exc}") from exc
    if not isinstance(record, dict):
        raise CorruptEventError(f"undecodable {name} payload")
    if bio.tell() != len(payload):
        raise CorruptEventError(f"{name} payload: trailing bytes ({len(payload) - bio.tell()})")
    # what Avro's types let through but the fields cannot be
    if cls is LogicalMessage and payload[-1] > 1:  # (the boolean is the last byte)
        raise CorruptEventError(
            f"{name} payload: transactional byte 0x{payload[-1]:02x} is no boolean"
        )
    if cls is SchemaChange:
        if not 0 <= record["source_id"] <= 0xFFFF:
            raise CorruptEventError(f"{name} payload: source id {record['source_id']}")
        if record["fingerprint"] < 0:
            record["fingerprint"] += 1 << 64
    if cls is DataLoss and not 0 <= record["from_scn"] <= record["to_scn"]:
        raise CorruptEventError(
            f"{name} payload: SCN range {record['from_scn']}..{record['to_scn']}"
        )
    result: ControlPayload = cls(**record)
    return result


def end_of_window_position(payload: bytes | memoryview) -> str:
    """The ``source_position`` of an END_OF_WINDOW payload, read without the Avro reader.

    The same answer as ``decode_control(Op.END_OF_WINDOW, payload).source_position``
    for a valid payload (two fields: a long, then a string), in about a quarter of
    its time: the relay reads it at every eviction. Raises
    :class:`CorruptEventError` for a payload it cannot read.
    """
    view = memoryview(payload)
    pos, size = 0, len(view)
    value = 0
    for _field in range(2):
        value, shift = 0, 0
        while True:
            if pos >= size or shift > 63:
                raise CorruptEventError("undecodable END_OF_WINDOW payload: truncated varint")
            byte = view[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
            shift += 7
    length = (value >> 1) ^ -(value & 1)
    if length < 0 or pos + length > size:
        raise CorruptEventError("undecodable END_OF_WINDOW payload: bad string length")
    if pos + length != size:
        raise CorruptEventError(f"END_OF_WINDOW payload: trailing bytes ({size - pos - length})")
    try:
        return str(view[pos : pos + length], "utf-8")
    except UnicodeDecodeError:
        raise CorruptEventError("undecodable END_OF_WINDOW payload: not UTF-8") from None
