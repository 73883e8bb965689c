"""Immediate restarts of the throwaway databases (the chaos harness's db_restart faults), on
private servers of this module's own (the session's servers stay untouched): same port and
data directory, committed data survives, crash recovery really ran, the call returns only
once the server accepts connections."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pymysql
import pytest

from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.fetchers.postgres import EmbeddedPostgres


def gone(pid: int, wait_s: float = 5.0) -> bool:
    """True once ``pid`` has ended (a zombie waiting for init to reap it counts as ended)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return True
        if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


@pytest.fixture(scope="module")
def pg() -> Iterator[EmbeddedPostgres]:
    base = Path(tempfile.mkdtemp(prefix="changebus-pg-restart-"))
    server = EmbeddedPostgres.start(base)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def maria() -> Iterator[EmbeddedMariaDB]:
    base = Path(tempfile.mkdtemp(prefix="changebus-mysql-restart-"))
    server = EmbeddedMariaDB.start(base)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.pg
def test_postgres_immediate_restart_keeps_port_data_and_slot(pg: EmbeddedPostgres) -> None:
    port, pid = pg.port, pg.pid
    with psycopg.connect(pg.dsn(), autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS r (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO r SELECT g, 'v' || g FROM generate_series(1, 500) g")
        conn.execute("SELECT pg_create_logical_replication_slot('restart_slot', 'pgoutput')")
    log = pg.directory / "server.log"
    log_before = log.stat().st_size
    with psycopg.connect(pg.dsn(), autocommit=True) as held:
        pg.restart()  # mode="immediate"
        # the connection held across the restart was cut (every backend ended at once)
        with pytest.raises(psycopg.OperationalError):
            held.execute("SELECT 1")

    assert pg.port == port
    assert pg.pid != pid and gone(pid)
    # no shutdown checkpoint: the start ran crash recovery
    with log.open(errors="replace") as f:
        f.seek(log_before)
        assert "automatic recovery in progress" in f.read()
    with psycopg.connect(pg.dsn(), autocommit=True) as conn:
        assert conn.execute("SELECT count(*), sum(id) FROM r").fetchone() == (500, 500 * 501 // 2)
        slots = conn.execute("SELECT slot_name FROM pg_replication_slots").fetchall()
        assert ("restart_slot",) in slots
        conn.execute("INSERT INTO r VALUES (501, 'after')")  # writable again
        conn.execute("SELECT pg_drop_replication_slot('restart_slot')")


@pytest.mark.pg
def test_postgres_restart_twice_and_fast_mode(pg: EmbeddedPostgres) -> None:
    pids = {pg.pid}
    for mode in ("immediate", "fast"):
        pg.restart(mode)
        pids.add(pg.pid)
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    assert len(pids) == 3


def maria_rows(server: EmbeddedMariaDB) -> tuple[int, int]:
    conn = server.connect("restart_db")
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT count(*), sum(id) FROM r")
            count, total = cur.fetchone()
            return int(count), int(total)
    finally:
        conn.close()


def binlog_file(server: EmbeddedMariaDB) -> str:
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW MASTER STATUS")
            return str(cur.fetchone()[0])
    finally:
        conn.close()


@pytest.mark.mysql
def test_mariadb_kill9_restart_keeps_port_and_committed_data(maria: EmbeddedMariaDB) -> None:
    conn = maria.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("CREATE DATABASE IF NOT EXISTS restart_db")
            cur.execute("CREATE TABLE restart_db.r (id int PRIMARY KEY, v text) ENGINE=InnoDB")
            for i in range(1, 301):
                cur.execute("INSERT INTO restart_db.r VALUES (%s, %s)", (i, f"v{i}"))
    finally:
        conn.close()
    port, pid = maria.port, maria.pid
    first_binlog = binlog_file(maria)
    log = maria.directory / "error.log"
    log_before = log.stat().st_size
    held = maria.connect()
    try:
        maria.restart()  # kill=True
        # the connection held across the restart was cut
        with pytest.raises(pymysql.err.OperationalError), held.cursor() as cur:
            cur.execute("SELECT 1")
    finally:
        held.close()

    assert maria.port == port
    assert maria.pid != pid and gone(pid)
    assert maria_rows(maria) == (300, 300 * 301 // 2)
    # killed, not shut down: the binlog was left open and is recovered, a new one begun
    with log.open(errors="replace") as f:
        f.seek(log_before)
        assert "Recovering after a crash" in f.read()
    assert binlog_file(maria) != first_binlog


@pytest.mark.mysql
def test_mariadb_clean_restart_and_a_second_kill(maria: EmbeddedMariaDB) -> None:
    pids = {maria.pid}
    maria.restart(kill=False)
    pids.add(maria.pid)
    maria.restart(kill=True)
    pids.add(maria.pid)
    assert len(pids) == 3
    assert maria_rows(maria)[0] == 300
