"""The postgres fetcher over TLS: ``stream_reader = "auto"`` falls back to libpq.

The socket reader reads the protocol from the raw socket, which TLS encrypts;
on an encrypted connection ``auto`` must use libpq (and still deliver every
change, exactly once), and ``socket`` must refuse with a clear error. A
throwaway Postgres 15 with a self-signed certificate (made with openssl) on
loopback; the fetcher connects with ``sslmode=require``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from test_pg_fetcher import replay_buffer, source, workload
from test_pg_socket_reader import config, make_table

from changebus.fetchers.postgres import EmbeddedPostgres
from changebus.relay import Relay
from fix_pg import caught_up, wait_until

pytestmark = pytest.mark.pg


@pytest.fixture(scope="module")
def tls_pg() -> Iterator[EmbeddedPostgres]:
    """A private server with a self-signed certificate and ``ssl = on`` (set at reload)."""
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make the test certificate")
    base = Path(tempfile.mkdtemp(prefix="changebus-pg-tls-"))
    server = EmbeddedPostgres.start(base)
    try:
        key, cert = base / "server.key", base / "server.crt"
        subprocess.run(
            [
                "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert),
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )  # fmt: skip
        key.chmod(0o600)
        owner = (base / "data").stat()  # the server's own user (see EmbeddedPostgres)
        for path in (key, cert):
            os.chown(path, owner.st_uid, owner.st_gid)
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute(f"ALTER SYSTEM SET ssl_cert_file = '{cert}'")
            conn.execute(f"ALTER SYSTEM SET ssl_key_file = '{key}'")
            conn.execute("ALTER SYSTEM SET ssl = on")
            conn.execute("SELECT pg_reload_conf()")
        yield server
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


def tls_dsn(server: EmbeddedPostgres, db: str) -> str:
    return server.dsn(db) + " sslmode=require"


def new_db(server: EmbeddedPostgres, name: str) -> str:
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return tls_dsn(server, name)


async def test_auto_uses_libpq_over_tls_and_delivers_everything(
    tmp_path: Path, tls_pg: EmbeddedPostgres
) -> None:
    dsn = new_db(tls_pg, "tls_auto")
    with psycopg.connect(dsn) as conn:
        assert conn.pgconn.ssl_in_use  # the test's premise: the connection is encrypted
    make_table(dsn)
    async with Relay(config(tmp_path, dsn, stream_reader="auto")) as relay:
        host = relay.hosts["pg"]
        await wait_until(lambda: host.state == "streaming")
        workload(dsn, seed=11, txns=150)
        await caught_up(relay, dsn)
        assert host.status()["fetcher"]["stream_reader"] == "libpq"
        rows, scns = replay_buffer(relay)
    assert scns == sorted(set(scns))  # commit order, no window twice
    assert rows == source(dsn)  # row by row


async def test_socket_reader_refuses_tls_clearly(tmp_path: Path, tls_pg: EmbeddedPostgres) -> None:
    dsn = new_db(tls_pg, "tls_socket")
    async with Relay(config(tmp_path, dsn, stream_reader="socket")) as relay:
        host = relay.hosts["pg"]
        await wait_until(lambda: host.state == "failed", seconds=30)
        assert "needs a connection without TLS or GSS encryption" in host.last_error
        assert "sslmode" not in host.last_error  # no DSN in the message
