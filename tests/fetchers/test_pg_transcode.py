"""The transcoder (pgoutput binary -> Avro) against the general path, byte for byte.

Every message of real pgoutput streams (every type, NULLs, unchanged TOAST,
key-only and full before-images, infinities, NaN, out-of-range values,
random values) goes through ``Assembler.feed`` (parse, decode, fastavro) and
``Assembler.feed_raw`` (the transcoder); the windows must be identical, and
the ordinary rows must have taken the fast path.
"""

from __future__ import annotations

import datetime
import decimal
import io
import random
import re
from typing import Any

import fastavro
import psycopg
import pytest
from test_pgoutput import COLUMNS, VALUES

from changebus.fetchers.postgres import Assembler, TypeResolver, parse_message
from changebus.fetchers.postgres._transcode import zigzag
from changebus.schemas import (
    AVRO_PRESENT_SMALL,
    ChangeDecoder,
    decode_header,
    event_at,
    parse_stream,
)

pytestmark = pytest.mark.pg

COLS = [c.strip().split()[0] for c in re.split(r",(?![^(]*\))", COLUMNS.strip())]


def both_paths(conn: psycopg.Connection[Any], slot: str = "s") -> tuple[list[bytes], Assembler]:
    """Windows of the slot's pending changes through both paths; asserts they are equal."""
    rows = conn.execute(
        "SELECT data FROM pg_logical_slot_get_binary_changes(%s, NULL, NULL, 'proto_version', '1', "
        "'publication_names', 'pub', 'binary', 'true', 'messages', 'true')",
        (slot,),
    ).fetchall()
    messages = [bytes(d) for (d,) in rows]
    resolver = TypeResolver(conn)
    general = Assembler(
        1, resolver.resolve, primary_key=resolver.primary_key, array_dims=resolver.array_dims
    )
    fast = Assembler(
        1, resolver.resolve, primary_key=resolver.primary_key, array_dims=resolver.array_dims
    )
    want: list[Any] = []
    got: list[Any] = []
    for m in messages:
        w = general.feed(parse_message(m))
        if w is not None:
            want.append(w)
        w = fast.feed_raw(b"pad" + m, 3)  # at an offset, as in an XLogData message
        if w is not None:
            got.append(w)
    assert len(got) == len(want) > 0
    for a, b in zip(want, got, strict=True):
        assert (a.scn, a.timestamp_ns, a.events, a.source_position) == (
            b.scn,
            b.timestamp_ns,
            b.events,
            b.source_position,
        )
        assert a.data == b.data
    return [w.data for w in got], fast


def data_events(datas: list[bytes], table: Any) -> list[tuple[int, dict[str, Any], Any]]:
    """``(op, key, change)`` of every data event of ``datas``, decoded as ``table``."""
    dec = ChangeDecoder(table)
    out = []
    for data in datas:
        offsets, headers = parse_stream(data)
        for off, h in zip(offsets.tolist(), headers, strict=True):
            if int(h["op"]) < 16:
                key, payload = event_at(data, off, decode_header(data, off))
                out.append((int(h["op"]), dec.decode_key(bytes(key)), dec.decode(bytes(payload))))
    return out


@pytest.fixture
def conn(pg_dsn: str):
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("CREATE TYPE mood AS ENUM ('sad', 'happy')")
        c.execute("CREATE DOMAIN posint AS int4 CHECK (VALUE > 0)")
        c.execute(f"CREATE TABLE alltypes ({COLUMNS})")
        c.execute("ALTER TABLE alltypes ALTER COLUMN big SET STORAGE EXTERNAL")
        c.execute("CREATE PUBLICATION pub FOR ALL TABLES")
        c.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
        yield c


