"""A new leader ends the deposed leader's walsender on the slot, and only while it leads.

The term was checked before the connect (up to 5 s); a leader paused or cut off in
between (its term lost) then ended its successor's walsender (found by review).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import psycopg
import pytest

from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.relay._slotholder import terminate_slot_holder
from fix_pg import wait_until

pytestmark = pytest.mark.usefixtures("no_blocking")


def _holder(dsn: str) -> int | None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = 'changebus'"
        ).fetchone()
    return None if row is None or row[0] is None else int(row[0])


async def test_the_slot_holder_is_ended_only_while_the_term_holds(
    tmp_path: Path, pg_dsn: str
) -> None:
    cfg = RelayConfig(
        data_dir=tmp_path / "relay",
        http=HttpConfig(port=0),
        partitions=(PartitionConfig("pg", 1, fetcher=FetcherConfig("postgres", {"dsn": pg_dsn})),),
    )
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        holder = None
        for _ in range(200):  # the walsender takes the slot once the stream starts
            holder = await asyncio.to_thread(_holder, pg_dsn)
            if holder is not None:
                break
            await asyncio.sleep(0.05)
        assert holder is not None
        # the term was lost meanwhile: the walsender (here: a successor's) stays
        ended = await asyncio.to_thread(terminate_slot_holder, pg_dsn, "changebus", lambda: False)
        assert ended is None and await asyncio.to_thread(_holder, pg_dsn) == holder
        ended = await asyncio.to_thread(terminate_slot_holder, pg_dsn, "changebus", lambda: True)
        assert ended == holder
