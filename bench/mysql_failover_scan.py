"""The mysql fetcher's start after a failover against a normal start, on one binlog.

Starts a throwaway MariaDB (:class:`EmbeddedMariaDB`) and writes ``--txns``
single-row transactions into one binlog file. Then it times the fetcher's
start-up checks (``MySQLFetcher.start``: settings, binlog list, the resume
check, ``information_schema``) for a relay whose last window is the last
transaction:

* **normal**: the position names this server (``server=1``): one
  ``BINLOG_GTID_POS`` at the recorded position (the baseline);
* **failover**: the position names another server (``server=99``), as after
  a switch to a promoted replica: the fetcher finds the transaction by its
  GTID, scanning the binlog file with ``SHOW BINLOG EVENTS`` (the worst
  case: the transaction is the file's last).

The two alternate ``--rounds`` times (the machine is shared: best of each).
Last line: one JSON object; ``failover_vs_normal_start_ratio`` is failover
time / normal time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from changebus.fetchers import ResumePoint
from changebus.fetchers.mysql import EmbeddedMariaDB, MySQLConfig, MySQLFetcher, format_position
from changebus.schemas import binlog_file_number, binlog_to_scn


def write_binlog(server: EmbeddedMariaDB, txns: int) -> tuple[str, int, str, int]:
    """``txns`` one-row transactions; returns (file, end, last GTID, binlog events)."""
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("CREATE DATABASE bench")
            cur.execute("CREATE TABLE bench.t (id int PRIMARY KEY, v int)")
            cur.execute("RESET MASTER")
            cur.execute(
                "CREATE PROCEDURE bench.fill(n int) BEGIN "
                "FOR i IN 1..n DO INSERT INTO bench.t VALUES (i, i); END FOR; END"
            )
            cur.execute("CALL bench.fill(%s)", (txns,))
            cur.execute("SHOW MASTER STATUS")
            file, end = cur.fetchone()[:2]
            cur.execute("SELECT @@gtid_binlog_pos")
            gtid = str(cur.fetchone()[0])
            cur.execute(f"SHOW BINLOG EVENTS IN '{file}'")
            events = len(cur.fetchall())
    finally:
        conn.close()
    return str(file), int(end), gtid, events


async def start_time(server: EmbeddedMariaDB, resume: ResumePoint) -> tuple[float, int]:
    fetcher = MySQLFetcher("bench", 1, MySQLConfig(host="127.0.0.1", port=server.port, user="root"))
    t0 = time.perf_counter()
    await fetcher.start(resume)
    elapsed = time.perf_counter() - t0
    base = int(fetcher.status()["scn_base"])
    await fetcher.close()
    return elapsed, base


async def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--txns", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    base_dir = Path(tempfile.mkdtemp(prefix="changebus-bench-failover-"))
    server = await asyncio.to_thread(EmbeddedMariaDB.start, base_dir)
    try:
        t0 = time.perf_counter()
        file, end, gtid, events = await asyncio.to_thread(write_binlog, server, args.txns)
        print(
            f"binlog: {args.txns} transactions, {events} events in {file} "
            f"({time.perf_counter() - t0:.1f} s to write)"
        )
        scn = binlog_to_scn(binlog_file_number(file), end)
        resumes = {
            name: ResumePoint(scn, format_position(gtid, file, end, server=sid))
            for name, sid in (("normal", 1), ("failover", 99))
        }
        best = {name: float("inf") for name in resumes}
        for r in range(args.rounds):
            for name, resume in resumes.items():
                elapsed, scn_base = await start_time(server, resume)
                assert scn_base == 0  # the same transaction at the same place: base 0
                best[name] = min(best[name], elapsed)
                print(f"round {r + 1}: {name:8s} start {elapsed * 1000:8.1f} ms")
    finally:
        await asyncio.to_thread(server.stop)
        shutil.rmtree(base_dir, ignore_errors=True)
    ratio = best["failover"] / best["normal"]
    print(
        f"best: normal {best['normal'] * 1000:.1f} ms, failover {best['failover'] * 1000:.1f} ms "
        f"({events / best['failover']:,.0f} binlog events passed/s), ratio {ratio:.1f}"
    )
    return {
        "txns": args.txns,
        "binlog_events": events,
        "normal_start_s": round(best["normal"], 4),
        "failover_start_s": round(best["failover"], 4),
        "failover_vs_normal_start_ratio": round(ratio, 2),
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
