"""The Postgres seeder's COPY encoder writes exactly what the general path writes.

A chunk's binary COPY rows are encoded twice at the same SCN, timestamp and
``seq`` numbering: by the table's generated :class:`CopyEncoder` (the fast
path the seeder takes) and by the general path (each row dressed up as a
pgoutput Insert and fed through the fetcher's Assembler). Both must give the
same bytes, event for event, over every type the Postgres fetcher supports
(the columns of tests/fetchers/test_pgoutput.py), NULLs, a TOASTed value,
edge values the fast path hands back to the general path, random values, and
a column policy (exclude, hash, truncate).
"""

from __future__ import annotations

import datetime
import decimal
import random
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from changebus.bootstrap import SeedRequest
from changebus.bootstrap._chunks import SnapshotScope
from changebus.bootstrap._seed import PostgresChunkSource
from changebus.bootstrap._seed_pg_keys import copy_rows
from changebus.fetchers import ColumnPolicy
from changebus.fetchers.postgres import (
    Assembler,
    Begin,
    Relation,
    RelationColumn,
    TypeResolver,
)
from changebus.schemas import ChangeDecoder, Op, SchemaRegistry, event_at, verify_event

pytestmark = pytest.mark.pg

#: every type the fetcher maps (as tests/fetchers/test_pgoutput.py), a domain and an enum
COLUMNS = """
    id int8 PRIMARY KEY, i2 int2, i4 int4, f4 float4, f8 float8, n numeric(12,3), nu numeric,
    b bool, t text, vc varchar(10), c char(3), by bytea, d date, tm time, tz timetz,
    ts timestamp, tstz timestamptz, iv interval, u uuid, j json, jb jsonb, ip inet, net cidr,
    mac macaddr, mo money, ia int4[], ta text[], ia2 int4[][], mood mood, dom posint, big text,
    o oid, n0 numeric(3,-2)
"""
ROWS = [
    "1, 7, -70000, 1.5, -2.25e300, -1234.567, 0.000001, true, 'héllo ✓', 'short', 'abc', "
    "'\\x00ff62696e'::bytea, '1999-12-31', '23:59:58.123456', '12:34:56+02', "
    "'2024-02-29 01:02:03.000004', '2024-02-29 01:02:03+00', '3 days 5 seconds', "
    "'12345678-1234-5678-1234-567812345678', '{\"a\": [1, 2]}', '{\"b\": null}', "
    "'192.168.0.1/24', '10.0.0.0/8', '08:00:2b:01:02:03', 12.34, '{1,NULL,3}', "
    "'{x,NULL}', '{{1,2},{3,4}}', 'happy', 5, repeat('t', 10), 4294967295, 12300",
    "2, NULL, NULL, NULL, NULL, NULL, 'NaN', false, '', NULL, NULL, NULL, '2024-01-01', "
    "NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, '::1', NULL, NULL, NULL, '{}', '{}', "
    "NULL, NULL, NULL, NULL, NULL, NULL",
    "3, -32768, 2147483647, '-Infinity', 'NaN', 999999999.999, '-1e-30', NULL, 'x', "
    "'', '', ''::bytea, '0001-01-01', '00:00', '00:00:00-14', '0001-01-01 00:00', "
    "'9999-12-31 23:59:59.999999+00', '-178000000 years', "
    "'ffffffff-ffff-ffff-ffff-ffffffffffff', 'null', '\"\\u00e9\"', '::/0', '::/0', "
    "'ff:ff:ff:ff:ff:ff', -92233720368547758.08, '{NULL}', '{\"\"}', '{{NULL}}', 'sad', "
    "2147483647, NULL, 0, -99900",
]
#: values the fast path hands back (the whole chunk then goes the general way)
EDGE_ROWS = [
    "10, 'infinity', 'infinity', '-infinity', '24:00', 'NaN', 'Infinity', '{{{1}}}'",
    "11, '-infinity', '-infinity', 'infinity', '00:00', '-0.001', '-1e-30', '{1,2}'",
]


