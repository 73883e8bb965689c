"""pgoutput parsing and binary value decoding against a real Postgres 15."""

from __future__ import annotations

import datetime
import decimal
import ipaddress
import json
import re
import uuid
from typing import Any

import psycopg
import pytest

from changebus.fetchers.postgres import (
    UNCHANGED,
    Begin,
    Commit,
    Delete,
    Insert,
    LogicalMessage,
    Relation,
    Truncate,
    TypeInfo,
    Update,
    decode_value,
    parse_message,
)
from changebus.schemas import CorruptEventError, lsn_to_scn

pytestmark = pytest.mark.pg

COLUMNS = """
    id int8 PRIMARY KEY, i2 int2, i4 int4, f4 float4, f8 float8, n numeric(12,3), nu numeric,
    b bool, t text, vc varchar(10), c char(3), by bytea, d date, tm time, tz timetz,
    ts timestamp, tstz timestamptz, iv interval, u uuid, j json, jb jsonb, ip inet, net cidr,
    mac macaddr, mo money, ia int4[], ta text[], ia2 int4[][], mood mood, dom posint, big text
"""

VALUES: list[tuple[Any, ...]] = [
    (
        1,
        7,
        -70000,
        1.5,
        -2.25e300,
        decimal.Decimal("-1234.567"),
        decimal.Decimal("0.000001"),
        True,
        "héllo ✓",
        "short",
        "abc",
        b"\x00\xffbin",
        datetime.date(1999, 12, 31),
        datetime.time(23, 59, 58, 123456),
        "12:34:56+02",
        datetime.datetime(2024, 2, 29, 1, 2, 3, 4),
        datetime.datetime(2024, 2, 29, 1, 2, 3, tzinfo=datetime.UTC),
        datetime.timedelta(days=3, seconds=5),
        uuid.UUID("12345678-1234-5678-1234-567812345678"),
        '{"a": [1, 2]}',
        '{"b": null}',
        "192.168.0.1/24",
        "10.0.0.0/8",
        "08:00:2b:01:02:03",
        "12.34",
        [1, None, 3],
        ["x", None],
        [[1, 2], [3, 4]],
        "happy",
        5,
        "t" * 10,
    ),
    (
        2,
        None,
        None,
        None,
        None,
        None,
        decimal.Decimal("NaN"),
        False,
        "",
        None,
        None,
        None,
        datetime.date(2024, 1, 1),
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        "::1",
        None,
        None,
        None,
        [],
        None,
        None,
        None,
        None,
        None,
    ),
]


@pytest.fixture
def peek(pg_dsn: str):
    conn = psycopg.connect(pg_dsn, autocommit=True)
    conn.execute("CREATE TYPE mood AS ENUM ('sad', 'happy')")
    conn.execute("CREATE DOMAIN posint AS int4 CHECK (VALUE > 0)")
    conn.execute(f"CREATE TABLE alltypes ({COLUMNS})")
    conn.execute("CREATE PUBLICATION pub FOR TABLE alltypes")
    conn.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")

    def changes() -> list[Any]:
        rows = conn.execute(
            "SELECT lsn::text, data FROM pg_logical_slot_get_binary_changes('s', NULL, NULL, "
            "'proto_version', '1', 'publication_names', 'pub', 'binary', 'true', 'messages', 'true')"
        ).fetchall()
        return [(lsn, parse_message(bytes(data))) for lsn, data in rows]

    yield conn, changes
    conn.close()


def expected_text(value: Any) -> Any:
    if isinstance(value, datetime.timedelta):
        return {
            "months": 0,
            "days": value.days,
            "micros": value.seconds * 1_000_000 + value.microseconds,
        }
    return value


