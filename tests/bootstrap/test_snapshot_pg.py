"""Online chunked snapshots of Postgres tables (issue 20): exact under writers, short transactions.

Real Postgres -> relay (postgres fetcher) -> bootstrap server seeding in small
chunks while writer threads insert, update and delete rows of the very table
being read. Afterwards (the applier at the source's final position) the
bootstrap store's live snapshot rows of the table equal the source's, row by
row, and the seeder's longest source transaction (sampled from
pg_stat_activity every ~20 ms by its application_name) stayed under a
second. Also: composite, text, uuid, numeric/timestamp keys and nullable
columns; a table without a key (refused) and a REPLICA IDENTITY FULL one
(the single_transaction fallback); the watermark waiting for an old open
transaction, and failing retriably when it never ends; ``keys`` and
``where`` scopes. The helpers are in snap_pg_support.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from boot_e2e import bootstrap_caught_up, relay_config, sync_marker
from snap_pg_support import (
    LongestTxn,
    RecordingSink,
    ResumingSink,
    Writers,
    assert_same,
    boot_config,
    relay_request,
    seed_and_wait,
    source_rows,
    store_rows,
    streamed_key,
    streaming_relay,
)

from changebus.bootstrap import BootstrapServer, SeedProgress, _seed as seed_module, seed_postgres
from changebus.bootstrap._chunks import JobState, SnapshotScope
from changebus.relay import Relay
from changebus.schemas import SourceConfigError, SourceError
from fix_pg import caught_up
from waiting import wait_until

pytestmark = [pytest.mark.pg, pytest.mark.usefixtures("no_blocking")]

BIG = 20_000


def big_step(conn: psycopg.Connection[Any], rnd: random.Random) -> None:
    for _ in range(rnd.randint(1, 3)):
        k = rnd.randint(1, BIG + 5000)
        r = rnd.random()
        if r < 0.45:
            conn.execute(
                "INSERT INTO big VALUES (%s, %s, %s, %s) ON CONFLICT (id) DO UPDATE "
                "SET grp = EXCLUDED.grp, name = EXCLUDED.name, note = EXCLUDED.note",
                (k, rnd.randint(0, 9), f"w{rnd.randint(0, 10**6)}", None if r < 0.2 else "n"),
            )
        elif r < 0.8:
            conn.execute("UPDATE big SET grp = grp + 1, note = NULL WHERE id = %s", (k,))
        else:
            conn.execute("DELETE FROM big WHERE id = %s", (k,))


@pytest.fixture
def store_db(tmp_path: Path) -> Path:
    return tmp_path / "boot" / "b.db"


# ---- (a) + (b): full-speed writers on the table being snapshotted -------------------------


async def test_a_chunked_seed_under_full_speed_writers_is_exact_with_short_transactions(
    tmp_path: Path, pg_dsn: str, store_db: Path
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE big (id int8 PRIMARY KEY, grp int4 NOT NULL, name text, note text)"
        )
        conn.execute(
            "INSERT INTO big SELECT g, g %% 10, 'row-' || g, CASE WHEN g %% 3 = 0 THEN NULL "
            "ELSE repeat('x', 20) END FROM generate_series(1, %s) g",
            (BIG,),
        )  # before the relay: these rows reach the store through the seed only
    cols = ["id", "grp", "name", "note"]
    async with Relay(relay_config(tmp_path, pg_dsn, 64 << 20)) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("UPDATE big SET grp = grp WHERE id = 1")  # the relay learns the schema
        async with BootstrapServer(boot_config(tmp_path, relay.url, pg_dsn, 200)) as boot:
            await bootstrap_caught_up(boot, sync_marker(pg_dsn))
            with LongestTxn(pg_dsn) as probe, Writers(pg_dsn, 3, big_step) as writers:
                await asyncio.sleep(0.3)
                started = time.monotonic()
                seed = await seed_and_wait(boot, ["public.big"])
                took = time.monotonic() - started
                txns = writers.txns
                writers.stop()
            assert seed.chunks >= BIG // 200 and seed.mode == "keyset"
            assert txns > 100, "the writers did not write during the seed"
            print(
                f"\nchunked seed: {seed.rows} rows in {seed.chunks} chunks, {took:.1f}s "
                f"({seed.rows / took:,.0f} rows/s) with {txns} writer txns; longest seed "
                f"txn {probe.longest * 1000:.0f} ms over {probe.samples} samples"
            )
            assert probe.seen > 0, "the probe never saw the seeder's transactions"
            assert probe.longest <= 1.0, probe.longest
            await bootstrap_caught_up(boot, sync_marker(pg_dsn))
            assert_same(
                store_rows(store_db, "public.big", cols), source_rows(pg_dsn, "big", cols), "big"
            )


# ---- (c) + (d): key kinds, nullable columns, no key, REPLICA IDENTITY FULL ----------------


def kinds_step(conn: psycopg.Connection[Any], rnd: random.Random) -> None:
    a = rnd.randint(0, 30)
    r = rnd.random()
    if r < 0.3:
        conn.execute(
            "INSERT INTO comp VALUES (%s, %s, %s) ON CONFLICT (a, b) DO UPDATE SET v = EXCLUDED.v",
            (a, f"b{rnd.randint(0, 40)}", None if r < 0.1 else "v"),
        )
    elif r < 0.5:
        conn.execute("DELETE FROM comp WHERE a = %s AND b = %s", (a, f"b{rnd.randint(0, 40)}"))
    elif r < 0.7:
        conn.execute(
            "INSERT INTO tkey VALUES (%s, %s) ON CONFLICT (k) DO UPDATE SET v = EXCLUDED.v",
            (f"k{rnd.randint(0, 2000)}", rnd.choice([None, rnd.randint(0, 9)])),
        )
    elif r < 0.8:
        conn.execute("DELETE FROM tkey WHERE k = %s", (f"k{rnd.randint(0, 2000)}",))
    elif r < 0.9:
        conn.execute("INSERT INTO ukey VALUES (gen_random_uuid(), %s)", (rnd.choice([None, "x"]),))
    else:
        conn.execute("UPDATE fullt SET y = y || '.' WHERE x = %s", (rnd.randint(0, 500),))


TABLES: dict[str, list[str]] = {
    "comp": ["a", "b", "v"],
    "tkey": ["k", "v"],
    "ukey": ["u", "v"],
    "nt": ["n", "ts", "v"],
    "fullt": ["x", "y"],
}


async def test_key_kinds_nullable_columns_and_tables_without_a_key(
    tmp_path: Path, pg_dsn: str, store_db: Path
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE comp (a int4, b text, v text, PRIMARY KEY (a, b))")
        conn.execute("CREATE TABLE tkey (k text PRIMARY KEY, v int8)")
        conn.execute("CREATE TABLE ukey (u uuid PRIMARY KEY, v text)")
        conn.execute(
            "CREATE TABLE nt (n numeric, ts timestamptz, v int4 UNIQUE, PRIMARY KEY (n, ts))"
        )
        conn.execute("CREATE TABLE fullt (x int4, y text)")
        conn.execute("ALTER TABLE fullt REPLICA IDENTITY FULL")
        conn.execute("CREATE TABLE nokey (x int4, y text)")
        conn.execute(
            "INSERT INTO comp SELECT a, 'b' || b, CASE WHEN b % 4 = 0 THEN NULL ELSE 'v' END "
            "FROM generate_series(0, 30) a, generate_series(0, 40) b"
        )
        words = ["a", "B", "é", "a b", "o'q", "z", "Zz", "", "ß", "a\\b", "日本"]
        conn.execute(
            "INSERT INTO tkey SELECT 'k' || g, CASE WHEN g % 5 = 0 THEN NULL ELSE g END "
            "FROM generate_series(0, 2000) g"
        )
        for i, w in enumerate(words):
            conn.execute("INSERT INTO tkey VALUES (%s, %s) ON CONFLICT DO NOTHING", (w, i))
        conn.execute(
            "INSERT INTO ukey SELECT gen_random_uuid(), CASE WHEN g % 2 = 0 THEN NULL ELSE 'u' END "
            "FROM generate_series(1, 1500) g"
        )
        conn.execute(
            "INSERT INTO nt SELECT (g % 7) / 3.0, timestamptz '2020-01-01 00:00:00.123456+00' "
            "+ (g || ' minutes')::interval, g FROM generate_series(1, 700) g"
        )
        conn.execute("INSERT INTO fullt SELECT g % 501, 'y' || g FROM generate_series(1, 1200) g")
        conn.execute("INSERT INTO nokey VALUES (1, 'a')")
    async with streaming_relay(
        tmp_path,
        pg_dsn,
        "UPDATE comp SET v = v WHERE a = 0 AND b = 'b1'",
        "UPDATE tkey SET v = v WHERE k = 'k1'",
        "INSERT INTO ukey VALUES (gen_random_uuid(), 'first')",
        "UPDATE nt SET v = v WHERE v = 1",
        "INSERT INTO fullt VALUES (9999, 'learn')",
        "INSERT INTO nokey VALUES (2, 'b')",
    ) as relay:
        # a table without a key: refused, naming the fix
        with pytest.raises(
            SourceConfigError, match=r"public\.nokey.*primary key.*REPLICA IDENTITY FULL"
        ):
            await asyncio.to_thread(
                seed_postgres,
                relay_request(relay, pg_dsn, "public.nokey"),
                lambda *_: None,
                SeedProgress(),
            )
        # REPLICA IDENTITY FULL without a key: the single_transaction fallback
        progress = SeedProgress()
        got: list[bytes] = []
        await asyncio.to_thread(
            seed_postgres,
            relay_request(relay, pg_dsn, "public.fullt", chunk_rows=100),
            lambda _t, ev, _s: got.extend(ev),
            progress,
        )
        assert progress.mode == "single_transaction" and progress.chunks > 3
        assert len(got) == 1201
        # a stored job of an earlier run: read again from the start, its counts not added;
        # and no throttle pause inside the one transaction (1201 rows at 300/s: 4 s)
        stored = JobState(
            "public.fullt", SnapshotScope("public.fullt").as_json(), "5", 3, 300, 1, 1
        )
        sink = ResumingSink(stored=stored)
        progress = SeedProgress()
        started = time.monotonic()
        await asyncio.to_thread(
            seed_postgres,
            relay_request(relay, pg_dsn, "public.fullt", chunk_rows=100, max_rows_per_s=300),
            lambda *_: None,
            progress,
            sink=sink,
        )
        assert progress.rows == 1201 and sink.finished[0].rows == 1201
        assert time.monotonic() - started < 3
        tables = [f"public.{t}" for t in TABLES]
        async with BootstrapServer(boot_config(tmp_path, relay.url, pg_dsn, 50)) as boot:
            await bootstrap_caught_up(boot, sync_marker(pg_dsn))
            with LongestTxn(pg_dsn), Writers(pg_dsn, 2, kinds_step) as writers:
                await asyncio.sleep(0.2)
                seed = await seed_and_wait(boot, tables)
                writers.stop()
            assert seed.tables_done == len(TABLES)
            await bootstrap_caught_up(boot, sync_marker(pg_dsn))
            for t, cols in TABLES.items():
                got_rows = store_rows(store_db, f"public.{t}", cols)
                if t == "nt":  # numeric and timestamp keys: compare the unique v column
                    want_v = {r[0] for r in source_rows(pg_dsn, t, ["v"])}
                    assert {r[2] for r in got_rows} == want_v
                    assert len(got_rows) == len(want_v)
                else:
                    assert_same(got_rows, source_rows(pg_dsn, t, cols), t)


# ---- (e): the watermark waits for an old open transaction ------------------------------------


async def test_the_watermark_waits_for_an_old_transaction_and_fails_retriably_when_it_stays(
    tmp_path: Path, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE kv (id int8 PRIMARY KEY, v text)")
        conn.execute("INSERT INTO kv SELECT g, 'v' || g FROM generate_series(1, 3000) g")
    async with streaming_relay(tmp_path, pg_dsn, "UPDATE kv SET v = v WHERE id = 1") as relay:
        blocker = psycopg.connect(pg_dsn)
        try:
            # an open transaction holding an xid (and a row the seed must then see)
            blocker.execute("INSERT INTO kv VALUES (100000, 'late') -- secret-query-text")
            pid = blocker.info.backend_pid
            sink = RecordingSink()
            progress = SeedProgress()
            req = relay_request(relay, pg_dsn, "public.kv", chunk_rows=500, watermark_wait_s=60)
            with LongestTxn(pg_dsn) as probe:
                task = asyncio.ensure_future(
                    asyncio.to_thread(seed_postgres, req, lambda *_: None, progress, sink=sink)
                )
                await asyncio.sleep(2.0)
                assert not task.done() and not sink.chunks  # waiting: no chunk without a watermark
                await asyncio.to_thread(blocker.commit)
                await asyncio.wait_for(task, 60)
            assert probe.longest <= 1.0, probe.longest  # it waited outside any transaction
            assert sink.finished and len(sink.chunks) == 7
            want = source_rows(pg_dsn, "kv", ["id", "v"])
            assert (100000, "late") in want
            assert_same(sink.rows(relay, "public.kv", ["id", "v"]), want, "kv")
            # a transaction that never ends: a retriable failure naming its backend
            blocker.execute("INSERT INTO kv VALUES (100001, 'never') -- secret-query-text")
            req = dataclasses.replace(req, watermark_wait_s=1.0)
            started = time.monotonic()
            with pytest.raises(SourceError) as caught:
                await asyncio.to_thread(seed_postgres, req, lambda *_: None, SeedProgress())
            assert time.monotonic() - started < 10
            err = caught.value
            assert err.retriable and f"pid {pid}" in err.message, err.message
            assert "secret-query-text" not in err.message and "INSERT" not in err.message
            blocker.rollback()
            # a lock taken while the seed runs (an ALTER TABLE): the next chunk's read,
            # its watermark from before, queued behind it with its snapshot open for as
            # long as the lock was held (and a stop could not end the wait)
            monkeypatch.setattr(seed_module, "LOCK_TIMEOUT_S", 1.0)
            req = dataclasses.replace(req, watermark_wait_s=60, max_rows_per_s=1000)
            progress = SeedProgress()
            task = asyncio.ensure_future(
                asyncio.to_thread(seed_postgres, req, lambda *_: None, progress)
            )
            await wait_until(lambda: progress.chunks >= 1, 30, "a first chunk")
            await asyncio.to_thread(blocker.execute, "LOCK TABLE kv IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            with pytest.raises(SourceError) as caught:
                await asyncio.wait_for(task, 30)
            assert time.monotonic() - started < 10, caught.value
            assert caught.value.retriable and "lock" in caught.value.message, caught.value
            assert progress.chunks < 6
        finally:
            blocker.close()


# ---- (f): keys and where scopes ------------------------------------------------------------


async def test_keys_and_where_scopes_rewrite_only_their_rows(
    tmp_path: Path, pg_dsn: str, store_db: Path
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE kv (id int8 PRIMARY KEY, v text)")
        conn.execute("INSERT INTO kv SELECT g, 'v' || g FROM generate_series(1, 1000) g")
    async with streaming_relay(
        tmp_path, pg_dsn, "INSERT INTO kv VALUES (5000, 'gone')", "DELETE FROM kv WHERE id = 5000"
    ) as relay:
        # keys, through seed_postgres: the found rows, and the absent keys' store keys
        sink = RecordingSink()
        keys = ((5,), (17,), (5000,), (42,), (5,), (999,))
        req = relay_request(relay, pg_dsn, "public.kv", chunk_rows=2, keys=keys)
        progress = SeedProgress()
        await asyncio.to_thread(seed_postgres, req, lambda *_: None, progress, sink=sink)
        assert progress.mode == "keys" and len(sink.chunks) == 3
        assert sink.rows(relay, "public.kv", ["id", "v"]) == {
            (5, "v5"),
            (17, "v17"),
            (42, "v42"),
            (999, "v999"),
        }
        absent = [a for c in sink.chunks for a in c.absent]
        assert absent == [streamed_key(relay, "public.kv", 5000)]
        tagged = relay_request(relay, pg_dsn, "public.kv", keys=(({"b64": "AA=="},),))
        with pytest.raises(SourceConfigError, match="tagged values"):
            await asyncio.to_thread(seed_postgres, tagged, lambda *_: None, SeedProgress())
        # where, through seed_postgres: '%' in the condition is the operator, not a placeholder
        sink = RecordingSink()
        req = relay_request(
            relay, pg_dsn, "public.kv", chunk_rows=30, where="id % 10 = 0 AND v <> ''"
        )
        await asyncio.to_thread(seed_postgres, req, lambda *_: None, SeedProgress(), sink=sink)
        assert {r[0] for r in sink.rows(relay, "public.kv", ["id", "v"])} == set(
            range(10, 1001, 10)
        )
        # each chunk looks at ~30 keys, not for 30 matching rows: a selective condition
        # would otherwise walk the key index far, in one transaction (vacuum held back)
        assert len(sink.chunks) >= 25  # (asking for 30 matching rows: 4 chunks)
        sink = RecordingSink()
        req = relay_request(relay, pg_dsn, "public.kv", chunk_rows=30, where="id > 990")
        await asyncio.to_thread(seed_postgres, req, lambda *_: None, SeedProgress(), sink=sink)
        assert {r[0] for r in sink.rows(relay, "public.kv", ["id", "v"])} == set(range(991, 1001))
        assert len(sink.chunks) >= 25 and sum(1 for c in sink.chunks if c.events) <= 2
        for bad, match in (
            ("id = ", "not valid"),
            ("true; DROP TABLE kv", "';'"),
            ("nope > 1", "nope"),
        ):
            req = relay_request(relay, pg_dsn, "public.kv", where=bad)
            with pytest.raises(SourceConfigError, match=match) as caught:
                await asyncio.to_thread(seed_postgres, req, lambda *_: None, SeedProgress())
            assert not caught.value.retriable
        # through the service: a where scope and a keys scope rewrite only their rows
        async with BootstrapServer(boot_config(tmp_path, relay.url, pg_dsn, 20)) as boot:
            await bootstrap_caught_up(boot, sync_marker(pg_dsn))
            assert store_rows(store_db, "public.kv", ["id", "v"]) == set()  # nothing seeded yet
            seed = await seed_and_wait(
                boot, ["public.kv"], SnapshotScope("public.kv", where="id % 100 = 0")
            )
            assert seed.rows == 10
            seeded = store_rows(store_db, "public.kv", ["id", "v"])
            assert seeded == {(i, f"v{i}") for i in range(100, 1001, 100)}
            seed = await seed_and_wait(
                boot, ["public.kv"], SnapshotScope("public.kv", keys=((7,), (8,), (123456,)))
            )
            assert seed.rows == 2
            assert store_rows(store_db, "public.kv", ["id", "v"]) == seeded | {(7, "v7"), (8, "v8")}


# ---- resume from a stored cursor; a DDL during the snapshot --------------------------------


async def test_a_composite_text_key_snapshot_resumes_after_its_last_chunk_and_refuses_a_ddl(
    tmp_path: Path, pg_dsn: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE comp (a int4, b text, v text, PRIMARY KEY (a, b))")
        conn.execute(
            "INSERT INTO comp SELECT a, 'b' || b, NULL FROM generate_series(0, 20) a, "
            "generate_series(0, 30) b"
        )
    cols = ["a", "b", "v"]
    async with streaming_relay(
        tmp_path, pg_dsn, "UPDATE comp SET v = 'x' WHERE a = 0 AND b = 'b0'"
    ) as relay:
        req = relay_request(relay, pg_dsn, "public.comp", chunk_rows=40)
        first = ResumingSink()
        await asyncio.to_thread(seed_postgres, req, lambda *_: None, SeedProgress(), sink=first)
        assert len(first.chunks) == 17  # 651 rows
        assert first.rows(relay, "public.comp", cols) == source_rows(pg_dsn, "comp", cols)
        # a crash after chunk 5: the run resumes from its stored job, reading 12 chunks
        again = ResumingSink(stored=first.jobs[4])
        progress = SeedProgress()
        await asyncio.to_thread(seed_postgres, req, lambda *_: None, progress, sink=again)
        assert len(again.chunks) == 12 and progress.chunks_resumed == 5
        later = ResumingSink()
        later.chunks = first.chunks[5:]
        assert again.rows(relay, "public.comp", cols) == later.rows(relay, "public.comp", cols)
        assert again.finished[0].chunks == 17 and again.finished[0].rows == 651

        # a column added between chunks: the snapshot stops, retriably
        def add_column(n: int) -> None:
            if n == 2:
                with psycopg.connect(pg_dsn, autocommit=True) as conn:
                    conn.execute("ALTER TABLE comp ADD COLUMN extra int4 DEFAULT 7")

        with pytest.raises(SourceConfigError, match=r"public\.comp changed \(DDL\)") as caught:
            await asyncio.to_thread(
                seed_postgres,
                req,
                lambda *_: None,
                SeedProgress(),
                sink=ResumingSink(after_chunk=add_column),
            )
        assert caught.value.retriable


async def test_a_table_with_a_generated_column_is_seeded(tmp_path: Path, pg_dsn: str) -> None:
    """pgoutput never sends generated columns, so the relay's schema lacks them; the seed
    described the table with them, took it for changed since the relay's newest schema
    version and refused it (retriably) on every try: such a table could never be seeded
    (review)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE gen (id int8 PRIMARY KEY, a int4, "
            "g int4 GENERATED ALWAYS AS (a * 2) STORED, b text)"
        )
        conn.execute(
            "INSERT INTO gen (id, a, b) SELECT g, g, 'b' || g FROM generate_series(1, 250) g"
        )
    async with streaming_relay(
        tmp_path, pg_dsn, "UPDATE gen SET a = a WHERE id = 1", capacity=8 << 20
    ) as relay:
        got: list[bytes] = []
        progress = SeedProgress()
        await asyncio.to_thread(
            seed_postgres,
            relay_request(relay, pg_dsn, "public.gen", chunk_rows=100),
            lambda _t, ev, _s: got.extend(ev),
            progress,
        )
    assert progress.rows == len(got) == 250
    assert progress.chunks >= 3