def table_schema_entries(
    conn: psycopg.Connection[Any], table: str, policy: ColumnPolicy | None = None
) -> list[tuple[int, Any]]:
    """The (source id, schema) the relay's fetcher would register for ``table``."""
    resolver = TypeResolver(conn)
    registry = SchemaRegistry()
    assembler = Assembler(
        1,
        resolver.resolve,
        registry,
        primary_key=resolver.primary_key,
        array_dims=resolver.array_dims,
        policy=policy,
    )
    oid = conn.execute("SELECT %s::regclass::oid::int", (table,)).fetchone()[0]  # type: ignore[index]
    cols = conn.execute(
        "SELECT attname::text, atttypid::int, atttypmod::int FROM pg_attribute "
        "WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
        (oid,),
    ).fetchall()
    pk = set(resolver.primary_key(oid) or ())
    nsp, _, rel = table.partition(".")
    assembler.feed(Begin(0, 0, 0))
    assembler.feed(
        Relation(oid, nsp, rel, "d", tuple(RelationColumn(c, t, m, c in pk) for c, t, m in cols))
    )
    return [(registry.source_id(table), s) for s in registry.versions(table)]


@pytest.fixture
def conn(pg_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("CREATE TYPE mood AS ENUM ('sad', 'happy')")
        c.execute("CREATE DOMAIN posint AS int4 CHECK (VALUE > 0)")
        c.execute(f"CREATE TABLE alltypes ({COLUMNS})")
        c.execute("ALTER TABLE alltypes ALTER COLUMN big SET STORAGE EXTERNAL")
        yield c


def both_paths(
    dsn: str,
    conn: psycopg.Connection[Any],
    table: str,
    *,
    limit: int = 1000,
    policy: ColumnPolicy | None = None,
) -> tuple[list[list[bytes]], PostgresChunkSource]:
    """Every keyset chunk of ``table`` through both paths (two chunks at least when the
    table has more than ``limit`` rows); asserts they are equal; returns the fast chunks."""
    entries = table_schema_entries(conn, table, policy)
    request = SeedRequest(dsn, 1, (table,), schemas=tuple(entries), column_policy=policy)
    got: list[list[bytes]] = []
    with PostgresChunkSource(request) as fast, PostgresChunkSource(request) as general:
        fast_reader = fast.reader(SnapshotScope(table))
        general.reader(SnapshotScope(table))
        t = fast_reader.table
        oid = fast_reader.oid
        ncols, nkey = len(t.columns), len(t.key)
        after: list[str] | None = None
        while True:
            sql, params = t.keyset(after, "", limit)
            fast.conn.execute("BEGIN")
            data = fast.copy_data(sql, oid, params)
            fast.conn.execute("COMMIT")
            tag, now = 1000 + len(got), 1_700_000_000_000_000_000 + len(got)
            events, extra = fast.encode_copy(tag, data, oid, ncols, nkey, now)
            rows = copy_rows(data, oid, ncols)
            want = general.events(tag, [m for m, _x in rows], now)
            assert len(events) == len(rows) == len(want)
            for i, (a, b) in enumerate(zip(events, want, strict=True)):
                assert a == b, f"chunk {len(got)} row {i}: the paths differ"
            if rows:
                assert extra == rows[-1][1]
            got.append(events)
            if len(rows) < limit or extra is None:
                break
            after = [v.decode() for v in extra if v is not None]
    return got, fast


def decoded(events: list[bytes], entries: list[tuple[int, Any]]) -> list[dict[str, Any]]:
    decoder = ChangeDecoder(entries[-1][1])
    out = []
    for ev in events:
        h = verify_event(ev, 0)
        assert h.op == Op.INSERT
        change = decoder.decode(bytes(event_at(ev, 0, h)[1]))
        assert change.after is not None
        out.append(dict(change.after))
    return out


def test_every_type_encodes_as_the_general_path(pg_dsn: str, conn: psycopg.Connection[Any]) -> None:
    for r in ROWS:
        conn.execute(f"INSERT INTO alltypes VALUES ({r})")
    conn.execute("INSERT INTO alltypes (id, big) VALUES (4, repeat('toast ', 20000))")
    chunks, fast = both_paths(pg_dsn, conn, "public.alltypes", limit=3)
    assert [len(c) for c in chunks] == [3, 1]
    assert fast.rows_fast == 4 and fast.rows_general == 0  # no row needed the general path
    rows = decoded([e for c in chunks for e in c], table_schema_entries(conn, "public.alltypes"))
    assert rows[0]["t"] == "héllo ✓" and rows[0]["ts"] == datetime.datetime(2024, 2, 29, 1, 2, 3, 4)
    assert rows[0]["n"] == decimal.Decimal("-1234.567") and rows[0]["o"] == 4294967295
    assert rows[3]["big"] == "toast " * 20000 and rows[3]["i2"] is None


def test_edge_values_send_the_chunk_the_general_way(
    pg_dsn: str, conn: psycopg.Connection[Any]
) -> None:
    conn.execute(
        "CREATE TABLE edge (id int8 PRIMARY KEY, d date, ts timestamp, tstz timestamptz, "
        "tm time, n numeric(12,3), nu numeric, ia2 int4[][])"
    )
    for r in EDGE_ROWS:
        conn.execute(f"INSERT INTO edge VALUES ({r})")
    conn.execute("INSERT INTO edge (id, d) SELECT g, '2000-01-01' FROM generate_series(20, 29) g")
    chunks, fast = both_paths(pg_dsn, conn, "public.edge", limit=5)
    assert [len(c) for c in chunks] == [5, 5, 2]
    assert fast.rows_general == 5 and fast.rows_fast == 7  # the first chunk held the edges


def test_random_values_and_a_column_policy_encode_as_the_general_path(
    pg_dsn: str, conn: psycopg.Connection[Any]
) -> None:
    conn.execute(
        "CREATE TABLE rnd (id int8 PRIMARY KEY, a int2, b int4, c int8, n numeric(18,4), "
        "m numeric(5,0), ts timestamptz, d date, t text, by bytea, f float4, tm time, "
        "u uuid, secret text, note text, gone text)"
    )
    rnd = random.Random(20)

    def num(digits: int, scale: int) -> decimal.Decimal:
        v = rnd.randrange(-(10**digits) + 1, 10**digits)
        return decimal.Decimal(v).scaleb(-scale)

    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO rnd VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, "
            "%s, %s)",
            [
                (
                    i,
                    rnd.choice([None, rnd.randint(-32768, 32767)]),
                    rnd.randint(-(2**31), 2**31 - 1),
                    rnd.randint(-(2**63), 2**63 - 1),
                    rnd.choice([None, num(14, 4)]),
                    num(5, 0),
                    datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
                    + datetime.timedelta(microseconds=rnd.randint(-(10**16), 10**16)),
                    datetime.date(2000, 1, 1) + datetime.timedelta(days=rnd.randint(-9999, 9999)),
                    "".join(rnd.choice("aé✓ z\n") for _ in range(rnd.randint(0, 40))),
                    rnd.randbytes(rnd.randint(0, 30)),
                    rnd.uniform(-1e6, 1e6),
                    datetime.time(rnd.randint(0, 23), rnd.randint(0, 59), rnd.randint(0, 59)),
                    uuid.UUID(int=rnd.getrandbits(128)),
                    f"s{i}",
                    "n" * rnd.randint(0, 30),
                    "x",
                )
                for i in range(1, 401)
            ],
        )
    chunks, fast = both_paths(pg_dsn, conn, "public.rnd", limit=150)
    assert [len(c) for c in chunks] == [150, 150, 100]
    assert fast.rows_fast == 400 and fast.rows_general == 0
    policy = ColumnPolicy.parse(
        {"public.rnd": {"secret": "hash", "note": "truncate:5", "gone": "exclude"}},
        hash_key="k" * 32,
    )
    chunks, fast = both_paths(pg_dsn, conn, "public.rnd", limit=400, policy=policy)
    assert fast.rows_fast == 400
    rows = decoded(chunks[0], table_schema_entries(conn, "public.rnd", policy))
    assert all(
        "gone" not in r and len(r["note"]) <= 5 and r["secret"] != f"s{r['id']}" for r in rows
    )