def test_every_type_nulls_toast_and_before_images(conn: psycopg.Connection[Any]) -> None:
    placeholders = ", ".join(["%s"] * len(COLS))
    with conn.transaction():
        for row in VALUES:
            conn.execute(f"INSERT INTO alltypes VALUES ({placeholders})", row)
    conn.execute("INSERT INTO alltypes (id) VALUES (3)")  # all NULL but the key
    conn.execute("INSERT INTO alltypes (id, t, big) VALUES (10, 'a', repeat('x', 100000))")
    conn.execute("UPDATE alltypes SET t = 'b' WHERE id = 10")  # big: unchanged TOAST
    conn.execute("UPDATE alltypes SET id = 11 WHERE id = 10")  # key change: key-only old row
    conn.execute("UPDATE alltypes SET i4 = 1 WHERE id = 1")
    conn.execute("DELETE FROM alltypes WHERE id = 11")  # key-only old row
    conn.execute("ALTER TABLE alltypes REPLICA IDENTITY FULL")
    conn.execute("UPDATE alltypes SET i2 = 8 WHERE id = 1")  # whole old row
    conn.execute("INSERT INTO alltypes (id, t, big) VALUES (20, 'a', repeat('y', 100000))")
    conn.execute("UPDATE alltypes SET t = 'c' WHERE id = 20")  # FULL and unchanged TOAST
    conn.execute("DELETE FROM alltypes WHERE id = 2")  # whole old row
    conn.execute("SELECT pg_logical_emit_message(true, 'app', 'hello')")
    conn.execute("TRUNCATE alltypes")
    _, fast = both_paths(conn)
    # the rows with arrays / NaN go through the general column encoder, not the general path
    assert fast.rows_general == 0
    assert fast.rows_transcoded == 12


def test_edge_values_fall_back_or_match(conn: psycopg.Connection[Any]) -> None:
    conn.execute(
        "CREATE TABLE edge (id int8 PRIMARY KEY, d date, ts timestamp, tstz timestamptz, "
        "tm time, n numeric(12,3), n0 numeric(3,-2), nu numeric, f4 float4, f8 float8, "
        "ia int4[], ia2 int4[][], b bool, iv interval, u uuid, jb jsonb)"
    )
    rows = [
        "1, 'infinity', 'infinity', '-infinity', '24:00', 'NaN', 12300, 'Infinity', "
        "'NaN', '-Infinity', '{}', '{{{1}}}', NULL, '-1 year 2 days -3 sec', NULL, 'null'",
        "2, '-infinity', '-infinity', 'infinity', '00:00', '-0.001', -99900, '-1e-30', "
        "'-0', '1e308', '{{1,2},{3,4}}', '{1,2}', true, '0', '00000000-0000-0000-0000-000000000000', '[]'",
        "3, '0001-01-01', '0001-01-01 00:00', '9999-12-31 23:59:59.999999+00', '23:59:59.999999', "
        "999999999.999, 0, '0.0000', 3.4e38, 5e-324, '{NULL}', NULL, false, '178000000 years', NULL, '{}'",
        "4, '0001-01-02', '9999-12-31 23:59:59.999999', '1970-01-01 00:00:00.000001+00', '12:00', "
        "-128, -100, '123456789012345678901234567890.123', 1.5, -2.25, NULL, NULL, true, "
        "'-178000000 years', 'ffffffff-ffff-ffff-ffff-ffffffffffff', '\"\\u00e9\"'",
    ]
    with conn.transaction():
        for r in rows:
            conn.execute(f"INSERT INTO edge VALUES ({r})")
    _, fast = both_paths(conn)
    assert fast.rows_general == 2  # the infinities; the rest is transcoded
    assert fast.rows_transcoded == 2


def test_random_values_match(conn: psycopg.Connection[Any]) -> None:
    conn.execute(
        "CREATE TABLE rnd (id int8 PRIMARY KEY, a int2, b int4, c int8, n numeric(18,4), "
        "m numeric(5,0), ts timestamptz, d date, t text, by bytea, f float4, tm time)"
    )
    rnd = random.Random(11)

    def num(digits: int, scale: int) -> decimal.Decimal:
        return decimal.Decimal(rnd.randint(-(10**digits) + 1, 10**digits - 1)).scaleb(-scale)

    with conn.transaction():
        for _ in range(400):
            conn.execute(
                "INSERT INTO rnd VALUES (%s, %s, %s, %s, %s, %s, "
                "to_timestamp(%s), '2000-01-01'::date + %s, %s, %s, %s, "
                "'00:00'::time + make_interval(secs => %s))",
                (
                    rnd.randint(-(2**63), 2**63 - 1),
                    rnd.randint(-(2**15), 2**15 - 1),
                    rnd.randint(-(2**31), 2**31 - 1),
                    rnd.choice([0, 1, -1, 2**63 - 1, -(2**63), rnd.randint(-(2**40), 2**40)]),
                    num(rnd.randint(1, 18), 4) if rnd.random() < 0.9 else None,
                    num(rnd.randint(1, 5), 0),
                    rnd.uniform(-1e10, 1e10),
                    rnd.randint(-700000, 2900000),
                    "".join(rnd.choices("aé✓\U0001f600z", k=rnd.randint(0, 300))),
                    rnd.randbytes(rnd.randint(0, 200)),
                    rnd.uniform(-1e30, 1e30),
                    rnd.uniform(0, 86399.999999),
                ),
            )
    _, fast = both_paths(conn)
    assert fast.rows_transcoded == 400 and fast.rows_general == 0


