"""TLS and the password file of MySQL connections, against a real MariaDB serving TLS.

A module-scoped MariaDB (``ssl-ca``/``ssl-cert``/``ssl-key`` from a throwaway
trustme CA, ``tests/fix_tls.py``) with a ``REQUIRE SSL`` user and a
``REQUIRE X509`` user: the server itself refuses them any connection that is
not TLS (and, for the second, without a client certificate), so a fetcher
that streams as them is encrypted on every connection it opens.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pymysql
import pytest
import trustme
from test_mysql_fetcher import caught_up, replay, source_rows

from changebus.bootstrap._seed_mysql import MySQLChunkSource
from changebus.bootstrap._seedtypes import SeedRequest
from changebus.fetchers import ResumePoint
from changebus.fetchers.mysql import EmbeddedMariaDB, MySQLConfig, MySQLFetcher, open_connection
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import SourceConfigError
from fix_mysql import mysql_execute as execute
from fix_tls import TlsFiles, write_tls_files
from waiting import wait_until

pytestmark = pytest.mark.mysql

PASSWORD = "tls-Pw-7c1e9b"
TLS_USER = "cbtls"
X509_USER = "cbx509"


@pytest.fixture(scope="module")
def tls_server() -> Iterator[tuple[EmbeddedMariaDB, TlsFiles]]:
    base = Path(tempfile.mkdtemp(prefix="changebus-mysql-tls-"))
    files = write_tls_files(trustme.CA(), base / "tls")  # (readable by the server's user)
    server = EmbeddedMariaDB.start(
        base,
        settings={
            "ssl-ca": str(files.ca),
            "ssl-cert": str(files.server_cert),
            "ssl-key": str(files.server_key),
        },
    )
    try:
        grants = "REPLICATION SLAVE, BINLOG MONITOR, SELECT"
        for user, require in ((TLS_USER, "SSL"), (X509_USER, "X509")):
            execute(
                server,
                "mysql",
                f"CREATE USER '{user}'@'%' IDENTIFIED BY '{PASSWORD}' REQUIRE {require}",
                f"GRANT {grants} ON *.* TO '{user}'@'%'",
            )
        yield server, files
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


def options(server: EmbeddedMariaDB, **extra: Any) -> dict[str, Any]:
    return {"host": "127.0.0.1", "port": server.port, "user": TLS_USER, **extra}


def password_file(tmp_path: Path) -> Path:
    path = tmp_path / "mysql.pw"
    path.write_text(PASSWORD + "\n")  # as `echo` writes it: the newline is not the password
    path.chmod(0o600)
    return path


def relay_config(tmp: Path, fetcher_options: dict[str, Any]) -> RelayConfig:
    return RelayConfig(
        data_dir=tmp / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "my", 1, capacity_bytes=16 << 20, fetcher=FetcherConfig("mysql", fetcher_options)
            ),
        ),
        flush_interval_s=0,
    )


def session_tls(conn: Any) -> tuple[str, str]:
    """``(Ssl_version, Ssl_cipher)`` of a connection's own session, as the server sees it."""
    with conn.cursor() as cur:
        cur.execute("SHOW SESSION STATUS WHERE Variable_name IN ('Ssl_version', 'Ssl_cipher')")
        status = {str(k): str(v) for k, v in cur.fetchall()}
    return status.get("Ssl_version", ""), status.get("Ssl_cipher", "")


def dump_threads(server: EmbeddedMariaDB, user: str) -> int:
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST "
                "WHERE USER = %s AND COMMAND LIKE 'Binlog Dump%%'",
                (user,),
            )
            return int(cur.fetchone()[0])
    finally:
        conn.close()


async def test_a_fetcher_with_the_ca_and_a_password_file_streams_every_row_encrypted(
    tmp_path: Path, tls_server: tuple[EmbeddedMariaDB, TlsFiles], caplog: pytest.LogCaptureFixture
) -> None:
    server, files = tls_server
    db = "tls_rows"
    execute(server, "mysql", f"CREATE DATABASE {db}")
    execute(server, db, "CREATE TABLE t (id int PRIMARY KEY, v varchar(40), n bigint)")
    # the REQUIRE X509 user: the server lets in only connections with the client
    # certificate, so every connection of the fetcher (set-up, binlog control and stream,
    # distance reader) must carry the TLS options, not PyMySQL's opportunistic TLS
    fetcher_options = options(
        server,
        user=X509_USER,
        databases=[db],
        password_file=str(password_file(tmp_path)),
        tls_ca_file=str(files.ca),
        tls_cert_file=str(files.client_cert),
        tls_key_file=str(files.client_key),
        binlog_stats_interval_s=0.05,
    )
    caplog.set_level(logging.DEBUG)
    async with Relay(relay_config(tmp_path, fetcher_options)) as relay:
        host = relay.hosts["my"]
        await wait_until(lambda: host.state in ("streaming", "failed"))
        assert host.state == "streaming", host.last_error
        statements: list[str | tuple[str, Any]] = [
            (
                "INSERT INTO t VALUES (%s, %s, %s)",
                (i, f"row {i} é", i * 1_000_000_007),
            )
            for i in range(1, 41)
        ]
        statements += [
            "UPDATE t SET v = CONCAT(v, ' updated'), n = -n WHERE id % 3 = 0",
            "DELETE FROM t WHERE id % 7 = 0",
            "UPDATE t SET id = id + 100 WHERE id = 2",  # a key change
        ]
        execute(server, db, *statements)
        await caught_up(relay, server, db)
        # the binlog stream is the REQUIRE X509 user's: the server let it in over TLS only
        assert dump_threads(server, X509_USER) == 1
        # (the distance reader's connections too)
        await wait_until(lambda: host.status()["fetcher"]["binlog_distance_bytes"] >= 0)
        rows, _, _ = replay(relay, "t")
        status = str(host.status())
    assert rows == source_rows(server, db, "t")
    assert len(rows) == 40 - 5
    assert PASSWORD not in caplog.text and PASSWORD not in status
    # a connection as the fetcher opens them: encrypted, the certificate verified
    config = MySQLConfig(**fetcher_options).resolved()
    conn = await asyncio.to_thread(open_connection, config)
    try:
        version, cipher = session_tls(conn)
        assert version.startswith("TLS") and cipher
        assert conn._sock.getpeercert()  # (only a verified peer's certificate is returned)
    finally:
        conn.close()
    # the server refuses this user without TLS: what the fetcher streamed went over TLS
    with pytest.raises(pymysql.err.OperationalError) as refused:
        pymysql.connect(
            host="127.0.0.1", port=server.port, user=X509_USER, password=PASSWORD, ssl_disabled=True
        )
    assert refused.value.args[0] == 1045


