"""Declared types of tables the relay's registry does not know, after a restart.

A restarted MariaDB fetcher resumes at the relay's last window. The declared
types (uuid, inet6 and json share binary representations with other types) of
tables the relay has sent no row of come from information_schema, read at the
restart: they already hold the DDL written while the relay was down. The
stream then read that DDL and applied it a second time: swapping renames gave a
uuid column the type of an int one, and its values came as raw bytes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from test_mysql_fetcher import caught_up, execute, relay_config, replay, wait_until

from changebus.fetchers.mysql import DeclaredTypes, EmbeddedMariaDB
from changebus.relay import Relay

UID = "6ccd780c-baba-1026-9564-5b8c656024db"


async def test_ddl_before_the_restart_is_not_applied_twice_to_a_table_seen_first_after_it(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    execute(
        mysql_server,
        mysql_db,
        "CREATE TABLE known (id int PRIMARY KEY)",
        "CREATE TABLE b (id int PRIMARY KEY, u uuid, n int)",
    )
    cfg = relay_config(tmp_path, mysql_server, mysql_db)
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        execute(mysql_server, mysql_db, "INSERT INTO known VALUES (1)")
        await caught_up(relay, mysql_server, mysql_db)
    # while the relay is down: b's columns swap names (b has no row in the relay)
    execute(mysql_server, mysql_db, "ALTER TABLE b RENAME COLUMN u TO w, RENAME COLUMN n TO u")
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        execute(mysql_server, mysql_db, f"INSERT INTO b (id, w, u) VALUES (1, '{UID}', 7)")
        await caught_up(relay, mysql_server, mysql_db)
        types = [
            {c.name: c.source_type for c in t.columns}
            for t in relay.hosts["my"].registry.versions(f"{mysql_db}.b")
        ]
        rows, _, _ = replay(relay, "b")
    assert len(types) == 1 and "uuid" in types[0]["w"] and "int" in types[0]["u"], types
    assert str(rows[1]["w"]) == UID and rows[1]["u"] == 7


async def test_ddl_after_a_tables_last_row_survives_a_restart_past_it(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    """The registry's newest version of a table is that of its last row change. Seeded
    from it, a restarted fetcher lost the DDL after that row which it does not read
    again (the relay's position had passed it): a uuid column added then came as
    binary(16), for good (found by review). information_schema is read first now."""
    execute(mysql_server, mysql_db, "CREATE TABLE k (id int PRIMARY KEY)")
    cfg = relay_config(tmp_path, mysql_server, mysql_db)
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        execute(mysql_server, mysql_db, "INSERT INTO k VALUES (1)")
        await caught_up(relay, mysql_server, mysql_db)
        execute(mysql_server, mysql_db, "ALTER TABLE k ADD COLUMN u uuid")
        # the relay's position passes the ALTER (a quiet source's windows move it)
        await caught_up(relay, mysql_server, mysql_db)
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        execute(mysql_server, mysql_db, f"INSERT INTO k VALUES (2, '{UID}')")
        await caught_up(relay, mysql_server, mysql_db)
        newest = relay.hosts["my"].registry.latest(f"{mysql_db}.k")
        rows, _, _ = replay(relay, "k")
    assert "uuid" in {c.name: c.source_type for c in newest.columns}["u"], newest.columns
    assert str(rows[2]["u"]) == UID


def test_statements_up_to_a_table_s_valid_at_leave_it_as_it_is() -> None:
    declared = DeclaredTypes()
    declared.set("d", "t", {"w": "uuid", "u": "int"}, valid_at=100)
    declared.set("d", "k", {"a": "int"})
    swap = "ALTER TABLE t RENAME COLUMN u TO w, RENAME COLUMN n TO u"
    declared.apply(swap, "d", 90)  # in t's types already
    declared.apply("ALTER TABLE k ADD COLUMN j json", "d", 95)  # k's types are older: applied
    assert declared.get("d", "t") == {"w": "uuid", "u": "int"}
    assert declared.get("d", "k") == {"a": "int", "j": "json"}
    # a statement past valid_at applies, and from then on every one does
    declared.apply("ALTER TABLE t ADD COLUMN x inet6", "d", 101)
    declared.apply("ALTER TABLE t DROP COLUMN x", "d", 50)  # (an older SCN no longer freezes)
    assert declared.get("d", "t") == {"w": "uuid", "u": "int"}
    # a table dropped and created again before valid_at keeps the later types
    declared.set("d", "r", {"v": "inet6"}, valid_at=200)
    declared.apply("DROP TABLE r", "d", 150)
    declared.apply("CREATE TABLE r (v int)", "d", 160)
    assert declared.get("d", "r") == {"v": "inet6"}


def test_create_table_if_not_exists_of_a_known_table_changes_nothing() -> None:
    """The server logs CREATE TABLE IF NOT EXISTS even when the table was there (and left
    as it was): an idempotent schema script run at every boot, with an old column list,
    replaced the tracked types, and uuid/json columns came as bytes and text (review)."""
    types = DeclaredTypes()
    types.set("app", "t", {"id": "int", "u": "uuid", "js": "longtext /* json */"})
    effect = types.apply("CREATE TABLE IF NOT EXISTS t (id int PRIMARY KEY, u binary(16))", "app")
    assert effect.kind == "other"
    assert types.get("app", "t") == {"id": "int", "u": "uuid", "js": "longtext /* json */"}
    # a table not known yet is created as before; so is one without IF NOT EXISTS
    types.apply("CREATE TABLE IF NOT EXISTS n (id int PRIMARY KEY, u uuid)", "app")
    assert types.get("app", "n") == {"id": "int", "u": "uuid"}
    types.apply("CREATE OR REPLACE TABLE t (id int PRIMARY KEY)", "app")
    assert types.get("app", "t") == {"id": "int"}


async def test_a_reconnect_behind_a_pending_xa_transaction_applies_no_ddl_twice(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    """With an XA transaction prepared and not committed, a reconnect reads the binlog again
    from its PREPARE. A RENAME read before the reconnect, after the last window the relay
    took (its own window is an idle HEARTBEAT, not sent), was applied a second time: the
    table was no longer known under its old name, its declared types were lost, and the
    uuid column came as raw bytes under a new schema version (review)."""
    from test_mysql_fetcher_ops import kill_binlog_dumps

    execute(
        mysql_server,
        mysql_db,
        "CREATE TABLE t (id int PRIMARY KEY, u uuid)",
        "CREATE TABLE o (id int PRIMARY KEY)",
    )
    cfg = relay_config(tmp_path, mysql_server, mysql_db)
    async with Relay(cfg) as relay:
        host = relay.hosts["my"]
        await wait_until(lambda: host.state == "streaming")
        execute(
            mysql_server,
            mysql_db,
            "XA START 'cbx'",
            "INSERT INTO o VALUES (1)",
            "XA END 'cbx'",
            "XA PREPARE 'cbx'",
        )
        try:
            before = host.buffer.meta.last_scn
            execute(mysql_server, mysql_db, f"INSERT INTO t VALUES (1, '{UID}')")
            await wait_until(lambda: host.buffer.meta.last_scn > before)
            execute(mysql_server, mysql_db, "RENAME TABLE t TO t2")
            await asyncio.sleep(0.5)  # (read by the fetcher, no window sent)
            assert kill_binlog_dumps(mysql_server) >= 1
            execute(mysql_server, mysql_db, f"INSERT INTO t2 VALUES (2, '{UID}')")
        finally:
            execute(mysql_server, mysql_db, "XA COMMIT 'cbx'")
        await caught_up(relay, mysql_server, mysql_db)
        assert host.status()["fetcher"]["reconnects"] >= 1
        versions = host.registry.versions(f"{mysql_db}.t2")
        rows, _, _ = replay(relay, "t2")
    assert [{c.name: c.source_type for c in v.columns}["u"] for v in versions] == ["uuid"]
    assert str(rows[2]["u"]) == UID