def test_zigzag_matches_fastavro() -> None:
    schema = fastavro.parse_schema("long")
    rnd = random.Random(3)
    values = [0, 1, -1, 63, -64, 64, 8191, -8192, 8192, 2**63 - 1, -(2**63)]
    values += [rnd.randint(-(2**63), 2**63 - 1) >> rnd.randint(0, 63) for _ in range(3000)]
    for v in values:
        bio = io.BytesIO()
        fastavro.schemaless_writer(bio, schema, v)
        assert zigzag(v) == bio.getvalue(), v


def test_present_small_table_is_the_union_branch_and_fastavro_long() -> None:
    schema = fastavro.parse_schema("long")
    assert len(AVRO_PRESENT_SMALL) == 8192
    for n in range(8192):
        bio = io.BytesIO()
        fastavro.schemaless_writer(bio, schema, n)
        assert AVRO_PRESENT_SMALL[n] == b"\x02" + bio.getvalue(), n


def test_full_identity_without_a_key_has_nullable_key_columns(
    conn: psycopg.Connection[Any],
) -> None:
    """A FULL-identity table without a primary key is keyed by all its columns.

    Any of them may be NULL: the key record's fields are ``["null", T]``
    (the row field's bytes), on the fast path as on the general one; a NULL
    once stopped the partition (the key could not be encoded).
    """
    conn.execute("CREATE TABLE nokey (a int4, b int8, t text, d date)")
    conn.execute("ALTER TABLE nokey REPLICA IDENTITY FULL")
    conn.execute("INSERT INTO nokey VALUES (1, 2, 'x', '2020-01-01'), (3, 4, 'y', NULL)")
    conn.execute("INSERT INTO nokey VALUES (NULL, NULL, NULL, NULL)")
    conn.execute("UPDATE nokey SET t = 'z' WHERE a = 1")
    conn.execute("UPDATE nokey SET t = 'w' WHERE a = 3")  # a NULL in the before-image's key
    conn.execute("DELETE FROM nokey WHERE a IS NULL")
    datas, fast = both_paths(conn)
    table = fast.registry.latest("public.nokey")
    assert table.key == ("a", "b", "t", "d")
    assert table.nullable_key and all(c.nullable for c in table.columns)
    assert fast.rows_transcoded == 2  # the rows without a NULL key column
    keys = [key for _op, key, _change in data_events(datas, table)]
    x = {"a": 1, "b": 2, "t": "x", "d": datetime.date(2020, 1, 1)}
    y = {"a": 3, "b": 4, "t": "y", "d": None}
    nulls = {"a": None, "b": None, "t": None, "d": None}
    # an update changes the whole-row key: the old key's DELETE follows it
    assert keys == [x, y, nulls, {**x, "t": "z"}, x, {**y, "t": "w"}, y, nulls]


def test_an_unchanged_toasted_value_of_an_all_column_key_comes_from_the_old_row(
    conn: psycopg.Connection[Any],
) -> None:
    """pgoutput sends an unchanged TOASTed value as 'u' in the new row.

    In a table keyed by all its columns that value is part of the key: taken
    as NULL, the update's key differed from the insert's and the delete's
    (another lane, another snapshot row). It is the old row's value.
    """
    conn.execute("CREATE TABLE nokey (a int4, big text)")
    conn.execute("ALTER TABLE nokey ALTER COLUMN big SET STORAGE EXTERNAL")
    conn.execute("ALTER TABLE nokey REPLICA IDENTITY FULL")
    big = "y" * 5000  # TOASTed (external storage), within a key's 64 KiB
    conn.execute("INSERT INTO nokey VALUES (1, %s)", (big,))
    conn.execute("UPDATE nokey SET a = 2")  # big: unchanged, TOASTed
    conn.execute("DELETE FROM nokey")
    datas, fast = both_paths(conn)
    events = data_events(datas, fast.registry.latest("public.nokey"))
    keys = [key for _op, key, _change in events]
    afters = [change.after_not_sent for _op, _key, change in events]
    one, two = {"a": 1, "big": big}, {"a": 2, "big": big}
    assert keys == [one, two, one, two]  # the update, then the old key's DELETE
    assert afters[1] == ()  # the value is sent, not listed as unchanged


