"""Online chunked snapshots from MariaDB (issue 20): exact under writers, short transactions.

A bootstrap server seeds a ~20k-row table in chunks of 200 rows from a real
MariaDB through a real relay (mysql fetcher) while several writers update,
insert and delete rows of that very table at full speed in short
transactions: once the applier reached the source's final position, the
snapshot's live rows equal the source row by row, and no transaction of the
seed's connection (sampled from ``information_schema.innodb_trx``)
was older than a second. Composite, varchar and BINARY(16) keys with
nullable columns come out exact too; a table without a primary key is
refused naming the fix; ``keys`` and ``where`` snapshots rewrite only their
rows, tombstone the keys the source lacks, and refuse a bad condition with
the server's message.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import decimal
import json
import logging
import random
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pymysql
import pytest

from changebus.bootstrap import (
    BootstrapConfig,
    BootstrapServer,
    HttpConfig as BootstrapHttp,
    SeedConfig,
    SeedProgress,
    SeedRequest,
    StoreConfig,
    seed_mysql,
)
from changebus.bootstrap._chunks import Chunk, ChunkSizer, JobState, SnapshotScope
from changebus.bootstrap._seed_mysql import MySQLChunkSource
from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import (
    ChangeDecoder,
    ConfigError,
    Op,
    RowEncoder,
    SourceConfigError,
    TableSchema,
    event_at,
    verify_event,
)
from fix_mysql import master_scn, mysql_execute
from waiting import wait_until

pytestmark = pytest.mark.mysql

SEED_USER = "snapseed"
PASSWORD = "snap-Seed-pw-42"
ROWS = 8_000  # 40 chunks of 200: enough interleaving with the writers, ~25 s


def seed_dsn(server: EmbeddedMariaDB) -> str:
    """A user of the seed alone (its transactions are found by user in innodb_trx)."""
    mysql_execute(
        server,
        "mysql",
        f"CREATE USER IF NOT EXISTS '{SEED_USER}'@'127.0.0.1' IDENTIFIED BY '{PASSWORD}'",
        f"GRANT SELECT, BINLOG MONITOR ON *.* TO '{SEED_USER}'@'127.0.0.1'",
    )
    return f"mysql://{SEED_USER}:{PASSWORD}@127.0.0.1:{server.port}"


def relay_config(tmp: Path, server: EmbeddedMariaDB, db: str) -> RelayConfig:
    return RelayConfig(
        data_dir=tmp / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "my",
                1,
                capacity_bytes=64 << 20,
                fetcher=FetcherConfig("mysql", server.options(databases=[db])),
            ),
        ),
        flush_interval_s=0,
    )


def boot_config(
    tmp: Path, relay: Relay, server: EmbeddedMariaDB, chunk_rows: int
) -> BootstrapConfig:
    return BootstrapConfig(
        relays=(relay.url,),
        data_dir=tmp / "boot",
        store=StoreConfig(kind="sqlite", path=tmp / "boot" / "b.db"),
        http=BootstrapHttp(port=0),
        seed=SeedConfig(
            kind="mysql",
            dsn=seed_dsn(server),
            on_start=True,
            chunk_rows=chunk_rows,
            log_every_chunks=25,
        ),
    )


def marker(server: EmbeddedMariaDB, db: str) -> int:
    """An SCN at or after every change committed so far (a captured marker change)."""
    mysql_execute(
        server,
        db,
        "CREATE TABLE IF NOT EXISTS marker (id int PRIMARY KEY, n bigint NOT NULL)",
        "INSERT INTO marker VALUES (1, 1) ON DUPLICATE KEY UPDATE n = n + 1",
    )
    return int(master_scn(server))


Row = tuple[Any, ...]


def source_rows(server: EmbeddedMariaDB, db: str, table: str, key: str) -> dict[Row, Row]:
    """``SELECT *`` of the source, by key (the key columns' values)."""
    conn = server.connect(db)
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT * FROM `{table}` ORDER BY {key}")
            names = [d[0] for d in cur.description]
            at = [names.index(k.strip(" `")) for k in key.split(",")]
            return {tuple(r[i] for i in at): tuple(r) for r in cur.fetchall()}
    finally:
        conn.close()


def _plain(value: Any, want: Any) -> Any:
    """A decoded Avro value as the source's Python value (when the types differ)."""
    if value is None or type(value) is type(want):
        return value
    if isinstance(want, bytes) and isinstance(value, str):
        return value.encode()
    if isinstance(want, datetime.datetime) and isinstance(value, datetime.datetime):
        return value.replace(tzinfo=None)
    return value


@dataclass
class StoreRow:
    scn: int
    deleted: bool
    after: dict[str, Any]


def store_rows(path: Path, table: str) -> dict[bytes, StoreRow]:
    """The bootstrap store's snapshot rows of ``table`` by store key (decoded)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        schemas = {
            (int(s), int(v)): TableSchema.from_json(json.loads(j))
            for s, v, j in conn.execute(
                "SELECT source_id, version, schema FROM cb_schema WHERE part = 'my' AND name = ?",
                (table,),
            )
        }
        sids = {s for s, _v in schemas}
        out: dict[bytes, StoreRow] = {}
        for sid, key, scn, deleted, event in conn.execute(
            "SELECT source_id, key, scn, deleted, event FROM cb_snap WHERE part = 'my'"
        ):
            if sid not in sids:
                continue
            h = verify_event(event, 0)
            change = ChangeDecoder(schemas[(sid, h.schema_version)]).decode(
                bytes(event_at(event, 0, h)[1])
            )
            image = change.after if change.after is not None else (change.before or {})
            out[bytes(key)] = StoreRow(int(scn), bool(deleted), dict(image))
        return out
    finally:
        conn.close()


def assert_same(
    store: dict[bytes, StoreRow], source: dict[Row, Row], names: list[str], key: list[str]
) -> None:
    """The store's live rows are the source's rows, row by row."""
    some_key = next(iter(source), None)
    got: dict[Row, Row] = {}
    for r in store.values():
        if r.deleted:
            continue
        k = tuple(r.after[c] for c in key)
        if some_key is not None:
            k = tuple(_plain(v, w) for v, w in zip(k, some_key, strict=True))
        row = tuple(r.after.get(c) for c in names)
        want = source.get(k)
        if want is not None:
            row = tuple(_plain(v, w) for v, w in zip(row, want, strict=True))
        got[k] = row
    bad = sorted((k for k in set(got) | set(source) if got.get(k) != source.get(k)), key=repr)
    detail = [(k, got.get(k), source.get(k)) for k in bad[:3]]
    assert not bad, f"{len(bad)} rows differ of {len(source)}: {detail}"


# ---- writers and the transaction sampler ------------------------------------------------


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
            async with BootstrapServer(boot_config(tmp_path, relay, server, 200)) as boot:
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
    assert w.seed.chunks >= ROWS // 200 * 9 // 10 and w.seed.mode == "keyset"
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


# ---- (c) + (d): composite, varchar and binary keys, nullable columns; no key ------------


@dataclass
class RecordingSink:
    """A :class:`~changebus.bootstrap._chunks.SnapshotSink` keeping what it is given."""

    chunks: list[Chunk] = field(default_factory=list)
    finished: list[JobState] = field(default_factory=list)

    def resume(self, scope: SnapshotScope) -> JobState | None:
        return None

    def chunk(self, scope: SnapshotScope, job: JobState, chunk: Chunk) -> None:
        self.chunks.append(chunk)

    def finish(self, scope: SnapshotScope, job: JobState) -> None:
        self.finished.append(job)

    def rows(self, schema: TableSchema) -> list[dict[str, Any]]:
        decoder = ChangeDecoder(schema)
        out = []
        for chunk in self.chunks:
            for ev in chunk.events:
                h = verify_event(ev, 0)
                assert (h.op, h.scn) == (Op.INSERT, chunk.tag)
                after = decoder.decode(bytes(event_at(ev, 0, h)[1])).after
                assert after is not None
                out.append(dict(after))
        return out


KEYED = {
    "comp": (
        "CREATE TABLE comp (a int NOT NULL, b varchar(20) NOT NULL, v int NULL, "
        "t datetime(6) NULL, PRIMARY KEY (a, b))",
        ["a", "b"],
        ["a", "b", "v", "t"],
    ),
    "vkey": (
        "CREATE TABLE vkey (k varchar(64) PRIMARY KEY, v bigint NULL, d date NULL)",
        ["k"],
        ["k", "v", "d"],
    ),
    "bkey": (
        "CREATE TABLE bkey (k binary(16) PRIMARY KEY, v varchar(20) NULL, n decimal(10,3) NULL)",
        ["k"],
        ["k", "v", "n"],
    ),
}


def keyed_row(table: str, i: int, rnd: random.Random) -> tuple[Any, ...]:
    maybe = rnd.random() < 0.3
    if table == "comp":
        at = datetime.datetime(2024, 5, 1) + datetime.timedelta(microseconds=rnd.randint(0, 10**12))
        return (i % 40, f"b{i // 40}-é", None if maybe else i, None if maybe else at)
    if table == "vkey":
        return (
            f"Key {i:05d} {'ü' * (i % 3)}",
            None if maybe else i * 7,
            None if maybe else datetime.date(2000, 1, 1) + datetime.timedelta(days=i),
        )
    return (
        uuid.UUID(int=rnd.getrandbits(128)).bytes,
        None if maybe else f"v{i}",
        None if maybe else decimal.Decimal(i) / 1000,
    )


def fill_keyed(server: EmbeddedMariaDB, db: str, n: int) -> None:
    rnd = random.Random(7)
    conn = server.connect(db)
    try:
        with conn.cursor() as cur:
            for table, (ddl, _key, names) in KEYED.items():
                cur.execute(ddl)
                marks = ", ".join(["%s"] * len(names))
                cur.executemany(
                    f"INSERT INTO {table} VALUES ({marks})",
                    [keyed_row(table, i, rnd) for i in range(n)],
                )
    finally:
        conn.close()


def keyed_writer(server: EmbeddedMariaDB, db: str, stop: threading.Event, n: int) -> None:
    """Updates, inserts and deletes on the three keyed tables until ``stop``."""
    rnd = random.Random(11)
    conn = server.connect(db)
    try:
        with conn.cursor() as cur:
            while not stop.is_set():
                table = rnd.choice(list(KEYED))
                _ddl, key, names = KEYED[table]
                cur.execute(f"SELECT {', '.join(key)} FROM {table} ORDER BY RAND() LIMIT 1")
                found = cur.fetchone()
                r = rnd.random()
                if found is not None and r < 0.4:
                    cond = " AND ".join(f"{k} = %s" for k in key)
                    col = names[len(key)]
                    cur.execute(f"UPDATE {table} SET {col} = NULL WHERE {cond}", found)
                elif found is not None and r < 0.6:
                    cond = " AND ".join(f"{k} = %s" for k in key)
                    cur.execute(f"DELETE FROM {table} WHERE {cond}", found)
                else:
                    marks = ", ".join(["%s"] * len(names))
                    cur.execute(
                        f"INSERT IGNORE INTO {table} VALUES ({marks})",
                        keyed_row(table, rnd.randint(n, 10 * n), rnd),
                    )
    finally:
        conn.close()


@pytest.mark.usefixtures("no_blocking")
async def test_composite_varchar_and_binary_keys_and_a_table_without_a_key(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    server, db = mysql_server, mysql_db
    await asyncio.to_thread(fill_keyed, server, db, 1200)
    mysql_execute(server, db, "CREATE TABLE nokey (a int, b varchar(10))")
    async with Relay(relay_config(tmp_path, server, db)) as relay:
        host = relay.hosts["my"]
        await wait_until(lambda: host.state == "streaming")
        mysql_execute(
            server,
            db,
            "UPDATE comp SET v = 1 WHERE a = 0 AND b = 'b0-é'",
            "UPDATE vkey SET v = 1 WHERE k = 'Key 00000 '",
            "UPDATE bkey SET v = 'x' ORDER BY k LIMIT 1",
            "INSERT INTO nokey VALUES (1, 'a')",
        )
        names = {f"{db}.{t}" for t in (*KEYED, "nokey")}
        await wait_until(lambda: names <= {n for _s, n in host.registry.sources()}, 30)
        stop = threading.Event()
        writer = threading.Thread(target=keyed_writer, args=(server, db, stop, 1200))
        writer.start()
        try:
            cfg = boot_config(tmp_path, relay, server, 50)
            cfg = BootstrapConfig(
                relays=cfg.relays,
                data_dir=cfg.data_dir,
                store=cfg.store,
                http=cfg.http,
                seed=SeedConfig(
                    kind="mysql",
                    dsn=cfg.seed.dsn,
                    tables=tuple(sorted(f"{db}.{t}" for t in KEYED)),
                    on_start=True,
                    chunk_rows=50,
                ),
            )
            async with BootstrapServer(cfg) as boot:
                w = boot.service.workers["my"]
                await wait_until(lambda: w.seed.state in ("done", "failed"), 180, "the seed")
                stop.set()
                await asyncio.to_thread(writer.join)
                assert w.seed.state == "done", w.seed.error
                assert w.seed.chunks >= 3 * 1200 // 50
                m = await asyncio.to_thread(marker, server, db)
                await wait_until(lambda: w.applier_scn >= m, 120, "the bootstrap applier")
                for table, (_ddl, key, cols) in KEYED.items():
                    got = await asyncio.to_thread(
                        store_rows, tmp_path / "boot" / "b.db", f"{db}.{table}"
                    )
                    want = source_rows(server, db, table, ", ".join(key))
                    assert any(None in r for r in want.values())  # nullable columns, NULLs
                    assert_same(got, want, cols, key)
        finally:
            stop.set()
            await asyncio.to_thread(writer.join)

        # (d) a table without a primary key is refused, naming the fix
        request = SeedRequest(
            seed_dsn(server),
            1,
            (f"{db}.nokey",),
            schemas=tuple(
                (host.registry.source_id(n), s) for n in names for s in host.registry.versions(n)
            ),
            relay_fetcher=host.status()["fetcher"],
        )
        with pytest.raises(
            SourceConfigError, match=r"nokey has no primary key.*add a primary key"
        ) as info:
            await asyncio.to_thread(
                seed_mysql, request, lambda *_: pytest.fail("written"), SeedProgress()
            )
        assert not info.value.retriable

        # composite keys: a keys scope reports the keys the source lacks (store keys)
        comp = host.registry.latest(f"{db}.comp")
        have = list(source_rows(server, db, "comp", "a, b"))[:2]
        sink = RecordingSink()
        scoped = SeedRequest(
            request.dsn,
            1,
            (f"{db}.comp",),
            schemas=request.schemas,
            relay_fetcher=request.relay_fetcher,
            keys=(have[0], have[1], (99, "nope")),
            chunk_rows=2,
        )
        await asyncio.to_thread(seed_mysql, scoped, lambda *_: None, SeedProgress(), sink=sink)
        rows = sink.rows(comp)
        assert sorted((r["a"], r["b"]) for r in rows) == sorted(have)
        encoder = RowEncoder(comp, source_id=host.registry.source_id(f"{db}.comp"), partition=1)
        assert [c.absent for c in sink.chunks] == [(), (encoder.key_bytes({"a": 99, "b": "nope"}),)]
        # a where scope in chunks of 7 (composite key bounds) reads exactly its rows
        sink = RecordingSink()
        where = SeedRequest(
            request.dsn,
            1,
            (f"{db}.comp",),
            schemas=request.schemas,
            relay_fetcher=request.relay_fetcher,
            where="v IS NULL AND b LIKE 'b1%'",
            chunk_rows=7,
        )
        await asyncio.to_thread(seed_mysql, where, lambda *_: None, SeedProgress(), sink=sink)
        want_keys = [
            k
            for k, r in source_rows(server, db, "comp", "a, b").items()
            if r[2] is None and k[1].startswith("b1")
        ]
        assert sorted((r["a"], r["b"]) for r in sink.rows(comp)) == sorted(want_keys)
        assert len(sink.chunks) >= 100 and len(want_keys) > 10


# ---- (e) keys and where scopes through the bootstrap server -------------------------------


def hidden(server: EmbeddedMariaDB, db: str, *statements: str) -> None:
    """Changes the relay never sees (``sql_log_bin = 0``): the store misses them."""
    mysql_execute(server, db, "SET SESSION sql_log_bin = 0", *statements)


async def run_scoped(boot: BootstrapServer, scope: SnapshotScope) -> SeedProgress:
    w = boot.service.workers["my"]
    boot.service.start_seed("my", [scope.table], again=True, scope=scope)
    await wait_until(lambda: w.seed.state in ("done", "failed"), 60, "the snapshot")
    assert w.seed.state == "done", w.seed.error
    return w.seed


def timed_reads(request: SeedRequest, table: str) -> tuple[float, int, float, float, int]:
    """A 0.4 s read and a chunk of 50 rows through a MySQLChunkSource: (last_txn_s before,
    whether the server had a transaction open during the read, its time, the chunk's, rows)."""

    def held(cur: Any) -> int:
        time.sleep(0.4)
        cur.execute("SELECT @@in_transaction")
        return int(cur.fetchone()[0])

    with MySQLChunkSource(request) as source:
        before = source.last_txn_s
        _tag, open_trx = source.snapshot(held, "a test read")
        held_s = source.last_txn_s
        chunk = source.reader(SnapshotScope(table)).read(None, 50)
    return before, open_trx, held_s, chunk.txn_s, len(chunk.events)


@pytest.mark.usefixtures("no_blocking")
async def test_keys_and_where_snapshots_rewrite_only_their_rows(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    server, db = mysql_server, mysql_db
    table = f"{db}.kv"
    mysql_execute(
        server, db, "CREATE TABLE kv (id int PRIMARY KEY, v varchar(20) NOT NULL, grp int)"
    )
    mysql_execute(
        server,
        db,
        "INSERT INTO kv SELECT seq, CONCAT('v', seq), seq % 10 FROM seq_1_to_300",
    )
    store = tmp_path / "boot" / "b.db"
    async with Relay(relay_config(tmp_path, server, db)) as relay:
        host = relay.hosts["my"]
        await wait_until(lambda: host.state == "streaming")
        mysql_execute(server, db, "UPDATE kv SET v = 'first' WHERE id = 1")
        await wait_until(lambda: table in {n for _s, n in host.registry.sources()}, 30)
        async with BootstrapServer(boot_config(tmp_path, relay, server, 40)) as boot:
            w = boot.service.workers["my"]
            await wait_until(lambda: w.seed.state in ("done", "failed"), 60, "the seed")
            assert w.seed.state == "done", w.seed.error
            m = await asyncio.to_thread(marker, server, db)
            await wait_until(lambda: w.applier_scn >= m, 60, "the bootstrap applier")
            before = {r.after["id"]: r for r in store_rows(store, table).values()}
            assert len(before) == 300 and not any(r.deleted for r in before.values())
            hidden(
                server,
                db,
                "UPDATE kv SET v = 'hidden' WHERE id IN (10, 11, 250)",
                "DELETE FROM kv WHERE id = 12",
                "UPDATE kv SET v = 'hidden-w' WHERE grp = 3",
            )

            # keys: 10 rewritten, 12 (gone from the source) tombstoned, 999 never was
            progress = await run_scoped(boot, SnapshotScope(table, keys=((10,), (12,), (999,))))
            assert (progress.mode, progress.rows) == ("keys", 1)
            assert 0 < progress.txn_max_s < 5  # the keys chunk's transaction, timed
            after = {r.after["id"]: r for r in store_rows(store, table).values()}
            changed = {k for k in after if after[k].scn != before[k].scn}
            assert changed == {10, 12}
            assert after[10].after["v"] == "hidden" and not after[10].deleted
            assert after[12].deleted and after[12].scn == after[10].scn  # at the chunk's tag
            assert after[11].after["v"] == "v11" and after[250].after["v"] == "v250"  # untouched
            assert 999 not in after

            # where (a LIKE with %): exactly the rows of grp 3, in chunks of 40 keys
            progress = await run_scoped(
                boot, SnapshotScope(table, where="grp = 3 AND v LIKE 'hidden%'")
            )
            assert (progress.mode, progress.rows) == ("keyset", 30)
            assert progress.chunks >= 300 // 40
            final = {r.after["id"]: r for r in store_rows(store, table).values()}
            changed = {k for k in final if final[k].scn != after[k].scn}
            assert changed == {k for k in range(1, 301) if k % 10 == 3}
            assert all(final[k].after["v"] == "hidden-w" for k in changed)
            assert final[11].after["v"] == "v11"  # outside the condition: not rewritten

        # the scopes are checked before a row is read
        request = SeedRequest(
            seed_dsn(server),
            1,
            (table,),
            schemas=tuple(
                (host.registry.source_id(table), s) for s in host.registry.versions(table)
            ),
            relay_fetcher=host.status()["fetcher"],
        )
        for where, match in (
            ("nosuch > 3", "Unknown column 'nosuch'"),
            ("id >", "SQL syntax"),
            ("1 = 1; DROP TABLE kv", r"no ';'"),
        ):
            with pytest.raises(SourceConfigError, match=match) as info:
                await asyncio.to_thread(
                    seed_mysql,
                    dataclasses.replace(request, where=where),
                    lambda *_: pytest.fail("written"),
                    SeedProgress(),
                )
            assert not info.value.retriable
        with pytest.raises(SourceConfigError, match=r"has 2 value\(s\)"):
            await asyncio.to_thread(
                seed_mysql,
                dataclasses.replace(request, keys=((1, 2),)),
                lambda *_: pytest.fail("written"),
                SeedProgress(),
            )

        # a chunk transaction is timed from before BEGIN to after COMMIT: a read held
        # 0.4 s inside it shows (the transaction was open meanwhile)
        timed = await asyncio.to_thread(timed_reads, request, table)
        assert timed[0] == -1.0 and timed[1] == 1, timed  # nothing timed yet; trx open
        assert 0.4 <= timed[2] < 5 and 0 < timed[3] < 2 and timed[4] == 50, timed

        # max_chunk_txn_s: chunks whose transaction runs over it make the next ones smaller
        # (a budget no chunk can meet: down to the floor of 100 rows), and every row is read
        sizes: list[int] = []
        progress = SeedProgress()
        await asyncio.to_thread(
            seed_mysql,
            dataclasses.replace(request, chunk_rows=120, max_chunk_txn_s=1e-6),
            lambda _t, events, _scn: sizes.append(len(events)),
            progress,
        )
        # 299 rows (12 was deleted), then the end-of-table write; without the knob 120, 120, 59
        assert sizes == [120, 100, 79, 0], sizes
        assert progress.rows == 299 and progress.chunk_limit == 100
        assert progress.as_dict()["chunk_limit"] == 100
        with pytest.raises(ConfigError, match="max_chunk_txn_s"):
            dataclasses.replace(request, max_chunk_txn_s=-1)


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
