"""MariaDB -> relay (mysql fetcher, tiny buffer) -> bootstrap server seeded from MariaDB -> consumer.

The bootstrap server seeds its snapshot from a consistent MariaDB snapshot
(``seed.kind = "mysql"``) while writers write; a consumer that starts late
(the relay evicted most windows) gets the snapshot, then the catch-up, then
the live stream, and ends with exactly the source's rows. A second test
checks that a seeded row is encoded exactly as the fetcher encodes the same
row, for every column type.
"""

from __future__ import annotations

import asyncio
import datetime
import decimal
import logging
import random
import sqlite3
import threading
from pathlib import Path
from typing import Any

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
from changebus.client import ConsumerConfig, SqliteReplica, Window
from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import (
    ChangeDecoder,
    ConfigError,
    Mode,
    Op,
    SourceConfigError,
    SourceError,
    event_at,
    parse_stream,
    verify_event,
)
from fix_mysql import mysql_execute
from snap_mysql import marker
from waiting import wait_until

pytestmark = pytest.mark.mysql

TABLES = ("acct", "item")
TINY = 256 << 10  # relay buffer: a few hundred windows
PASSWORD = "s3cret-Seed-pw"


def relay_config(tmp: Path, server: EmbeddedMariaDB, db: str, capacity: int) -> RelayConfig:
    return RelayConfig(
        data_dir=tmp / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "my",
                1,
                capacity_bytes=capacity,
                fetcher=FetcherConfig("mysql", server.options(databases=[db])),
            ),
        ),
        flush_interval_s=0,
    )


def create_tables(server: EmbeddedMariaDB, db: str) -> None:
    for t in TABLES:
        mysql_execute(
            server,
            db,
            f"CREATE TABLE {t} (id int PRIMARY KEY, bal bigint, name varchar(40), "
            "amt decimal(12,2), at datetime(6))",
        )


def workload(server: EmbeddedMariaDB, db: str, seed: int, txns: int, keys: int = 300) -> None:
    """Random upserts, updates (some of the key) and deletes, 1-5 per transaction."""
    rnd = random.Random(seed)
    conn = server.connect(db)
    conn.autocommit(False)
    try:
        with conn.cursor() as cur:
            for _ in range(txns):
                for _ in range(rnd.randint(1, 5)):
                    t = rnd.choice(TABLES)
                    k = rnd.randint(1, keys)
                    r = rnd.random()
                    if r < 0.6:
                        cur.execute(
                            f"INSERT INTO {t} VALUES (%s, %s, %s, %s, %s) ON DUPLICATE KEY "
                            "UPDATE bal = VALUES(bal), name = VALUES(name), amt = VALUES(amt)",
                            (
                                k,
                                rnd.randint(0, 10**6),
                                f"n{k}-{rnd.randint(0, 99)}",
                                decimal.Decimal(rnd.randint(-(10**6), 10**6)) / 100,
                                datetime.datetime(2024, 1, 1, microsecond=rnd.randint(0, 999999))
                                + datetime.timedelta(minutes=rnd.randint(0, 10**6)),
                            ),
                        )
                    elif r < 0.67:
                        k2 = rnd.randint(1, keys)
                        cur.execute(f"UPDATE IGNORE {t} SET id = %s WHERE id = %s", (k2, k))
                    elif r < 0.85:
                        cur.execute(f"UPDATE {t} SET bal = bal + 1 WHERE id = %s", (k,))
                    else:
                        cur.execute(f"DELETE FROM {t} WHERE id = %s", (k,))
                conn.commit()
    finally:
        conn.close()


Row = tuple[Any, ...]


def source_rows(server: EmbeddedMariaDB, db: str) -> dict[str, dict[int, Row]]:
    conn = server.connect(db)
    try:
        with conn.cursor() as cur:
            out: dict[str, dict[int, Row]] = {}
            for t in TABLES:
                cur.execute(f"SELECT id, bal, name, amt, at FROM {t}")
                out[t] = {r[0]: tuple(r) for r in cur.fetchall()}
            return out
    finally:
        conn.close()


def replica_rows(path: Path, db: str) -> dict[str, dict[int, Row]]:
    """The replica's rows, with decimals and datetimes read back into Python values."""
    conn = sqlite3.connect(path)
    try:
        out: dict[str, dict[int, Row]] = {}
        for t in TABLES:
            try:
                rows = conn.execute(f'SELECT id, bal, name, amt, at FROM "{db}_{t}"').fetchall()
            except sqlite3.OperationalError:
                rows = []
            out[t] = {
                r[0]: (
                    r[0],
                    r[1],
                    r[2],
                    None if r[3] is None else decimal.Decimal(r[3]),
                    None if r[4] is None else datetime.datetime.fromisoformat(r[4]),
                )
                for r in rows
            }
        return out
    finally:
        conn.close()


