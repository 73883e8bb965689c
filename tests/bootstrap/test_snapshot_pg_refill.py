"""A first Postgres seed and a row that moves, without its TOASTed value, to a key the
seed has passed (real Postgres -> relay -> bootstrap server).

Postgres leaves an unchanged TOASTed value out of an UPDATE (REPLICA IDENTITY
DEFAULT). Row 480 (not copied yet) moves to key -5 (before every key the seed
has read): the applier has no earlier image of row 480 to take the value from,
the seed's chunk of -5's range was read before the move and that of 480's
after it. Before the refill, the store kept row -5 without ``doc`` for good
(a consumer from nothing got NULL there); the seed now reads such rows again
by key before it ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from boot_e2e import bootstrap_caught_up, relay_config, sync_marker
from snap_pg_support import (
    RecordingSink,
    assert_same,
    boot_config,
    relay_request,
    seed_and_wait,
    source_rows,
    store_rows,
)

from changebus.bootstrap import BootstrapServer, SeedProgress, seed_postgres
from changebus.bootstrap._chunks import Chunk, JobState, SnapshotScope
from changebus.bootstrap._seed import PostgresChunkSource
from changebus.bootstrap._sink import StoreSink
from changebus.relay import Relay
from changebus.schemas import ChangeDecoder, event_at, verify_event
from fix_pg import caught_up
from waiting import wait_until

pytestmark = [pytest.mark.pg, pytest.mark.usefixtures("no_blocking")]


def _applier_scn(db: Path) -> int:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT applier_scn FROM cb_state WHERE part = 'pg'").fetchone()
        return -1 if row is None else int(row[0])
    finally:
        conn.close()


def _markers(db: Path) -> list[str]:
    """The seed markers (logical messages ``changebus.seed``) in the bootstrap's log."""
    from changebus.schemas import LogicalMessage, Op, decode_control, event_at, verify_event

    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT event FROM cb_log WHERE op = ?", (int(Op.MESSAGE),))
        out = []
        for (event,) in rows.fetchall():
            ev = bytes(event)
            h = verify_event(ev, 0)
            msg = decode_control(h.op, event_at(ev, 0, h)[1])
            assert isinstance(msg, LogicalMessage)
            if msg.prefix == "changebus.seed":
                out.append(msg.content.decode())
        return out
    finally:
        conn.close()


