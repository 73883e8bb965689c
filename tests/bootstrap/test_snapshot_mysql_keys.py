"""MariaDB snapshots of keyed tables and scoped snapshots (issue 20).

Composite, varchar and BINARY(16) keys with nullable columns come out
exact under writers; a table without a primary key is refused naming the
fix; ``keys`` and ``where`` snapshots rewrite only their rows, tombstone the
keys the source lacks, and refuse a bad condition with the server's message.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import decimal
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from changebus.bootstrap import (
    BootstrapConfig,
    BootstrapServer,
    SeedConfig,
    SeedProgress,
    SeedRequest,
    seed_mysql,
)
from changebus.bootstrap._chunks import Chunk, JobState, SnapshotScope
from changebus.bootstrap._seed_mysql import MySQLChunkSource
from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.relay import Relay
from changebus.schemas import (
    ChangebusError,
    ChangeDecoder,
    ConfigError,
    Op,
    RowEncoder,
    SourceConfigError,
    TableSchema,
    event_at,
    verify_event,
)
from fix_mysql import mysql_execute
from snap_mysql import (
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

    def unfilled(
        self, scope: SnapshotScope, upto: int, stop: threading.Event, *, exact: bool
    ) -> list[tuple[bytes, tuple[Any, ...], int]]:
        return []

    def refill(self, scope: SnapshotScope, chunk: Chunk, skipped: list[bytes]) -> None:
        self.chunks.append(chunk)

    def finish(self, scope: SnapshotScope, job: JobState, stop: threading.Event) -> None:
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
    # an ENUM sorts by its labels' positions, not alphabetically: chunk bounds inside it
    "ekey": (
        "CREATE TABLE ekey (s enum('c','b','a') NOT NULL, i int NOT NULL, v int NULL, "
        "PRIMARY KEY (s, i))",
        ["s", "i"],
        ["s", "i", "v"],
    ),
}


def keyed_row(table: str, i: int, rnd: random.Random) -> tuple[Any, ...]:
    maybe = rnd.random() < 0.3
    if table == "comp":
        at = datetime.datetime(2024, 5, 1) + datetime.timedelta(microseconds=rnd.randint(0, 10**12))
        return (i % 40, f"b{i // 40}-é", None if maybe else i, None if maybe else at)
    if table == "ekey":
        return ("cba"[i % 3], i, None if maybe else i)
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
            "UPDATE ekey SET v = 1 ORDER BY s, i LIMIT 1",
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
                assert w.seed.chunks >= len(KEYED) * 1200 // 50
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

        # (e) a table dropped since the relay saw it: nothing to read, the table is done (a
        #     gap's repair once failed on it for good, or read it until an error; review)
        mysql_execute(server, db, "DROP TABLE vkey")
        sink = RecordingSink()
        gone = dataclasses.replace(request, tables=(f"{db}.vkey",))
        await asyncio.to_thread(seed_mysql, gone, lambda *_: None, SeedProgress(), sink=sink)
        assert sink.chunks == []
        assert [(j.table, j.chunks) for j in sink.finished] == [(f"{db}.vkey", 0)]
        # ...but a table the seed's user may not read is no dropped table (information_schema
        # hides it all the same): refused, naming the grant
        mysql_execute(
            server,
            "mysql",
            "CREATE USER IF NOT EXISTS 'narrow'@'127.0.0.1' IDENTIFIED BY 'narrow-pw'",
            f"GRANT SELECT ON `{db}`.`bkey` TO 'narrow'@'127.0.0.1'",
            "GRANT BINLOG MONITOR ON *.* TO 'narrow'@'127.0.0.1'",
        )
        narrow = dataclasses.replace(
            request,
            dsn=f"mysql://narrow:narrow-pw@127.0.0.1:{server.port}",
            tables=(f"{db}.comp",),
        )
        with pytest.raises(SourceConfigError, match=r"may not read table.*grant it SELECT"):
            await asyncio.to_thread(seed_mysql, narrow, lambda *_: None, SeedProgress())

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
        # FLOAT keys 1 + n * 2**-23, next to each other: the text protocol prints them
        # all as 1
        "CREATE TABLE fk (k float PRIMARY KEY, v int NOT NULL)",
        "INSERT INTO fk SELECT 1 + seq * POW(2, -23), seq FROM seq_1_to_200",
    )
    store = tmp_path / "boot" / "b.db"
    async with Relay(relay_config(tmp_path, server, db)) as relay:
        host = relay.hosts["my"]
        await wait_until(lambda: host.state == "streaming")
        mysql_execute(server, db, "UPDATE kv SET v = 'first' WHERE id = 1")
        mysql_execute(server, db, "UPDATE fk SET v = 1000 WHERE v = 1")
        await wait_until(lambda: table in {n for _s, n in host.registry.sources()}, 30)
        await wait_until(lambda: f"{db}.fk" in {n for _s, n in host.registry.sources()}, 30)
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
            # a key the server compares by its own rules: 1.5 matches no row there, and it
            # named row 1 here (int(1.5)), which was deleted as absent (review)
            await run_scoped(boot, SnapshotScope(table, keys=((1.5,),)))
            still = {r.after["id"]: r for r in store_rows(store, table).values()}
            assert not still[1].deleted and still[1].after["v"] == "first"
            assert still[1].scn == after[1].scn

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

            # where on FLOAT keys: each chunk's bound was read printed with 6 digits, the
            # same as the cursor, and the read failed as a chunk "ended where it started"
            progress = await run_scoped(boot, SnapshotScope(f"{db}.fk", where="v >= 100"))
            assert (progress.mode, progress.rows) == ("keyset", 102)  # (and v = 1000)
            assert progress.chunks >= 200 // 40

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

        # a gap repair waiting for a newer binlog position (min_tag) ends when the run
        # is stopped, not after watermark_wait_s (it slept through the stop)
        stop = threading.Event()
        waiting = dataclasses.replace(request, min_tag=1 << 62, watermark_wait_s=60)
        started = time.monotonic()
        threading.Timer(0.5, stop.set).start()
        with pytest.raises(ChangebusError, match="seeding stopped"):
            await asyncio.to_thread(
                seed_mysql, waiting, lambda *_: pytest.fail("written"), SeedProgress(), stop=stop
            )
        assert time.monotonic() - started < 5
