"""The JSON form of decoded Avro values, one rule for every component.

Decoded rows hold types JSON lacks; :func:`jsonable` (a ``json.dumps``
``default=`` hook) maps them: bytes as base64, decimals and UUIDs as text,
dates and times in ISO 8601, sets and tuples as lists. The relay's
``format=ndjson``, ``changebus tail`` and the replicas' JSON columns all use
it, so a value looks the same wherever a person or a program reads it.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import uuid
from typing import Any

__all__ = ["jsonable"]


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
