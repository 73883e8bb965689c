"""Online chunked snapshots from MariaDB (issue 20): exact under writers, short transactions.

A bootstrap server seeds a ~20k-row table in chunks of 200 rows from a real
MariaDB through a real relay (mysql fetcher) while several writers update,
insert and delete rows of that very table at full speed in short
transactions: once the applier reached the source's final position, the
snapshot's live rows equal the source row by row, and no transaction of the
seed's connection (sampled from ``information_schema.innodb_trx``)
was older than a second. Keyed tables and scoped snapshots:
``test_snapshot_mysql_keys.py``; the shared helpers: ``tests/snap_mysql.py``.
"""

from __future__ import annotations

import asyncio
import datetime
import decimal
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pymysql
import pytest

from changebus.bootstrap import (
    BootstrapServer,
)
from changebus.bootstrap._chunks import ChunkSizer
from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.relay import Relay
from changebus.schemas import (
    ConfigError,
)
from fix_mysql import mysql_execute
from snap_mysql import (
    PASSWORD,
    ROWS,
    SEED_USER,
    assert_same,
    boot_config,
    marker,
    relay_config,
    seed_dsn,
    source_rows,
    store_rows,
)
from waiting import wait_until

pytestmark = pytest.mark.mysql


class Writers:
    """``n`` threads updating, inserting and deleting rows of ``big`` at full speed."""

    def __init__(self, server: EmbeddedMariaDB, db: str, n: int) -> None:
        self.stop = threading.Event()
        self.done = [0] * n
        self.errors: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._run, args=(server, db, i), daemon=True) for i in range(n)
        ]

    def __enter__(self) -> Writers:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(30)

    def _run(self, server: EmbeddedMariaDB, db: str, i: int) -> None:
        rnd = random.Random(i)
        conn = server.connect(db)
        try:
            with conn.cursor() as cur:
                while not self.stop.is_set():
                    k = rnd.randint(1, ROWS + ROWS // 10)
                    r = rnd.random()
                    try:
                        if r < 0.4:
                            cur.execute(
                                "UPDATE big SET val = val + 1, name = %s WHERE id = %s",
                                (f"u{rnd.randint(0, 999)}", k),
                            )
                        elif r < 0.65:
                            cur.execute(
                                "INSERT INTO big VALUES (%s, %s, %s, %s, %s, %s) ON DUPLICATE KEY "
                                "UPDATE val = VALUES(val), note = VALUES(note)",
                                (k, k % 7, rnd.randint(0, 10**9), f"i{k}", None, None),
                            )
                        elif r < 0.85:
                            cur.execute("DELETE FROM big WHERE id = %s", (k,))
                        else:  # a short transaction of three changes
                            cur.execute("BEGIN")
                            for j in sorted(rnd.sample(range(1, ROWS), 3)):
                                cur.execute("UPDATE big SET val = val - 1 WHERE id = %s", (j,))
                            cur.execute("COMMIT")
                        self.done[i] += 1
                    except pymysql.err.OperationalError as exc:  # a deadlock: go on
                        if exc.args[0] not in (1213, 1205):
                            raise
                        conn.rollback()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)
        finally:
            conn.close()


