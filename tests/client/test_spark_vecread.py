"""The vectorised record reader (``_vecread``) against the row path, value for value.

``test_spark_columns.py`` compares the columnar decoder with the row path on
a table of every type, which the vectorised reader declines (nested types):
there the generated column reader runs. Here the table holds every column
type the vectorised reader takes, so that it does the reading, and the same
comparisons must hold: inserts, updates with and without before-images,
deletes, truncates, not-sent values, nulls everywhere, a batch it leaves to
the generated reader (a UUID in upper case), and malformed records.
"""

from __future__ import annotations

import importlib
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from changebus.client.spark._arrow import union_schema
from changebus.client.spark._vecread import Fallback, _Field, vector_reader
from changebus.schemas import (
    FIRST_CONTROL_OP,
    HEADER_SIZE,
    ChangeDecoder,
    CorruptEventError,
    Op,
    TableSchema,
    encode_event,
    parse_stream,
)
from changebus.schemas._avroread import _Unsupported

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "schemas"))
_cols: Any = importlib.import_module("test_spark_columns")
_types: Any = importlib.import_module("test_avroread")


def _takes(avro: Any) -> bool:
    try:
        _Field(avro, 0)
    except _Unsupported:
        return False
    return True


_ALL: TableSchema = _types.TABLE
FLAT = TableSchema(
    "public.flat",
    tuple(c for c in _ALL.columns if _takes(c.type)),
    key=("id",),
    version=1,
)
FLAT_ROWS = _types.ROWS.map(lambda r: {c.name: r[c.name] for c in FLAT.columns})
SCHEMA = union_schema([FLAT])


def test_the_table_is_read_vectorised() -> None:
    names = {c.name for c in FLAT.columns}
    # int, long, float, double, boolean, text, bytea, date, time, timestamps, uuid,
    # json, numeric(12,2), inet, MySQL datetime
    assert len(names) >= 15, names
    assert vector_reader(ChangeDecoder(FLAT)) is not None
    assert vector_reader(ChangeDecoder(_ALL)) is None  # nested types: the generated reader


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([Op.INSERT, Op.UPDATE, Op.DELETE, Op.TRUNCATE]),
            FLAT_ROWS,
            st.none() | FLAT_ROWS,
        ),
        min_size=1,
        max_size=8,
    ),
    st.booleans(),
)
def test_every_type_equals_the_row_path(
    changes: list[tuple[Op, dict[str, Any], dict[str, Any] | None]], preimage: bool
) -> None:
    encoded: list[tuple[Any, ...]] = []
    for op, row, before in changes:
        if op is Op.INSERT:
            encoded.append((op, row, None, (), ()))
        elif op is Op.UPDATE:
            encoded.append((op, row, before, (), ()))
        elif op is Op.DELETE:
            encoded.append((op, None, before if before is not None else row, (), ()))
        else:
            encoded.append((op, None, None, (), ()))
    data = _cols._stream([(1, FLAT, encoded)])
    rows, cols = _cols._both(data, {1: FLAT}, SCHEMA, include_preimage=preimage)
    _cols._equal(rows, cols)


def test_not_sent_nulls_and_a_batch_left_to_the_generated_reader() -> None:
    empty = {c.name: None for c in FLAT.columns}
    row = empty | {"id": 7, "pg_6": "old", "pg_1": 5}
    new = row | {"pg_6": None, "pg_1": 6}
    changes: list[tuple[Any, ...]] = [
        (Op.UPDATE, new, row, ("pg_6", "no_such"), ()),  # pg_6 from the before-image
        (Op.UPDATE, new, row, ("pg_6",), ("pg_6",)),  # not in the before-image either: null
        (Op.INSERT, empty | {"id": 8}, None, (), ()),  # every other column null
        (Op.DELETE, None, row, (), ()),
        (Op.TRUNCATE, None, None, (), ()),
    ]
    data = _cols._stream([(1, FLAT, changes)])
    for preimage in (True, False):
        rows, cols = _cols._both(data, {1: FLAT}, SCHEMA, include_preimage=preimage)
        _cols._equal(rows, cols)
    good = data
    post = [r for r in cols.to_pylist() if r["_change_type"] == "update_postimage"]
    assert [r["pg_6"] for r in post] == ["old", None]
    # a UUID in upper case (the encoder writes canonical text: patched in the bytes):
    # the vectorised reader declines the batch, the generated one gives the
    # canonical text, as the row path does
    uuid_col = next(
        c.name for c in FLAT.columns if c.type == {"type": "string", "logicalType": "uuid"}
    )
    lower = "abcdefab-cdef-4abc-8def-abcdefabcdef"
    data = _cols._stream(
        [(1, FLAT, [(Op.INSERT, empty | {"id": 1, uuid_col: uuid.UUID(lower)}, None, (), ())])]
    )
    offsets, headers = parse_stream(data)
    h = headers[0]
    klen, end = int(h["key_length"]), int(h["total_length"])
    payload = data[HEADER_SIZE + klen : end].replace(lower.encode(), lower.upper().encode())
    first = encode_event(
        Op.INSERT, int(h["scn"]), int(h["seq"]), int(h["timestamp_ns"]),
        data[HEADER_SIZE : HEADER_SIZE + klen], payload, source_id=1, schema_version=1,
        schema_id=int(h["schema_id"]), key_hash=int(h["key_hash"]),
    )  # fmt: skip
    data = first + data[end:]
    offsets, headers = parse_stream(data)
    starts = offsets + HEADER_SIZE + headers["key_length"]
    stops = offsets + headers["total_length"]
    starts, stops = starts[:1], stops[:1]
    reader = vector_reader(ChangeDecoder(FLAT))
    assert reader is not None
    with pytest.raises(Fallback):
        reader.read(data, starts, stops)
    rows, cols = _cols._both(data, {1: FLAT}, SCHEMA)
    _cols._equal(rows, cols)
    assert cols.column(uuid_col).to_pylist() == [lower]
    # malformed records fail as corrupt, never as wrong values
    offsets, headers = parse_stream(good)
    data = (offsets + HEADER_SIZE + headers["key_length"])[headers["op"] < FIRST_CONTROL_OP]
    ends = (offsets + headers["total_length"])[headers["op"] < FIRST_CONTROL_OP]
    assert reader.read(good, data, ends)[2].tolist() == [3, 3, 1, 2, 0]
    with pytest.raises(CorruptEventError):
        reader.read(good, data, ends - 1)  # ends early
    broken = bytearray(good)
    broken[int(data[0])] = 7  # not a union branch
    with pytest.raises(CorruptEventError):
        reader.read(bytes(broken), data, ends)
    # the lowest long takes ten bytes, the last 0x01; 0x03 there makes 65 bits
    low = _cols._stream([(1, FLAT, [(Op.INSERT, empty | {"id": -(2**63)}, None, (), ())])])
    offsets, headers = parse_stream(low)
    starts = offsets + HEADER_SIZE + headers["key_length"]
    stops = offsets + headers["total_length"]
    after = reader.read(low, starts, stops)[0]
    assert [-(2**63)] in [a.to_pylist() for a in after if a is not None]
    wide = low.replace(b"\xff" * 9 + b"\x01", b"\xff" * 9 + b"\x03")
    with pytest.raises(CorruptEventError, match="long range"):
        reader.read(wide, starts, stops)