async def test_a_seed_source_of_another_cluster_is_refused(
    tmp_path: Path, pg_dsn: str, pg_server: Any
) -> None:
    """Chunks are tagged with the seed source's LSNs: a source other than the cluster the
    relay reads (a logical replica, a clone) ordered its rows against another WAL, ahead
    of the stream's changes or behind them, silently (review). Refused now, by the
    clusters' system identifiers."""
    import gc
    import shutil
    import tempfile

    from fix_pg import start_pg

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE dup (id int8 PRIMARY KEY, v text)")
        conn.execute("INSERT INTO dup SELECT g, 'v' FROM generate_series(1, 10) g")
    base = Path(tempfile.mkdtemp(prefix="changebus-pg-"))  # (the server's user reads it)
    other = start_pg(base)
    try:
        with psycopg.connect(other.dsn(), autocommit=True) as conn:
            conn.execute("CREATE TABLE dup (id int8 PRIMARY KEY, v text)")
        async with Relay(relay_config(tmp_path, pg_dsn, 8 << 20)) as relay:
            await wait_until(lambda: relay.hosts["pg"].state == "streaming")
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute("UPDATE dup SET v = 'w' WHERE id = 1")
            await caught_up(relay, pg_dsn)
            fetcher = relay.hosts["pg"].status()["fetcher"]
            assert fetcher["system_identifier"]
            request = dataclasses.replace(
                relay_request(relay, other.dsn(), "public.dup"), relay_fetcher=fetcher
            )
            with pytest.raises(SourceConfigError, match="another Postgres cluster") as refused:
                await asyncio.to_thread(
                    seed_postgres, request, lambda *_: pytest.fail("written"), SeedProgress()
                )
            assert not refused.value.retriable
            del refused
            gc.collect()  # (its connection is closed: a leak fails this test, not a later one)
            # the cluster the relay reads: seeded
            same = dataclasses.replace(request, dsn=pg_dsn)
            progress = SeedProgress()
            await asyncio.to_thread(seed_postgres, same, lambda *_: None, progress)
            assert progress.rows == 10
    finally:
        other.stop()
        shutil.rmtree(base, ignore_errors=True)


