"""Snapshot (seed) throughput of a big table against the source's own bulk read, and the
source's longest transaction meanwhile (issue 20).

Postgres (an embedded Postgres 15): a table of ``--rows`` rows of ~500 B
(bigint key, int, bigint, two ~200-character texts, float, timestamptz,
int), loaded with ``INSERT ... SELECT generate_series`` and ``VACUUM
ANALYZE``. Baseline, in the same run: ``COPY t TO STDOUT`` read through
psycopg (text, ``copy_rows_per_s``; binary also reported). Then the real
pipeline: a relay (``changebus relay``, the postgres fetcher) capturing the
table and a bootstrap server (``changebus bootstrap``, SQLite store,
``seed.dsn`` set) seeding the whole table (``POST /v1/seed``, polled on
``/v1/status`` until ``done``): ``snapshot_rows_per_s`` = rows / seed wall
time, ``snapshot_vs_copy_ratio`` (goal >= 0.5), ``source_longest_txn_s``
(the seeder's longest transaction, from ``pg_stat_activity`` every 20 ms:
application_name ``changebus-seed``; goal <= 1). The same snapshot again
into a fresh bootstrap store with writers updating, inserting and deleting
rows of the table at ``--writer-rows-per-s`` (2,000):
``snapshot_with_writers_rows_per_s`` and its longest transaction; then a
random sample of keys is compared row by row (source vs the store's
decoded snapshot rows, once the applier caught up).

MariaDB (``--mysql``, default on when the binaries exist): the same shape
(``--mysql-rows``, 1,000,000 by default: loading takes a while), baseline =
a plain full scan through PyMySQL's unbuffered ``SSCursor``
(``mysql_scan_rows_per_s``) and ``SELECT ... INTO OUTFILE``; the same
figures with a ``mysql_`` prefix; the seeder's transactions are found in
``information_schema.innodb_trx`` by its user, keyed by connection and
``trx_started`` (1 s resolution), so chunk transactions starting in the same
second merge: an upper bound. ``*seeder_txn_max*_s`` is the seeder's own
figure (``source_txn_max_s`` of ``/v1/status``: each chunk transaction timed
from before BEGIN to after COMMIT; -1 for Postgres, which does not time them).

Every server listens on 127.0.0.1 and is stopped by its pid. Prints the
figures while running; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

import _common
import _snap_pipeline as sp
from changebus.fetchers.postgres import EmbeddedPostgres

PG_TABLE = "public.t"
MY_DB = "snap"
MY_TABLE = f"{MY_DB}.t"
SEED_USER = "cbseed"


def normalize(_column: str, value: Any) -> Any:
    """A comparable form of a column value (source drivers and the decoder differ in types)."""
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return round(value.timestamp() * 1e6)
    if isinstance(value, float):
        return round(value, 9)
    if isinstance(value, dt.date):
        return value.isoformat()
    return value


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


def postgres(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"rows": args.rows}
    server = EmbeddedPostgres.start(base / "pg")
    try:
        dsn = server.dsn()
        print(f"postgres: loading {args.rows:,} rows ...", flush=True)
        out.update(pg_load(dsn, args.rows))
        print(f"  loaded in {out['load_s']} s ({out['table_mb']} MB)", flush=True)
        out["copy_rows_per_s"] = round(pg_copy_rate(dsn, args.rows, binary=False))
        out["copy_binary_rows_per_s"] = round(pg_copy_rate(dsn, args.rows, binary=True))
        print(
            f"  COPY TO STDOUT: {out['copy_rows_per_s']:,} rows/s (text), "
            f"{out['copy_binary_rows_per_s']:,} rows/s (binary)",
            flush=True,
        )
        relay_port = _common.free_port()
        relay_cfg = sp.relay_toml(
            base,
            relay_port,
            "pg",
            "postgres",
            f"{{ dsn = {sp.toml_str(dsn)}, status_interval_s = 0.5 }}",
        )
        with sp.daemon("relay", relay_cfg, relay_port, base / "relay-pg.log"):
            with psycopg.connect(dsn, autocommit=True) as conn:
                deadline = time.monotonic() + 60
                while not conn.execute("SELECT count(*) FROM pg_replication_slots").fetchone()[0]:  # type: ignore[index]
                    if time.monotonic() > deadline:
                        raise RuntimeError("the relay did not create its slot")
                    time.sleep(0.1)
                conn.execute("UPDATE t SET a = a WHERE id = 1")  # the relay sees the table
            figs = pg_pipeline(args, base, dsn, relay_port, out["copy_rows_per_s"])
            out.update(figs)
    finally:
        server.stop()
    out["snapshot_vs_copy_ratio"] = round(out["snapshot_rows_per_s"] / out["copy_rows_per_s"], 3)
    if "snapshot_with_writers_rows_per_s" in out:
        out["snapshot_with_writers_vs_copy_ratio"] = round(
            out["snapshot_with_writers_rows_per_s"] / out["copy_rows_per_s"], 3
        )
    return out


def pg_pipeline(
    args: argparse.Namespace, base: Path, dsn: str, relay_port: int, copy_rate: float
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    conn, sample = pg_sampler(dsn)
    with conn:
        secs, seed, longest = seed_once(
            base / "boot-pg-1",
            relay_port,
            "pg",
            "postgres",
            dsn,
            PG_TABLE,
            args.chunk_rows,
            sample,
            max_chunk_txn_s=args.max_chunk_txn_s,
            out=out,
        )
        out.update(
            snapshot_s=round(secs, 2),
            snapshot_rows_per_s=round(args.rows / secs),
            snapshot_chunks=seed.get("chunks", 0),
            source_longest_txn_s=round(longest, 3),
        )
        print(
            f"  snapshot: {out['snapshot_rows_per_s']:,} rows/s ({secs:.1f} s, "
            f"{out['snapshot_chunks']} chunks), {out['snapshot_rows_per_s'] / copy_rate:.2f} of "
            f"COPY's rate; longest seeder txn {longest:.3f} s",
            flush=True,
        )
        if args.writer_rows_per_s <= 0:
            return out
        rnd = random.Random(20)
        wconn, tick = pg_writer(dsn, args.rows, rnd)
        with wconn:
            seed_once(
                base / "boot-pg-2",
                relay_port,
                "pg",
                "postgres",
                dsn,
                PG_TABLE,
                args.chunk_rows,
                sample,
                max_chunk_txn_s=args.max_chunk_txn_s,
                writer=sp.PacedWriter(tick, args.writer_rows_per_s),
                check=(pg_source_rows(dsn), args.rows, args.sample),
                out=out,
            )
    return out


def seed_once(
    home: Path,
    relay_port: int,
    part: str,
    kind: str,
    dsn: str,
    table: str,
    chunk_rows: int,
    sample: Any,
    *,
    writer: sp.PacedWriter | None = None,
    check: tuple[Any, int, int] | None = None,
    out: dict[str, Any] | None = None,
    span: bool = False,
    every_s: float = 0.02,
    max_chunk_txn_s: float = 0.5,
) -> Any:
    """One whole-table seed into a fresh bootstrap store; (seconds, seed status, longest txn
    [, writer]). With ``writer``: it runs during the seed; ``check``: then a sample is
    compared and the figures go to ``out`` with a ``_with_writers`` name."""
    port = _common.free_port()
    cfg = sp.bootstrap_toml(home, port, relay_port, part, kind, dsn, chunk_rows, max_chunk_txn_s)
    url = f"http://127.0.0.1:{port}"
    prefix = "" if part == "pg" else "mysql_"
    with sp.daemon("bootstrap", cfg, port, home / "bootstrap.log") as proc:
        sp.wait_for_source(url, part, table)
        cpu0, load0 = sp.cpu_seconds(proc.pid), os.getloadavg()[0]
        with sp.LongestTxn(sample, every_s, span) as lt, writer or contextlib.nullcontext():
            secs, seed = sp.run_seed(url, part, table)
        cpu_us = (sp.cpu_seconds(proc.pid) - cpu0) / max(seed["rows"], 1) * 1e6
        print(
            f"  bootstrap server CPU: {cpu_us:.1f} us/row; load average {load0:.1f} -> "
            f"{os.getloadavg()[0]:.1f}",
            flush=True,
        )
        # the seeder's own figure (BEGIN to COMMIT of each chunk; -1: not measured, Postgres);
        # the sampled one above is an upper bound (it may merge back-to-back chunks)
        exact = float(seed.get("source_txn_max_s", -1.0))
        print(f"  seeder-measured longest chunk txn: {exact:.3f} s", flush=True)
        if writer is None:
            if out is not None:
                out[f"{prefix}bootstrap_cpu_us_per_row"] = round(cpu_us, 1)
                out[f"{prefix}seeder_txn_max_s"] = round(exact, 3)
            return secs, seed, lt.longest_s
        assert out is not None
        assert check is not None
        out[f"{prefix}bootstrap_cpu_us_per_row_with_writers"] = round(cpu_us, 1)
        rows = seed["rows"]
        out[f"{prefix}snapshot_with_writers_s"] = round(secs, 2)
        out[f"{prefix}snapshot_with_writers_rows_per_s"] = round(rows / secs)
        out[f"{prefix}source_longest_txn_with_writers_s"] = round(lt.longest_s, 3)
        out[f"{prefix}seeder_txn_max_with_writers_s"] = round(exact, 3)
        out[f"{prefix}writers_rows_per_s"] = round(writer.rate)
        print(
            f"  snapshot with writers at {writer.rate:,.0f} rows/s: "
            f"{rows / secs:,.0f} rows/s ({rows:,} rows in {secs:.1f} s), longest seeder txn "
            f"{lt.longest_s:.3f} s",
            flush=True,
        )
        source_rows, max_id, n = check
        if n > 0:
            ids = random.Random(7).sample(range(1, max_id + 1), min(n, max_id))
            ids += list(range(max_id + 1, max_id + 1 + writer.rows // 4, 7))[: n // 4]  # inserted
            compared, differ = sp.check_sample(
                source_rows, home / "boot.db", part, table, ids, normalize
            )
            out[f"{prefix}sample_rows_checked"] = compared
            out[f"{prefix}sample_rows_differ"] = differ
            print(f"  row-by-row sample: {differ} of {compared} rows differ", flush=True)
        return secs, seed, lt.longest_s, writer


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


def mariadb(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    from changebus.fetchers.mysql import EmbeddedMariaDB

    rows = args.mysql_rows
    out: dict[str, Any] = {"mysql_rows": rows}
    server = EmbeddedMariaDB.start(base / "my")
    try:
        print(f"mariadb: loading {rows:,} rows ...", flush=True)
        figs = my_load(server, rows)
        out.update(mysql_load_s=figs["load_s"], mysql_table_mb=figs["table_mb"])
        print(f"  loaded in {figs['load_s']} s ({figs['table_mb']} MB)", flush=True)
        out["mysql_scan_rows_per_s"] = round(my_scan_rate(server, rows))
        outfile = my_outfile_rate(server, base, rows)
        out["mysql_outfile_rows_per_s"] = None if outfile is None else round(outfile)
        print(
            f"  full scan (SSCursor): {out['mysql_scan_rows_per_s']:,} rows/s; INTO OUTFILE: "
            f"{out['mysql_outfile_rows_per_s']} rows/s",
            flush=True,
        )
        relay_port = _common.free_port()
        relay_cfg = sp.relay_toml(
            base,
            relay_port,
            "my",
            "mysql",
            f'{{ host = "127.0.0.1", port = {server.port}, user = "root", '
            f'databases = ["{MY_DB}"] }}',
        )
        dsn = f"mysql://{SEED_USER}:seedpw@127.0.0.1:{server.port}"
        with sp.daemon("relay", relay_cfg, relay_port, base / "relay-my.log"):
            time.sleep(2)  # the fetcher connects and starts at the binlog's end
            touch = server.connect()
            with closing_conn(touch), touch.cursor() as cur:
                cur.execute(f"UPDATE {MY_TABLE} SET a = a WHERE id = 1")
                cur.execute(f"UPDATE {MY_TABLE} SET a = a + 0, h = h WHERE id = 1 OR id = 2")
                cur.execute(f"UPDATE {MY_TABLE} SET h = h + 1 WHERE id = 1")
            sconn, sample = my_sampler(server)
            with closing_conn(sconn):
                secs, seed, longest = seed_once(
                    base / "boot-my-1",
                    relay_port,
                    "my",
                    "mysql",
                    dsn,
                    MY_TABLE,
                    args.chunk_rows,
                    sample,
                    max_chunk_txn_s=args.max_chunk_txn_s,
                    span=True,
                    every_s=0.11,
                )
                out.update(
                    mysql_snapshot_s=round(secs, 2),
                    mysql_snapshot_rows_per_s=round(rows / secs),
                    mysql_snapshot_chunks=seed.get("chunks", 0),
                    mysql_source_longest_txn_s=round(longest, 3),
                    mysql_seeder_txn_max_s=round(float(seed.get("source_txn_max_s", -1.0)), 3),
                )
                print(
                    f"  snapshot: {rows / secs:,.0f} rows/s ({secs:.1f} s), longest seeder txn "
                    f"{longest:.3f} s",
                    flush=True,
                )
                if args.writer_rows_per_s > 0:
                    wconn, tick = my_writer(server, rows, random.Random(21))
                    with closing_conn(wconn):
                        seed_once(
                            base / "boot-my-2",
                            relay_port,
                            "my",
                            "mysql",
                            dsn,
                            MY_TABLE,
                            args.chunk_rows,
                            sample,
                            span=True,
                            every_s=0.11,
                            max_chunk_txn_s=args.max_chunk_txn_s,
                            writer=sp.PacedWriter(tick, args.writer_rows_per_s),
                            check=(my_source_rows(server), rows, args.sample),
                            out=out,
                        )
    finally:
        server.stop()
    out["mysql_snapshot_vs_scan_ratio"] = round(
        out["mysql_snapshot_rows_per_s"] / out["mysql_scan_rows_per_s"], 3
    )
    if out.get("mysql_outfile_rows_per_s"):
        out["mysql_snapshot_vs_outfile_ratio"] = round(
            out["mysql_snapshot_rows_per_s"] / out["mysql_outfile_rows_per_s"], 3
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2_000_000, help="Postgres table rows")
    ap.add_argument("--mysql-rows", type=int, default=1_000_000, help="MariaDB table rows")
    ap.add_argument("--chunk-rows", type=int, default=0, help="seed.chunk_rows (0: the default)")
    ap.add_argument(
        "--max-chunk-txn-s",
        type=float,
        default=0.5,
        help="seed.max_chunk_txn_s (the default 0.5; 0: off, every chunk reads chunk_rows)",
    )
    ap.add_argument("--writer-rows-per-s", type=float, default=2000.0, help="0: no writers run")
    ap.add_argument("--sample", type=int, default=2000, help="keys compared row by row")
    ap.add_argument("--pg", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--mysql", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    ap.add_argument(
        "--profile",
        type=Path,
        help="cProfile every thread of the bootstrap servers into this directory (slower)",
    )
    args = ap.parse_args()
    if args.mysql is None:
        args.mysql = mariadb_available()
    sp.PROFILE_DIR = args.profile
    result: dict[str, Any] = {
        "chunk_rows": args.chunk_rows or None,
        "max_chunk_txn_s": args.max_chunk_txn_s or None,
    }
    t0 = time.perf_counter()
    base = Path(tempfile.mkdtemp(prefix="changebus-bench-snap-"))
    base.chmod(0o755)
    try:
        if args.pg:
            result.update(postgres(args, base))
        if args.mysql:
            result.update(mariadb(args, base))
    finally:
        if args.keep:
            print(f"kept {base}", flush=True)
        else:
            shutil.rmtree(base, ignore_errors=True)
    result["bench_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
