"""The postgres fetcher in operation: heartbeats, slot figures, lost slots, large
transactions, the SQL-interface mode, and a relay killed with -9 mid-stream."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import tracemalloc
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
import pytest
from test_pg_fetcher import caught_up, replay_buffer, source, wait_until, workload

from changebus.fetchers import ResumePoint
from changebus.fetchers.postgres import PostgresConfig
from changebus.fetchers.postgres._setup import set_up
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import (
    ChangeDecoder,
    DataLoss,
    Op,
    SourceConfigError,
    decode_control,
    event_at,
    lsn_to_scn,
    parse_stream,
    scn_to_lsn,
    verify_event,
)
from fix_pg import PgServer

pytestmark = pytest.mark.pg

ROOT = Path(__file__).resolve().parents[2]


def config(tmp: Path, dsn: str, **options: Any) -> RelayConfig:
    return RelayConfig(
        data_dir=tmp / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "pg",
                1,
                capacity_bytes=8 << 20,
                fetcher=FetcherConfig(
                    "postgres", {"dsn": dsn, "status_interval_s": 0.2, **options}
                ),
            ),
        ),
        flush_interval_s=0,
    )


def control_events(relay: Relay, op: Op) -> list[tuple[int, Any]]:
    """(scn, payload) of every control event ``op`` in the relay's buffer."""
    buf = relay.hosts["pg"].buffer
    sel = buf.select(-1, -1, 1 << 30)
    if sel is None:
        return []  # nothing yet
    data = b"".join(bytes(v) for v in sel.views)
    assert buf.release(sel)
    offsets, _ = parse_stream(data)
    out = []
    for off in offsets.tolist():
        h = verify_event(data, off)
        if h.op == op:
            out.append((h.scn, decode_control(op, event_at(data, off, h)[1])))
    return out


def make_table(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE acct (id int8 PRIMARY KEY, bal int8, name text)")


def wal_lsn(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    return lsn_to_scn(row[0])


async def test_idle_heartbeats_advance_the_slot_and_show_retained_wal(
    tmp_path: Path, pg_dsn: str
) -> None:
    make_table(pg_dsn)
    cfg = config(tmp_path, pg_dsn, heartbeat_interval_s=0.2, slot_stats_interval_s=0.1)
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        await wait_until(lambda: len(control_events(relay, Op.HEARTBEAT)) >= 3)
        beats = control_events(relay, Op.HEARTBEAT)
        assert [s for s, _ in beats] == sorted({s for s, _ in beats})
        status = relay.hosts["pg"].status()["fetcher"]
        assert status["heartbeats"] >= 3
        assert status["retained_wal_bytes"] >= 0
        assert status["slot_wal_status"] == "reserved"
        metrics = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"{relay.url}/metrics", timeout=10).read().decode()
        )
        assert 'figure="retained_wal_bytes"' in metrics
        # the slot follows the heartbeats: confirmed past the second one
        second = beats[1][0]

        def confirmed() -> int:
            with psycopg.connect(pg_dsn) as conn:
                row = conn.execute(
                    "SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                    "WHERE slot_name = 'changebus'"
                ).fetchone()
            assert row is not None
            return lsn_to_scn(row[0])

        await wait_until(lambda: confirmed() > second)


@pytest.mark.parametrize("mode", ["stream", "sql"])
async def test_the_slot_figures_are_read_while_a_backlog_drains(
    tmp_path: Path, pg_dsn: str, mode: str
) -> None:
    """The slot's figures (retained and unconfirmed WAL, its state) were read only when
    a read came back empty: a backlog keeps every read busy, so they froze while it
    drained, when an operator watches them most (review)."""
    make_table(pg_dsn)
    cfg = config(tmp_path, pg_dsn, heartbeat_interval_s=0, slot_stats_interval_s=0.05, mode=mode)
    async with Relay(cfg) as relay:  # (makes the slot)
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "DO $$ BEGIN FOR i IN 0..15999 LOOP INSERT INTO acct SELECT i * 10 + g, g, "
            "repeat('x', 200) FROM generate_series(0, 9) g; COMMIT; END LOOP; END $$"
        )
    async with Relay(cfg) as relay:
        host = relay.hosts["pg"]
        started = time.monotonic()
        await caught_up(relay, pg_dsn)
        took = time.monotonic() - started
        reads = host.status()["fetcher"]["slot_stats_reads"]
    # (a backlog that takes a while: 8,000 transactions once drained in 0.49 s in CI)
    assert took > 0.5
    # (not one per interval: the stream thread also waits for the relay, and an SQL peek
    # of a backlog takes a while; before, none came until the backlog was drained)
    assert reads >= max(3, took / 3), (reads, took)


