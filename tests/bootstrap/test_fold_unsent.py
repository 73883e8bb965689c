"""Unsent columns (Postgres' unchanged TOAST values) filled from a row's earlier image."""

from __future__ import annotations

from typing import Any

from changebus.bootstrap._fold import merge_unsent
from changebus.schemas import (
    HEADER_SIZE,
    ChangeDecoder,
    Column,
    Op,
    RowEncoder,
    TableSchema,
    decode_header,
)


def table(version: int, body: Any, n: Any = "int") -> TableSchema:
    cols = (Column("id", "long", nullable=False), Column("body", body), Column("n", n))
    return TableSchema("public.docs", cols, ("id",), version)


def decoded(t: TableSchema, event: bytes) -> Any:
    h = decode_header(event)
    return h, ChangeDecoder(t).decode(memoryview(event)[HEADER_SIZE + h.key_length :])


def test_a_value_the_new_schema_takes_is_filled_and_one_it_does_not_is_left_unsent() -> None:
    """A column whose type changed since the image (text to bytea): its old value made the
    UPDATE's encoder raise, and the applier retried the same batch for ever while the
    log grew (review). It is left unsent, to be filled from the source."""
    v1 = table(1, "string")
    image = RowEncoder(v1, source_id=1).encode(
        Op.INSERT, 10, 0, 0, {"id": 1, "body": "big text", "n": 1}
    )
    _, old = decoded(v1, image)
    for v2, fits in ((table(2, "string", "long"), True), (table(2, "bytes"), False)):
        enc = RowEncoder(v2, source_id=1)
        update = enc.encode(
            Op.UPDATE, 20, 0, 0, {"id": 1, "body": None, "n": 2}, after_not_sent=("body",)
        )
        h, change = decoded(v2, update)
        key = update[HEADER_SIZE : HEADER_SIZE + h.key_length]
        merged = merge_unsent(h, key, change, enc, old)
        if not fits:
            assert merged is None
            continue
        assert merged is not None and merged[1]
        _, whole = decoded(v2, merged[0])
        assert whole.after == {"id": 1, "body": "big text", "n": 2}
        assert not whole.after_not_sent