async def test_a_partitioned_table_without_a_key_is_read_in_bounded_ranges(
    tmp_path: Path, pg_dsn: str
) -> None:
    """A partitioned table (published via its root) with REPLICA IDENTITY FULL and no key
    takes the single_transaction fallback, whose chunks are ctid ranges sized by the
    table's pages: a partitioned table has none of its own, so it went in ONE COPY,
    whole, however big (review). Each range now spans every leaf."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE pfull (x int4, y text) PARTITION BY RANGE (x)")
        for i in range(3):
            conn.execute(
                f"CREATE TABLE pfull_{i} PARTITION OF pfull"
                f" FOR VALUES FROM ({i * 1000}) TO ({(i + 1) * 1000})"
            )
            conn.execute(f"ALTER TABLE pfull_{i} REPLICA IDENTITY FULL")
        conn.execute("ALTER TABLE pfull REPLICA IDENTITY FULL")
        conn.execute(
            "INSERT INTO pfull SELECT g, repeat('y', 200) || g FROM generate_series(0, 2999) g"
        )
        conn.execute("ANALYZE pfull")
        conn.execute(
            "CREATE PUBLICATION changebus FOR ALL TABLES WITH (publish_via_partition_root)"
        )
    async with streaming_relay(
        tmp_path, pg_dsn, "INSERT INTO pfull VALUES (2999, 'learn')"
    ) as relay:
        progress = SeedProgress()
        got: list[bytes] = []
        sizes: list[int] = []

        def chunk(_t: Any, events: list[bytes], _s: Any) -> None:
            got.extend(events)
            sizes.append(len(events))

        await asyncio.to_thread(
            seed_postgres,
            relay_request(relay, pg_dsn, "public.pfull", chunk_rows=300),
            chunk,
            progress,
        )
    assert progress.mode == "single_transaction"
    assert len(got) == 3001
    assert len(sizes) >= 5 and max(sizes) <= 2 * 300, sizes


async def test_a_table_with_a_publication_row_filter_is_refused(
    tmp_path: Path, pg_dsn: str
) -> None:
    """A row filter of the relay's publication (Postgres 15) leaves rows out of the
    stream that a seed copied, and the snapshot kept them for good (review): refused,
    naming the filter, until the seed applies it."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE rf (id int PRIMARY KEY, region text NOT NULL)")
        conn.execute("CREATE TABLE plain (id int PRIMARY KEY)")
        conn.execute("INSERT INTO rf SELECT g, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END"
                     " FROM generate_series(1, 10) g")  # fmt: skip
        conn.execute("CREATE PUBLICATION changebus FOR TABLE rf WHERE (id % 2 = 0), plain")
    async with Relay(relay_config(tmp_path, pg_dsn, 64 << 20)) as relay:
        host = relay.hosts["pg"]
        await wait_until(lambda: host.state == "streaming")
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("UPDATE rf SET region = 'fr' WHERE id = 2")
            conn.execute("INSERT INTO plain VALUES (1)")
        await caught_up(relay, pg_dsn)
        assert host.fetcher is not None
        status = host.fetcher.status()
        assert status["publication"] == "changebus"
        with pytest.raises(SourceConfigError, match=r"public\.rf has a row filter.*id"):
            await asyncio.to_thread(
                seed_postgres,
                relay_request(relay, pg_dsn, "public.rf", relay_fetcher=status),
                lambda *_: None,
                SeedProgress(),
            )
        got: list[bytes] = []
        await asyncio.to_thread(  # a table without one is seeded as ever
            seed_postgres,
            relay_request(relay, pg_dsn, "public.plain", relay_fetcher=status),
            lambda _t, ev, _s: got.extend(ev),
            SeedProgress(),
        )
        assert len(got) == 1
