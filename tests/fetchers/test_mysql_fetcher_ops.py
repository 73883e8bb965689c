"""The mysql fetcher in operation: ops, DDL, rotation, restarts, kill -9, settings, purges."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from test_mysql_fetcher import (
    caught_up,
    execute,
    relay_config,
    replay,
    source_rows,
    wait_until,
)

from changebus.fetchers import ResumePoint
from changebus.fetchers.mysql import (
    EmbeddedMariaDB,
    MySQLConfig,
    MySQLFetcher,
    consistent_snapshot,
)
from changebus.relay import Relay
from changebus.schemas import (
    DataLoss,
    Heartbeat,
    Op,
    SchemaChange,
    SourceConfigError,
    binlog_file_number,
    binlog_to_scn,
)
from fix_mysql import master_scn

pytestmark = pytest.mark.mysql

ROOT = Path(__file__).resolve().parents[2]


def current(rows: dict[Any, dict[str, Any]], source: dict[Any, dict[str, Any]]) -> dict[Any, Any]:
    """Rebuilt rows read with the source's present columns (as an Avro reader schema would)."""
    columns = next(iter(source.values())).keys() if source else ()
    return {k: {c: r.get(c) for c in columns} for k, r in rows.items()}


def make_tables(server: EmbeddedMariaDB, db: str) -> None:
    execute(
        server,
        db,
        "CREATE TABLE acct (id int PRIMARY KEY, bal bigint, name varchar(20))",
        "CREATE TABLE log (id int AUTO_INCREMENT PRIMARY KEY, acct int, delta int)",
    )


def workload(server: EmbeddedMariaDB, db: str, seed: int, txns: int) -> None:
    """Multi-table transactions: inserts, updates (incl. key changes) and deletes."""
    rnd = random.Random(seed)
    conn = server.connect(db)
    conn.autocommit(False)
    try:
        with conn.cursor() as cur:
            for _ in range(txns):
                for _ in range(rnd.randint(1, 4)):
                    k = rnd.randint(1, 40)
                    r = rnd.random()
                    if r < 0.5:
                        cur.execute(
                            "INSERT INTO acct VALUES (%s, %s, %s) ON DUPLICATE KEY UPDATE bal = VALUES(bal)",
                            (k, rnd.randint(0, 1000), f"n{k}"),
                        )
                    elif r < 0.75:
                        cur.execute("UPDATE acct SET bal = bal + 1 WHERE id = %s", (k,))
                    elif r < 0.85:
                        cur.execute("UPDATE IGNORE acct SET id = id + 100 WHERE id = %s", (k,))
                    else:
                        cur.execute("DELETE FROM acct WHERE id = %s", (k,))
                    cur.execute("INSERT INTO log (acct, delta) VALUES (%s, 1)", (k,))
                conn.commit()
    finally:
        conn.close()


