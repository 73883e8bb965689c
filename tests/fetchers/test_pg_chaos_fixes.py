"""Regressions found by the chaos harness (bench/chaos.py), Postgres fetcher.

* A half-open connection between the relay and Postgres (a network that forwards
  nothing and resets nothing; here a fault proxy) stalled the partition for good:
  the stream thread waited on the replication socket -- or in a catalog query of its
  heartbeat or slot statistics -- for an answer that never came, and nothing noticed.
  Now the fetcher asks the server for a reply after a third of ``receive_timeout_s``
  of silence and, when even that goes unanswered for ``receive_timeout_s``, cuts its
  connections: the relay starts it again and streams on.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import psycopg
import pytest

from _chaos_proxy import FaultProxy
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import ConfigError, lsn_to_scn
from changebus.schemas.config import load_config_dict
from waiting import wait_until

pytestmark = [pytest.mark.pg, pytest.mark.usefixtures("no_blocking")]


def _marker(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_logical_emit_message(false, 'sync', 'x')::text").fetchone()
    assert row is not None
    return lsn_to_scn(row[0])


async def test_a_half_open_connection_to_postgres_is_cut_and_the_stream_goes_on(
    tmp_path: Path, pg_dsn: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    port = int(str(psycopg.conninfo.conninfo_to_dict(pg_dsn)["port"]))
    proxy = FaultProxy("pg", "127.0.0.1", port)
    await proxy.start()
    try:
        dsn = psycopg.conninfo.make_conninfo(pg_dsn, port=proxy.port, connect_timeout=3)
        options = {"dsn": dsn, "status_interval_s": 0.2, "receive_timeout_s": 2.0}
        cfg = RelayConfig(
            data_dir=tmp_path / "relay",
            http=HttpConfig(port=0),
            partitions=(
                PartitionConfig(
                    "pg",
                    1,
                    capacity_bytes=1 << 20,
                    fetcher=FetcherConfig("postgres", options, retry_initial_s=0.1),
                ),
            ),
            flush_interval_s=0,
        )
        async with Relay(cfg) as relay:
            host = relay.hosts["pg"]
            await wait_until(lambda: host.state == "streaming", 30, "the relay")
            m = _marker(pg_dsn)
            await wait_until(lambda: host.buffer.meta.last_scn >= m, 30, "the first marker")
            # idle but healthy: the server answers the keepalive requests, nothing is cut
            await asyncio.sleep(4)  # twice the receive timeout
            assert host.stats["fetcher_restarts"] == 0
            proxy.half_open()
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute("INSERT INTO t VALUES (1)")
            m = _marker(pg_dsn)
            await asyncio.sleep(1)
            proxy.heal()  # new connections pass; the stuck ones stay stuck
            await wait_until(lambda: host.buffer.meta.last_scn >= m, 30, "the stream going on")
            assert host.stats["fetcher_restarts"] >= 1
    finally:
        await proxy.close()


def test_receive_timeout_is_checked() -> None:
    from changebus.fetchers.postgres import PostgresConfig

    assert load_config_dict(PostgresConfig, {"dsn": "x"}, "f").receive_timeout_s == 30.0
    with pytest.raises(ConfigError, match="receive_timeout_s"):
        load_config_dict(PostgresConfig, {"dsn": "x", "receive_timeout_s": -1}, "f")
