"""Schema announcements across a fetcher restart (Postgres and MariaDB).

A fetcher announces a table (one SCHEMA_CHANGE event) in the first window touching
it unless the relay it resumes already holds the table's schema (same source id,
name, version and columns: ``ResumePoint.schemas``). So a relay restarted, or a new
leader of a relay cluster re-reading windows from the source, writes them exactly as
before; a changed schema and a new table are still announced.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import psycopg
import pytest
from test_mysql_fetcher import caught_up as my_caught_up, execute, relay_config, replay

from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import Op, SchemaChange, decode_control, event_at, parse_stream, verify_event
from fix_pg import caught_up, wait_until


def pg_config(tmp: Path, dsn: str) -> RelayConfig:
    source = FetcherConfig("postgres", {"dsn": dsn, "status_interval_s": 0.2})
    return RelayConfig(
        data_dir=tmp / "relay",
        http=HttpConfig(port=0),
        partitions=(PartitionConfig("pg", 1, capacity_bytes=8 << 20, fetcher=source),),
        flush_interval_s=0,
    )


def control_events(relay: Relay, op: Op) -> list[tuple[int, Any]]:
    """(scn, payload) of every control event ``op`` in the relay's buffer."""
    buf = relay.hosts["pg"].buffer
    sel = buf.select(-1, -1, 1 << 30)
    if sel is None:
        return []
    data = b"".join(bytes(v) for v in sel.views)
    assert buf.release(sel)
    offsets, _ = parse_stream(data)
    out = []
    for off in offsets.tolist():
        h = verify_event(data, off)
        if h.op == op:
            out.append((h.scn, decode_control(op, event_at(data, off, h)[1])))
    return out


def pg_write(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for s in statements:
            conn.execute(s)


def announced(changes: list[tuple[int, Any]]) -> list[tuple[str, int, int]]:
    """(table, version, source id) of every SCHEMA_CHANGE, in stream order."""
    return [(p.source, p.version, p.source_id) for _scn, p in changes]


@pytest.mark.pg
async def test_pg_restart_does_not_announce_a_known_table_again(
    tmp_path: Path, pg_dsn: str
) -> None:
    pg_write(pg_dsn, "CREATE TABLE acct (id int8 PRIMARY KEY, bal int8)")
    cfg = pg_config(tmp_path, pg_dsn)
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        pg_write(pg_dsn, "INSERT INTO acct VALUES (1, 10)", "INSERT INTO acct VALUES (2, 20)")
        await caught_up(relay, pg_dsn)
        first = announced(control_events(relay, Op.SCHEMA_CHANGE))
    assert first == [("public.acct", 1, first[0][2])]
    sid = first[0][2]
    for restart in range(2):  # a new stream session each time, the same schema
        async with Relay(cfg) as relay:
            await wait_until(lambda r=relay: r.hosts["pg"].state == "streaming")
            pg_write(pg_dsn, f"INSERT INTO acct VALUES ({10 + restart}, 1)")
            await caught_up(relay, pg_dsn)
            assert announced(control_events(relay, Op.SCHEMA_CHANGE)) == first
    # a changed schema and a new table are announced, once each
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        pg_write(
            pg_dsn,
            "ALTER TABLE acct ADD COLUMN note text",
            "INSERT INTO acct VALUES (20, 1, 'x')",
            "CREATE TABLE other (id int PRIMARY KEY)",
            "INSERT INTO other VALUES (1)",
            "INSERT INTO acct VALUES (21, 1, 'y')",
        )
        await caught_up(relay, pg_dsn)
        changes = announced(control_events(relay, Op.SCHEMA_CHANGE))
    assert changes[:2] == [*first, ("public.acct", 2, sid)]
    assert [(t, v) for t, v, _ in changes[2:]] == [("public.other", 1)]


@pytest.mark.mysql
async def test_mysql_restart_does_not_announce_a_known_table_again(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    execute(mysql_server, mysql_db, "CREATE TABLE acct (id int PRIMARY KEY, bal int NOT NULL)")
    cfg = relay_config(tmp_path, mysql_server, mysql_db)

    def versions(relay: Relay) -> list[tuple[str, int]]:
        _rows, _scns, events = replay(relay, "acct")
        return [
            (p.source.rpartition(".")[2], p.version)
            for op, p in events
            if op == Op.SCHEMA_CHANGE and isinstance(p, SchemaChange)
        ]

    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        await asyncio.to_thread(execute, mysql_server, mysql_db, "INSERT INTO acct VALUES (1, 1)")
        await my_caught_up(relay, mysql_server, mysql_db)
        first = versions(relay)
    assert first == [("acct", 1), ("marker", 1)]
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        await asyncio.to_thread(execute, mysql_server, mysql_db, "INSERT INTO acct VALUES (2, 2)")
        await my_caught_up(relay, mysql_server, mysql_db)
        assert versions(relay) == first
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        await asyncio.to_thread(
            execute,
            mysql_server,
            mysql_db,
            "ALTER TABLE acct ADD COLUMN note varchar(10) NULL",
            "INSERT INTO acct VALUES (3, 3, 'x')",
            "CREATE TABLE other (id int PRIMARY KEY)",
            "INSERT INTO other VALUES (1)",
        )
        await my_caught_up(relay, mysql_server, mysql_db)
        assert versions(relay) == [*first, ("acct", 2), ("other", 1)]
