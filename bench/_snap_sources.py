"""The source tables bench/snapshot.py seeds, on Postgres and on MariaDB.

For each source: loading the table (``--rows`` / ``--mysql-rows`` rows of
~500 B), the baseline bulk reads (``COPY TO STDOUT``; a full scan through
PyMySQL's ``SSCursor`` and ``SELECT ... INTO OUTFILE``), a sampler of the
seeder's open transactions (``pg_stat_activity``; ``information_schema.innodb_trx``
by the seeder's user), a writer updating, inserting and deleting rows during a
seed, and a reader of rows by key for the row-by-row sample check.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

import _snap_pipeline as sp

PG_TABLE = "public.t"
MY_DB = "snap"
MY_TABLE = f"{MY_DB}.t"
SEED_USER = "cbseed"


# ---- Postgres ---------------------------------------------------------------------------


def pg_load(dsn: str, rows: int) -> dict[str, float]:
    t0 = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE t (id int8 PRIMARY KEY, a int4 NOT NULL, b int8, c text, d text, "
            "f float8, g timestamptz, h int4)"
        )
        step = 500_000
        for start in range(1, rows + 1, step):
            conn.execute(
                "INSERT INTO t SELECT g, g %% 1000, g * 7, repeat(md5(g::text), 7), "
                "repeat(md5((g + 1)::text), 6), g / 3.0, "
                "timestamptz '2026-01-01 00:00:00+00' + g * interval '1 second', g %% 97 "
                "FROM generate_series(%s::int8, %s::int8) AS g",
                (start, min(start + step - 1, rows)),
            )
        conn.execute("VACUUM ANALYZE t")
        size = conn.execute("SELECT pg_table_size('t')").fetchone()
    assert size is not None
    return {"load_s": round(time.perf_counter() - t0, 1), "table_mb": round(size[0] / 1e6, 1)}


def pg_copy_rate(dsn: str, rows: int, binary: bool) -> float:
    sql = "COPY t TO STDOUT" + (" (FORMAT binary)" if binary else "")
    with psycopg.connect(dsn) as conn:
        t0 = time.perf_counter()
        nbytes = 0
        with conn.cursor().copy(sql) as copy:
            for block in copy:
                nbytes += len(block)
        secs = time.perf_counter() - t0
    return rows / secs


def pg_sampler(dsn: str) -> Any:
    conn = psycopg.connect(dsn, autocommit=True)

    def sample() -> list[tuple[Any, float]]:
        rows = conn.execute(
            "SELECT pid, xact_start, extract(epoch FROM clock_timestamp() - xact_start)::float8 "
            "FROM pg_stat_activity WHERE application_name = %s AND xact_start IS NOT NULL",
            (sp.SEED_APP,),
        ).fetchall()
        return [((pid, start), float(age)) for pid, start, age in rows]

    return conn, sample


def pg_writer(dsn: str, rows: int, rnd: random.Random) -> tuple[Any, Any]:
    conn = psycopg.connect(dsn)
    state = {"next": rows + 1}

    def tick(_n: int) -> int:
        upd, ins, dels = sp.writer_plan(rnd, rows, state["next"], 20)
        state["next"] += len(ins)
        with conn.transaction():
            conn.execute("UPDATE t SET a = a + 1, f = random() WHERE id = ANY(%s)", (upd,))
            conn.execute(
                "INSERT INTO t SELECT g, g %% 1000, g * 7, repeat(md5(g::text), 7), "
                "repeat(md5((g + 1)::text), 6), g / 3.0, now(), g %% 97 "
                "FROM unnest(%s::int8[]) AS g",
                (ins,),
            )
            conn.execute("DELETE FROM t WHERE id = ANY(%s)", (dels,))
        return len(upd) + len(ins) + len(dels)

    return conn, tick


def pg_source_rows(dsn: str) -> Any:
    def rows(ids: list[int]) -> dict[int, dict[str, Any]]:
        with psycopg.connect(dsn) as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
            cur.execute("SELECT * FROM t WHERE id = ANY(%s)", (ids,))
            return {int(r["id"]): dict(r) for r in cur.fetchall()}

    return rows


# ---- MariaDB ----------------------------------------------------------------------------


def mariadb_available() -> bool:
    return bool(shutil.which("mariadbd") or Path("/usr/sbin/mariadbd").exists())


def my_load(server: Any, rows: int) -> dict[str, float]:
    t0 = time.perf_counter()
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SET sql_log_bin = 0")  # the load is not a change to stream
            cur.execute(f"CREATE DATABASE {MY_DB}")
            cur.execute(f"USE {MY_DB}")
            cur.execute(
                f"CREATE TABLE {MY_TABLE} (id BIGINT PRIMARY KEY, a INT NOT NULL, b BIGINT, "
                "c VARCHAR(300), d VARCHAR(300), f DOUBLE, g DATETIME(6), h INT) ENGINE=InnoDB"
            )
            step = 100_000
            for start in range(1, rows + 1, step):
                end = min(start + step - 1, rows)
                cur.execute(
                    f"INSERT INTO {MY_TABLE} SELECT seq, seq % 1000, seq * 7, REPEAT(MD5(seq), 7), "
                    "REPEAT(MD5(seq + 1), 6), seq / 3, "
                    "TIMESTAMP '2026-01-01 00:00:00' + INTERVAL seq SECOND, seq % 97 "
                    f"FROM seq_{start}_to_{end}"
                )
            cur.execute(f"ANALYZE TABLE {MY_TABLE}")
            cur.fetchall()
            cur.execute(
                "SELECT data_length FROM information_schema.TABLES "
                "WHERE table_schema = %s AND table_name = 't'",
                (MY_DB,),
            )
            size = cur.fetchone()[0]
            cur.execute(f"CREATE USER '{SEED_USER}'@'127.0.0.1' IDENTIFIED BY 'seedpw'")
            cur.execute(f"GRANT ALL ON *.* TO '{SEED_USER}'@'127.0.0.1'")
    finally:
        conn.close()
    return {"load_s": round(time.perf_counter() - t0, 1), "table_mb": round(size / 1e6, 1)}


def my_scan_rate(server: Any, rows: int) -> float:
    import pymysql.cursors

    conn = server.connect(cursorclass=pymysql.cursors.SSCursor)
    try:
        with conn.cursor() as cur:
            t0 = time.perf_counter()
            cur.execute(f"SELECT * FROM {MY_TABLE}")
            n = 0
            for _row in cur:
                n += 1
            secs = time.perf_counter() - t0
    finally:
        conn.close()
    assert n == rows, (n, rows)
    return rows / secs


def my_outfile_rate(server: Any, base: Path, rows: int) -> float | None:
    out_dir = base / "outfile"
    out_dir.mkdir(exist_ok=True)
    out_dir.chmod(0o777)
    target = out_dir / f"t-{time.monotonic_ns()}.txt"
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            t0 = time.perf_counter()
            cur.execute(f"SELECT * FROM {MY_TABLE} INTO OUTFILE %s", (str(target),))
            secs = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - reported, the scan stays the baseline
        print(f"  SELECT ... INTO OUTFILE refused: {exc}", flush=True)
        return None
    finally:
        conn.close()
    with contextlib.suppress(OSError):
        target.unlink()
    return rows / secs


def my_sampler(server: Any) -> tuple[Any, Any]:
    conn = server.connect()

    def sample() -> list[tuple[Any, float]]:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT t.trx_mysql_thread_id, t.trx_started FROM information_schema.innodb_trx t "
                "JOIN information_schema.processlist p ON p.id = t.trx_mysql_thread_id "
                "WHERE p.user = %s",
                (SEED_USER,),
            )
            return [((tid, started), 0.0) for tid, started in cur.fetchall()]

    return conn, sample


def my_writer(server: Any, rows: int, rnd: random.Random) -> tuple[Any, Any]:
    conn = server.connect()
    conn.autocommit(False)
    state = {"next": rows + 1}

    def tick(_n: int) -> int:
        upd, ins, dels = sp.writer_plan(rnd, rows, state["next"], 20)
        state["next"] += len(ins)
        with conn.cursor() as cur:
            cur.execute(f"UPDATE {MY_TABLE} SET a = a + 1, f = RAND() WHERE id IN %s", (upd,))
            cur.executemany(
                f"INSERT INTO {MY_TABLE} VALUES (%s, %s, %s, REPEAT(MD5(%s), 7), "
                "REPEAT(MD5(%s), 6), %s, NOW(6), %s)",
                [(g, g % 1000, g * 7, g, g + 1, g / 3, g % 97) for g in ins],
            )
            cur.execute(f"DELETE FROM {MY_TABLE} WHERE id IN %s", (dels,))
        conn.commit()
        return len(upd) + len(ins) + len(dels)

    return conn, tick


def my_source_rows(server: Any) -> Any:
    import pymysql.cursors

    def rows(ids: list[int]) -> dict[int, dict[str, Any]]:
        conn = server.connect(cursorclass=pymysql.cursors.DictCursor)
        try:
            with conn.cursor() as cur:
                cur.execute(f"SELECT * FROM {MY_TABLE} WHERE id IN %s", (ids,))
                return {int(r["id"]): dict(r) for r in cur.fetchall()}
        finally:
            conn.close()

    return rows


@contextlib.contextmanager
def closing_conn(conn: Any) -> Iterator[Any]:
    try:
        yield conn
    finally:
        conn.close()
