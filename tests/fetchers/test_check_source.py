"""``changebus check-source`` against real servers, good and set up wrongly on purpose.

A Postgres server with ``wal_level = replica``, unlimited
``max_slot_wal_keep_size``, its one replication slot taken, a role without
REPLICATION and a table without a key; a MariaDB server with
``binlog_format = STATEMENT`` and ``binlog_row_image = MINIMAL``, a user
without replication grants and a table without a primary key (each started
once for this module). Each problem is named with its fix and the exit
status is 1; the session's good servers pass (exit 0). The CLI runs as a
subprocess once per source, and a DSN's password never appears in what it
prints.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from changebus.fetchers import CheckReport, Level, check_source
from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.fetchers.postgres import EmbeddedPostgres
from changebus.schemas._cli import main
from fix_pg import PgServer

PASSWORD = "Sekrit-pw-4711"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "changebus.schemas", "check-source", *args],
        capture_output=True,
        text=True,
        env={**ENV, **(env or {})},
        timeout=120,
        check=False,
    )


def level(report: CheckReport, check: str) -> Level:
    levels = [f.level for f in report.findings if f.check == check]
    assert levels, f"no {check} finding in {report.findings}"
    return levels[0]


@pytest.fixture(scope="module")
def bad_pg() -> Iterator[EmbeddedPostgres]:
    base = Path(tempfile.mkdtemp(prefix="changebus-badpg-"))
    server = EmbeddedPostgres.start(
        base,
        settings={
            "wal_level": "replica",
            "max_slot_wal_keep_size": "-1",
            "max_replication_slots": "1",
        },
    )
    try:
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute("SELECT pg_create_physical_replication_slot('other')")
            conn.execute(f"CREATE ROLE weak LOGIN PASSWORD '{PASSWORD}'")
            conn.execute("CREATE TABLE nopk (a int, b text)")
            conn.execute("CREATE TABLE withpk (id int PRIMARY KEY)")
        yield server
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def bad_mysql() -> Iterator[EmbeddedMariaDB]:
    base = Path(tempfile.mkdtemp(prefix="changebus-badmy-"))
    server = EmbeddedMariaDB.start(
        base, settings={"binlog-format": "STATEMENT", "binlog-row-image": "MINIMAL"}
    )
    try:
        conn = server.connect()
        with conn.cursor() as cur:
            cur.execute("CREATE DATABASE shop")
            cur.execute("CREATE TABLE shop.nopk (a INT, b TEXT)")
            cur.execute("CREATE TABLE shop.withpk (id INT PRIMARY KEY)")
            cur.execute(f"CREATE USER 'weak'@'%' IDENTIFIED BY '{PASSWORD}'")
            cur.execute("GRANT SELECT ON shop.* TO 'weak'@'%'")
        conn.close()
        yield server
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_bad_postgres_names_each_problem_and_exits_1(bad_pg: EmbeddedPostgres) -> None:
    dsn = f"host=127.0.0.1 port={bad_pg.port} user=weak password={PASSWORD} dbname=postgres"
    done = run_cli("--dsn", dsn)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert PASSWORD not in out + done.stderr
    lines = out.splitlines()

    def line(check: str) -> str:
        return next(x for x in lines if f"  {check} " in x)

    assert line("wal_level").lstrip().startswith("FAIL")
    assert line("replication_slots").lstrip().startswith("FAIL")
    assert line("replication_role").lstrip().startswith("FAIL")
    assert line("keys").lstrip().startswith("FAIL") and "public.nopk" in line("keys")
    assert "public.withpk" not in line("keys")
    assert line("publication").lstrip().startswith("FAIL")
    assert line("select").lstrip().startswith("WARN")
    assert line("max_slot_wal_keep_size").lstrip().startswith("WARN")
    assert "wal_level = logical" in out and "restart" in out
    assert "ALTER ROLE weak REPLICATION;" in out
    assert "ALTER TABLE public.nopk REPLICA IDENTITY FULL;" in out
    assert "max_replication_slots = " in out
    assert "ALTER SYSTEM SET max_slot_wal_keep_size" in out
    assert "GRANT SELECT ON public.nopk, public.withpk TO weak;" in out
    assert out.rstrip().splitlines()[-1].startswith("NOT READY")


async def test_bad_postgres_slot_checks(bad_pg: EmbeddedPostgres) -> None:
    # a physical slot under the configured name; the capacity check then needs no new slot
    report = await check_source(bad_pg.dsn(), slot="other", tables=("withpk",))
    assert level(report, "slot") is Level.FAIL
    assert "physical" in next(f.found for f in report.findings if f.check == "slot")
    assert level(report, "replication_slots") is Level.OK
    assert level(report, "replication_role") is Level.OK  # the superuser
    assert level(report, "keys") is Level.OK  # only withpk is in scope
    missing = await check_source(bad_pg.dsn(), tables=("public.nosuch",))
    assert level(missing, "tables") is Level.FAIL


def test_good_postgres_passes(
    pg_server: PgServer, pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id bigint PRIMARY KEY, total numeric)")
        conn.execute("CREATE TABLE audit (at timestamptz, what text)")
        conn.execute("ALTER TABLE audit REPLICA IDENTITY FULL")
    slot = f"cb_check_{uuid.uuid4().hex[:8]}"
    status = main(["check-source", "--dsn", pg_dsn, "--slot", slot, "--publication", slot])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "FAIL" not in out
    assert out.rstrip().splitlines()[-1].startswith("READY")
    assert "2 table(s) in scope, each with a key" in out


def test_bad_mariadb_names_each_problem_and_exits_1(bad_mysql: EmbeddedMariaDB) -> None:
    dsn = f"mysql://weak:{PASSWORD}@127.0.0.1:{bad_mysql.port}/shop"
    done = run_cli(env={"CHANGEBUS_SOURCE_DSN": dsn})
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert PASSWORD not in out + done.stderr
    lines = out.splitlines()

    def line(check: str) -> str:
        return next(x for x in lines if f"  {check} " in x)

    assert line("binlog_format").lstrip().startswith("FAIL") and "STATEMENT" in out
    assert line("binlog_row_image").lstrip().startswith("FAIL") and "MINIMAL" in out
    assert line("binlog_row_metadata").lstrip().startswith("ok")
    assert line("grants").lstrip().startswith("FAIL")
    assert line("keys").lstrip().startswith("FAIL") and "shop.nopk" in line("keys")
    assert "shop.withpk" not in line("keys")  # its key is visible to a user with SELECT only
    assert line("select").lstrip().startswith("ok")
    assert "SET GLOBAL binlog_format = 'ROW';" in out
    assert "binlog_row_image = FULL" in out
    assert "GRANT REPLICATION SLAVE, BINLOG MONITOR ON *.* TO 'weak'@'%';" in out
    assert "ALTER TABLE `shop`.`nopk` ADD PRIMARY KEY" in out


async def test_bad_mariadb_mixed_format(bad_mysql: EmbeddedMariaDB) -> None:
    conn = bad_mysql.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SET GLOBAL binlog_format = 'MIXED'")
        report = await check_source(f"mysql://root@127.0.0.1:{bad_mysql.port}")
    finally:
        with conn.cursor() as cur:
            cur.execute("SET GLOBAL binlog_format = 'STATEMENT'")
        conn.close()
    assert level(report, "binlog_format") is Level.FAIL
    assert "MIXED" in next(f.found for f in report.findings if f.check == "binlog_format")
    assert level(report, "grants") is Level.OK  # root has every privilege
    assert report.exit_status == 1


def test_good_mariadb_passes(
    mysql_server: EmbeddedMariaDB, mysql_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    conn = mysql_server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute(f"CREATE TABLE `{mysql_db}`.orders (id BIGINT PRIMARY KEY, total INT)")
    finally:
        conn.close()
    status = main(
        ["check-source", "--dsn", f"mysql://root@127.0.0.1:{mysql_server.port}/{mysql_db}"]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    assert "FAIL" not in out
    assert "1 table(s) in scope, each with a primary key" in out


def test_config_partitions_json_and_errors(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    pg_dsn: str,
    mysql_server: EmbeddedMariaDB,
    mysql_db: str,
) -> None:
    slot = f"cb_check_{uuid.uuid4().hex[:8]}"
    config = tmp_path / "relay.toml"
    config.write_text(
        f"""
