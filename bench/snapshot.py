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
from pathlib import Path
from typing import Any

import psycopg

import _common
import _snap_pipeline as sp
from _snap_sources import (
    MY_DB,
    MY_TABLE,
    PG_TABLE,
    SEED_USER,
    closing_conn,
    mariadb_available,
    my_load,
    my_outfile_rate,
    my_sampler,
    my_scan_rate,
    my_source_rows,
    my_writer,
    pg_copy_rate,
    pg_load,
    pg_sampler,
    pg_source_rows,
    pg_writer,
)
from changebus.fetchers.postgres import EmbeddedPostgres


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
