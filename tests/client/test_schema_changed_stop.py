"""A row newer than the reader's schema, with ``refuse_newer_writers``: the consumer stops
with the retriable :class:`SchemaChangedError`, at once (review).

The error is retriable for the application (start again with the new
schema), and the relay stream took it for a relay's failure: it switched
relays, backed off and fetched the same window again, for ever (or, with
``max_attempts``, ended with "no relay answered", the real error only its
cause).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import psycopg
import pytest
from test_e2e_pg import pg_relay

from changebus.client import Consumer, ConsumerConfig
from changebus.schemas import SchemaChangedError
from fix_pg import wait_until

pytestmark = pytest.mark.pg


async def test_a_newer_writer_stops_the_consumer_with_schema_changed(
    tmp_path: Path, pg_dsn: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, a text)")
    async with pg_relay(tmp_path, pg_dsn, 0) as relay:
        host = relay.hosts["pg"]
        await wait_until(lambda: host.state == "streaming")
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO t VALUES (1, 'one')")
        await wait_until(lambda: host.registry.has("public.t"))
        v1 = host.registry.latest("public.t")
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("ALTER TABLE t ADD COLUMN b int")
            conn.execute("INSERT INTO t VALUES (2, 'two', 2)")
        await wait_until(lambda: host.registry.latest("public.t").version > v1.version)
        consumer = Consumer(
            ConsumerConfig(
                relays=(relay.url, relay.url + "/"),  # (two relays: the failover had one more)
                partition="pg",
                reader_schemas={"public.t": v1},
                refuse_newer_writers=True,
            )
        )
        await consumer.start()
        try:
            seen: list[int] = []

            async def read() -> None:
                async with asyncio.timeout(20):
                    async for window in consumer:
                        seen.extend(e.key["id"] for e in window.events if e.table == "public.t")

            with pytest.raises(SchemaChangedError, match="newer than the reader's") as info:
                await read()
            assert info.value.retriable
            assert seen == [1]  # the row of the old shape came, the newer one did not
        finally:
            await consumer.close()