@dataclass
class TrxSampler:
    """Samples the seed user's InnoDB transactions every 0.15 s (their age in seconds).

    Not every 20 ms: InnoDB refreshes the cache behind ``innodb_trx`` only when
    it was not read for 0.1 s, so faster polling sees one stale picture forever.
    """

    server: EmbeddedMariaDB
    stop: threading.Event = field(default_factory=threading.Event)
    samples: int = 0
    seen: int = 0
    longest_s: int = 0
    oldest: tuple[Any, ...] = ()
    started: set[datetime.datetime] = field(default_factory=set)
    errors: list[BaseException] = field(default_factory=list)
    #: samples lost to a transient server error (more than three fail the sampler)
    transient: list[BaseException] = field(default_factory=list)

    def run(self) -> None:
        conn = self.server.connect()
        try:
            with conn.cursor() as cur:
                while not self.stop.wait(0.15):
                    # trx_started has a resolution of one second: TIMESTAMPDIFF in whole
                    # seconds is <= 1 for every transaction shorter than a second
                    try:
                        cur.execute(
                            "SELECT t.trx_started, TIMESTAMPDIFF(SECOND, t.trx_started, NOW()), "
                            "t.trx_mysql_thread_id, t.trx_state, p.COMMAND, p.INFO FROM "
                            "information_schema.innodb_trx t JOIN information_schema.PROCESSLIST p "
                            "ON p.ID = t.trx_mysql_thread_id WHERE p.USER = %s",
                            (SEED_USER,),
                        )
                    except pymysql.err.InternalError as exc:
                        # the join's internal temporary table can fail on a busy server
                        # ("Error on delete of '/tmp/#sql-temptable-...'"): one lost sample
                        self.transient.append(exc)
                        if len(self.transient) > 3:
                            raise
                        continue
                    rows = cur.fetchall()
                    self.samples += 1
                    if rows:
                        self.seen += 1
                    for started, age, *what in rows:
                        self.started.add(started)
                        if int(age) > self.longest_s:
                            self.longest_s = int(age)
                            self.oldest = (started, int(age), *what)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)
        finally:
            conn.close()


# ---- (a) + (b): exact under writers, short transactions ------------------------------


def probe_transaction(server: EmbeddedMariaDB, seconds: float) -> None:
    """A transaction of the seed's user held open ``seconds`` (the sampler's check)."""
    conn = pymysql.connect(
        host="127.0.0.1", port=server.port, user=SEED_USER, password=PASSWORD, autocommit=True
    )
    try:
        with conn.cursor() as cur:
            cur.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT")
            time.sleep(seconds)
            cur.execute("COMMIT")
    finally:
        conn.close()


def fill_big(server: EmbeddedMariaDB, db: str) -> None:
    mysql_execute(
        server,
        db,
        "CREATE TABLE big (id int PRIMARY KEY, grp int NOT NULL, val bigint NOT NULL, "
        "name varchar(40) NOT NULL, note varchar(200) NULL, amt decimal(12,2) NULL)",
    )
    conn = server.connect(db)
    try:
        with conn.cursor() as cur:
            for start in range(1, ROWS + 1, 2000):
                cur.executemany(
                    "INSERT INTO big VALUES (%s, %s, %s, %s, %s, %s)",
                    [
                        (
                            i,
                            i % 7,
                            i * 3,
                            f"row {i}",
                            None if i % 3 else "x" * (i % 150),
                            None if i % 5 == 0 else decimal.Decimal(i) / 100,
                        )
                        for i in range(start, min(start + 2000, ROWS + 1))
                    ],
                )
    finally:
        conn.close()


