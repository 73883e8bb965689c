"""Spark source on a cluster: rows/s on ``local-cluster[2,1,1024]`` vs ``local[2]``.

A relay process (synthetic fetcher, pre-filled with ``--windows`` windows of
5 events of ~100 B over 2 tables) serves one SCN range; for each master a
fresh driver process (this script with ``--run MASTER``) reads all of it with
``spark.readStream.format("changebus")``, Trigger.AvailableNow, into
``format("noop")``, ``--partitions`` key-hash slices:

* ``local[2]`` -- one JVM, the tasks are threads of the driver JVM and their
  Python workers its children;
* ``local-cluster[2,1,1024]`` -- a master and a worker inside the driver JVM
  and two executors in JVMs of their own (1 core, 1 GiB each), each with its
  own Python workers; tasks are shipped over RPC, results come back over the
  network, as on a real cluster.

Timed from ``start()`` to the query's end (planning, checkpoint writes, task
scheduling included; session start-up and a warm-up batch read excluded and
printed separately). Where the time goes: CPU seconds of the timed query per
kind of process (driver JVM, executor JVMs, Python workers, driver Python,
relay) and Spark's own per-trigger durations (``latestOffset``,
``queryPlanning``, ``addBatch``, ``walCommit``, summed). A Python worker that
exits during the query hands its CPU time to its parent JVM's figure.
Everything shares the machine's cores. Last line: one JSON object with
``cluster_vs_local_ratio`` = local-cluster rows/s / local[2] rows/s.

Usage: ``python bench/spark_cluster.py [--windows 20000] [--partitions 2]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from _common import PATHS, free_port, start_relay, stop_relay

EVENTS_PER_WINDOW = 5
MASTERS = ("local[2]", "local-cluster[2,1,1024]")


def status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/v1/status", timeout=10) as resp:
        data: dict[str, Any] = json.load(resp)["partitions"][0]
        return data


def _kind(cmd: bytes) -> str:
    if b"CoarseGrainedExecutorBackend" in cmd:
        return "executor_jvms"
    if b"java" in cmd.split(b"\0", 1)[0]:
        return "driver_jvm"
    if b"pyspark" in cmd or b"daemon" in cmd:
        return "python_workers"
    return "other"


def cpu_by_kind(root: int) -> dict[int, tuple[str, float]]:
    """``{pid: (kind, CPU seconds)}`` of ``root``'s descendants (reaped children included)."""
    procs: dict[int, tuple[int, str, float]] = {}
    tck = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ticks = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        procs[int(entry)] = (int(fields[1]), _kind(cmd), ticks / tck)
    out: dict[int, tuple[str, float]] = {}
    for pid, (ppid, kind, cpu) in procs.items():
        p = ppid
        while p > 1 and p != root:
            p = procs.get(p, (0, "", 0.0))[0]
        if p == root:
            out[pid] = (kind, cpu)
    return out


def cpu_delta(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    """CPU seconds spent between two :func:`cpu_by_kind` samples, per kind."""
    out: dict[str, float] = {}
    for pid, (kind, cpu) in after.items():
        out[kind] = out.get(kind, 0.0) + cpu - before.get(pid, (kind, 0.0))[1]
    return {k: round(v, 2) for k, v in sorted(out.items())}


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of one process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:13]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def run_one(
    master: str, url: str, since: int, until: int, partitions: int, tmp: str, relay_pid: int
) -> None:
    """The driver of one measurement (a process of its own): prints one JSON object."""
    from pyspark.sql import SparkSession

    t0 = time.perf_counter()
    spark = (
        SparkSession.builder.master(master)
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    startup_s = time.perf_counter() - t0

    def reader(kind: Any) -> Any:
        return (
            kind.format("changebus")
            .option("relays", url)
            .option("startingScn", str(since))
            .option("numPartitions", str(partitions))
        )

    t0 = time.perf_counter()
    warm = reader(spark.read).option("endingScn", str(min(until, since + 2000))).load().count()
    warm_s = time.perf_counter() - t0
    assert warm > 0
    before, py0, relay0 = cpu_by_kind(os.getpid()), own_cpu_s(), proc_cpu_s(relay_pid)
    t0 = time.perf_counter()
    q = (
        reader(spark.readStream)
        .load()
        .writeStream.format("noop")
        .option("checkpointLocation", f"{tmp}/ck-{master}")
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination()
    wall_s = time.perf_counter() - t0
    cpu = cpu_delta(before, cpu_by_kind(os.getpid()))
    cpu["driver_python"] = round(own_cpu_s() - py0, 2)
    cpu["relay"] = round(proc_cpu_s(relay_pid) - relay0, 2)
    progress = q.recentProgress
    rows = sum(int(p["numInputRows"]) for p in progress)
    phases: dict[str, int] = {}
    for p in progress:
        for k, v in (p["durationMs"] or {}).items():
            phases[k] = phases.get(k, 0) + int(v)
    spark.stop()
    print(
        json.dumps(
            {
                "master": master,
                "rows": rows,
                "seconds": round(wall_s, 2),
                "rows_per_s": round(rows / wall_s),
                "batches": len([p for p in progress if int(p["numInputRows"])]),
                "startup_s": round(startup_s, 1),
                "warmup_s": round(warm_s, 1),
                "cpu_s": cpu,
                "spark_ms": phases,
            }
        ),
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=20_000)
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--run", help=argparse.SUPPRESS)  # MASTER URL SINCE UNTIL TMP: one driver
    args, rest = ap.parse_known_args()

    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = os.pathsep.join(PATHS)
    if args.run:
        relay_url, first, last, workdir, relay_pid = rest
        run_one(
            args.run, relay_url, int(first), int(last), args.partitions, workdir, int(relay_pid)
        )
        return

    results: dict[str, dict[str, Any]] = {}
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
            for master in MASTERS:
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--run",
                        master,
                        "--partitions",
                        str(args.partitions),
                        url,
                        str(since),
                        str(until),
                        tmp,
                        str(relay.pid),
                    ],
                    check=True,
                    stdout=subprocess.PIPE,
                    text=True,
                ).stdout
                result = json.loads(out.strip().splitlines()[-1])
                assert result["rows"] == expected, (result["rows"], expected)
                results[master] = result
                print(
                    f"{master}: {result['rows']:,} rows in {result['seconds']} s ="
                    f" {result['rows_per_s']:,} rows/s ({result['batches']} batches);"
                    f" start-up {result['startup_s']} s, warm-up {result['warmup_s']} s;"
                    f" CPU-s {result['cpu_s']}; Spark ms {result['spark_ms']}",
                    flush=True,
                )
        finally:
            stop_relay(relay)
    local, cluster = results[MASTERS[0]], results[MASTERS[1]]
    ratio = cluster["rows_per_s"] / local["rows_per_s"]
    print(f"local-cluster / local[2]: {ratio:.2f}")
    print(
        json.dumps(
            {
                "rows": expected,
                "partitions": args.partitions,
                "local_rows_per_s": local["rows_per_s"],
                "cluster_rows_per_s": cluster["rows_per_s"],
                "cluster_vs_local_ratio": round(ratio, 3),
                "local_startup_s": local["startup_s"],
                "cluster_startup_s": cluster["startup_s"],
                "local_cpu_s": local["cpu_s"],
                "cluster_cpu_s": cluster["cpu_s"],
                "local_spark_ms": local["spark_ms"],
                "cluster_spark_ms": cluster["spark_ms"],
            }
        )
    )


if __name__ == "__main__":
    main()
