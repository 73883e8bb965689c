"""The bootstrap seeders follow the fetcher's column policy: masked data never leaks
through a snapshot.

A seeded row is the very payload the fetcher wrote for the same row (excluded
columns absent, hashed and truncated ones as the fetcher wrote them), from
Postgres and from MariaDB; a seed without the fetcher's policy is refused,
naming the column; the ``[seed]`` table takes the policy options.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from pathlib import Path
from typing import Any

import psycopg
import pytest

from changebus.bootstrap import SeedConfig, SeedProgress, SeedRequest, seed_mysql, seed_postgres
from changebus.fetchers import ColumnPolicy
from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import (
    ChangeDecoder,
    ConfigError,
    Op,
    SourceConfigError,
    event_at,
    parse_stream,
    verify_event,
)
from fix_mysql import master_scn
from fix_pg import caught_up
from waiting import wait_until

KEY = "column-key-0123456789-abcdefghijklmnop"
ENV = "CB_TEST_COLUMN_KEY"
PART = "pg"  # the partition (fix_pg.caught_up looks at "pg"; the MySQL test uses it too)


def seed_user(server: EmbeddedMariaDB) -> str:
    """A read-only user with a password for the MySQL seed."""
    conn = server.connect("mysql")
    try:
        with conn.cursor() as cur:
            cur.execute(
                "CREATE USER IF NOT EXISTS 'colseeder'@'127.0.0.1' IDENTIFIED BY 'colpw-123'"
            )
            cur.execute("GRANT SELECT, BINLOG MONITOR ON *.* TO 'colseeder'@'127.0.0.1'")
    finally:
        conn.close()
    return f"mysql://colseeder:colpw-123@127.0.0.1:{server.port}"


def marker(server: EmbeddedMariaDB, db: str) -> int:
    """An SCN at or after every change committed so far (a captured marker change)."""
    conn = server.connect(db)
    try:
        with conn.cursor() as cur:
            cur.execute("CREATE TABLE IF NOT EXISTS marker (id int PRIMARY KEY, n bigint)")
            cur.execute("INSERT INTO marker VALUES (1, 1) ON DUPLICATE KEY UPDATE n = n + 1")
    finally:
        conn.close()
    return int(master_scn(server))


def mac(value: str) -> str:
    return hmac.new(KEY.encode(), value.encode(), hashlib.sha256).hexdigest()


def policy(source: str) -> dict[str, Any]:
    return {
        source: {
            "email": "hash",
            "ssn": "exclude",
            "bio": "truncate:4",
            "code": "hash",
            "id": "hash",
        }
    }


def relay_config(tmp: Path, kind: str, options: dict[str, Any]) -> RelayConfig:
    return RelayConfig(
        data_dir=tmp / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(PART, 1, capacity_bytes=8 << 20, fetcher=FetcherConfig(kind, options)),
        ),
        flush_interval_s=0,
    )


def streamed_inserts(relay: Relay, table: str) -> set[bytes]:
    host = relay.hosts[PART]
    sel = host.buffer.select(-1, -1, 1 << 30)
    assert sel is not None
    data = b"".join(bytes(v) for v in sel.views)
    assert host.buffer.release(sel)
    out = set()
    for off in parse_stream(data)[0].tolist():
        h = verify_event(data, off)
        if h.op == Op.INSERT and host.registry.name_for_id(h.source_id) == table:
            out.add(bytes(event_at(data, off, h)[1]))
    return out


def request(relay: Relay, dsn: str, table: str, rules: ColumnPolicy | None) -> SeedRequest:
    host = relay.hosts[PART]
    registry = host.registry
    schemas = tuple((registry.source_id(table), s) for s in registry.versions(table))
    return SeedRequest(
        dsn,
        1,
        (table,),
        schemas=schemas,
        relay_fetcher=host.status()["fetcher"],
        column_policy=rules,
    )


def check_seeded(seeded: list[bytes], streamed: set[bytes], relay: Relay, table: str) -> None:
    assert len(seeded) == 3
    decoder = ChangeDecoder(relay.hosts[PART].registry.latest(table))
    for event in seeded:
        payload = bytes(event_at(event, 0, verify_event(event, 0))[1])
        change = decoder.decode(payload)
        assert change.after is not None and "ssn" not in change.after
        assert change.after["email"] in (mac("ann@example.com"), mac("bob@example.com"), None)
        assert payload in streamed, change  # the very bytes the fetcher wrote


@pytest.mark.pg
async def test_a_postgres_seed_follows_the_policy(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, KEY)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE users (id int8 PRIMARY KEY, email text, ssn text, bio text, code int8)"
        )
    options = {
        "dsn": pg_dsn,
        "status_interval_s": 0.2,
        "column_policy": policy("public.users"),
        "column_hash_key_env": ENV,
    }
    cfg = relay_config(tmp_path, "postgres", options)
    # the same policy through a [seed] table with a shared file
    shared = tmp_path / "columns.toml"
    shared.write_text(
        '["public.users"]\nemail = "hash"\nssn = "exclude"\nbio = "truncate:4"\n'
        'code = "hash"\nid = "hash"\n'
    )
    seed_cfg = SeedConfig(dsn=pg_dsn, column_policy_file=str(shared), column_hash_key_env=ENV)
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts[PART].state == "streaming")
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO users VALUES (1, 'ann@example.com', '123', 'long text', 42), "
                "(2, 'ann@example.com', NULL, NULL, NULL), (3, 'bob@example.com', 'x', 'ab', 7)"
            )
        await caught_up(relay, pg_dsn)
        streamed = streamed_inserts(relay, "public.users")
        seeded: list[bytes] = []
        req = request(relay, pg_dsn, "public.users", seed_cfg.column_rules())
        await asyncio.to_thread(
            seed_postgres, req, lambda _t, ev, _s: seeded.extend(ev), SeedProgress()
        )
        check_seeded(seeded, streamed, relay, "public.users")
        # without the fetcher's policy the seed is refused before a row is read
        for rules in (None, ColumnPolicy.parse({"public.users": {"email": "hash"}}, KEY)):
            with pytest.raises(SourceConfigError, match=r"public\.users\.\w+.*column_policy"):
                await asyncio.to_thread(
                    seed_postgres,
                    request(relay, pg_dsn, "public.users", rules),
                    lambda *_: pytest.fail("a row was written"),
                    SeedProgress(),
                )


@pytest.mark.mysql
async def test_a_mysql_seed_follows_the_policy(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    server, db = mysql_server, mysql_db
    table = f"{db}.users"
    conn = server.connect(db)
    try:
        with conn.cursor() as cur:
            cur.execute(
                "CREATE TABLE users (id bigint PRIMARY KEY, email varchar(50), ssn varchar(9), "
                "bio text, code bigint)"
            )
    finally:
        conn.close()
    options = server.options(databases=[db], column_policy=policy(table), column_hash_key=KEY)
    async with Relay(relay_config(tmp_path, "mysql", options)) as relay:
        await wait_until(lambda: relay.hosts[PART].state == "streaming")
        conn = server.connect(db)
        try:
            with conn.cursor() as cur:
                cur.execute(
                    "INSERT INTO users VALUES (1, 'ann@example.com', '123', 'long text', 42), "
                    "(2, 'ann@example.com', NULL, NULL, NULL), (3, 'bob@example.com', 'x', 'ab', 7)"
                )
        finally:
            conn.close()
        m = marker(server, db)
        await wait_until(lambda: relay.hosts[PART].buffer.meta.last_scn >= m)
        streamed = streamed_inserts(relay, table)
        dsn = seed_user(server)
        seeded: list[bytes] = []
        rules = ColumnPolicy.parse(policy(table), KEY)
        await asyncio.to_thread(
            seed_mysql,
            request(relay, dsn, table, rules),
            lambda _t, ev, _s: seeded.extend(ev),
            SeedProgress(),
        )
        check_seeded(seeded, streamed, relay, table)
        with pytest.raises(SourceConfigError, match=rf"{db}\.users\.\w+.*column_policy"):
            await asyncio.to_thread(
                seed_mysql,
                request(relay, dsn, table, None),
                lambda *_: pytest.fail("a row was written"),
                SeedProgress(),
            )


def test_seed_config_checks_the_policy(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'public\.t'.*'c'.*no key"):
        SeedConfig(dsn="host=x", column_policy={"public.t": {"c": "hash"}})
    with pytest.raises(ConfigError, match="column_policy_file"):
        SeedConfig(dsn="host=x", column_policy_file=str(tmp_path / "missing.toml"))
    (tmp_path / "bad.toml").write_text("[x\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        SeedConfig(dsn="host=x", column_policy_file=str(tmp_path / "bad.toml"))
    cfg = SeedConfig(dsn="host=x", column_policy={"public.t": {"c": "hash"}}, column_hash_key=KEY)
    assert KEY not in repr(cfg)
    assert cfg.column_rules().rules_for("public.t")["c"].label == "hmac-sha256"