def test_every_type_round_trips(peek) -> None:
    conn, changes = peek
    cols = [c.strip().split()[0] for c in re.split(r",(?![^(]*\))", COLUMNS.strip())]
    placeholders = ", ".join(["%s"] * len(cols))
    with conn.transaction():
        for row in VALUES:
            conn.execute(f"INSERT INTO alltypes VALUES ({placeholders})", row)
    msgs = [m for _, m in changes()]
    assert isinstance(msgs[0], Begin) and isinstance(msgs[-1], Commit)
    relation = next(m for m in msgs if isinstance(m, Relation))
    assert relation.name == "alltypes" and relation.namespace == "public"
    assert [c.name for c in relation.columns] == cols
    assert [c.key for c in relation.columns] == [c == "id" for c in cols]
    types = {m.name for m in msgs if isinstance(m, TypeInfo)}
    assert "mood" in types
    inserts = [m for m in msgs if isinstance(m, Insert)]
    assert len(inserts) == 2
    oids = {
        r[0]: r[1]
        for r in conn.execute(
            "SELECT a.attname, CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE a.atttypid END "
            "FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid "
            "WHERE a.attrelid = 'alltypes'::regclass AND a.attnum > 0"
        ).fetchall()
    }
    for ins, row in zip(inserts, VALUES, strict=True):
        decoded = {
            c.name: decode_value(oids[c.name], cell)
            for c, cell in zip(relation.columns, ins.new, strict=True)
        }
        for name, want in zip(cols, row, strict=True):
            got = decoded[name]
            want = expected_text(want)
            if name in ("j", "jb") and want is not None:
                assert json.loads(got) == json.loads(want), name
            elif name == "nu" and isinstance(want, decimal.Decimal) and want.is_nan():
                assert got.is_nan()
            elif name == "ip" and want is not None:
                assert (
                    got == str(ipaddress.ip_interface(want)).replace("/128", "").replace("/32", "")
                    or got == want
                ), name
            else:
                assert got == want, (name, got, want)


def test_update_delete_truncate_toast_and_messages(peek) -> None:
    conn, changes = peek
    conn.execute("ALTER TABLE alltypes REPLICA IDENTITY DEFAULT")
    # out of line and uncompressed, so an unchanged value is not sent
    conn.execute("ALTER TABLE alltypes ALTER COLUMN big SET STORAGE EXTERNAL")
    conn.execute("INSERT INTO alltypes (id, t, big) VALUES (10, 'a', repeat('x', 100000))")
    conn.execute("UPDATE alltypes SET t = 'b' WHERE id = 10")  # big is TOASTed and unchanged
    conn.execute("UPDATE alltypes SET id = 11 WHERE id = 10")  # key change: old key sent
    conn.execute("DELETE FROM alltypes WHERE id = 11")
    conn.execute("SELECT pg_logical_emit_message(true, 'app', 'hello')")
    conn.execute("TRUNCATE alltypes")
    msgs = [m for _, m in changes()]
    updates = [m for m in msgs if isinstance(m, Update)]
    big = [c.name for c in next(m for m in msgs if isinstance(m, Relation)).columns].index("big")
    assert updates[0].old is None and updates[0].new[big] is UNCHANGED
    assert updates[1].old_kind == "K" and updates[1].old is not None
    assert decode_value(20, updates[1].old[0]) == 10 and decode_value(20, updates[1].new[0]) == 11
    delete = next(m for m in msgs if isinstance(m, Delete))
    assert delete.old_kind == "K" and decode_value(20, delete.old[0]) == 11
    assert delete.old[1] is None  # non-key columns are not sent under REPLICA IDENTITY DEFAULT
    message = next(m for m in msgs if isinstance(m, LogicalMessage))
    assert (message.prefix, message.content, message.transactional) == ("app", b"hello", True)
    truncate = next(m for m in msgs if isinstance(m, Truncate))
    assert len(truncate.relation_oids) == 1 and not truncate.cascade


def test_commit_lsn_is_the_begin_final_lsn_and_increases(peek) -> None:
    conn, changes = peek
    for i in range(5):
        conn.execute("INSERT INTO alltypes (id) VALUES (%s)", (100 + i,))
    msgs = [m for _, m in changes()]
    begins = [m for m in msgs if isinstance(m, Begin)]
    commits = [m for m in msgs if isinstance(m, Commit)]
    assert [b.final_lsn for b in begins] == [c.commit_lsn for c in commits]
    scns = [c.commit_lsn for c in commits]
    assert scns == sorted(set(scns))
    assert all(c.end_lsn > c.commit_lsn for c in commits)
    now_ns = datetime.datetime.now(datetime.UTC).timestamp() * 1e9
    assert all(abs(c.commit_ts_ns - now_ns) < 60e9 for c in commits)
    current = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]
    assert scns[-1] < lsn_to_scn(current) + 1


@pytest.mark.parametrize(
    "data", [b"", b"Z", b"B\x00", b"I\x00\x00\x00\x01N\x00\x01x", b"R\x00\x00\x00\x01abc"]
)
def test_garbage_is_rejected(data: bytes) -> None:
    with pytest.raises(CorruptEventError):
        parse_message(data)
