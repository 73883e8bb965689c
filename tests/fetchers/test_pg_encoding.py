"""A source database not in UTF-8: text arrives as UTF-8 all the same.

The walsender and the SQL interface convert text to the connection's
``client_encoding``, which followed the database's (LATIN1 here): every decoder
reads UTF-8, so a LATIN1 ``é`` stopped the partition with a non-retriable
"cannot decode" error, and LATIN1 bytes that happen to be valid UTF-8 would
have passed as other characters (review).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from test_pg_fetcher import replay_buffer
from test_pg_fetcher_ops import config

from changebus.relay import Relay
from fix_pg import PgServer, caught_up, fresh_database, wait_until

pytestmark = pytest.mark.pg


@pytest.fixture
def latin1_dsn(pg_server: PgServer) -> Iterator[str]:
    options = "ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"
    with fresh_database(pg_server, options, "l_") as dsn:
        yield dsn


@pytest.mark.parametrize("mode", ["stream", "sql"])
async def test_a_latin1_database_streams_its_text_as_utf8(
    tmp_path: Path, latin1_dsn: str, mode: str
) -> None:
    with psycopg.connect(latin1_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE acct (id int8 PRIMARY KEY, bal int8, name text)")
    async with Relay(config(tmp_path, latin1_dsn, mode=mode, sql_poll_interval_s=0.02)) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        with psycopg.connect(latin1_dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO acct VALUES (1, 10, 'café'), (2, 20, 'Ãx ñ ÿ')")
        await caught_up(relay, latin1_dsn)
        assert relay.hosts["pg"].state == "streaming", relay.hosts["pg"].last_error
        rows, _ = await asyncio.to_thread(replay_buffer, relay)
    assert {k: v["name"] for k, v in rows.items()} == {1: "café", 2: "Ãx ñ ÿ"}