[[partitions]]
name = "pg"
id = 1
[partitions.fetcher]
kind = "postgres"
options = {{ slot = "{slot}", publication = "{slot}" }}

[[partitions]]
name = "my"
id = 2
[partitions.fetcher]
kind = "mysql"
options = {{ host = "127.0.0.1", port = {mysql_server.port}, user = "root", databases = ["{mysql_db}"] }}

[[partitions]]
name = "syn"
id = 3
[partitions.fetcher]
kind = "synthetic"
"""
    )
    os.environ["CHANGEBUS_SOURCE_DSN"] = pg_dsn  # the pg partition has no dsn of its own
    try:
        assert main(["check-source", "--config", str(config), "--json"]) == 0
        body = json.loads(capsys.readouterr().out)
        assert [b["partition"] for b in body] == ["pg", "my"]
        assert [b["kind"] for b in body] == ["postgres", "mysql"]
        assert all(b["ok"] and b["exit_status"] == 0 for b in body)
        assert {"check", "level", "found", "fix"} <= set(body[0]["findings"][0])
        assert main(["check-source", "--config", str(config), "--partition", "nope"]) == 2
        assert "no partition 'nope'" in capsys.readouterr().out
    finally:
        del os.environ["CHANGEBUS_SOURCE_DSN"]
    # a source that cannot be reached: the check cannot run
    closed = f"mysql://weak:{PASSWORD}@127.0.0.1:1/x"
    assert main(["check-source", "--dsn", closed]) == 2
    out = capsys.readouterr().out
    assert "cannot connect" in out and PASSWORD not in out
    assert main(["check-source", "--dsn", closed, "--json"]) == 2
    error = json.loads(capsys.readouterr().out)
    assert error["exit_status"] == 2 and "cannot connect" in error["error"]
    assert main(["check-source"]) == 2
    assert "--dsn" in capsys.readouterr().out


async def test_mariadb_grants_through_a_default_role(bad_mysql: EmbeddedMariaDB) -> None:
    conn = bad_mysql.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("CREATE ROLE cdc")
            cur.execute("GRANT REPLICATION SLAVE, BINLOG MONITOR, SELECT ON *.* TO cdc")
            cur.execute(f"CREATE USER 'viarole'@'%' IDENTIFIED BY '{PASSWORD}'")
            cur.execute("GRANT cdc TO 'viarole'@'%'")
            cur.execute("SET DEFAULT ROLE cdc FOR 'viarole'@'%'")
    finally:
        conn.close()
    report = await check_source(f"mysql://viarole:{PASSWORD}@127.0.0.1:{bad_mysql.port}/shop")
    assert level(report, "grants") is Level.OK
    assert level(report, "select") is Level.OK
    assert PASSWORD not in json.dumps(report.to_json())
