"""Column policies against a real Postgres: source -> postgres fetcher -> relay -> consumer.

An excluded column is absent from the schema and the rows, a hashed column is
the HMAC-SHA256 of the source value (computed here) and equal for equal
values, a truncated one is cut, NULLs stay NULL, an unchanged TOAST value
stays not sent; the key never reaches a log. Both row paths (the general
decoder and the pgoutput transcoder) write the same bytes with a policy.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
from pathlib import Path
from typing import Any

import psycopg
import pytest

from changebus.client import ChangeEvent, Consumer, ConsumerConfig
from changebus.fetchers import ColumnPolicy
from changebus.fetchers.postgres import Assembler, PostgresConfig, TypeResolver, parse_message
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import ConfigError, SourceConfigError
from changebus.schemas.config import load_config_dict
from fix_pg import caught_up, wait_until

pytestmark = pytest.mark.pg

KEY = "column-key-0123456789-abcdefghijklmnop"
ENV = "CB_TEST_COLUMN_KEY"
POLICY = {
    "public.users": {
        "email": "hash",
        "ssn": "exclude",
        "bio": "truncate:5",
        "code": "hash",
        "photo": "truncate:3",
        "notes": "hash",
        "gone": "exclude",  # not a column: a warning, not an error
    }
}
NOTES = "y" * 3000  # stored out of line: an update of another column does not send it
FAST: dict[str, Any] = {"wait_s": 0.3, "backoff_initial_s": 0.01, "backoff_max_s": 0.2}


def mac(value: bytes | str) -> str:
    data = value.encode() if isinstance(value, str) else value
    return hmac.new(KEY.encode(), data, hashlib.sha256).hexdigest()


def create(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE users (id int8 PRIMARY KEY, email text, ssn text, bio text, "
            "code int8, photo bytea, n int4, notes text)"
        )
        conn.execute("ALTER TABLE users ALTER COLUMN bio SET STORAGE EXTERNAL")
        conn.execute("ALTER TABLE users ALTER COLUMN notes SET STORAGE EXTERNAL")
        conn.execute("CREATE TABLE plain (id int8 PRIMARY KEY, ssn text)")


def write(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO users VALUES (1, 'ann@example.com', '123-45', %s, 42, %s, 1, %s)",
            ("x" * 3000, b"\x01\x02\x03\x04", NOTES),
        )
        conn.execute(
            "INSERT INTO users VALUES (2, 'ann@example.com', NULL, NULL, NULL, NULL, 2, NULL), "
            "(3, 'bob@example.com', 'zzz', 'short', -7, '\\x00'::bytea, 3, 'n')"
        )
        conn.execute("UPDATE users SET n = 10 WHERE id = 1")  # bio: unchanged TOAST
        conn.execute("DELETE FROM users WHERE id = 3")
        conn.execute("INSERT INTO plain VALUES (1, 'kept')")


def relay_config(tmp: Path, dsn: str, key_from: str = "env") -> RelayConfig:
    options: dict[str, Any] = {"dsn": dsn, "status_interval_s": 0.2, "column_policy": POLICY}
    if key_from == "env":
        options["column_hash_key_env"] = ENV
    else:
        options["column_hash_key"] = KEY
    return RelayConfig(
        data_dir=tmp / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "pg", 1, capacity_bytes=8 << 20, fetcher=FetcherConfig("postgres", options)
            ),
        ),
        flush_interval_s=0,
    )


async def consume(url: str, n: int) -> list[ChangeEvent]:
    events: list[ChangeEvent] = []
    async with Consumer(ConsumerConfig(relays=(url,), partition="pg", **FAST)) as consumer:
        async for window in consumer:
            events.extend(window.events)
            if len(events) >= n:
                return events
    return events


@pytest.mark.parametrize("key_from", ["env", "option"])
async def test_policies_end_to_end(
    tmp_path: Path,
    pg_dsn: str,
    key_from: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv(ENV, KEY)
    create(pg_dsn)
    async with Relay(relay_config(tmp_path, pg_dsn, key_from)) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        await asyncio.to_thread(write, pg_dsn)
        await caught_up(relay, pg_dsn)
        events = await asyncio.wait_for(consume(relay.url, 6), 30)
        status = json.dumps(relay.hosts["pg"].status())
    users = [e for e in events if e.table == "public.users"]
    assert [e.op.name for e in users] == ["INSERT", "INSERT", "INSERT", "UPDATE", "DELETE"]
    schema = users[0].schema
    assert schema is not None
    fields = {f["name"]: f for f in schema.row_schema["fields"]}
    assert "ssn" not in fields and "gone" not in fields
    assert fields["email"]["changebus.policy"] == "hmac-sha256"
    assert fields["email"]["type"] == ["null", "string"]
    assert fields["code"]["type"] == ["null", "string"]
    assert fields["code"]["changebus.source_type"] == "bigint"
    assert fields["bio"]["changebus.policy"] == "truncate:5"
    assert fields["photo"]["changebus.policy"] == "truncate:3"
    assert "changebus.policy" not in fields["n"]
    ins1, ins2, ins3, upd, dele = users
    assert ins1.after == {
        "id": 1,
        "email": mac("ann@example.com"),
        "bio": "xxxxx",
        "code": mac("42"),
        "photo": b"\x01\x02\x03",
        "n": 1,
        "notes": mac(NOTES),
    }
    assert ins2.after == {"id": 2, "email": ins1.after["email"], "bio": None, "code": None,
                          "photo": None, "n": 2, "notes": None}  # fmt: skip
    assert ins3.after is not None and ins3.after["code"] == mac("-7")
    assert ins3.after["bio"] == "short" and ins3.after["photo"] == b"\x00"
    assert ins3.after["email"] == mac("bob@example.com") != ins1.after["email"]
    # an unchanged TOAST value stays not sent (not a hash or a cut of a placeholder)
    assert upd.after is not None and upd.after["n"] == 10 and upd.after["bio"] is None
    assert upd.after["notes"] is None and upd.not_sent == ("bio", "notes")
    assert upd.after["email"] == ins1.after["email"]
    # a key-only before-image: the excluded column is not listed as not sent
    assert dele.before is not None and dele.before["id"] == 3 and "ssn" not in dele.before
    assert "ssn" not in dele.before_not_sent and "email" in dele.before_not_sent
    plain = [e for e in events if e.table == "public.plain"]
    assert plain and plain[0].after == {"id": 1, "ssn": "kept"}
    # the key is in no log line and not in the status
    assert KEY not in caplog.text and KEY not in status
    assert "public.users.gone" in caplog.text
    assert caplog.text.count("public.users.gone") == 1


def test_both_row_paths_write_the_same_bytes(pg_dsn: str) -> None:
    create(pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE PUBLICATION pub FOR ALL TABLES")
        conn.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
        write(pg_dsn)
        conn.execute("ALTER TABLE users REPLICA IDENTITY FULL")
        conn.execute("UPDATE users SET n = 11, email = 'new@example.com' WHERE id = 1")
        conn.execute("DELETE FROM users WHERE id = 2")
        policy = ColumnPolicy.parse(POLICY, KEY)
        datas, fast = both_paths(conn, policy=policy)
    assert fast.rows_transcoded >= 6
    assert mac("new@example.com").encode() in b"".join(datas)
    assert b"123-45" not in b"".join(datas) and b"ann@example.com" not in b"".join(datas)


def test_key_columns(pg_dsn: str) -> None:
    """A hashed key column keys events by the hash; excluding or truncating one is refused."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE k (email text PRIMARY KEY, v int4)")
        conn.execute("CREATE PUBLICATION pub FOR ALL TABLES")
        conn.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
        conn.execute("INSERT INTO k VALUES ('a@b', 1)")
        conn.execute("DELETE FROM k")
        datas, fast = both_paths(
            conn, policy=ColumnPolicy.parse({"public.k": {"email": "hash"}}, KEY)
        )
        assert mac("a@b").encode() in b"".join(datas) and b"a@b" not in b"".join(datas)
        assert fast.rows_transcoded == 2  # the hashed key on the fast path
        resolver = TypeResolver(conn)
        for action in ("exclude", "truncate:2"):
            asm = Assembler(
                1,
                resolver.resolve,
                primary_key=resolver.primary_key,
                policy=ColumnPolicy.parse({"public.k": {"email": action}}, KEY),
            )
            conn.execute("INSERT INTO k VALUES (%s, 2)", (action,))
            with pytest.raises(SourceConfigError, match=r"public\.k\.email.*key column"):
                both_paths_with(conn, asm)


