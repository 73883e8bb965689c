"""The chaos workload against real databases: it writes its mix, survives an immediate restart
(kill -9) of the database under it, and the source keeps its invariants (no ledger gap, the
accounts' sum, TOASTed docs, the DDL)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from _chaos_check import ledger_gaps, source_ledger_high, source_rows
from _chaos_workload import SourceWorkload, WorkloadConfig
from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.fetchers.postgres import EmbeddedPostgres

CONFIG = WorkloadConfig(
    accounts=20, kv_keys=50, docs=5, big_bytes=20_000, writers=2, rate_tps=60.0, ddl_after_s=1.0
)


def restart_pg(server: EmbeddedPostgres) -> None:
    """``pg_ctl restart -m immediate`` (a crash of every backend), same port and data."""
    if hasattr(server, "restart"):
        server.restart(mode="immediate")
        return
    data = server.directory / "data"
    args = [str(server.bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w"]
    args += ["-t", "60", "-l", str(server.directory / "server.log"), "restart"]
    if os.geteuid() == 0:
        args = ["runuser", "-u", _user(data.stat().st_uid), "--", *args]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    server.pid = int((data / "postmaster.pid").read_text().splitlines()[0])


def _user(uid: int) -> str:
    import pwd

    return pwd.getpwuid(uid).pw_name


def restart_mariadb(server: EmbeddedMariaDB) -> None:
    """kill -9 mariadbd and start it again with the same arguments (port, datadir)."""
    if hasattr(server, "restart"):
        server.restart(kill=True)
        return
    argv = Path(f"/proc/{server.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    os.kill(server.pid, signal.SIGKILL)
    if server.process is not None:
        server.process.wait()
    process = subprocess.Popen(
        [a.decode() for a in argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    server.pid, server.process = process.pid, process
    deadline = time.monotonic() + 60
    while True:
        try:
            server.connect().close()
            return
        except Exception:  # noqa: BLE001 - not accepting connections yet
            assert process.poll() is None, "mariadbd did not start again"
            assert time.monotonic() < deadline, "mariadbd did not accept connections again"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def own_pg() -> Iterator[EmbeddedPostgres]:
    """A private server: restarting the session's shared one would disturb other tests."""
    base = Path(tempfile.mkdtemp(prefix="changebus-chaoswl-pg-"))
    server = EmbeddedPostgres.start(base)
    try:
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute("CREATE DATABASE chaos")
        yield server
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def own_mariadb() -> Iterator[EmbeddedMariaDB]:
    base = Path(tempfile.mkdtemp(prefix="changebus-chaoswl-my-"))
    server = EmbeddedMariaDB.start(base)
    try:
        conn = server.connect()
        with conn.cursor() as cur:
            cur.execute("CREATE DATABASE chaos")
        conn.close()
        yield server
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


def check_source(kind: str, connect: Callable[[], Any], workload: SourceWorkload) -> None:
    ledger = source_rows(kind, connect, "ledger")
    assert ledger_gaps(ledger) == []
    assert len(ledger) == workload.transactions
    assert source_ledger_high(kind, connect) == workload.high_water()
    stats = workload.stats()
    assert stats["transactions"] == len(ledger) and stats["ddl_done"]
    assert stats["high_water"] == workload.high_water() and stats["errors"] == workload.errors
    accounts = source_rows(kind, connect, "accounts")
    assert len(accounts) == CONFIG.accounts
    assert sum(row[1] for row in accounts.values()) == CONFIG.total_balance
    kinds = {row[3] for row in ledger.values()}
    assert {"transfer", "append", "kv_upsert", "doc_small"} <= kinds, kinds
    kv = source_rows(kind, connect, "kv")
    assert any(row[4] is not None for row in kv.values())  # upserts after the DDL
    assert any(row[4] is None for row in kv.values())  # rows older than the DDL
    docs = source_rows(kind, connect, "docs")
    assert all(len(row[3]) == CONFIG.big_bytes for row in docs.values())


def run_through_restart(
    kind: str, connect: Callable[[], Any], restart: Callable[[], None]
) -> SourceWorkload:
    workload = SourceWorkload(kind, connect, CONFIG, seed=7)
    workload.create_tables()
    workload.create_tables()  # idempotent
    workload.start()
    try:
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            time.sleep(0.05)
        before = workload.transactions
        assert before > 20, workload.errors
        restart()
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            time.sleep(0.05)
        assert workload.transactions > before + 20, workload.errors
    finally:
        workload.stop()
    assert not workload.running
    assert "writer_crashed" not in workload.errors, workload.errors
    assert workload.ddl_done.is_set()
    # the writers noticed the restart and reconnected
    assert (
        workload.errors.get("connect_failed", 0)
        + workload.errors.get("statement_failed", 0)
        + workload.errors.get("commit_unknown", 0)
        + workload.errors.get("query_failed", 0)
        > 0
    )
    return workload


