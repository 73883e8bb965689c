"""JSON forms of decoded events (``changebus tail``, JSON columns of replicas).

Decoded Avro values include types JSON lacks; :func:`jsonable` maps them the
way the relay's ``format=ndjson`` does: bytes as base64, decimals and UUIDs
as text, dates and times in ISO 8601, sets and tuples as lists.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
import uuid
from typing import Any

from ._model import ChangeEvent

__all__ = ["event_json", "jsonable"]


def jsonable(value: Any) -> Any:
    """``json.dumps(default=...)`` hook for decoded Avro values."""
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, decimal.Decimal | uuid.UUID):
        return str(value)
    if isinstance(value, datetime.date | datetime.time | datetime.datetime):
        return value.isoformat()
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def event_json(event: ChangeEvent) -> str:
    """One compact JSON line: scn, seq, op, table, key, before, after, not_sent."""
    return json.dumps(
        {
            "scn": event.scn,
            "seq": event.seq,
            "op": event.op.value,
            "table": event.table,
            "key": event.key,
            "before": event.before,
            "after": event.after,
            "not_sent": list(event.not_sent),
        },
        default=jsonable,
        separators=(",", ":"),
    )