@pytest.mark.parametrize("how", ["dropped", "invalidated"])
async def test_lost_slot_becomes_a_data_loss_event(
    tmp_path: Path, pg_server: PgServer, pg_dsn: str, how: str
) -> None:
    make_table(pg_dsn)
    cfg = config(tmp_path, pg_dsn, heartbeat_interval_s=0)
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        await asyncio.to_thread(workload, pg_dsn, 1, 20)
        await caught_up(relay, pg_dsn)
        last = relay.hosts["pg"].buffer.meta.last_scn
    lost_from = wal_lsn(pg_dsn)
    if how == "dropped":
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_drop_replication_slot('changebus')")
        await asyncio.to_thread(workload, pg_dsn, 2, 10)
    else:
        admin = pg_server.dsn()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'")
            conn.execute("SELECT pg_reload_conf()")
        try:
            await asyncio.to_thread(workload, pg_dsn, 2, 10)
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                for _ in range(3):
                    conn.execute("INSERT INTO acct VALUES (1000, 1, 'x') ON CONFLICT DO NOTHING")
                    conn.execute("SELECT pg_switch_wal()")
                conn.execute("CHECKPOINT")
                state = conn.execute(
                    "SELECT wal_status FROM pg_replication_slots WHERE slot_name = 'changebus'"
                ).fetchone()
            assert state == ("lost",)
        finally:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute("ALTER SYSTEM RESET max_slot_wal_keep_size")
                conn.execute("SELECT pg_reload_conf()")
    lost_to = wal_lsn(pg_dsn)
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        await asyncio.to_thread(workload, pg_dsn, 3, 10)
        await caught_up(relay, pg_dsn)
        losses = control_events(relay, Op.DATA_LOSS)
        _, scns = replay_buffer(relay)
    assert len(losses) == 1
    scn, loss = losses[0]
    assert isinstance(loss, DataLoss)
    assert loss.from_scn == last + 1
    assert loss.from_scn <= lost_from + 1 and loss.to_scn >= lost_to
    assert scn == loss.to_scn
    assert how in loss.reason or "vanished" in loss.reason
    # the stream goes on after the gap, in order
    assert scns == sorted(set(scns)) and scns[-1] > scn


