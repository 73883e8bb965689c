"""Column policies against a real MariaDB: source -> mysql fetcher -> relay -> consumer.

The same policy table as for Postgres (sources named ``database.table``):
excluded columns are absent from the schema and the rows, hashed ones are the
HMAC-SHA256 of the value (equal to what the Postgres fetcher writes for the
same text or integer), truncated ones are cut, NULLs stay NULL; in the
fetcher's thread and in decode worker processes alike.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from test_mysql_fetcher import _connect, caught_up, execute, relay_config

from changebus.client import ChangeEvent, Consumer, ConsumerConfig
from changebus.fetchers.mysql import EmbeddedMariaDB, MySQLConfig
from changebus.relay import Relay
from changebus.schemas import ConfigError
from changebus.schemas.config import load_config_dict
from fix_mysql import master_scn
from waiting import wait_until

pytestmark = pytest.mark.mysql

KEY = "column-key-0123456789-abcdefghijklmnop"
ENV = "CB_TEST_COLUMN_KEY"
FAST: dict[str, Any] = {"wait_s": 0.3, "backoff_initial_s": 0.01, "backoff_max_s": 0.2}


def mac(value: bytes | str) -> str:
    data = value.encode() if isinstance(value, str) else value
    return hmac.new(KEY.encode(), data, hashlib.sha256).hexdigest()


def policy(db: str) -> dict[str, Any]:
    return {
        f"{db}.users": {
            "email": "hash",
            "ssn": "exclude",
            "bio": "truncate:5",
            "code": "hash",
            "photo": "truncate:3",
            "uid": "hash",
            "gone": "exclude",
        }
    }


async def consume(url: str, n: int) -> list[ChangeEvent]:
    events: list[ChangeEvent] = []
    async with Consumer(ConsumerConfig(relays=(url,), partition="my", **FAST)) as consumer:
        async for window in consumer:
            events.extend(e for e in window.events if not e.table.endswith(".marker"))
            if len(events) >= n:
                return events
    return events


@pytest.mark.parametrize("decode_workers", [0, 1])
async def test_policies_end_to_end(
    tmp_path: Path,
    mysql_server: EmbeddedMariaDB,
    mysql_db: str,
    decode_workers: int,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv(ENV, KEY)
    db = mysql_db
    execute(
        mysql_server,
        db,
        "CREATE TABLE users (uid bigint unsigned NOT NULL PRIMARY KEY, email varchar(100), "
        "ssn varchar(20), bio text, code bigint, photo varbinary(10), n int)",
        "CREATE TABLE plain (id int PRIMARY KEY, ssn varchar(20))",
    )
    cfg = relay_config(
        tmp_path,
        mysql_server,
        db,
        decode_workers=decode_workers,
        column_policy=policy(db),
        column_hash_key_env=ENV,
    )
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        await asyncio.to_thread(
            execute,
            mysql_server,
            db,
            (
                "INSERT INTO users VALUES (18446744073709551615, 'ann@example.com', '123-45', "
                "%s, 42, %s, 1)",
                ("x" * 3000, b"\x01\x02\x03\x04"),
            ),
            "INSERT INTO users VALUES (2, 'ann@example.com', NULL, NULL, NULL, NULL, 2)",
            "UPDATE users SET n = 10, bio = 'héllo wörld' WHERE uid = 2",
            "DELETE FROM users WHERE uid = 2",
            "INSERT INTO plain VALUES (1, 'kept')",
        )
        await caught_up(relay, mysql_server, db)
        events = await asyncio.wait_for(consume(relay.url, 5), 30)
        status = json.dumps(relay.hosts["my"].status())
    users = [e for e in events if e.table == f"{db}.users"]
    assert [e.op.name for e in users] == ["INSERT", "INSERT", "UPDATE", "DELETE"]
    schema = users[0].schema
    assert schema is not None
    fields = {f["name"]: f for f in schema.row_schema["fields"]}
    assert "ssn" not in fields and "gone" not in fields
    assert fields["email"]["changebus.policy"] == "hmac-sha256"
    assert fields["uid"]["type"] == ["null", "string"]
    assert schema.key_schema["fields"] == [{"name": "uid", "type": "string"}]
    assert fields["bio"]["changebus.policy"] == "truncate:5"
    ins1, ins2, upd, dele = users
    assert ins1.after == {
        "uid": mac("18446744073709551615"),
        "email": mac("ann@example.com"),
        "bio": "xxxxx",
        "code": mac("42"),
        "photo": b"\x01\x02\x03",
        "n": 1,
    }
    assert ins1.key == {"uid": mac("18446744073709551615")}
    assert ins2.after == {"uid": mac("2"), "email": mac("ann@example.com"), "bio": None,
                          "code": None, "photo": None, "n": 2}  # fmt: skip
    assert upd.after is not None and upd.after["bio"] == "héllo"  # characters, not bytes
    assert upd.before is not None and upd.before["bio"] is None
    assert dele.before is not None and dele.before["uid"] == mac("2")
    assert "ssn" not in dele.before and "ssn" not in dele.before_not_sent
    plain = [e for e in events if e.table == f"{db}.plain"]
    assert plain and plain[0].after == {"id": 1, "ssn": "kept"}
    assert KEY not in caplog.text and KEY not in status
    if decode_workers:  # (how often rows events carried their layout: once per table)
        fetcher = json.loads(status)["fetcher"]
        assert 2 <= fetcher["worker_layouts_sent"] <= 3  # (users, plain, the marker table)
        assert fetcher["worker_layout_misses"] == 0
    assert caplog.text.count(f"{db}.users.gone") == 1


def test_config_errors() -> None:
    for options, message in [
        ({"column_policy": {"d.t": {"c": "hash"}}}, r"'d\.t'.*'c'.*no key"),
        ({"column_policy": {"d.t": {"c": "truncate:-1"}}}, r"positive length"),
        ({"column_policy": {"d.t": {"c": "redact"}}}, r"unknown policy"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config_dict(MySQLConfig, options, "fetcher")
    cfg = load_config_dict(
        MySQLConfig, {"column_hash_key": KEY, "column_policy": {"d.t": {"c": "hash"}}}, "fetcher"
    )
    assert KEY not in repr(cfg)


def test_decoder_and_transcoder_agree_under_a_policy(
    mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    """With a policy, the generated decoder (+ fastavro) and transcoder write the same bytes."""
    from pymysqlreplication import BinLogStreamReader
    from pymysqlreplication.row_event import (
        DeleteRowsEvent,
        TableMapEvent,
        UpdateRowsEvent,
        WriteRowsEvent,
    )

    from changebus.fetchers import ColumnPolicy
    from changebus.fetchers.mysql import (
        compile_decoder,
        compile_transcoder,
        layout_from_table_map,
    )
    from changebus.schemas import RowEncoder, SchemaRegistry

    db = mysql_db
    rules = ColumnPolicy.parse(policy(db), KEY)
    start = master_scn(mysql_server)
    execute(
        mysql_server,
        db,
        "CREATE TABLE users (uid bigint unsigned NOT NULL PRIMARY KEY, email varchar(100), "
        "ssn varchar(20), bio text, code bigint, photo varbinary(10), n int)",
        "INSERT INTO users VALUES (1, 'ann@example.com', 'x', 'long text', 42, x'01020304', 1), "
        "(2, NULL, NULL, NULL, NULL, NULL, NULL)",
        "UPDATE users SET n = 5, email = 'bob@example.com'",
        "DELETE FROM users WHERE uid = 2",
    )
    number, pos = start >> 32, start & 0xFFFFFFFF
    reader = BinLogStreamReader(
        connection_settings={"host": "127.0.0.1", "port": mysql_server.port, "user": "root"},
        server_id=4712,
        blocking=False,
        resume_stream=True,
        log_file=f"mysql-bin.{number:06d}",
        log_pos=pos,
        only_events=[TableMapEvent, WriteRowsEvent, UpdateRowsEvent, DeleteRowsEvent],
        only_schemas=[db],
        pymysql_wrapper=_connect,
    )
    checked = 0
    try:
        table: Any = None
        for event in reader:
            if isinstance(event, TableMapEvent):
                layout = layout_from_table_map(event, {}).with_policy(rules)
                assert layout.plan is not None
                encoder = RowEncoder(
                    SchemaRegistry().register(layout.table_schema()), source_id=1, partition=1
                )
                table = (compile_decoder(layout), compile_transcoder(layout))
                continue
            decode, transcode = table
            packet = event.packet.packet
            raw, lo, hi = packet._data, packet._position, len(packet._data) - 4
            decoded, coded = decode(raw, lo, hi, 1), transcode(raw, lo, hi)
            for row, _ in decoded:
                assert "ssn" not in row and row["uid"] in (mac("1"), mac("2"))
            old: list[tuple[Any, ...]]
            new: list[tuple[Any, ...]]
            if isinstance(event, UpdateRowsEvent):
                old = [
                    (2, a, b, ans or (), bns or ())
                    for (b, bns), (a, ans) in zip(decoded[0::2], decoded[1::2], strict=True)
                ]
                new = [
                    (2, ak, a, b, ans or (), bns or ())
                    for (_, b, bns), (ak, a, ans) in zip(coded[0::2], coded[1::2], strict=True)
                ]
            elif isinstance(event, DeleteRowsEvent):
                old = [(3, None, r, (), ns or ()) for r, ns in decoded]
                new = [(3, k, None, r, (), ns or ()) for k, r, ns in coded]
            else:
                old = [(1, r, None, ns or (), ()) for r, ns in decoded]
                new = [(1, k, r, None, ns or (), ()) for k, r, ns in coded]
            assert encoder.encode_many_encoded(new, 7, 9) == encoder.encode_many(old, 7, 9)
            checked += len(old)
    finally:
        reader.close()
    assert checked == 2 + 2 + 1