def assert_same(got: dict[str, dict[int, Row]], want: dict[str, dict[int, Row]]) -> None:
    for t in TABLES:
        g, w = got[t], want[t]
        bad = sorted(k for k in set(g) | set(w) if g.get(k) != w.get(k))
        detail = [(k, g.get(k), w.get(k)) for k in bad[:3]]
        assert not bad, f"{t}: {len(bad)} rows differ of {len(w)}: {detail}"


class PhaseReplica(SqliteReplica):
    """A SQLite replica recording the phase of each window it applies."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.phases: list[str] = []

    async def on_start_window(self, window: Window) -> Any:
        self.phases.append(window.phase)
        return await super().on_start_window(window)


async def replicate_until(replica: PhaseReplica, cfg: ConsumerConfig, scn: int) -> None:
    """Run the replica until its stored checkpoint is online at or after ``scn``."""

    def online() -> bool:
        stored = replica._stored
        pc = stored.get("my") if stored is not None else None
        return pc is not None and pc.mode is Mode.ONLINE and pc.window_scn >= scn

    async def watch() -> None:
        while not online():
            await asyncio.sleep(0.02)
        replica.stop()

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait_for(replica.run(cfg), 120)
    finally:
        watcher.cancel()


def seed_user(server: EmbeddedMariaDB) -> str:
    """A user with a password for the seed (the password must never be logged)."""
    mysql_execute(
        server,
        "mysql",
        f"CREATE USER IF NOT EXISTS 'seeder'@'127.0.0.1' IDENTIFIED BY '{PASSWORD}'",
        "GRANT SELECT, BINLOG MONITOR ON *.* TO 'seeder'@'127.0.0.1'",
    )
    return f"mysql://seeder:{PASSWORD}@127.0.0.1:{server.port}"


# the relay and the bootstrap server (seeding from MySQL) run in the test's event
# loop: neither may block that loop
@pytest.mark.usefixtures("no_blocking")
async def test_late_consumer_gets_a_mysql_seed_then_catchup_then_live(
    tmp_path: Path,
    mysql_server: EmbeddedMariaDB,
    mysql_db: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    server, db = mysql_server, mysql_db
    create_tables(server, db)
    # before the relay (only the seed has them); keys 301-600 are never written again
    await asyncio.to_thread(workload, server, db, 1, 400, 600)
    before = source_rows(server, db)
    async with Relay(relay_config(tmp_path, server, db, TINY)) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        for t in TABLES:  # the relay learns the tables' schemas
            mysql_execute(server, db, f"INSERT INTO {t} (id, bal) VALUES (100000, 1)")
        bcfg = BootstrapConfig(
            relays=(relay.url,),
            data_dir=tmp_path / "boot",
            store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
            http=BootstrapHttp(port=0),
            seed=SeedConfig(kind="mysql", dsn=seed_user(server), on_start=True, chunk_rows=100),
        )
        writer = threading.Thread(target=workload, args=(server, db, 2, 1500))
        writer.start()
        async with BootstrapServer(bcfg) as boot:
            w = boot.service.workers["my"]
            await wait_until(lambda: w.seed.state in ("done", "failed"), 90, "the seed")
            assert w.seed.state == "done", w.seed.error
            assert w.seed.rows >= sum(len(r) for r in before.values())
            assert w.seed.tables_total == 2  # acct, item (the marker table is not there yet)
            await asyncio.to_thread(writer.join)
            m = marker(server, db)
            await wait_until(lambda: w.applier_scn >= m, 60, "the bootstrap applier")
            assert relay.hosts["my"].status()["prev_scn"] > w.seed.scn  # the relay evicted
            # a late consumer, while writers write again
            writer = threading.Thread(target=workload, args=(server, db, 3, 400))
            writer.start()
            path = tmp_path / "replica.db"
            replica = PhaseReplica(path)
            cfg = ConsumerConfig(
                relays=(relay.url,),
                partition="my",
                wait_s=0.5,
                bootstrap_servers=(boot.url,),
                backoff_initial_s=0.05,
                backoff_max_s=0.5,
                bootstrap_page_bytes=8 << 10,
            )
            try:
                task = asyncio.create_task(replicate_until(replica, cfg, 2**62))
                await asyncio.to_thread(writer.join)
                m = marker(server, db)

                def online() -> bool:
                    stored = replica._stored
                    pc = stored.get("my") if stored is not None else None
                    return pc is not None and pc.mode is Mode.ONLINE and pc.window_scn >= m

                await wait_until(online, 90, "the replica")
                replica.stop()
                await task
            finally:
                await replica.close()
            now = source_rows(server, db)
            assert_same(replica_rows(path, db), now)
            assert replica.phases.count("snapshot") > 3  # several pages
            # snapshot pages, then catch-up windows when the relay no longer held the
            # snapshot's SCN by then (timing: the writer may have finished first),
            # then online
            order = {"snapshot": 0, "catchup": 1, "online": 2}
            ranks = [order[p] for p in replica.phases]
            assert ranks == sorted(ranks) and ranks[0] == 0 and ranks[-1] == 2, replica.phases
            # rows never changed after capture began reached the consumer through the seed
            untouched = sum(1 for t in TABLES for k, r in before[t].items() if now[t].get(k) == r)
            assert untouched > 10
    assert PASSWORD not in caplog.text


TYPES = {
    "ti": ("tinyint", "-128"),
    "b1": ("tinyint(1)", "1"),
    "miu": ("mediumint unsigned", "16777215"),
    "iu": ("int unsigned", "4294967295"),
    "bi": ("bigint", "-9223372036854775808"),
    "biu": ("bigint unsigned", "18446744073709551615"),
    "de": ("decimal(20,6)", "-12345678901234.567891"),
    "fl": ("float", "0.1"),
    "fl7": ("float", "1.2345678"),  # (7 digits: the text protocol prints a FLOAT with 6)
    "db": ("double", "1.5e300"),
    "bt": ("bit(5)", "b'10101'"),
    "bt64": ("bit(64)", "b'1111111111111111111111111111111111111111111111111111111111111111'"),
    "en": ("enum('x','y','z z')", "'z z'"),
    "st": ("set('a','b','c')", "'a,c'"),
    "js": ("json", '\'{"a": [1, "é"]}\''),
    "uu": ("uuid", "'123e4567-e89b-12d3-a456-426614174000'"),
    "i6": ("inet6", "'2001:db8::1'"),
    "i4": ("inet4", "'10.0.0.255'"),
    "da": ("date", "'2024-02-29'"),
    "dz": ("date", "'0000-00-00'"),
    "tm": ("time(3)", "'-838:59:59.000'"),
    "dt": ("datetime(6)", "'2024-01-02 03:04:05.123456'"),
    "ts": ("timestamp(6) NULL", "'2038-01-19 03:14:07.999999'"),
    "yr": ("year", "2155"),
    "ch": ("char(4)", "'ab'"),
    "vc": ("varchar(300)", "'héllo 🙂'"),
    "bn": ("binary(4)", "x'01020000'"),
    "vb": ("varbinary(10)", "x'00ff'"),
    "bl": ("longblob", "x'deadbeef'"),
    "gm": ("point", "ST_GeomFromText('POINT(1 2)')"),
}


@pytest.mark.parametrize("server_mode", ["", "PAD_CHAR_TO_FULL_LENGTH,EMPTY_STRING_IS_NULL"])
async def test_a_seeded_row_is_encoded_as_the_fetcher_encodes_it(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str, server_mode: str
) -> None:
    """Also with a server default mode that changes what a SELECT returns (CHAR values
    padded, '' read as NULL): the seed's session used it (review)."""
    if server_mode:
        mysql_execute(mysql_server, mysql_db, f"SET GLOBAL sql_mode = '{server_mode}'")
    try:
        await _seeded_like_streamed(tmp_path, mysql_server, mysql_db)
    finally:
        mysql_execute(mysql_server, mysql_db, "SET GLOBAL sql_mode = DEFAULT")