@pytest.mark.pg
@pytest.mark.slow
def test_pg_workload_survives_immediate_restart(own_pg: EmbeddedPostgres) -> None:
    def connect() -> Any:
        return psycopg.connect(own_pg.dsn("chaos"), connect_timeout=5)

    workload = run_through_restart("pg", connect, lambda: restart_pg(own_pg))
    check_source("pg", connect, workload)
    with psycopg.connect(own_pg.dsn("chaos")) as conn:
        storage = conn.execute(
            "SELECT a.attstorage FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid"
            " WHERE c.relname = 'docs' AND a.attname = 'big'"
        ).fetchone()
        assert storage == ("e",)  # EXTERNAL: out of line, uncompressed
        toasted = conn.execute(
            "SELECT count(*) FROM docs WHERE pg_column_size(big) < octet_length(big) / 10"
        ).fetchone()
        assert toasted is not None and toasted[0] == 0  # not compressed inline either
        row = conn.execute(
            "SELECT relreplident FROM pg_class WHERE relname = 'accounts'"
        ).fetchone()
        assert row == ("f",)
    # a second start continues the ledger where it stopped
    again = SourceWorkload("pg", connect, CONFIG, seed=8)
    again.create_tables()
    again.start()
    time.sleep(0.5)
    again.stop()
    assert again.ddl_done.is_set()
    ledger = source_rows("pg", connect, "ledger")
    assert ledger_gaps(ledger) == []
    assert len(ledger) == workload.transactions + again.transactions


@pytest.mark.mysql
@pytest.mark.slow
def test_mariadb_workload_survives_kill_9(own_mariadb: EmbeddedMariaDB) -> None:
    def connect() -> Any:
        return own_mariadb.connect("chaos")

    workload = run_through_restart("mysql", connect, lambda: restart_mariadb(own_mariadb))
    check_source("mysql", connect, workload)


class FlakyCursor:
    """A real cursor whose COMMIT fails now and then, after or before reaching the server."""

    def __init__(self, conn: FlakyConnection) -> None:
        self._conn = conn
        self._cur = conn.real.cursor()

    def execute(self, sql: str, params: Any = None) -> Any:
        if sql == "COMMIT":
            faults = self._conn.faults
            faults["commits"] += 1
            n = faults["commits"]
            if n % 7 == 0:  # committed, but the answer is lost
                self._cur.execute("COMMIT")
                faults["lost_ack"] += 1
                raise psycopg.OperationalError("injected: connection lost after COMMIT")
            if n % 7 == 3:  # the COMMIT never arrived: the server rolls back
                self._cur.execute("ROLLBACK")
                faults["lost_commit"] += 1
                raise psycopg.OperationalError("injected: connection lost before COMMIT")
        return self._cur.execute(sql, params)

    def executemany(self, sql: str, rows: Any) -> None:
        self._cur.executemany(sql, rows)

    def fetchone(self) -> Any:
        return self._cur.fetchone()

    def close(self) -> None:
        self._cur.close()


class FlakyConnection:
    def __init__(self, real: Any, faults: dict[str, int]) -> None:
        self.real = real
        self.faults = faults

    @property
    def autocommit(self) -> bool:
        return bool(self.real.autocommit)

    @autocommit.setter
    def autocommit(self, value: bool) -> None:
        self.real.autocommit = value

    def cursor(self) -> FlakyCursor:
        return FlakyCursor(self)

    def close(self) -> None:
        self.real.close()


@pytest.mark.pg
def test_unknown_commit_outcomes_are_resolved_without_gap_or_duplicate(pg_dsn: str) -> None:
    faults = {"commits": 0, "lost_ack": 0, "lost_commit": 0}
    config = WorkloadConfig(accounts=10, kv_keys=20, docs=3, big_bytes=3000, rate_tps=200.0)

    def connect() -> Any:
        return psycopg.connect(pg_dsn, connect_timeout=5)

    workload = SourceWorkload("pg", lambda: FlakyConnection(connect(), faults), config, seed=3)
    workload.create_tables()
    workload.start()
    deadline = time.monotonic() + 30
    while faults["lost_ack"] < 5 or faults["lost_commit"] < 5:
        assert time.monotonic() < deadline, faults
        time.sleep(0.05)
    workload.stop()
    errors = workload.errors
    assert "writer_crashed" not in errors, errors
    assert errors["commit_unknown"] == faults["lost_ack"] + faults["lost_commit"]
    assert errors["unknown_committed"] == faults["lost_ack"]
    assert errors["unknown_rolled_back"] == faults["lost_commit"]
    ledger = source_rows("pg", connect, "ledger")
    assert ledger_gaps(ledger) == []
    assert len(ledger) == workload.transactions
    accounts = source_rows("pg", connect, "accounts")
    assert sum(row[1] for row in accounts.values()) == config.total_balance