@pytest.mark.parametrize("decode_workers", [0, 1])
async def test_ops_ddl_rotation_truncate_and_restart(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str, decode_workers: int
) -> None:
    make_tables(mysql_server, mysql_db)
    cfg = relay_config(tmp_path, mysql_server, mysql_db, decode_workers=decode_workers)
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        await asyncio.to_thread(workload, mysql_server, mysql_db, 1, 30)
        execute(mysql_server, mysql_db, "FLUSH BINARY LOGS")
        await asyncio.to_thread(workload, mysql_server, mysql_db, 2, 20)
        # DDL mid-stream: a new column, then rows with it; then a dropped column
        execute(mysql_server, mysql_db, "ALTER TABLE acct ADD COLUMN note json NULL")
        execute(mysql_server, mysql_db, "UPDATE acct SET note = '{\"k\": 1}' WHERE id < 20")
        await caught_up(relay, mysql_server, mysql_db)
        rows, first_scns, events = replay(relay, "acct")
        src = source_rows(mysql_server, mysql_db, "acct")
        assert current(rows, src) == src
    # more while the relay is down: a rotation, a column drop, a truncate
    execute(mysql_server, mysql_db, "FLUSH BINARY LOGS", "ALTER TABLE acct DROP COLUMN note")
    await asyncio.to_thread(workload, mysql_server, mysql_db, 3, 20)
    execute(
        mysql_server, mysql_db, "TRUNCATE TABLE log", "INSERT INTO log (acct, delta) VALUES (7, 7)"
    )
    async with Relay(cfg) as relay:
        await caught_up(relay, mysql_server, mysql_db)
        rows, scns, events = replay(relay, "acct")
        log_rows, _, _ = replay(relay, "log")
        status = relay.hosts["my"].status()
    assert scns[: len(first_scns)] == first_scns  # nothing rewritten
    assert scns == sorted(set(scns))  # commit order, no duplicate window
    src = source_rows(mysql_server, mysql_db, "acct")
    assert current(rows, src) == src and "note" not in src[next(iter(src))]
    assert log_rows == source_rows(mysql_server, mysql_db, "log")
    assert len({s >> 32 for s in scns}) >= 3  # three binlog files
    ops = [op for op, _ in events]
    assert Op.TRUNCATE in ops and Op.UPDATE in ops and Op.DELETE in ops
    versions = [
        (p.source, p.version)
        for op, p in events
        if op == Op.SCHEMA_CHANGE and isinstance(p, SchemaChange)
    ]
    acct = [v for s, v in versions if s.endswith(".acct")]
    assert acct == [1, 2, 3]  # survived the restart: no version repeated or renumbered
    updates = [p[1] for op, p in events if op == Op.UPDATE and p[0].endswith(".acct")]
    assert all(u.before is not None and u.after is not None for u in updates)
    assert status["fetcher"]["kind"] == "mysql" and status["fetcher"]["windows"] > 0
    assert status["fetcher"]["decode_workers"] == decode_workers
    # a TRUNCATE that comes first after a restart, before any row change of its table
    # in the new run (no TABLE_MAP for it yet): it was dropped, the old rows lived on
    assert source_rows(mysql_server, mysql_db, "log")  # (the row inserted above)
    execute(mysql_server, mysql_db, "TRUNCATE TABLE log")
    async with Relay(cfg) as relay:
        await caught_up(relay, mysql_server, mysql_db)
        log_rows, _, log_events = replay(relay, "log")
    assert log_rows == source_rows(mysql_server, mysql_db, "log") == {}
    assert [op for op, _ in log_events].count(Op.TRUNCATE) == 2


@pytest.mark.parametrize(
    ("setting", "bad", "good"),
    [
        ("binlog_format", "STATEMENT", "ROW"),
        ("binlog_format", "MIXED", "ROW"),
        ("binlog_row_image", "MINIMAL", "FULL"),
        ("binlog_row_image", "NOBLOB", "FULL"),
        ("binlog_row_metadata", "MINIMAL", "FULL"),
    ],
)
async def test_wrong_server_setting_is_a_clear_error(
    mysql_server: EmbeddedMariaDB, mysql_db: str, setting: str, bad: str, good: str
) -> None:
    fetcher = MySQLFetcher(
        "my", 1, MySQLConfig(host="127.0.0.1", port=mysql_server.port, user="root")
    )
    execute(mysql_server, mysql_db, f"SET GLOBAL {setting} = '{bad}'")
    try:
        with pytest.raises(SourceConfigError, match=f"{setting} is {bad}.*{setting} = {good}") as e:
            await fetcher.start(ResumePoint())
        assert not e.value.retriable
    finally:
        execute(mysql_server, mysql_db, f"SET GLOBAL {setting} = '{good}'")