def test_inlined_varints_equal_avro_longs_at_every_boundary() -> None:
    from changebus.fetchers.postgres import _copyenc as ce
    from changebus.schemas import avro_long

    env = {"ZS": ce._ZS, "PZ": ce._PZ, "L14": ce._LOW14, "PL14": ce._PLOW14, "z_big": ce._z_big}
    edges = [0, 1, 2, 63, 64, 127, 128, 16383, 16384, 2**63 - 1, 2**64 - 2, 2**64 - 1]
    edges += [v + d for k in (28, 42, 56) for v in (2**k,) for d in (-2, -1, 0, 1)]
    for z in edges:
        n = (z >> 1) ^ -(z & 1)  # the long whose zig-zag value is z
        assert eval(ce._Z_EXPR, env, {"z": z}) == avro_long(n), z
        assert eval(ce._PZ_EXPR, env, {"z": z}) == b"\x02" + avro_long(n), z


def test_a_table_rewritten_during_a_chunk_is_read_whole(
    pg_dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A rewriting ALTER TABLE (same columns: the shape check passes) that committed after
    the chunk's snapshot but before the COPY took its lock left the COPY a new file whose
    rows the snapshot cannot see: an empty chunk, read as the table's end, and the sweep
    would have made the rest tombstones (review). The chunk's transaction takes the
    table's lock before its snapshot, so the ALTER waits for the chunk."""
    import threading

    conn.execute("CREATE TABLE rw (id int8 PRIMARY KEY, v int4)")
    conn.execute("INSERT INTO rw SELECT g, g FROM generate_series(1, 100) g")
    entries = table_schema_entries(conn, "public.rw")
    request = SeedRequest(pg_dsn, 1, ("public.rw",), schemas=tuple(entries))
    altered = threading.Event()

    def rewrite() -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as other:
            other.execute("SET lock_timeout = '30s'")
            other.execute("ALTER TABLE rw ALTER COLUMN v TYPE int4 USING v + 0")
        altered.set()

    with PostgresChunkSource(request) as src:
        reader = src.reader(SnapshotScope("public.rw"))
        t, oid = reader.table, reader.oid
        src.begin_chunk("public.rw")
        thread = threading.Thread(target=rewrite)
        thread.start()
        altered.wait(1.0)  # (without the lock it commits at once)
        sql, params = t.keyset(None, "", 1000)
        data = src.copy_data(sql, oid, params)
        src.conn.execute("COMMIT")
        thread.join(30)
    assert altered.is_set()
    assert len(copy_rows(data, oid, len(t.columns))) == 100


def test_a_table_and_a_condition_holding_a_percent_sign_are_read(pg_dsn: str) -> None:
    """psycopg reads ``%`` as a placeholder mark when a query has parameters: the quoted
    name of a table ``t%x`` failed the seed from its second chunk on (ProgrammingError,
    not retriable), found by review. Every query now has parameters, and every ``%``
    doubled, names and conditions alike."""
    from changebus.bootstrap._chunks import SnapshotScope as Scope

    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute('CREATE TABLE "t%x" (id int8 PRIMARY KEY, v text)')
        c.execute("""INSERT INTO "t%x" SELECT g, 'a' || g FROM generate_series(1, 25) g""")
        c.execute("""INSERT INTO "t%x" VALUES (26, 'b%s')""")
        oid = c.execute("""SELECT 'public."t%x"'::regclass::oid::int""").fetchone()[0]  # type: ignore[index]
        resolver = TypeResolver(c)
        registry = SchemaRegistry()
        asm = Assembler(1, resolver.resolve, registry, primary_key=resolver.primary_key)
        asm.feed(Begin(0, 0, 0))
        asm.feed(
            Relation(
                oid,
                "public",
                "t%x",
                "d",
                (RelationColumn("id", 20, -1, True), RelationColumn("v", 25, -1, False)),
            )
        )
    name = "public.t%x"
    entries = [(registry.source_id(name), s) for s in registry.versions(name)]
    request = SeedRequest(pg_dsn, 1, (name,), schemas=tuple(entries))
    with PostgresChunkSource(request) as src:
        for where, want in (("", 26), ("v LIKE 'b%'", 1)):
            reader = src.reader(Scope(name, where=where))
            t, oid = reader.table, reader.oid
            got, after = 0, None
            while True:  # chunks of 10 rows: parameters from the second one on
                sql, params = t.keyset(after, where, 10)
                src.begin_chunk(name)
                rows = copy_rows(src.copy_data(sql, oid, params), oid, len(t.columns))
                src.conn.execute("COMMIT")
                got += len(rows)
                if len(rows) < 10:
                    break
                after = [v.decode() for v in rows[-1][1] if v is not None]
            assert got == want, where
