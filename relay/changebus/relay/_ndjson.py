"""``format=ndjson``: events decoded to JSON lines, for people.

Decoding is Python work per event (the binary format is the fast one), so
it must not hold the event loop: bodies above :data:`_INLINE_BYTES` are
encoded in a worker thread, at most :data:`_CONCURRENCY` at a time per relay
(:class:`NdjsonEncoder`), and the handler caps how much one request selects
(``http.max_ndjson_bytes``). The schema registry it reads is thread-safe.

Memory: JSON may be many times the binary events (a table of many small
columns with long names: every name on every line), so an answer is never
made whole. :meth:`NdjsonEncoder.pieces` hands it out in pieces of about
:data:`PIECE_BYTES` (more only for one event's line), each sent before the
next is made: a request holds its binary selection plus one piece.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
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

__all__ = ["PIECE_BYTES", "NdjsonEncoder", "ndjson_pieces"]

#: bodies up to this size are encoded on the loop (a few milliseconds at most)
_INLINE_BYTES = 32 * 1024
#: encodings running in threads at once (each holds the GIL while it works)
_CONCURRENCY = 2
#: JSON bytes of one piece of an answer (a piece ends after the line that reaches it)
PIECE_BYTES = 64 * 1024


class NdjsonEncoder:
    """Encodes bodies inline when small, else in a thread with bounded concurrency.

    A thread slot is held while one piece is made, not while it is sent: a
    slow client does not keep others' answers waiting.
    """

    def __init__(self) -> None:
        self._slots = asyncio.Semaphore(_CONCURRENCY)

    async def pieces(self, registry: SchemaRegistry, body: bytes) -> AsyncIterator[bytes]:
        """The JSON lines of ``body`` in pieces of about :data:`PIECE_BYTES`, in order."""
        made = ndjson_pieces(registry, body, PIECE_BYTES)
        if len(body) <= _INLINE_BYTES:
            for small in made:
                yield small
            return
        while True:
            async with self._slots:
                # one thread at a time advances the generator (the next piece waits for this one)
                piece = await asyncio.to_thread(_next_piece, made)
            if piece is None:
                return
            yield piece


def _next_piece(pieces: Iterator[bytes]) -> bytes | None:
    return next(pieces, None)


def ndjson_pieces(registry: SchemaRegistry, body: bytes, piece_bytes: int) -> Iterator[bytes]:
    """The events of ``body`` as JSON lines, in pieces of about ``piece_bytes`` (any thread)."""
    offsets, headers = parse_stream(body)
    lines: list[str] = []
    size = 0
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
        line = json_text(record)
        lines.append(line)
        size += len(line) + 1
        if size >= piece_bytes:
            yield ("\n".join(lines) + "\n").encode()
            lines, size = [], 0
    if lines:
        yield ("\n".join(lines) + "\n").encode()


def _control_json(op: Op, payload: bytes) -> dict[str, Any]:
    info = decode_control(op, payload)
    return {name: getattr(info, name) for name in info.__slots__}