async def test_a_wrong_ca_is_a_clear_non_retriable_error_without_the_password(
    tmp_path: Path, tls_server: tuple[EmbeddedMariaDB, TlsFiles], caplog: pytest.LogCaptureFixture
) -> None:
    server, files = tls_server
    caplog.set_level(logging.DEBUG)
    wrong = options(server, password=PASSWORD, tls_ca_file=str(files.other_ca))
    fetcher = MySQLFetcher("my", 1, MySQLConfig(**wrong))
    with pytest.raises(SourceConfigError, match=r"TLS certificate .* is not trusted") as info:
        await fetcher.start(ResumePoint())
    await fetcher.close()
    assert not info.value.retriable
    assert "tls_ca_file" in info.value.message and PASSWORD not in info.value.message
    # through a relay: the partition fails for good, the password nowhere
    async with Relay(relay_config(tmp_path, wrong)) as relay:
        host = relay.hosts["my"]
        await wait_until(lambda: host.state == "failed")
        assert "is not trusted" in host.last_error
        status = str(host.status())
    assert PASSWORD not in host.last_error and PASSWORD not in status
    assert PASSWORD not in caplog.text


async def test_a_client_certificate_logs_in_a_require_x509_user(
    tls_server: tuple[EmbeddedMariaDB, TlsFiles],
) -> None:
    server, files = tls_server
    base = options(server, user=X509_USER, password=PASSWORD, tls_ca_file=str(files.ca))
    with_cert = MySQLConfig(
        **base, tls_cert_file=str(files.client_cert), tls_key_file=str(files.client_key)
    )
    conn = await asyncio.to_thread(open_connection, with_cert)
    try:
        assert session_tls(conn)[1]
    finally:
        conn.close()
    with pytest.raises(pymysql.err.OperationalError) as refused:  # no certificate: refused
        await asyncio.to_thread(open_connection, MySQLConfig(**base))
    assert refused.value.args[0] == 1045


async def test_require_tls_refuses_a_server_without_tls(
    mysql_server: EmbeddedMariaDB,
) -> None:
    """The session's plain server offers no TLS: a fetcher asking for it must not go on in
    clear (PyMySQL 1.1 would log in without TLS and say nothing)."""
    conn = mysql_server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT @@have_ssl")
            assert str(cur.fetchone()[0]) != "YES"
    finally:
        conn.close()
    fetcher = MySQLFetcher(
        "my", 1, MySQLConfig(port=mysql_server.port, user="root", require_tls=True)
    )
    with pytest.raises(SourceConfigError, match="does not offer TLS") as info:
        await fetcher.start(ResumePoint())
    await fetcher.close()
    assert not info.value.retriable


def test_the_seeder_uses_the_password_file_and_tls_of_its_dsn(
    tmp_path: Path, tls_server: tuple[EmbeddedMariaDB, TlsFiles]
) -> None:
    server, files = tls_server
    pw = password_file(tmp_path)

    def request(ca: Path) -> SeedRequest:
        dsn = (
            f"mysql://{X509_USER}@127.0.0.1:{server.port}?password_file={pw}&tls_ca_file={ca}"
            f"&tls_cert_file={files.client_cert}&tls_key_file={files.client_key}"
        )
        return SeedRequest(dsn, 1, (), relay_fetcher={"kind": "mysql", "mysql_server_id": 1})

    with MySQLChunkSource(request(files.ca)) as source:
        version, cipher = session_tls(source.conn)
        assert version.startswith("TLS") and cipher
    with (
        pytest.raises(SourceConfigError, match="is not trusted") as info,
        MySQLChunkSource(request(files.other_ca)),
    ):
        pass
    assert not info.value.retriable and PASSWORD not in info.value.message


async def test_a_login_that_ends_in_clear_is_refused_after_the_handshake(
    mysql_server: EmbeddedMariaDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PyMySQL 1.1 finishes a login in clear when the server offers no TLS, whatever the
    ``ssl`` argument: emulated here by a connect that drops it. The socket is checked."""
    real = pymysql.connect

    def without_tls(**kwargs: Any) -> Any:
        kwargs.pop("ssl", None)
        return real(**kwargs, ssl_disabled=True)

    monkeypatch.setattr(pymysql, "connect", without_tls)
    config = MySQLConfig(port=mysql_server.port, user="root", require_tls=True)
    with pytest.raises(SourceConfigError, match="does not offer TLS") as info:
        await asyncio.to_thread(open_connection, config)
    assert not info.value.retriable
