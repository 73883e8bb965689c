"""Postgres seeds read exactly the table the stream names, whatever the source's settings.

Found by review, each read a different set of rows than the table's own, with
no error:

* a schema or table name with a dot: the stream names tables ``schema.table``
  unescaped, the seed split at the first dot, found nothing, and took the
  table for dropped (recorded as seeded, none of its rows read);
* a table with inheritance children: ``SELECT ... FROM parent`` read the
  children's rows too (the stream carries them under their own names), and
  their keys, shared with the parent's, made keyset chunks skip rows;
* ``extra_float_digits = 0`` set on the database: a float key printed short
  was the next chunk's cursor, and the row at the shortened value was skipped;
* row-level security: a seed user the policies apply to read a subset, and
  the sweep would take the other rows for deleted. It now fails loudly.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from boot_e2e import relay_config
from snap_pg_support import RecordingSink, relay_request

from changebus.bootstrap import SeedProgress, seed_postgres
from changebus.relay import Relay
from changebus.schemas import ChangebusError
from fix_pg import caught_up
from waiting import wait_until

pytestmark = [pytest.mark.pg, pytest.mark.usefixtures("no_blocking")]


def _rows(dsn: str, sql: str) -> set[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        conn.execute("SET extra_float_digits = 3")  # (floats in full here too)
        return {tuple(r) for r in conn.execute(sql).fetchall()}


async def _seed(relay: Relay, dsn: str, table: str, chunk_rows: int) -> RecordingSink:
    sink = RecordingSink()
    await asyncio.to_thread(
        seed_postgres,
        relay_request(relay, dsn, table, chunk_rows=chunk_rows),
        lambda *_: None,
        SeedProgress(),
        sink=sink,
    )
    return sink


async def test_dotted_names_inherited_tables_and_short_float_keys(
    tmp_path: Path, pg_dsn: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute('CREATE SCHEMA "a.b"')
        conn.execute('CREATE TABLE "a.b".t (id int8 PRIMARY KEY, v text)')
        conn.execute("""INSERT INTO "a.b".t SELECT g, 'v' || g FROM generate_series(1, 50) g""")
        conn.execute("CREATE TABLE par (id int8 PRIMARY KEY, v text)")
        conn.execute("CREATE TABLE kid () INHERITS (par)")
        conn.execute("INSERT INTO par SELECT g, 'p' FROM generate_series(1, 40) g")
        conn.execute("INSERT INTO kid SELECT g, 'k' FROM generate_series(1, 60) g")
        conn.execute("CREATE TABLE fl (k float8 PRIMARY KEY, v text)")
        conn.execute(
            "INSERT INTO fl VALUES (0.1::float8 + 0.2::float8, 'a'), (0.3, 'b'), "
            "(0.29999999999999993, 'c'), (1.0::float8 / 3, 'd'), (2, 'e')"
        )
        db = conn.execute("SELECT current_database()").fetchone()
        assert db is not None
        conn.execute(f'ALTER DATABASE "{db[0]}" SET extra_float_digits = 0')
    async with Relay(relay_config(tmp_path, pg_dsn)) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute('UPDATE "a.b".t SET v = v WHERE id = 1')
            conn.execute("UPDATE ONLY par SET v = v WHERE id = 1")
            conn.execute("UPDATE fl SET v = v WHERE k = 2")
        await caught_up(relay, pg_dsn)
        dotted = await _seed(relay, pg_dsn, "a.b.t", 7)
        parent = await _seed(relay, pg_dsn, "public.par", 3)
        floats = await _seed(relay, pg_dsn, "public.fl", 1)
        got_dotted = dotted.rows(relay, "a.b.t", ["id", "v"])
        got_parent = parent.rows(relay, "public.par", ["id", "v"])
        got_floats = floats.rows(relay, "public.fl", ["k", "v"])
    assert dotted.finished and len(dotted.chunks) >= 7
    assert got_dotted == _rows(pg_dsn, 'SELECT id, v FROM "a.b".t')
    assert got_parent == _rows(pg_dsn, "SELECT id, v FROM ONLY par")
    want = _rows(pg_dsn, "SELECT k, v FROM fl")
    assert len(want) == 5
    assert got_floats == want


async def test_a_seed_user_row_level_security_applies_to_fails_loudly(
    tmp_path: Path, pg_dsn: str
) -> None:
    role = f"seeder_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE rls (id int8 PRIMARY KEY, v text)")
        conn.execute("INSERT INTO rls SELECT g, 'v' FROM generate_series(1, 40) g")
        conn.execute("ALTER TABLE rls ENABLE ROW LEVEL SECURITY")
        conn.execute("CREATE POLICY evens ON rls FOR SELECT USING (id % 2 = 0)")
        conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute(f"GRANT SELECT ON rls TO {role}")
    seed_dsn = pg_dsn.replace("user=postgres", f"user={role}")
    try:
        async with Relay(relay_config(tmp_path, pg_dsn)) as relay:
            await wait_until(lambda: relay.hosts["pg"].state == "streaming")
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute("UPDATE rls SET v = v WHERE id = 2")
            await caught_up(relay, pg_dsn)
            with pytest.raises(ChangebusError, match="row-level security"):
                await _seed(relay, seed_dsn, "public.rls", 5)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")
