"""A throwaway PostgreSQL 15 server for the tests (pytest plugin).

``pg_server`` (session scope) runs ``initdb`` into a temporary directory as
an unprivileged helper user (initdb refuses root), starts the postmaster on
127.0.0.1 with a free port, ``wal_level = logical`` and a private socket
directory, and stops it by its pid at the end. ``pg_dsn`` gives a fresh
database per test module. Debian's binaries are used; `make test` installs
``postgresql-15`` when missing.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PG_BIN = Path(os.environ.get("CHANGEBUS_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
PG_USER = "changebus-pgtest"


@dataclass
class PgServer:
    """A running throwaway server."""

    directory: Path
    port: int
    pid: int

    def dsn(self, dbname: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={dbname}"

    def stop(self) -> None:
        try:
            os.kill(self.pid, signal.SIGINT)  # fast shutdown
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
        os.kill(self.pid, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_as(user: str | None, args: list[str]) -> subprocess.CompletedProcess[str]:
    cmd = ["runuser", "-u", user, "--", *args] if user else args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def start_pg(base: Path) -> PgServer:
    """initdb + start; returns the running server."""
    if not (PG_BIN / "initdb").exists():
        raise RuntimeError(
            f"PostgreSQL 15 binaries not found in {PG_BIN} (apt-get install postgresql-15)"
        )
    user: str | None = None
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(PG_USER)
        except KeyError:
            subprocess.run(["useradd", "--system", "--no-create-home", PG_USER], check=True)
        user = PG_USER
        shutil.chown(base, user)
        base.chmod(0o755)
    data = base / "data"
    init = _run_as(
        user,
        [
            str(PG_BIN / "initdb"),
            "-D",
            str(data),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C.UTF-8",
            "--no-sync",
        ],
    )
    if init.returncode != 0:
        raise RuntimeError(f"initdb failed: {init.stderr}")
    port = _free_port()
    with (data / "postgresql.conf").open("a") as conf:
        conf.write(
            f"listen_addresses = '127.0.0.1'\nport = {port}\nunix_socket_directories = '{base}'\n"
            "wal_level = logical\nmax_replication_slots = 20\nmax_wal_senders = 20\n"
            "max_slot_wal_keep_size = 1GB\nfsync = off\nfull_page_writes = off\n"
            "shared_buffers = 128MB\nlog_min_messages = warning\n"
        )
    start = _run_as(
        user,
        [
            str(PG_BIN / "pg_ctl"),
            "-D",
            str(data),
            "-l",
            str(base / "server.log"),
            "-w",
            "-t",
            "60",
            "start",
        ],
    )
    if start.returncode != 0:
        log = (base / "server.log").read_text() if (base / "server.log").exists() else ""
        raise RuntimeError(f"postgres did not start: {start.stderr}\n{log}")
    pid = int((data / "postmaster.pid").read_text().splitlines()[0])
    return PgServer(base, port, pid)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    base = Path(tempfile.mkdtemp(prefix="changebus-pg-"))
    server = start_pg(base)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def pg_dsn(pg_server: PgServer) -> Iterator[str]:
    """A fresh database on the session's server; dropped afterwards."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield pg_server.dsn(name)
    finally:
        with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
            for (slot,) in conn.execute(
                "SELECT slot_name FROM pg_replication_slots WHERE database = %s", (name,)
            ).fetchall():
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