def changes(conn: psycopg.Connection[Any]) -> list[bytes]:
    rows = conn.execute(
        "SELECT data FROM pg_logical_slot_get_binary_changes('s', NULL, NULL, 'proto_version', "
        "'1', 'publication_names', 'pub', 'binary', 'true')"
    ).fetchall()
    return [bytes(d) for (d,) in rows]


def both_paths_with(conn: psycopg.Connection[Any], asm: Assembler) -> None:
    for m in changes(conn):
        asm.feed(parse_message(m))


def both_paths(
    conn: psycopg.Connection[Any], *, policy: ColumnPolicy
) -> tuple[list[bytes], Assembler]:
    """The slot's changes through the general path and the transcoder: the same windows."""
    resolver = TypeResolver(conn)
    general, fast = (
        Assembler(1, resolver.resolve, primary_key=resolver.primary_key, policy=policy)
        for _ in range(2)
    )
    want, got = [], []
    for m in changes(conn):
        w = general.feed(parse_message(m))
        if w is not None:
            want.append(w.data)
        w = fast.feed_raw(b"pad" + m, 3)
        if w is not None:
            got.append(w.data)
    assert want == got and got
    return got, fast


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"column_policy": {"public.t": {"c": "mask"}}}, r"'public\.t'.*'c'.*unknown policy"),
        ({"column_policy": {"public.t": {"c": "truncate:0"}}}, r"'c'.*positive length"),
        ({"column_policy": {"public.t": {"c": "truncate"}}}, r"'c'.*positive length"),
        ({"column_policy": {"public.t": {"c": "truncate:x"}}}, r"positive length"),
        ({"column_policy": {"public.t": {"c": "hash"}}}, r"'public\.t'.*'c'.*no key"),
        ({"column_policy": {"t": {"c": "hash"}}}, r"schema\.table"),
        ({"column_policy": {"public.t": {"c": 3}}}, r"'c'.*expected"),
        ({"column_hash_key_env": "CB_TEST_UNSET_VARIABLE"}, r"CB_TEST_UNSET_VARIABLE.*not set"),
        ({"column_hash_key": KEY, "column_hash_key_env": ENV}, r"not both"),
    ],
)
def test_config_errors(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        load_config_dict(PostgresConfig, {"dsn": "host=x password=pw", **options}, "fetcher")
    assert KEY not in str(err.value)


def test_truncate_of_a_number_is_refused(pg_dsn: str) -> None:
    create(pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE PUBLICATION pub FOR ALL TABLES")
        conn.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
        conn.execute("INSERT INTO users (id, n) VALUES (9, 1)")
        resolver = TypeResolver(conn)
        asm = Assembler(
            1,
            resolver.resolve,
            primary_key=resolver.primary_key,
            policy=ColumnPolicy.parse({"public.users": {"n": "truncate:2"}}),
        )
        with pytest.raises(SourceConfigError, match=r"public\.users\.n.*text and binary"):
            both_paths_with(conn, asm)


def test_key_is_not_in_the_config_repr() -> None:
    cfg = load_config_dict(
        PostgresConfig,
        {"dsn": "host=x", "column_hash_key": KEY, "column_policy": POLICY},
        "fetcher",
    )
    assert KEY not in repr(cfg) and KEY not in repr(cfg.column_rules())