async def test_a_row_moved_behind_the_seed_keeps_its_toasted_value(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE mv (id int8 PRIMARY KEY, bal int8, doc text)")
        conn.execute("ALTER TABLE mv ALTER COLUMN doc SET STORAGE EXTERNAL")  # (out of line)
        conn.execute(
            "INSERT INTO mv SELECT g, g, repeat('doc' || g || ' ', 1000) "
            "FROM generate_series(1, 500) g"
        )  # before the relay: these rows reach the store through the seed only
    cols = ["id", "bal", "doc"]
    db = tmp_path / "boot" / "b.db"
    moved: list[int] = []
    real_chunk = StoreSink.chunk

    def chunk_then_move(self: StoreSink, scope: SnapshotScope, job: JobState, chunk: Chunk) -> None:
        real_chunk(self, scope, job, chunk)
        if job.chunks == 3 and not moved:  # (seeder thread) keys 1..150 are read
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute("UPDATE mv SET id = -5, bal = bal + 1 WHERE id = 480")
            moved.append(sync_marker(pg_dsn))  # (the applier folds it when it may)

    monkeypatch.setattr(StoreSink, "chunk", chunk_then_move)
    async with Relay(relay_config(tmp_path, pg_dsn, 64 << 20)) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("UPDATE mv SET bal = bal WHERE id = 1")  # the relay learns the schema
        async with BootstrapServer(boot_config(tmp_path, relay.url, pg_dsn, 50)) as boot:
            await bootstrap_caught_up(boot, sync_marker(pg_dsn))
            seed = await seed_and_wait(boot, ["public.mv"])
            assert moved and seed.chunks >= 10
            # a marker before each listing (the moved row, then none left): the refill
            # waited for the applier to fold what came before them, the move too
            assert _markers(db) == ["public.mv"] * 2 and _applier_scn(db) >= moved[0]
            await bootstrap_caught_up(boot, sync_marker(pg_dsn))
            want = source_rows(pg_dsn, "mv", cols)
            assert (-5, 481, "doc480 " * 1000) in want
            assert_same(store_rows(db, "public.mv", cols), want, "mv")


async def test_a_moved_row_read_again_under_an_in_flight_transaction_gets_its_value(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Postgres chunk's tag is only a lower bound of its snapshot: while a write
    transaction older than the newest sample runs, an older sample gives it. Here one
    (an xid taken before the move) stays open from before row 480 moves to key -5 until
    a second after the refill listed -5: the refill's read of -5, whole, was tagged
    below the move, lost to the stored UPDATE without ``doc`` and could not complete it,
    and the next listing (-5 again) ended the refill: -5 lacked ``doc`` for good
    (review). The read now waits for a tag at or above the move's SCN."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE mv (id int8 PRIMARY KEY, bal int8, doc text)")
        conn.execute("ALTER TABLE mv ALTER COLUMN doc SET STORAGE EXTERNAL")  # (out of line)
        conn.execute(
            "INSERT INTO mv SELECT g, g, repeat('doc' || g || ' ', 1000) "
            "FROM generate_series(1, 500) g"
        )
    cols = ["id", "bal", "doc"]
    db = tmp_path / "boot" / "b.db"
    held: list[psycopg.Connection[Any]] = []
    listed: list[float] = []
    ended = threading.Event()
    real_chunk, real_unfilled = StoreSink.chunk, StoreSink.unfilled

    def end_held() -> None:
        held[0].rollback()
        held[0].close()
        ended.set()

    def chunk_then_move(self: StoreSink, scope: SnapshotScope, job: JobState, chunk: Chunk) -> None:
        real_chunk(self, scope, job, chunk)
        if job.chunks == 3 and not held:  # (seeder thread) keys 1..150 are read
            held.append(psycopg.connect(pg_dsn))  # (a transaction: an xid, open)
            held[0].execute("SELECT pg_current_xact_id()")
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute("UPDATE mv SET id = -5, bal = bal + 1 WHERE id = 480")

    def unfilled(self: StoreSink, scope: SnapshotScope, *a: Any, **kw: Any) -> Any:
        found = real_unfilled(self, scope, *a, **kw)
        if found and not listed:  # the first listing: end the transaction a second later
            listed.append(time.monotonic())
            threading.Timer(1.0, end_held).start()
        return found

    monkeypatch.setattr(StoreSink, "chunk", chunk_then_move)
    monkeypatch.setattr(StoreSink, "unfilled", unfilled)
    async with Relay(relay_config(tmp_path, pg_dsn, 64 << 20)) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("UPDATE mv SET bal = bal WHERE id = 1")  # the relay learns the schema
        async with BootstrapServer(boot_config(tmp_path, relay.url, pg_dsn, 50)) as boot:
            await bootstrap_caught_up(boot, sync_marker(pg_dsn))
            try:
                seed = await seed_and_wait(boot, ["public.mv"])
            finally:
                await asyncio.to_thread(ended.wait, 30)
            assert held and listed and seed.chunks >= 10
            await bootstrap_caught_up(boot, sync_marker(pg_dsn))
            want = source_rows(pg_dsn, "mv", cols)
            assert (-5, 481, "doc480 " * 1000) in want
            assert_same(store_rows(db, "public.mv", cols), want, "mv")


async def test_keys_as_the_store_decodes_them_are_found_again_by_a_keys_read(
    tmp_path: Path, pg_dsn: str
) -> None:
    """The refill reads rows by the key values the store decoded: every key type a
    primary key commonly has must come back as text Postgres casts to the same key."""
    key = "u uuid, ts timestamptz, lt timestamp, d date, n numeric, b bytea, t text, " + (
        "i int8, f float8, bo bool, tm time, iv interval"
    )
    names = [c.split()[0] for c in key.split(", ")]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SET TimeZone = 'Asia/Kolkata'")  # (not the seed session's zone)
        conn.execute(f"CREATE TABLE kk ({key}, v text, PRIMARY KEY ({', '.join(names)}))")
        for i in range(5):
            conn.execute(
                "INSERT INTO kk VALUES (gen_random_uuid(), now() - %s * interval '1 day 7 us', "
                "'2001-02-03 04:05:06.789'::timestamp + %s * interval '1 h', "
                "'1999-12-31'::date + %s, 1.5 / (%s + 3), decode(%s, 'hex'), %s, -%s, "
                "0.1 * %s, %s, '23:59:59.999999'::time - %s * interval '1 s', %s * interval "
                "'1 mon 2 days 3 s', 'x')",
                (i, i, i, i, "00ff" * i, f"t'\\{i}", i, i, i % 2 == 0, i, i),
            )
    async with Relay(relay_config(tmp_path, pg_dsn, 64 << 20)) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("UPDATE kk SET v = 'y' WHERE i = 0")  # the relay learns the schema
        await caught_up(relay, pg_dsn)
        req = relay_request(relay, pg_dsn, "public.kk", chunk_rows=100)
        whole = RecordingSink()
        await asyncio.to_thread(seed_postgres, req, lambda *_: None, SeedProgress(), sink=whole)
        decoder = ChangeDecoder(relay.hosts["pg"].registry.latest("public.kk"))
        source = PostgresChunkSource(req)
        keys = []
        for ev in whole.chunks[0].events:
            after = decoder.decode(bytes(event_at(ev, 0, verify_event(ev, 0))[1])).after
            assert after is not None
            values = source.key_values("public.kk", tuple(after[c] for c in names))
            assert values is not None, after
            keys.append(values)
        assert len(keys) == 5
        again = RecordingSink()
        req_keys = dataclasses.replace(req, keys=tuple(keys))
        await asyncio.to_thread(
            seed_postgres, req_keys, lambda *_: None, SeedProgress(), sink=again
        )
        assert [c.absent for c in again.chunks] == [()]
        assert len(again.chunks[0].events) == 5


def test_key_values_without_an_exact_text_form_are_not_read_again() -> None:
    """``-infinity`` / ``infinity`` dates decode to the first and last day, ``24:00:00``
    and BC dates to plain numbers: read by such text the key would be another one, or
    refused (review)."""
    import datetime
    import decimal
    import uuid

    from changebus.bootstrap._seed_pg_keys import key_text

    utc = datetime.UTC
    for bad, temporal in (
        (datetime.date.max, True),
        (datetime.date.min, True),
        (datetime.datetime.max.replace(tzinfo=utc), True),
        (datetime.datetime.min, True),
        (86_400_000_000, True),  # time 24:00:00
        (-800_000, True),  # a BC date
        ([1, 2], False),
    ):
        assert key_text(bad, temporal=temporal) is None, bad
    assert key_text(datetime.date(2001, 2, 3), temporal=True) == "2001-02-03"
    ts = datetime.datetime(2001, 2, 3, 4, 5, 6, 7, tzinfo=utc)
    assert key_text(ts, temporal=True) == "2001-02-03T04:05:06.000007+00:00"
    assert key_text(b"\x00\xff") == "\\x00ff" and key_text(True) == "true"
    assert key_text(decimal.Decimal("1.50")) == "1.50" and key_text(7) == 7
    u = uuid.uuid4()
    assert key_text(u) == str(u)
