"""The JSON form of decoded Avro values, one rule for every component.

Decoded rows hold types JSON lacks; :func:`jsonable` (a ``json.dumps``
``default=`` hook) maps them: bytes as base64, decimals and UUIDs as text,
dates and times in ISO 8601, sets and tuples as lists. The relay's
``format=ndjson``, ``changebus tail`` and the replicas' JSON columns all use
it, through :func:`json_text`, so a value looks the same wherever a person or
a program reads it. Floats that JSON has no number for (NaN, infinities: a
``float8`` or ``double`` column may hold them) are the strings ``"NaN"``,
``"Infinity"`` and ``"-Infinity"``, as decimals' are: Python writes them as
bare ``NaN`` tokens, which jq, ``JSON.parse`` and Postgres' ``jsonb`` refuse.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
import math
import uuid
from typing import Any

__all__ = ["json_text", "jsonable"]


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


def json_text(value: Any) -> str:
    """Compact, strict JSON text of a decoded value (module docstring): one NDJSON line."""
    try:
        return json.dumps(value, default=jsonable, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a NaN or an infinity somewhere (rare: checked only then)
        return json.dumps(_finite(value), default=jsonable, separators=(",", ":"), allow_nan=False)


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float as its text."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_finite(v) for v in value]
    return value
