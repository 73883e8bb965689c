"""Spark source throughput: rows/s through format("changebus") into a noop sink.

A relay process (synthetic fetcher, pre-filled with ``--windows`` windows of
5 events of ~100 B over 2 tables) serves the same SCN range twice:

* baseline -- the raw client library reading the range into Arrow in this
  process, exactly what one Spark task does without Spark
  (:func:`~changebus.client.spark._read.read_range`: a columnar
  :class:`~changebus.client.Consumer` with validation and windows, feeding
  :class:`~changebus.client.spark.ArrowDecoder`);
* Spark -- ``spark.readStream.format("changebus")`` with Trigger.AvailableNow
  into ``format("noop")``, ``local[2]``, ``--partitions`` tasks (SCN
  sub-ranges, the source's default; ``--split-by key``: key-hash slices);
  timed from ``start()`` to the query's end (the query's start, planning,
  checkpoint writes and task scheduling included; session start-up and a
  warm-up run of the same query over the newest 2,000 windows excluded, as
  the baseline's warm-up reads 2,000 windows first).

``spark_vs_raw_client_ratio`` = Spark rows/s / baseline rows/s (goal >= 0.8
in 5 of 5 runs). CPU seconds per million rows of the whole process tree (this
process, the relay, the JVM and Spark's Python workers) are printed too: on a
shared machine they move less than wall-clock rates; ``cpu_efficiency_ratio``
= baseline CPU / Spark CPU for the same rows (goal >= 0.7). The Spark run's
CPU is also split by process: the JVM, Spark's Python workers (the tasks'
reading and decoding), the relay and this process.
The relay, the Spark JVM, its Python workers and the baseline share 2 cores.
Last line: one JSON object.

Usage: ``python bench/spark_source.py [--windows 300000] [--partitions 2] [--split-by scn|key]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from _common import PATHS, free_port, start_relay, stop_relay
from changebus.client.spark import register
from changebus.client.spark._arrow import union_schema
from changebus.client.spark._options import SourceOptions
from changebus.client.spark._read import RangeSpec, read_range
from changebus.client.spark._relay import partition_bounds, run_sync, table_schemas

EVENTS_PER_WINDOW = 5


def status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/v1/status", timeout=10) as resp:
        data: dict[str, Any] = json.load(resp)["partitions"][0]
        return data


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system, reaped children included) of ``root`` and its descendants."""
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ppid = int(fields[1])
        ticks = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        stats[int(entry)] = (ppid, ticks / os.sysconf("SC_CLK_TCK"))
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0.0))[1]
        todo.extend(children.get(pid, []))
    return total


def cpu_by_kind(root: int, relay: int) -> dict[str, float]:
    """CPU seconds so far of the JVM, Spark's Python workers, the relay and this process."""
    out = {"jvm": 0.0, "python_workers": 0.0, "relay": tree_cpu_s(relay), "bench": 0.0}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                head, rest = fh.read().rsplit(")", 1)
        except OSError:
            continue
        fields = rest.split()
        own = (int(fields[11]) + int(fields[12])) / tick  # utime stime
        reaped = (int(fields[13]) + int(fields[14])) / tick
        name, ppid = head.split("(", 1)[1], int(fields[1])
        if int(entry) == root:
            out["bench"] += own
        elif ppid == root and name == "java":
            out["jvm"] += own  # its Python workers are counted below
        elif name.startswith("python") and _has_ancestor(int(entry), root, relay):
            out["python_workers"] += own + reaped
    return out


def _has_ancestor(pid: int, root: int, exclude: int) -> bool:
    while pid > 1:
        if pid == exclude:
            return False
        try:
            with open(f"/proc/{pid}/stat") as fh:
                pid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
        if pid == root:
            return True
    return False