async def test_compressed_binlog_events_are_refused_at_start(
    mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    """The replication library has no reader for MariaDB's compressed events: with
    log_bin_compress on, rows over 256 bytes were skipped without a word."""
    fetcher = MySQLFetcher(
        "my", 1, MySQLConfig(host="127.0.0.1", port=mysql_server.port, user="root")
    )
    execute(mysql_server, mysql_db, "SET GLOBAL log_bin_compress = ON")
    try:
        with pytest.raises(SourceConfigError, match="log_bin_compress is ON") as e:
            await fetcher.start(ResumePoint())
        assert not e.value.retriable
    finally:
        execute(mysql_server, mysql_db, "SET GLOBAL log_bin_compress = OFF")


async def test_missing_privileges_are_a_clear_error(
    mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    # no privilege at all: the start-up checks fail; BINLOG MONITOR + SELECT but no
    # REPLICATION SLAVE: the binlog stream itself is refused
    users = {f"n{mysql_db}": "", f"m{mysql_db}": "BINLOG MONITOR, SELECT"}
    for user, grants in users.items():
        execute(mysql_server, mysql_db, f"CREATE USER '{user}'@'127.0.0.1' IDENTIFIED BY 'pw'")
        if grants:
            execute(mysql_server, mysql_db, f"GRANT {grants} ON *.* TO '{user}'@'127.0.0.1'")
    try:
        for user in users:
            config = MySQLConfig(
                port=mysql_server.port, user=user, password="pw", reconnect_backoff_s=0.01
            )
            fetcher = MySQLFetcher("my", 1, config)
            with pytest.raises(SourceConfigError, match="REPLICATION SLAVE") as e:
                await start_and_read(fetcher)
            await fetcher.close()
            assert not e.value.retriable and "pw" not in e.value.message
    finally:
        for user in users:
            execute(mysql_server, mysql_db, f"DROP USER '{user}'@'127.0.0.1'")


async def start_and_read(fetcher: MySQLFetcher) -> None:
    await fetcher.start(ResumePoint())
    async for _ in fetcher.windows():
        pass


async def test_a_statement_logged_change_stops_the_stream_with_a_clear_error(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    make_tables(mysql_server, mysql_db)
    async with Relay(relay_config(tmp_path, mysql_server, mysql_db)) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        execute(mysql_server, mysql_db, "INSERT INTO acct VALUES (1, 1, 'row')")
        execute(
            mysql_server,
            mysql_db,
            "SET SESSION binlog_format = 'STATEMENT'",
            "INSERT INTO acct VALUES (2, 2, 'statement')",
        )
        await wait_until(lambda: relay.hosts["my"].state == "failed")
        host = relay.hosts["my"]
        assert "logged as a statement" in host.last_error
        assert "'statement'" not in host.last_error  # no statement text
        rows, _, _ = replay(relay, "acct")
    assert list(rows) == [1]  # the row change before it is kept


@pytest.mark.parametrize("how", ["commented_statement", "compressed"])
async def test_changes_the_library_cannot_read_stop_the_stream_instead_of_being_skipped(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str, how: str
) -> None:
    """Review: a statement-logged change after a comment (``-- c``) did not match the
    statement check, and compressed events (MariaDB's log_bin_compress, checked only at
    start, turned on while the relay ran) were skipped by the library: both changes were
    lost without a word (MariaDB compresses query events: statements, DDL). Both now
    stop the partition with the binlog position."""
    make_tables(mysql_server, mysql_db)
    try:
        async with Relay(relay_config(tmp_path, mysql_server, mysql_db)) as relay:
            await wait_until(lambda: relay.hosts["my"].state == "streaming")
            execute(mysql_server, mysql_db, "INSERT INTO acct VALUES (1, 1, 'row')")
            if how == "compressed":
                execute(mysql_server, mysql_db, "SET GLOBAL log_bin_compress = ON")
                # a statement past log_bin_compress_min_len (256 bytes) is logged as a
                # compressed query event: a DDL the fetcher would not have seen
                execute(
                    mysql_server,
                    mysql_db,
                    f"ALTER TABLE acct ADD COLUMN extra int COMMENT '{'c' * 300}'",
                )
                needle = "compressed event (MariaDB log_bin_compress = ON)"
            else:
                execute(
                    mysql_server,
                    mysql_db,
                    "SET SESSION binlog_format = 'STATEMENT'",
                    "-- a comment first\nINSERT INTO acct VALUES (2, 2, 'statement')",
                )
                needle = "logged as a statement"
            host = relay.hosts["my"]
            await wait_until(lambda: host.state == "failed")
            assert needle in host.last_error, host.last_error
            rows, _, _ = replay(relay, "acct")
    finally:
        execute(mysql_server, mysql_db, "SET GLOBAL log_bin_compress = OFF")
    assert list(rows) == [1]  # the row change before it is kept


async def test_a_dropped_partition_is_logged_as_rows_removed_without_events(
    tmp_path: Path,
    mysql_server: EmbeddedMariaDB,
    mysql_db: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """DROP/TRUNCATE PARTITION remove rows with no row events; the fetcher said so only
    at INFO as any DDL (review): now a warning naming the table and what to do."""
    execute(
        mysql_server,
        mysql_db,
        "CREATE TABLE parted (id int PRIMARY KEY) PARTITION BY RANGE (id) "
        "(PARTITION p0 VALUES LESS THAN (10), PARTITION p1 VALUES LESS THAN MAXVALUE)",
    )
    caplog.set_level(logging.INFO, logger="changebus.fetchers.mysql")
    async with Relay(relay_config(tmp_path, mysql_server, mysql_db)) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        execute(mysql_server, mysql_db, "INSERT INTO parted VALUES (1), (20)")
        execute(mysql_server, mysql_db, "ALTER TABLE parted ADD COLUMN v int")
        execute(mysql_server, mysql_db, "ALTER TABLE parted DROP PARTITION p0")
        await wait_until(lambda: "removes rows of" in caplog.text)
    warned = [r for r in caplog.records if "removes rows of" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert f"{mysql_db}.parted" in warned[0].getMessage()


async def test_fetcher_reconnects_after_the_server_drops_its_stream(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    make_tables(mysql_server, mysql_db)
    cfg = relay_config(tmp_path, mysql_server, mysql_db, reconnect_backoff_s=0.05)
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        writer = asyncio.create_task(asyncio.to_thread(workload, mysql_server, mysql_db, 5, 150))
        kills = 0
        while not writer.done():
            kills += await asyncio.to_thread(kill_binlog_dumps, mysql_server)
            await asyncio.sleep(0.1)
        await writer
        if not kills:  # the writer was quicker than the first kill: one more round
            await wait_until(lambda: _binlog_client(mysql_server))
            kills += await asyncio.to_thread(kill_binlog_dumps, mysql_server)
            await asyncio.to_thread(workload, mysql_server, mysql_db, 6, 10)
        await caught_up(relay, mysql_server, mysql_db)
        rows, scns, _ = replay(relay, "acct")
        status = relay.hosts["my"].status()
        restarts = relay.hosts["my"].stats["fetcher_restarts"]
    # the fetcher reconnected by itself: the relay never had to restart it
    assert kills >= 1 and status["fetcher"]["reconnects"] >= 1 and restarts == 0
    assert scns == sorted(set(scns)) and len(scns) >= 150  # no loss, no duplicate window
    assert rows == source_rows(mysql_server, mysql_db, "acct")


def kill_binlog_dumps(server: EmbeddedMariaDB) -> int:
    """Kill the server's binlog dump threads (what a network cut looks like); how many."""
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT ID FROM information_schema.PROCESSLIST WHERE COMMAND LIKE 'Binlog Dump%'"
            )
            ids = [int(r[0]) for r in cur.fetchall()]
            for pid in ids:
                cur.execute(f"KILL {pid}")
            return len(ids)
    finally:
        conn.close()


async def test_a_rewritten_binlog_is_refused_not_misread(tmp_path: Path) -> None:
    """Same file names, other contents (RESET MASTER, or a failover to another server)."""
    server = await asyncio.to_thread(EmbeddedMariaDB.start, Path(tempfile.mkdtemp()))
    try:
        execute(server, "mysql", "CREATE DATABASE fo")
        make_tables(server, "fo")
        cfg = relay_config(tmp_path, server, "fo")
        async with Relay(cfg) as relay:
            await wait_until(lambda: relay.hosts["my"].state == "streaming")
            await asyncio.to_thread(workload, server, "fo", 1, 10)
            await caught_up(relay, server, "fo")
            _, before, _ = replay(relay, "acct")
        execute(server, "fo", "RESET MASTER")
        await asyncio.to_thread(workload, server, "fo", 2, 30)
        async with Relay(cfg) as relay:
            await wait_until(lambda: relay.hosts["my"].state == "failed")
            assert "is not in this server's binlog" in relay.hosts["my"].last_error
            _, after, _ = replay(relay, "acct")
        assert after == before  # nothing read from the wrong place
    finally:
        await asyncio.to_thread(server.stop)
        shutil.rmtree(server.directory, ignore_errors=True)


async def test_purged_binlog_becomes_a_data_loss_event(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    make_tables(mysql_server, mysql_db)
    cfg = relay_config(tmp_path, mysql_server, mysql_db)
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        await asyncio.to_thread(workload, mysql_server, mysql_db, 1, 5)
        await caught_up(relay, mysql_server, mysql_db)
        _, before, _ = replay(relay, "acct")
    # while the relay is down: changes, then their binlog file is purged
    await asyncio.to_thread(workload, mysql_server, mysql_db, 2, 5)
    current = await asyncio.to_thread(purge_binlogs, mysql_server)
    execute(mysql_server, mysql_db, "INSERT INTO acct VALUES (999, 9, 'after')")
    async with Relay(cfg) as relay:
        await caught_up(relay, mysql_server, mysql_db)
        rows, scns, events = replay(relay, "acct")
    losses = [p for op, p in events if op == Op.DATA_LOSS and isinstance(p, DataLoss)]
    assert len(losses) == 1
    assert losses[0].from_scn == before[-1] + 1 and "purged" in losses[0].reason
    assert losses[0].to_scn == binlog_to_scn(binlog_file_number(current), 4)
    assert scns == sorted(set(scns))
    # the stream goes on from the oldest binlog kept: the row written after the purge is there
    assert rows[999]["name"] == "after"


def purge_binlogs(server: EmbeddedMariaDB) -> str:
    """Rotate, then purge every binlog file but the new one (its name)."""
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("FLUSH BINARY LOGS")
            cur.execute("SHOW MASTER STATUS")
            current = str(cur.fetchone()[0])
            # the stopped relay's dump thread may linger and keep its file in use
            cur.execute(
                "SELECT ID FROM information_schema.PROCESSLIST WHERE COMMAND LIKE 'Binlog Dump%'"
            )
            for (pid,) in cur.fetchall():
                cur.execute(f"KILL {int(pid)}")
            deadline = time.monotonic() + 10  # until InnoDB's binlog checkpoint moves on
            while True:
                cur.execute(f"PURGE BINARY LOGS TO '{current}'")
                cur.execute("SHOW BINARY LOGS")
                if [r[0] for r in cur.fetchall()] == [current]:
                    return current
                assert time.monotonic() < deadline, "the server kept the old binlog"
                time.sleep(0.1)
    finally:
        conn.close()


def test_relay_killed_with_9_mid_stream_loses_and_repeats_nothing(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    make_tables(mysql_server, mysql_db)
    data_dir = tmp_path / "relay"
    toml = tmp_path / "relay.toml"
    toml.write_text(
        f'data_dir = "{data_dir}"\nflush_interval_s = 0\n[http]\nport = 0\n'
        f'[[partitions]]\nname = "my"\nid = 1\ncapacity_bytes = "16MiB"\n'
        f'[partitions.fetcher]\nkind = "mysql"\n'
        f'options = {{ host = "127.0.0.1", port = {mysql_server.port}, user = "root", '
        f'databases = ["{mysql_db}"] }}\n'
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
        deadline = time.monotonic() + 30
        while not any(data_dir.glob("**/*")) or not _binlog_client(mysql_server):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        workload(mysql_server, mysql_db, 1, 40)
        proc.send_signal(signal.SIGKILL)
        workload(mysql_server, mysql_db, 2, 40)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)

    async def restart() -> tuple[dict[Any, dict[str, Any]], list[int]]:
        async with Relay(relay_config(tmp_path, mysql_server, mysql_db)) as relay:
            await wait_until(lambda: relay.hosts["my"].state == "streaming", 60)
            await caught_up(relay, mysql_server, mysql_db)
            rows, scns, _ = replay(relay, "acct")
            return rows, scns

    rows, scns = asyncio.run(restart())
    assert scns == sorted(set(scns))  # no duplicate window, commit order
    assert len(scns) >= 80  # every transaction
    assert rows == source_rows(mysql_server, mysql_db, "acct")


def _binlog_client(server: EmbeddedMariaDB) -> bool:
    """True when a binlog reader (the relay's fetcher) is connected."""
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE COMMAND LIKE 'Binlog Dump%'"
            )
            return bool(cur.fetchone()[0])
    finally:
        conn.close()


async def test_consistent_snapshot_plus_the_stream_after_it_is_the_table(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    """Seeding: rows of a snapshot taken under load, then the windows after its SCN."""
    make_tables(mysql_server, mysql_db)
    async with Relay(relay_config(tmp_path, mysql_server, mysql_db)) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        host = relay.hosts["my"]
        writer = asyncio.create_task(asyncio.to_thread(workload, mysql_server, mysql_db, 7, 400))
        # the snapshot lands in the middle of the writes
        await wait_until(lambda: host.buffer.stats["windows_appended"] >= 20)
        config = MySQLConfig(port=mysql_server.port, user="root")
        with await asyncio.to_thread(consistent_snapshot, config) as snap:
            assert not writer.done()
            seeded = {r["id"]: r for batch in snap.rows(mysql_db, "acct", 7) for r in batch}
            at = snap.scn
        await writer
        assert not writer.exception()
        await caught_up(relay, mysql_server, mysql_db)
        _, scns, events = replay(relay, "acct")
    assert scns[0] < at < scns[-1]  # taken while the stream ran
    # apply the changes of the windows after the snapshot to its rows
    rows = dict(seeded)
    pending: list[tuple[Op, Any]] = []
    window_scns = iter(scns)
    applied = 0
    for op, payload in events:
        if op == Op.END_OF_WINDOW:
            if next(window_scns) > at:
                for change_op, change in pending:
                    applied += 1
                    if change_op in (Op.UPDATE, Op.DELETE):
                        rows.pop(change.before["id"], None)
                    if change_op in (Op.INSERT, Op.UPDATE):
                        rows[change.after["id"]] = change.after
            pending = []
        elif not op.is_control and payload[0].endswith(".acct"):
            pending.append((op, payload[1]))
    assert applied > 0 and seeded  # both halves matter
    assert rows == source_rows(mysql_server, mysql_db, "acct")


async def test_a_quiet_database_still_moves_the_resume_position(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    """Transactions elsewhere become a HEARTBEAT window now and then, not one each."""
    make_tables(mysql_server, mysql_db)
    other = f"o{mysql_db}"
    execute(mysql_server, mysql_db, f"CREATE DATABASE {other}")
    execute(mysql_server, other, "CREATE TABLE busy (id int PRIMARY KEY)")
    cfg = relay_config(tmp_path, mysql_server, mysql_db, idle_window_interval_s=0.3)
    try:
        async with Relay(cfg) as relay:
            host = relay.hosts["my"]
            await wait_until(lambda: host.state == "streaming")
            first = host.buffer.meta.last_scn
            t0 = time.monotonic()
            for i in range(60):
                execute(mysql_server, other, f"INSERT INTO busy VALUES ({i})")
                await asyncio.sleep(0.02)
            target = master_scn(mysql_server)
            # the last of them may be skipped (within the interval): it goes out when the
            # server turns idle (its heartbeat), so the position reaches the binlog's end
            await wait_until(lambda: host.buffer.meta.last_scn >= target)
            elapsed = time.monotonic() - t0
            _, scns, events = replay(relay, "acct")
    finally:
        execute(mysql_server, mysql_db, f"DROP DATABASE {other}")
    beats = [p for op, p in events if op == Op.HEARTBEAT]
    # one per interval at most (61 transactions passed), and no other windows
    assert 1 <= len(beats) <= min(elapsed / 0.3 + 1, 40) and len(scns) == len(beats)
    assert scns[-1] > first and scns == sorted(set(scns))
    assert all(isinstance(b, Heartbeat) and "file=" in b.source_position for b in beats)


def test_mysql_partial_json_updates_are_read_to_be_refused() -> None:
    """MySQL logs a session's partial JSON updates (``binlog_row_value_options =
    PARTIAL_JSON``) as their own event type, which the library drops before anything
    sees it unless its class is asked for: those updates vanished without a word
    (review; MariaDB has no such event, so no server here writes one)."""
    import inspect

    from pymysqlreplication.constants.BINLOG import PARTIAL_UPDATE_ROWS_EVENT

    from changebus.fetchers.mysql import _stream

    source = inspect.getsource(_stream._open_reader)
    assert "PartialUpdateRowsEvent," in source.split("only_events")[1]
    assert "PartialUpdateRowsEvent" in inspect.getsource(_stream._stream).split("refused")[1]
    with pytest.raises(SourceConfigError) as info:
        _stream._refuse_unread(PARTIAL_UPDATE_ROWS_EVENT, "bin.000007", 4242)
    assert "partial JSON update" in info.value.message
    assert "bin.000007:4242" in info.value.message


def test_a_mysql_binary_json_column_is_refused_with_a_clear_error() -> None:
    """MySQL (not MariaDB) logs json columns in its binary JSON form, which the fetcher
    sent as if it were UTF-8 text: garbage to every reader (review). Refused by name
    until decoded (MariaDB's json, a longtext, is covered by the tests against it)."""
    from types import SimpleNamespace

    from changebus.fetchers.mysql import layout_from_table_map

    event = SimpleNamespace(
        schema="shop",
        table="docs",
        columns=[SimpleNamespace(name="doc", type=245, length_size=4)],
        null_bitmask=b"\x01",
        optional_metadata=SimpleNamespace(simple_primary_key_list=[]),
    )
    with pytest.raises(SourceConfigError) as info:
        layout_from_table_map(event)
    assert "'doc' of shop.docs is a MySQL json column" in info.value.message
    assert not info.value.retriable


async def test_create_table_select_is_rows_in_row_format_and_stops_in_statement_format(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    """ROW format logs ``CREATE TABLE ... SELECT`` as a plain CREATE TABLE and the new
    table's rows as row events: captured. A statement-format session logged the SELECT
    itself, taken for DDL: the new table's rows were lost without a word (review)."""
    make_tables(mysql_server, mysql_db)
    async with Relay(relay_config(tmp_path, mysql_server, mysql_db)) as relay:
        host = relay.hosts["my"]
        await wait_until(lambda: host.state == "streaming")
        execute(
            mysql_server,
            mysql_db,
            "INSERT INTO acct VALUES (1, 1, 'a'), (2, 2, 'b')",
            "CREATE TABLE copied (PRIMARY KEY (id)) SELECT * FROM acct",
        )
        await caught_up(relay, mysql_server, mysql_db)
        assert host.state == "streaming", host.last_error
        rows, _, _ = replay(relay, "copied")
        assert sorted(rows) == [1, 2]
        execute(
            mysql_server,
            mysql_db,
            "SET SESSION binlog_format = 'STATEMENT'",
            "CREATE TABLE copied2 (PRIMARY KEY (id)) SELECT * FROM acct",
        )
        await wait_until(lambda: host.state == "failed")
        assert "logged as a statement" in host.last_error
