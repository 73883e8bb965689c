"""A relay that takes the slot over with an empty buffer checks the slot against it.

A cluster follower's buffer can be empty and complete after the upstream's
``prev_scn`` P (a new member, or one restarted after its upstream evicted
what it lacked). It used to know only P, not where window P ends in the WAL,
so when it became leader the Postgres fetcher started from wherever the slot
was confirmed: a slot confirmed past P (the old leader had acknowledged more
while this member was away) skipped the transactions in between without a
DATA_LOSS window (found by review). The buffer now keeps the position at the
end of window P (its upstream says it: ``prev_position``), so the slot is
checked as for a buffer with windows.
"""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
from test_pg_fetcher import replay_buffer, source, workload
from test_pg_fetcher_ops import control_events

from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import (
    Op,
    lsn_to_scn,
    scn_to_lsn,
)
from fix_pg import caught_up, wait_until

pytestmark = pytest.mark.pg


def _config(data_dir: Path, fetcher: FetcherConfig) -> RelayConfig:
    return RelayConfig(
        data_dir=data_dir,
        http=HttpConfig(port=0),
        partitions=(PartitionConfig("pg", 1, capacity_bytes=8 << 20, fetcher=fetcher),),
        flush_interval_s=0,
    )


def _postgres(dsn: str) -> FetcherConfig:
    return FetcherConfig("postgres", {"dsn": dsn, "status_interval_s": 0.2})


def _confirmed(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots"
            " WHERE slot_name = 'changebus'"
        ).fetchone()
    assert row is not None
    return lsn_to_scn(row[0])


async def _take_over(data_dir: Path, dsn: str, after: int, position: str) -> Relay:
    """A relay with no source and an empty buffer complete after ``after`` (as a
    follower restarted at its upstream's ``prev_scn``) that then leads: its
    fetcher becomes the Postgres one (``switch_fetcher``, as an elected member's)."""
    relay = Relay(_config(data_dir, FetcherConfig()))
    await relay.start()
    host = relay.hosts["pg"]
    host.buffer.set_start(after, evicted=True, position=position)
    assert host.buffer.last_source_position == position
    await host.switch_fetcher(_postgres(dsn))
    await wait_until(lambda: host.state == "streaming")
    return relay


async def test_an_empty_buffer_taking_the_slot_over_sees_a_slot_confirmed_past_it(
    tmp_path: Path, pg_dsn: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE acct (id int8 PRIMARY KEY, bal int8, name text)")
    async with Relay(_config(tmp_path / "old-leader", _postgres(pg_dsn))) as leader:
        await wait_until(lambda: leader.hosts["pg"].state == "streaming")
        workload(pg_dsn, 1, 20)
        await caught_up(leader, pg_dsn)
        at = leader.hosts["pg"].buffer.meta.last_scn
        position = leader.hosts["pg"].buffer.last_source_position
        # the old leader acknowledges its last window: the slot then ends where it does
        await wait_until(lambda: _confirmed(pg_dsn) == lsn_to_scn(position))
    assert lsn_to_scn(position) > at
    state_at = source(pg_dsn)

    # 1. the slot where the buffer says it is complete: no gap, nothing lost or doubled
    relay = await _take_over(tmp_path / "member-a", pg_dsn, at, position)
    try:
        workload(pg_dsn, 2, 20)
        await caught_up(relay, pg_dsn)
        rows, scns = replay_buffer(relay, dict(state_at))
        assert control_events(relay, Op.DATA_LOSS) == []
        assert scns == sorted(set(scns)) and scns[0] > at
        assert rows == source(pg_dsn)  # the state at P plus what came after: the source
        stale = relay.hosts["pg"].buffer.meta.last_scn
        end = lsn_to_scn(relay.hosts["pg"].buffer.last_source_position)
        await wait_until(lambda: _confirmed(pg_dsn) == end)
    finally:
        await relay.stop()

    # 2. the slot confirmed past the buffer's end (here by member a; in a cluster by
    # the old leader while this member was away): one DATA_LOSS window, then on
    relay = await _take_over(tmp_path / "member-b", pg_dsn, at, position)
    try:
        workload(pg_dsn, 3, 10)
        await caught_up(relay, pg_dsn)
        _, scns = replay_buffer(relay)
        losses = [loss for _, loss in control_events(relay, Op.DATA_LOSS)]
        assert len(losses) == 1
        assert losses[0].from_scn == at + 1 and losses[0].to_scn >= stale
        assert "confirmed beyond" in losses[0].reason
        assert scns[0] == losses[0].to_scn and scns == sorted(set(scns)) and len(scns) > 1
    finally:
        await relay.stop()


async def test_a_new_relay_keeps_where_its_slot_started(tmp_path: Path, pg_dsn: str) -> None:
    """A relay started on a slot with nothing buffered yet is complete after one
    before the slot's confirmed position C, and keeps C: restarted before its first
    window, it resumes from C and checks the slot against it (review). Before, it
    kept the SCN C alone: a commit starting exactly at C was dropped as held, and a
    slot moved meanwhile (another reader, an operator's advance) went unseen."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE acct (id int8 PRIMARY KEY, bal int8, name text)")
    cfg = _config(tmp_path / "relay", _postgres(pg_dsn))
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        meta = relay.hosts["pg"].buffer.meta
        start = _confirmed(pg_dsn)
        assert (meta.prev_scn, meta.last_scn, meta.evicted) == (start - 1, start - 1, 0)
        assert relay.hosts["pg"].buffer.last_source_position == scn_to_lsn(start)
    # the slot moves on while the relay is down and holds no window
    workload(pg_dsn, 4, 10)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_replication_slot_advance('changebus', pg_current_wal_lsn())")
    moved = _confirmed(pg_dsn)
    assert moved > start
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        workload(pg_dsn, 5, 5)
        await caught_up(relay, pg_dsn)
        _, scns = replay_buffer(relay)
        losses = [loss for _, loss in control_events(relay, Op.DATA_LOSS)]
    assert len(losses) == 1 and losses[0].from_scn == start
    assert losses[0].to_scn == moved - 1 and scns[0] == losses[0].to_scn
