"""A throwaway MariaDB server for the tests (pytest plugin).

``mysql_server`` (session scope) starts a private server with
:class:`changebus.fetchers.mysql.EmbeddedMariaDB` (127.0.0.1, a free port,
``binlog_format=ROW``, ``binlog_row_image=FULL``, ``binlog_row_metadata=FULL``)
and stops it by its pid at the end. ``mysql_db`` gives a fresh database per
test, dropped afterwards. Debian's ``mariadb-server`` is used; `make test`
installs it when missing.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.schemas import binlog_file_number, binlog_to_scn


@pytest.fixture(scope="session")
def mysql_server() -> Iterator[EmbeddedMariaDB]:
    base = Path(tempfile.mkdtemp(prefix="changebus-mysql-"))
    server = EmbeddedMariaDB.start(base)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def mysql_db(mysql_server: EmbeddedMariaDB) -> Iterator[str]:
    """A fresh database on the session's server (its name); dropped afterwards."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    conn = mysql_server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute(f"CREATE DATABASE `{name}`")
    finally:
        conn.close()
    try:
        yield name
    finally:
        conn = mysql_server.connect()
        try:
            with conn.cursor() as cur:
                cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
        finally:
            conn.close()


def master_scn(server: EmbeddedMariaDB) -> int:
    """The SCN of the server's binlog end (``SHOW MASTER STATUS``)."""
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW MASTER STATUS")
            file, pos = cur.fetchone()[:2]
    finally:
        conn.close()
    return binlog_to_scn(binlog_file_number(file), int(pos))


def mysql_execute(server: EmbeddedMariaDB, db: str, *statements: str | tuple[str, Any]) -> None:
    """Run ``statements`` (SQL, or (SQL, parameters)) in ``db`` on one autocommit connection."""
    conn = server.connect(db)
    try:
        with conn.cursor() as cur:
            for s in statements:
                if isinstance(s, tuple):
                    cur.execute(s[0], s[1])
                else:
                    cur.execute(s)
    finally:
        conn.close()
