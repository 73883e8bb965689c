"""A throwaway PostgreSQL 15 server for the tests (pytest plugin).

``pg_server`` (session scope) starts a private server with
:class:`changebus.fetchers.postgres.EmbeddedPostgres` (initdb as an
unprivileged user, 127.0.0.1 and a free port, ``wal_level = logical``) and
stops it by its pid at the end. ``pg_dsn`` gives a fresh
database per test module. Debian's binaries are used; `make test` installs
``postgresql-15`` when missing.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from changebus.fetchers.postgres import EmbeddedPostgres, message_scn
from waiting import wait_until as wait_until  # re-exported: tests import it from here

if TYPE_CHECKING:
    from changebus.relay import Relay

PgServer = EmbeddedPostgres


def writer_txn(conn: psycopg.Connection[Any], body: Callable[[], None]) -> bool:
    """Run ``body`` in one transaction of concurrent test writers; False if it lost a deadlock.

    Writers touching random keys in random order can deadlock each other; the
    server then rolls the victim's transaction back whole, so it wrote nothing
    and the tests' row-by-row comparisons with the table still hold: the writer
    just goes on with its next transaction.
    """
    try:
        with conn.transaction():
            body()
    except psycopg.errors.DeadlockDetected:
        return False
    return True


def start_pg(base: Path) -> PgServer:
    """initdb + start; returns the running server."""
    return EmbeddedPostgres.start(base)


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
    with fresh_database(pg_server) as dsn:
        yield dsn


@contextlib.contextmanager
def fresh_database(pg_server: PgServer, options: str = "", prefix: str = "t_") -> Iterator[str]:
    """A new database on ``pg_server`` (``CREATE DATABASE ... options``): its DSN; dropped
    afterwards with its replication slots."""
    name = f"{prefix}{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" {options}')
    try:
        yield pg_server.dsn(name)
    finally:
        with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
            for (slot,) in conn.execute(
                "SELECT slot_name FROM pg_replication_slots WHERE database = %s", (name,)
            ).fetchall():
                _drop_slot(conn, slot)
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


def _drop_slot(conn: psycopg.Connection[Any], slot: str) -> None:
    """Drop ``slot``; a walsender still holding it (a test's stream, closing) is ended
    first. Slot names are the server's, not the database's: one left behind fails the
    next test that creates it."""
    deadline = time.monotonic() + 10
    while True:
        conn.execute(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots"
            " WHERE slot_name = %s AND active_pid IS NOT NULL",
            (slot,),
        )
        try:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            return
        except psycopg.errors.ObjectInUse:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


async def caught_up(relay: Relay, dsn: str) -> None:
    """Wait until the relay holds everything committed so far (a sync marker's window)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        marker = conn.execute("SELECT pg_logical_emit_message(false, 'sync', 'x')::text").fetchone()
    assert marker is not None
    target = message_scn(marker[0])
    await wait_until(lambda: relay.hosts["pg"].buffer.meta.last_scn >= target)