async def _seeded_like_streamed(tmp_path: Path, server: EmbeddedMariaDB, db: str) -> None:
    cols = ", ".join(f"`{n}` {t}" for n, (t, _) in TYPES.items())
    mysql_execute(
        server, db, "SET SESSION sql_mode = ''", f"CREATE TABLE ty (id int PRIMARY KEY, {cols})"
    )
    async with Relay(relay_config(tmp_path, server, db, 16 << 20)) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        names = ", ".join(f"`{n}`" for n in TYPES)
        values = ", ".join(v for _, v in TYPES.values())
        mysql_execute(
            server,
            db,
            "SET SESSION sql_mode = ''",
            f"INSERT INTO ty (id, {names}) VALUES (1, {values})",
            "INSERT INTO ty (id) VALUES (2)",  # every column NULL
        )
        m = marker(server, db)
        host = relay.hosts["my"]
        await wait_until(lambda: host.buffer.meta.last_scn >= m)
        sel = host.buffer.select(-1, -1, 1 << 30)
        assert sel is not None
        data = b"".join(bytes(v) for v in sel.views)
        assert host.buffer.release(sel)
        registry = host.registry
        streamed: dict[bytes, tuple[int, bytes]] = {}
        for off in parse_stream(data)[0].tolist():
            h = verify_event(data, off)
            if h.op == Op.INSERT and registry.name_for_id(h.source_id) == f"{db}.ty":
                streamed[bytes(event_at(data, off, h)[1])] = (h.schema_version, data[off : off + 8])
        schemas = [(registry.source_id(n), s) for n in [f"{db}.ty"] for s in registry.versions(n)]
        seeded: list[bytes] = []
        scn = seed_mysql(
            SeedRequest(
                seed_user(server),
                1,
                (f"{db}.ty",),
                schemas=tuple(schemas),
                relay_fetcher=host.status()["fetcher"],
            ),
            lambda _t, events, _scn: seeded.extend(events),
            SeedProgress(),
        )
    assert scn >= m  # the snapshot is after everything committed before it
    assert len(seeded) == 2 and len(streamed) == 2
    schema = registry.latest(f"{db}.ty")
    decoder = ChangeDecoder(schema)
    for event in seeded:
        h = verify_event(event, 0)
        assert (h.op, h.scn, h.schema_version) == (Op.INSERT, scn, schema.version)
        assert registry.name_for_id(h.source_id) == f"{db}.ty"
        payload = bytes(event_at(event, 0, h)[1])
        change = decoder.decode(payload)
        assert change.after is not None
        if change.after["id"] == 1:
            assert list(change.after_not_sent) == ["dz"]  # a zero date: no Avro value
        # the very bytes the fetcher wrote for the same row (values, nulls, not-sent columns)
        assert payload in streamed, change