def test_full_identity_fills_unchanged_toasted_values_and_a_key_change_deletes_the_old_key(
    conn: psycopg.Connection[Any],
) -> None:
    """With REPLICA IDENTITY FULL the old row is whole (pgoutput flattens its TOASTed
    values): an unchanged TOASTed value of the new row is taken from it, so the update
    is whole, and writers that cannot move rows between keys (a consumer group's units)
    need nothing they lack. An update changing the key is followed by the old key's
    DELETE, on both paths, byte for byte."""
    conn.execute("CREATE TABLE docs (id int PRIMARY KEY, n int, big text)")
    conn.execute("ALTER TABLE docs ALTER COLUMN big SET STORAGE EXTERNAL")
    conn.execute("ALTER TABLE docs REPLICA IDENTITY FULL")
    big = "z" * 5000
    conn.execute("INSERT INTO docs VALUES (1, 1, %s)", (big,))
    conn.execute("UPDATE docs SET n = 2")  # big: unchanged, TOASTed
    conn.execute("UPDATE docs SET id = 5, n = 3")  # a key change, big unchanged
    datas, fast = both_paths(conn)
    assert fast.rows_transcoded == 3
    seen = []
    for op, key, change in data_events(datas, fast.registry.latest("public.docs")):
        after = None if change.after is None else change.after["n"], change.after_not_sent
        seen.append((op, key["id"], after))
        if change.after is not None:
            assert change.after["big"] == big
    assert seen == [(1, 1, (1, ())), (2, 1, (2, ())), (2, 5, (3, ())), (3, 1, (None, ()))]


def test_an_identity_index_other_than_the_key_gives_no_old_key(
    conn: psycopg.Connection[Any],
) -> None:
    """REPLICA IDENTITY USING INDEX on other columns than the primary key: the key-only
    before-image holds those columns, not the key. Working out the old key's DELETE of
    an update raised a TypeError there and stopped the fetcher (found by review). The
    identity index keys the events now (test_pg_assembler): the update of the identity
    is a key change, with the old key's DELETE after it."""
    conn.execute("CREATE TABLE ident (id int PRIMARY KEY, u int NOT NULL, v text)")
    conn.execute("CREATE UNIQUE INDEX ident_u ON ident (u)")
    conn.execute("ALTER TABLE ident REPLICA IDENTITY USING INDEX ident_u")
    conn.execute("INSERT INTO ident VALUES (1, 10, 'a')")
    conn.execute("UPDATE ident SET u = 11, v = 'b' WHERE id = 1")  # the identity changes
    datas, fast = both_paths(conn)
    table = fast.registry.latest("public.ident")
    ops = [op for op, _key, _change in data_events(datas, table)]
    assert table.key == ("u",) and ops == [1, 2, 3]


def test_transcoders_of_many_tables_are_kept_for_the_recent_ones_only(
    conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A source with thousands of relations (each partition of a partitioned table is
    one) kept a compiled transcoder (~12 KB), a row encoder (~5 KB) and the schema's
    derived Avro schemas per relation for ever. Now the assembler keeps those of the
    tables that had rows last (MAX_TRANSCODERS), makes a dropped one's again when its
    rows come back, and the windows are the same bytes."""
    from changebus.fetchers.postgres import _tables

    monkeypatch.setattr(_tables, "MAX_TRANSCODERS", 3)
    for t in range(8):
        conn.execute(f"CREATE TABLE many{t} (id int8 PRIMARY KEY, v text)")
    for i in range(64):
        with conn.transaction():
            conn.execute(f"INSERT INTO many{i % 8} VALUES (%s, %s)", (i, f"v{i}"))
            conn.execute(f"UPDATE many{(i + 3) % 8} SET v = v || 'x'")
    _datas, fast = both_paths(conn)  # (asserts both paths give the same windows)
    assert len(fast.transcoders) == 3
    assert fast.transcoders.compiled > 8  # dropped ones were compiled again
    assert fast.transcoders.encoders_made > 8  # and their row encoders made again
    assert fast.rows_general == 0 and fast.rows_transcoded > 64
    assert sum(1 for t in fast._tables.values() if t.transcoder is not None) == 3
    kept = [t for t in fast._tables.values() if t.encoder is not None]
    assert len(kept) == 3 and all(t.transcoder is not None for t in kept)
    # a dropped table keeps its shape, not its derived Avro schemas (made again when used)
    dropped = [t for t in fast._tables.values() if t.encoder is None]
    assert len(dropped) == 5
    assert all("row_schema" not in t.schema.__dict__ for t in dropped)