@pytest.mark.usefixtures("no_blocking")
async def test_a_chunked_seed_under_writers_is_exact_with_short_transactions(
    tmp_path: Path,
    mysql_server: EmbeddedMariaDB,
    mysql_db: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    server, db = mysql_server, mysql_db
    await asyncio.to_thread(fill_big, server, db)
    async with Relay(relay_config(tmp_path, server, db)) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        mysql_execute(
            server,
            db,
            "UPDATE big SET val = val WHERE id = 1",
            "UPDATE big SET val = 0 WHERE id = 2",
        )
        await wait_until(lambda: relay.hosts["my"].registry.sources() != [], 30, "the schema")
        seed_dsn(server)  # the seed's user
        sampler = TrxSampler(server)
        sampling = threading.Thread(target=sampler.run, daemon=True)
        sampling.start()
        # the sampler sees a transaction of the seed's user, and how old it is
        await asyncio.to_thread(probe_transaction, server, 2.5)
        await wait_until(lambda: sampler.longest_s >= 2 or sampler.errors, 10, "the probe")
        assert not sampler.errors and sampler.longest_s >= 2, sampler
        await asyncio.sleep(0.5)  # the sampler's cache no longer shows the probe
        sampler.longest_s = sampler.seen = 0
        with Writers(server, db, 3) as writers:
            await asyncio.sleep(0.3)  # the writers are at full speed
            started = time.monotonic()
            # chunks of 100: a seed of several seconds (8,000 rows in chunks of 200
            # once took 1.97 s, too short for the sampler's whole seconds)
            async with BootstrapServer(boot_config(tmp_path, relay, server, 100)) as boot:
                w = boot.service.workers["my"]
                await wait_until(lambda: w.seed.state in ("done", "failed"), 300, "the seed")
                took = time.monotonic() - started
                writes_during = sum(writers.done)
                writers.stop.set()
                sampler.stop.set()
                await asyncio.to_thread(sampling.join, 10)
                assert w.seed.state == "done", w.seed.error
                m = await asyncio.to_thread(marker, server, db)
                await wait_until(lambda: w.applier_scn >= m, 120, "the bootstrap applier")
                got = await asyncio.to_thread(store_rows, tmp_path / "boot" / "b.db", f"{db}.big")
        assert not writers.errors and not sampler.errors, (writers.errors, sampler.errors)
    want = source_rows(server, db, "big", "id")
    names = ["id", "grp", "val", "name", "note", "amt"]
    assert_same(got, want, names, ["id"])
    rows_per_s = w.seed.rows / took
    logging.getLogger("test").warning(
        "chunked seed: %d rows in %d chunks, %.1f s (%.0f rows/s), %d writes meanwhile; "
        "seed transactions seen in %d of %d samples, longest %d s",
        w.seed.rows,
        w.seed.chunks,
        took,
        rows_per_s,
        writes_during,
        sampler.seen,
        sampler.samples,
        sampler.longest_s,
    )
    assert w.seed.chunks >= ROWS // 100 * 9 // 10 and w.seed.mode == "keyset"
    assert writes_during > 1000  # the writers wrote all along the seed
    # (b) a seed of several seconds; none of its transactions was a second old (one
    # transaction for the whole table would have been seen as old as the seed, by the
    # sampler in whole seconds and by the seeder's own timing; 2.9 s on a quiet machine)
    assert took > 2 and sampler.samples > 10
    assert sampler.longest_s <= 1, sampler.oldest
    # the seeder's own figure (BEGIN to COMMIT of each chunk), in /v1/status and the metrics
    assert 0 < w.seed.txn_last_s <= w.seed.txn_max_s <= 1, w.seed
    assert w.seed.as_dict()["source_txn_max_s"] == round(w.seed.txn_max_s, 4)
    assert "seeded" in caplog.text and PASSWORD not in caplog.text


def test_the_chunk_sizer_shrinks_over_budget_and_grows_back_after_full_chunks() -> None:
    sizer = ChunkSizer(5000, 0.5)
    assert sizer.limit == 5000
    assert sizer.after(5000, 1.75) == 1000  # aims at 0.35 s: 5000 * 0.35 / 1.75
    assert sizer.after(1000, 0.1) == 2000  # at most 2x a chunk
    assert sizer.after(700, 0.01) == 2000  # a short chunk (the end) does not grow it
    assert sizer.after(2000, 0.35) == 2000  # on target
    assert sizer.after(2000, 0.05) == 4000 and sizer.after(4000, 0.05) == 5000  # chunk_rows
    assert sizer.after(5000, 100.0) == 100  # the floor
    assert sizer.after(100, -1.0) == 100  # not timed: unchanged
    assert ChunkSizer(5000).after(5000, 9.0) == 5000  # off
    assert ChunkSizer(40, 0.5).after(40, 9.0) == 40  # the floor is at most chunk_rows
    with pytest.raises(ConfigError, match="max_chunk_txn_s"):
        ChunkSizer(5000, -0.1)
