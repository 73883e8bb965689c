"""JSON forms of decoded events (``changebus tail``, JSON columns of replicas).

Decoded Avro values include types JSON lacks; :func:`json_text` (shared with
the relay's ``format=ndjson``, from :mod:`changebus.schemas._jsonable`) maps
them: bytes as base64, decimals and UUIDs as text, dates and times in ISO
8601, sets and tuples as lists, NaN and infinities as text.
"""

from __future__ import annotations

from changebus.schemas import json_text, jsonable

from ._model import ChangeEvent

__all__ = ["event_json", "json_text", "jsonable"]


def event_json(event: ChangeEvent, *, unit: str = "", phase: str = "online") -> str:
    """One compact JSON line: scn, seq, op, table, key, before, after, not_sent.

    ``unit`` (a consumer group's window unit, ``<partition>.<bucket>``) is
    added as ``"unit"`` when not empty; ``phase`` (the window's
    :attr:`~._model.Window.phase`) as ``"phase"`` when it is not
    ``"online"``: ``"snapshot"`` lines carry each row's own SCN in row order,
    not in SCN order, and ``"catchup"`` lines start again at the snapshot's
    start SCN (docs/guarantees.md).
    """
    doc = {
        "scn": event.scn,
        "seq": event.seq,
        "op": event.op.value,
        "table": event.table,
        "key": event.key,
        "before": event.before,
        "after": event.after,
        "not_sent": list(event.not_sent),
    }
    if unit:
        doc["unit"] = unit
    if phase != "online":
        doc["phase"] = phase
    return json_text(doc)