async def test_a_restart_right_after_a_data_loss_announces_it_once(
    tmp_path: Path, pg_dsn: str
) -> None:
    """The DATA_LOSS window is positioned where the new slot starts.

    It was one LSN before: a restart before the next window found the slot
    "confirmed beyond the relay's last window" and announced a second loss.
    """
    make_table(pg_dsn)
    cfg = config(tmp_path, pg_dsn, heartbeat_interval_s=0)
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        await asyncio.to_thread(workload, pg_dsn, 1, 5)
        await caught_up(relay, pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot('changebus')")
    await asyncio.to_thread(workload, pg_dsn, 2, 5)
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        await wait_until(lambda: len(control_events(relay, Op.DATA_LOSS)) == 1)
    async with Relay(cfg) as relay:  # nothing written in between
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        await asyncio.to_thread(workload, pg_dsn, 3, 5)
        await caught_up(relay, pg_dsn)
        assert len(control_events(relay, Op.DATA_LOSS)) == 1


def test_a_new_slot_behind_the_relay_is_a_data_loss(pg_dsn: str) -> None:
    """A slot gone and a server whose WAL is behind the relay's end.

    A server restored from a backup, or a standby promoted before it had
    replayed the relay's last changes: its new commits have SCNs the relay
    already passed, which the fetcher cannot deliver in order. That is a
    data loss, said as such (it was no event at all: a new slot at or behind
    the relay's end looked like no gap).
    """
    make_table(pg_dsn)
    now = wal_lsn(pg_dsn)
    ahead = now + (1 << 30)
    cfg = PostgresConfig(dsn=pg_dsn, on_slot_lost="recreate")
    plan = set_up(cfg, ResumePoint(ahead, scn_to_lsn(ahead)), "pg")
    assert plan.data_loss is not None
    lo, hi, why = plan.data_loss
    assert (lo, hi) == (ahead + 1, ahead + 1)
    assert "vanished" in why and "WAL went back" in why and str(hi) in why
    new_start = lsn_to_scn(plan.resume.source_position)
    assert now <= new_start < ahead and plan.resume.scn == hi
    # the slot as it stands now is no gap (the relay's end and the slot agree)
    plan = set_up(cfg, ResumePoint(hi, plan.resume.source_position), "pg")
    assert plan.data_loss is None
    # with "fail", it stops instead
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot('changebus')")
    with pytest.raises(SourceConfigError, match="vanished"):
        set_up(replace(cfg, on_slot_lost="fail"), ResumePoint(ahead, scn_to_lsn(ahead)), "pg")


def test_a_server_whose_wal_is_behind_the_relay_is_a_data_loss(pg_dsn: str) -> None:
    """The slot is there and not lost, but the server's WAL ends before the relay's last
    window: restored from a backup together with its slot, or a standby promoted before
    it had replayed the relay's changes. Its new commits take SCNs the relay passed; a
    slot behind the relay counted as harmless, so they were skipped silently (review)."""
    make_table(pg_dsn)
    cfg = PostgresConfig(dsn=pg_dsn)
    now = set_up(cfg, ResumePoint(-1, ""), "pg").confirmed  # the slot, created
    plan = set_up(cfg, ResumePoint(now, scn_to_lsn(now)), "pg")
    assert plan.data_loss is None
    ahead = wal_lsn(pg_dsn) + (1 << 30)
    plan = set_up(cfg, ResumePoint(ahead, scn_to_lsn(ahead)), "pg")
    assert plan.data_loss is not None
    lo, hi, why = plan.data_loss
    assert (lo, hi) == (ahead + 1, ahead + 1) and "WAL ends at" in why and "went back" in why
    # the relay's end within the server's WAL and the slot behind it: no gap, as before
    plan = set_up(cfg, ResumePoint(now, scn_to_lsn(now)), "pg")
    assert plan.data_loss is None


async def test_lost_slot_can_fail_instead(tmp_path: Path, pg_dsn: str) -> None:
    make_table(pg_dsn)
    cfg = config(tmp_path, pg_dsn, on_slot_lost="fail")
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        await asyncio.to_thread(workload, pg_dsn, 1, 3)
        await caught_up(relay, pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot('changebus')")
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "failed")
        assert "vanished" in relay.hosts["pg"].last_error
        assert "on_slot_lost" in relay.hosts["pg"].last_error


def big_transaction(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO acct SELECT g, g, repeat('x', 100) FROM generate_series(1, 500) g"
        )
        conn.execute("INSERT INTO acct VALUES (9999, 1, 'small')")


async def test_oversized_transaction_is_skipped_with_a_data_loss_event(
    tmp_path: Path, pg_dsn: str
) -> None:
    make_table(pg_dsn)
    cfg = config(tmp_path, pg_dsn, max_transaction_bytes=20_000, on_oversized_transaction="skip")
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        await asyncio.to_thread(big_transaction, pg_dsn)
        await caught_up(relay, pg_dsn)
        losses = control_events(relay, Op.DATA_LOSS)
        rows, _ = replay_buffer(relay)  # decodes: the next window re-announces its schema
        changes = control_events(relay, Op.SCHEMA_CHANGE)
    assert len(losses) == 1
    scn, loss = losses[0]
    assert loss.from_scn == loss.to_scn == scn
    assert "500 changes" in loss.reason
    assert list(rows) == [9999]
    assert len(changes) == 1 and changes[0][0] > scn


async def test_oversized_transaction_fails_clearly_by_default(tmp_path: Path, pg_dsn: str) -> None:
    make_table(pg_dsn)
    cfg = config(tmp_path, pg_dsn, max_transaction_bytes=20_000)
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        await asyncio.to_thread(big_transaction, pg_dsn)
        await wait_until(lambda: relay.hosts["pg"].state == "failed")
        assert "max_transaction_bytes" in relay.hosts["pg"].last_error
        assert control_events(relay, Op.END_OF_WINDOW) == []  # nothing half-written


async def test_sql_interface_mode_exactly_once_across_restart(tmp_path: Path, pg_dsn: str) -> None:
    make_table(pg_dsn)
    cfg = config(tmp_path, pg_dsn, mode="sql", sql_batch_changes=50, sql_poll_interval_s=0.02)
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        await asyncio.to_thread(workload, pg_dsn, 1, 60)
        await caught_up(relay, pg_dsn)
        first_rows, first_scns = replay_buffer(relay)
    assert first_rows == source(pg_dsn)
    await asyncio.to_thread(workload, pg_dsn, 2, 40)
    async with Relay(cfg) as relay:
        await caught_up(relay, pg_dsn)
        rows, scns = replay_buffer(relay)
    assert scns[: len(first_scns)] == first_scns
    assert scns == sorted(set(scns))
    assert len(scns) >= len(first_scns) + 40
    assert rows == source(pg_dsn)


async def test_sql_mode_reads_past_a_slot_behind_the_relay_by_more_than_a_peek(
    tmp_path: Path, pg_dsn: str
) -> None:
    """A slot behind what the relay holds by more than ``sql_batch_changes`` (a restart
    before the last batch's advance): every peek started at the slot and returned only
    windows the relay holds, none was emitted or acknowledged, the slot never moved,
    and the partition stood still for good (review)."""
    make_table(pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        # a second slot, far behind once the first relay run has read the workload
        conn.execute("SELECT pg_create_logical_replication_slot('behind', 'pgoutput')")
    first = config(tmp_path, pg_dsn, slot="first")
    async with Relay(first) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        await asyncio.to_thread(workload, pg_dsn, 1, 60)
        await caught_up(relay, pg_dsn)
        held = relay.hosts["pg"].buffer.meta.last_scn
    sql = config(
        tmp_path, pg_dsn, slot="behind", mode="sql", sql_batch_changes=15, sql_poll_interval_s=0.02
    )
    async with Relay(sql) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        await asyncio.to_thread(workload, pg_dsn, 2, 20)
        await caught_up(relay, pg_dsn)
        rows, scns = replay_buffer(relay)
        assert scns == sorted(set(scns)) and scns[-1] > held
        assert rows == source(pg_dsn)
        # and the slot follows the acknowledgements
        await wait_until(lambda: slot_confirmed(pg_dsn, "behind") > held)


def slot_confirmed(dsn: str, slot: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        ).fetchone()
    assert row is not None
    return lsn_to_scn(row[0])


async def test_sql_mode_streams_a_big_peek_instead_of_holding_it(
    tmp_path: Path, pg_dsn: str
) -> None:
    """A peek answers with whole transactions: one of 24 MiB must pass through the
    assembler (which drops it past max_transaction_bytes) a chunk at a time, never
    held whole in the fetcher (it was: the peek's rows were fetched all at once)."""
    make_table(pg_dsn)
    cfg = config(
        tmp_path,
        pg_dsn,
        mode="sql",
        sql_poll_interval_s=0.02,
        max_transaction_bytes=1 << 20,
        on_oversized_transaction="skip",
    )
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            await asyncio.to_thread(huge_transaction, pg_dsn, 24_000, 1000)
            await caught_up(relay, pg_dsn)
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        losses = control_events(relay, Op.DATA_LOSS)
        rows, _ = replay_buffer(relay)
    assert len(losses) == 1 and "24000 changes" in losses[0][1].reason
    assert list(rows) == [99999999]  # the small transaction after it, whole
    assert peak < 8 << 20, f"the fetcher held {peak >> 20} MiB of a 24 MiB transaction"


def huge_transaction(dsn: str, rows: int, width: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO acct SELECT g, g, repeat(md5(g::text), %s) FROM generate_series(1, %s) g",
            (width // 32, rows),
        )
        conn.execute("INSERT INTO acct VALUES (99999999, 1, 'small')")


def test_relay_killed_with_9_mid_stream_loses_and_repeats_nothing(
    tmp_path: Path, pg_dsn: str
) -> None:
    make_table(pg_dsn)
    data_dir = tmp_path / "relay"
    toml = tmp_path / "relay.toml"
    toml.write_text(
        f'data_dir = "{data_dir}"\nflush_interval_s = 0\n[http]\nport = 0\n'
        f'[[partitions]]\nname = "pg"\nid = 1\ncapacity_bytes = "8MiB"\n'
        f'[partitions.fetcher]\nkind = "postgres"\n'
        f'options = {{ dsn = "{pg_dsn}", status_interval_s = 0.2 }}\n'
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            str(ROOT / s)
            for s in ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client")
        ),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "changebus.schemas", "relay", "--config", str(toml)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # wait until the slot is streaming to the relay, then write while killing it
        deadline = time.monotonic() + 30
        while True:
            with psycopg.connect(pg_dsn) as conn:
                row = conn.execute(
                    "SELECT active FROM pg_replication_slots WHERE slot_name = 'changebus'"
                ).fetchone()
            if row == (True,):
                break
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        workload(pg_dsn, 1, 40)
        proc.send_signal(signal.SIGKILL)
        workload(pg_dsn, 2, 40)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)

    async def restart() -> tuple[dict[int, dict[str, Any]], list[int]]:
        async with Relay(config(tmp_path, pg_dsn)) as relay:
            await wait_until(lambda: relay.hosts["pg"].state == "streaming", 60)
            await caught_up(relay, pg_dsn)
            rows, scns = replay_buffer(relay)
            return rows, scns

    rows, scns = asyncio.run(restart())
    assert scns == sorted(set(scns))  # no duplicate window, commit order
    assert len(scns) >= 60  # 80 transactions, minus those that changed nothing
    assert rows == source(pg_dsn)


async def test_schema_versions_and_source_ids_survive_a_restart(
    tmp_path: Path, pg_dsn: str
) -> None:
    make_table(pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE other (id int8 PRIMARY KEY, v text)")
    cfg = config(tmp_path, pg_dsn)
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO acct VALUES (1, 10, 'a')")
            conn.execute("INSERT INTO other VALUES (1, 'x')")
            conn.execute("ALTER TABLE acct ADD COLUMN note text")
            conn.execute("INSERT INTO acct VALUES (2, 20, 'b', 'n2')")
        await caught_up(relay, pg_dsn)
        reg = relay.hosts["pg"].registry
        ids = {reg.source_id("public.acct"), reg.source_id("public.other")}
        assert [t.version for t in reg.versions("public.acct")] == [1, 2]
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            # after the restart: `other` first (a fresh numbering would give it id 1),
            # an unchanged acct (still version 2), then a third acct version
            conn.execute("INSERT INTO other VALUES (2, 'y')")
            conn.execute("INSERT INTO acct VALUES (3, 30, 'c', 'n3')")
            conn.execute("ALTER TABLE acct DROP COLUMN name")
            conn.execute("INSERT INTO acct VALUES (4, 40, 'n4')")
        await caught_up(relay, pg_dsn)
        host = relay.hosts["pg"]
        assert host.state == "streaming", host.last_error
        reg = host.registry
        assert {reg.source_id("public.acct"), reg.source_id("public.other")} == ids
        assert [t.version for t in reg.versions("public.acct")] == [1, 2, 3]
        assert [t.version for t in reg.versions("public.other")] == [1]
        # every row decodes with the version its event names
        sel = host.buffer.select(-1, -1, 1 << 30)
        assert sel is not None
        data = b"".join(bytes(v) for v in sel.views)
        assert host.buffer.release(sel)
    seen: dict[str, list[Any]] = {}
    offsets, _ = parse_stream(data)
    for off in offsets.tolist():
        h = verify_event(data, off)
        if h.op.is_control:
            continue
        table = reg.get(reg.name_for_id(h.source_id), h.schema_version)
        after = ChangeDecoder(table).decode(event_at(data, off, h)[1]).after
        assert after is not None
        seen.setdefault(table.name, []).append((h.schema_version, after))
    assert seen["public.acct"] == [
        (1, {"id": 1, "bal": 10, "name": "a"}),
        (2, {"id": 2, "bal": 20, "name": "b", "note": "n2"}),
        (2, {"id": 3, "bal": 30, "name": "c", "note": "n3"}),
        (3, {"id": 4, "bal": 40, "note": "n4"}),
    ]
    assert [v for _, v in seen["public.other"]] == [{"id": 1, "v": "x"}, {"id": 2, "v": "y"}]