def test_a_seed_is_refused_unless_aligned_with_the_relays_server(
    mysql_server: EmbeddedMariaDB, caplog: pytest.LogCaptureFixture
) -> None:
    """No running mysql fetcher on the relay, or another server than the relay's: refused."""
    caplog.set_level(logging.DEBUG)
    dsn = seed_user(mysql_server)

    def seed(relay_fetcher: dict[str, Any] | None) -> int:
        request = SeedRequest(dsn, 1, ("d.t",), relay_fetcher=relay_fetcher)
        return seed_mysql(request, lambda *_: None, SeedProgress())

    for missing in (None, {"kind": "postgres"}, {"kind": "mysql", "mysql_server_id": 0}):
        with pytest.raises(SourceError, match="not a running mysql fetcher") as info:
            seed(missing)
        assert info.value.retriable
    with pytest.raises(SourceConfigError, match="the relay reads server id 99"):
        seed({"kind": "mysql", "mysql_server_id": 99, "scn_base": 0})
    with pytest.raises(SourceConfigError, match=r"d\.t is not in the relay's stream"):
        seed({"kind": "mysql", "mysql_server_id": 1, "scn_base": 0})
    bad = dsn.replace(PASSWORD, "wrong-" + PASSWORD)
    with pytest.raises(SourceConfigError) as denied:
        seed_mysql(
            SeedRequest(bad, 1, ("d.t",), relay_fetcher={"kind": "mysql", "mysql_server_id": 1}),
            lambda *_: None,
            SeedProgress(),
        )
    assert PASSWORD not in str(denied.value)
    assert PASSWORD not in caplog.text


def test_seed_config_of_kind_mysql_wants_a_mysql_url() -> None:
    secret_dsn = f"postgresql://u:{PASSWORD}@h/db"
    with pytest.raises(ConfigError, match="mysql://") as info:
        SeedConfig(kind="mysql", dsn=secret_dsn)
    assert PASSWORD not in str(info.value)
    cfg = SeedConfig(kind="mysql", dsn=f"mysql://u:{PASSWORD}@h:3306")
    assert PASSWORD not in repr(cfg)  # secrets stay out of reprs (and so of logs)
    # tables seeded before are skipped: nothing to do, no connection made
    progress = SeedProgress(scn=7)
    request = SeedRequest(cfg.dsn, 1, ("d.t",), done=frozenset({"d.t"}))
    assert seed_mysql(request, lambda *_: None, progress) == 7
    assert progress.state == "copied" and progress.tables_done == 1


def test_a_table_whose_name_holds_a_percent_sign_is_found(
    mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    """The readability check ran its query without parameters, so the doubled ``%`` of
    the quoted name stayed doubled: the table was not found, and a seed recorded it as
    gone, copied nothing, and a gap repair ended without it (review)."""
    from changebus.bootstrap._seed_mysql_conn import check_readable

    mysql_execute(mysql_server, mysql_db, "CREATE TABLE `t%x` (id int PRIMARY KEY)")
    conn = mysql_server.connect()
    try:
        check_readable(conn, f"{mysql_db}.t%x")  # raised SourceConfigError(gone=True)
        with pytest.raises(SourceConfigError) as err:
            check_readable(conn, f"{mysql_db}.t%y")
        assert err.value.details.get("gone") is True
    finally:
        conn.close()
