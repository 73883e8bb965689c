"""Regressions found by the chaos harness (bench/chaos.py), client side.

* A Postgres replica whose target database restarted kept its dead connection: every
  window after it failed on it ("the connection is lost"), was rolled back, retried on
  the same connection, and after ``max_rollbacks`` the replica gave up (``changebus
  replicate`` exited with status 3). Now a lost connection is replaced before the
  next use and the window that failed is applied again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from changebus.client import ConsumerConfig, PostgresReplica

pytestmark = pytest.mark.pg


def _terminate_others(dsn: str) -> int:
    """End every other session of the database (what a restart does to its clients)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchall()
    return len(rows)


async def test_a_postgres_replica_reconnects_after_its_database_dropped_it(
    make_relay: Any, pg_dsn: str
) -> None:
    windows = 200
    last = 1000 + windows - 1
    async with make_relay(max_windows=windows, windows_per_s=40, wait=False) as relay:
        replica = PostgresReplica(pg_dsn)
        cfg = ConsumerConfig(
            relays=(relay.url,),
            partition="syn",
            wait_s=0.5,
            backoff_initial_s=0.01,
            max_rollbacks=3,  # fewer than the windows that come while the connection is dead
        )

        def at(scn: int) -> bool:
            stored = replica.checkpoint
            return stored is not None and stored.get("syn").window_scn >= scn

        run = asyncio.create_task(replica.run(cfg))
        try:
            for _ in range(400):
                if at(1040) or run.done():
                    break
                await asyncio.sleep(0.05)
            assert at(1040), "the replica did not start"
            assert await asyncio.to_thread(_terminate_others, pg_dsn) >= 1
            for _ in range(600):
                if at(last) or run.done():
                    break
                await asyncio.sleep(0.05)
            assert not run.done(), run.exception()
            assert at(last)
            rows = await asyncio.to_thread(
                replica.query, "SELECT count(*) FROM changebus_checkpoints"
            )
            assert rows == [(1,)]
        finally:
            replica.stop()
            await asyncio.wait_for(asyncio.shield(run), 30)
            await replica.close()