def raw_client(url: str, since: int, until: int) -> tuple[int, float]:
    """Rows read by the client library into Arrow, and seconds."""
    opts = SourceOptions.parse({"relays": url}, mode="batch")
    bounds = run_sync(partition_bounds(opts))
    tables = run_sync(table_schemas(opts, list(bounds)))
    schema = union_schema(tables.values())
    rows = 0
    t0 = time.perf_counter()
    for batch in read_range(opts, RangeSpec("bench", since, until), schema, tables):
        rows += batch.num_rows
    return rows, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=300_000)
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--split-by", choices=["key", "scn"], default="scn")
    args = ap.parse_args()

    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = os.pathsep.join(PATHS)
    from pyspark.sql import SparkSession

    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        config = Path(tmp) / "relay.toml"
        config.write_text(
            f'data_dir = "{tmp}/data"\nflush_interval_s = 0\nlog_level = "warning"\n'
            f'[http]\nport = {port}\nmax_response_bytes = "64MiB"\n'
            '[[partitions]]\nname = "bench"\nid = 1\ncapacity_bytes = "512MiB"\n'
            '[partitions.fetcher]\nkind = "synthetic"\n'
            f"options = {{ windows_per_s = 0, max_windows = {args.windows},"
            f" events_per_window = {EVENTS_PER_WINDOW}, row_bytes = 100, tables = 2,"
            " keys = 1000000, update_ratio = 0.0, delete_ratio = 0.0 }\n"
        )
        relay = start_relay(config, port)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 300
            while status(url)["state"] != "finished":
                assert time.time() < deadline, "the relay did not fill"
                time.sleep(0.2)
            st = status(url)
            since, until = int(st["prev_scn"]), int(st["max_scn"])
            expected = args.windows * EVENTS_PER_WINDOW
            print(f"relay holds {st['windows']} windows, SCNs ({since}, {until}]", flush=True)

            raw_client(url, since, min(until, since + 2000))  # warm-up
            cpu0 = tree_cpu_s(os.getpid())
            raw_rows, raw_s = raw_client(url, since, until)
            raw_cpu = tree_cpu_s(os.getpid()) - cpu0
            assert raw_rows == expected, (raw_rows, expected)
            raw_rate = raw_rows / raw_s
            print(
                f"raw client -> Arrow: {raw_rows:,} rows in {raw_s:.2f} s = {raw_rate:,.0f} rows/s,"
                f" {raw_cpu / raw_rows * 1e6:.1f} CPU-s per 1M rows (relay included)"
            )

            spark = (
                SparkSession.builder.master("local[2]")
                .config("spark.ui.enabled", "false")
                .config("spark.driver.host", "127.0.0.1")
                .config("spark.driver.bindAddress", "127.0.0.1")
                .config("spark.sql.shuffle.partitions", "2")
                .getOrCreate()
            )
            spark.sparkContext.setLogLevel("ERROR")
            register(spark)
            try:

                def query(start: int, checkpoint: str) -> Any:
                    return (
                        spark.readStream.format("changebus")
                        .option("relays", url)
                        .option("startingScn", str(start))
                        .option("numPartitions", str(args.partitions))
                        .option("splitBy", args.split_by)
                        .load()
                        .writeStream.format("noop")
                        .option("checkpointLocation", checkpoint)
                        .trigger(availableNow=True)
                        .start()
                    )

                # warm-up: the same query over the newest 2,000 windows (as the baseline's
                # warm-up reads 2,000): the JVM compiles the stream's and the sink's code paths
                # once per process, not once per query
                warm = query(max(since, until - 2000), f"{tmp}/ck-warm")
                warm.awaitTermination()
                assert sum(int(p["numInputRows"]) for p in warm.recentProgress) > 0
                cpu0 = tree_cpu_s(os.getpid())
                kinds0 = cpu_by_kind(os.getpid(), relay.pid)
                t0 = time.perf_counter()
                q = query(since, f"{tmp}/ck")
                q.awaitTermination()
                spark_s = time.perf_counter() - t0
                spark_cpu = tree_cpu_s(os.getpid()) - cpu0
                kinds = {
                    k: round(v - kinds0[k], 2)
                    for k, v in cpu_by_kind(os.getpid(), relay.pid).items()
                }
                spark_rows = sum(int(p["numInputRows"]) for p in q.recentProgress)
                batches = len([p for p in q.recentProgress if int(p["numInputRows"])])
                phases: dict[str, float] = {}
                for p in q.recentProgress:
                    for k, v in p["durationMs"].items():
                        phases[k] = round(phases.get(k, 0.0) + v / 1000, 2)
            finally:
                spark.stop()
            assert spark_rows == expected, (spark_rows, expected)
            spark_rate = spark_rows / spark_s
            print(
                f"spark format('changebus') -> noop, {args.partitions} partitions"
                f" split by {args.split_by}:"
                f" {spark_rows:,} rows in {spark_s:.2f} s ({batches} batches) ="
                f" {spark_rate:,.0f} rows/s, {spark_cpu / spark_rows * 1e6:.1f} CPU-s per 1M rows"
                " (JVM, Python workers, relay)"
            )
            print(f"spark run CPU-s by process: {kinds}")
            print(f"spark trigger phases (s): {phases}; from start() to the end {spark_s:.1f} s")
        finally:
            stop_relay(relay)
    ratio = spark_rate / raw_rate
    print(f"ratio {ratio:.2f} (goal >= 0.8), CPU {raw_cpu / spark_cpu:.2f} (goal >= 0.7)")
    print(
        json.dumps(
            {
                "rows": expected,
                "partitions": args.partitions,
                "split_by": args.split_by,
                "raw_client_rows_per_s": round(raw_rate),
                "spark_rows_per_s": round(spark_rate),
                "spark_vs_raw_client_ratio": round(ratio, 3),
                "raw_client_cpu_s_per_mrow": round(raw_cpu / expected * 1e6, 1),
                "spark_cpu_s_per_mrow": round(spark_cpu / expected * 1e6, 1),
                "cpu_efficiency_ratio": round(raw_cpu / spark_cpu, 3),
                "spark_cpu_s_by_process": kinds,
                "spark_trigger_phases_s": phases,
                "spark_s": round(spark_s, 2),
                "load_average_1min": round(os.getloadavg()[0], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
