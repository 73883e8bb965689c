"""``format=ndjson``: events decoded to JSON lines, for people.

Decoding is Python work per event (the binary format is the fast one), so
it must not hold the event loop: bodies above :data:`_INLINE_BYTES` are
encoded in a worker thread, at most :data:`_CONCURRENCY` at a time per relay
(:class:`NdjsonEncoder`), and the handler caps how much one request selects
(``http.max_ndjson_bytes``). The schema registry it reads is thread-safe.
"""

from __future__ import annotations

import asyncio
from typing import Any

from changebus.schemas import (
    ChangeDecoder,
    Op,
    SchemaRegistry,
    decode_control,
    decode_header,
    event_at,
    parse_stream,
)
from changebus.schemas.server import json_text

__all__ = ["NdjsonEncoder", "encode_ndjson"]

#: bodies up to this size are encoded on the loop (a few milliseconds at most)
_INLINE_BYTES = 32 * 1024
#: encodings running in threads at once (each holds the GIL while it works)
_CONCURRENCY = 2


class NdjsonEncoder:
    """Encodes bodies inline when small, else in a thread with bounded concurrency."""

    def __init__(self) -> None:
        self._slots = asyncio.Semaphore(_CONCURRENCY)

    async def encode(self, registry: SchemaRegistry, body: bytes) -> bytes:
        if len(body) <= _INLINE_BYTES:
            return encode_ndjson(registry, body)
        async with self._slots:
            return await asyncio.to_thread(encode_ndjson, registry, body)


def encode_ndjson(registry: SchemaRegistry, body: bytes) -> bytes:
    """Decode the events of ``body`` to JSON lines (any thread)."""
    offsets, headers = parse_stream(body)
    lines = []
    decoders: dict[tuple[int, int], ChangeDecoder] = {}
    for off, h in zip(offsets.tolist(), headers, strict=True):
        op = Op(int(h["op"]))
        record: dict[str, Any] = {
            "scn": int(h["scn"]),
            "seq": int(h["seq"]),
            "op": op.name.lower(),
            "timestamp_ns": int(h["timestamp_ns"]),
        }
        header = decode_header(body, off)
        key, payload = event_at(body, off, header)
        if op.is_control:
            record["control"] = _control_json(op, bytes(payload))
        else:
            sid, version = int(h["source_id"]), int(h["schema_version"])
            dec = decoders.get((sid, version))
            if dec is None:
                table = registry.get(registry.name_for_id(sid), version)
                dec = decoders[(sid, version)] = ChangeDecoder(table)
            change = dec.decode(payload)
            record.update(
                source=dec.writer.name,
                key=dec.decode_key(key) if len(key) else None,
                after=change.after,
                before=change.before,
            )
            if change.after_not_sent:
                record["after_not_sent"] = list(change.after_not_sent)
            if change.before_not_sent:
                record["before_not_sent"] = list(change.before_not_sent)
        lines.append(json_text(record))
    return ("\n".join(lines) + "\n").encode() if lines else b""


def _control_json(op: Op, payload: bytes) -> dict[str, Any]:
    info = decode_control(op, payload)
    return {name: getattr(info, name) for name in info.__slots__}
