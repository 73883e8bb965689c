"""A Spark driver for test_spark_cluster.py: the example mirror job on ``local-cluster[2,1,1024]``.

    python spark_cluster_job.py RELAY_URL MIRROR CHECKPOINT CTRL KILL_BATCH

Runs deploy/spark/parquet_mirror.py's ``start_mirror`` with two executors in
JVMs of their own (each with its own Python workers), talking to the test
through files in CTRL:

1. the streaming query runs (processing-time trigger, two tasks per batch);
   a watcher thread waits until a micro-batch from KILL_BATCH on is planned
   (``offsets/<id>`` in the checkpoint, no commit yet) while both executors
   run one of its tasks, then kill -9s one executor JVM and, once Spark
   counts a failed task of those stages, writes ``CTRL/killed`` ("<pid>
   <batch> <active tasks>"); Spark must retry the lost task on another
   executor (a kill that came after its task ended is tried again);
2. on ``CTRL/stop`` it stops the query and writes ``CTRL/stopped``;
3. on ``CTRL/restart`` it starts the query again on the same checkpoint with
   Trigger.AvailableNow, waits for it, writes the restarted query's progress
   (batch ids and input rows) to ``CTRL/progress.json`` and exits 0.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

ROOT = Path(__file__).resolve().parents[2]


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location(
        "parquet_mirror", ROOT / "deploy" / "spark" / "parquet_mirror.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def executor_jvms() -> list[int]:
    """Pids of this driver's executor JVMs (descendants running CoarseGrainedExecutorBackend)."""
    parents: dict[int, int] = {}
    cmds: dict[int, bytes] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmds[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    me = os.getpid()

    def mine(pid: int) -> bool:
        while pid > 1:
            if pid == me:
                return True
            pid = parents.get(pid, 0)
        return False

    return sorted(
        pid for pid, cmd in cmds.items() if b"CoarseGrainedExecutorBackend" in cmd and mine(pid)
    )


def wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(0.1)


def failed_tasks(tracker: Any, stages: list[int]) -> int:
    infos = [tracker.getStageInfo(sid) for sid in stages]
    return sum(info.numFailedTasks for info in infos if info is not None)


def task_lost(tracker: Any, stages: list[int], failed_before: int) -> bool:
    """Whether a task of ``stages`` failed after the kill (False once they all ended without)."""
    deadline = time.monotonic() + 120
    ended_at: float | None = None
    while time.monotonic() < deadline:
        if failed_tasks(tracker, stages) > failed_before:
            return True
        if set(stages) & set(tracker.getActiveStageIds()):
            ended_at = None
        elif ended_at is None:
            ended_at = time.monotonic()
        elif time.monotonic() - ended_at > 2:  # the status listener lags the scheduler a little
            return False
        time.sleep(0.05)
    return False


def kill_in_batch(spark: Any, checkpoint: Path, ctrl: Path, first: int) -> None:
    """Kill one executor JVM while both executors run tasks of micro-batch ``first`` or later.

    Two tasks running at once on two one-core executors means each executor
    has one: whichever JVM dies, a task of the batch is lost with it. Tasks are
    short and the status tracker lags, so the kill can land just after the
    task ended: then the stage's failed-task count stays put, and the watcher
    tries again in a later batch once the worker has started a new executor.
    ``CTRL/killed`` is written only for a kill that cost a task.
    """
    tracker = spark.sparkContext.statusTracker()
    jvms, scanned = executor_jvms(), time.monotonic()
    while True:
        batches = [int(p.name) for p in (checkpoint / "offsets").glob("[0-9]*")]
        batch = max(batches, default=-1)
        stages = list(tracker.getActiveStageIds())
        running = 0
        if batch >= first and not (checkpoint / "commits" / str(batch)).exists():
            for sid in stages:
                info = tracker.getStageInfo(sid)
                if info is not None:
                    running += info.numActiveTasks
        if running >= 2 and len(jvms) == 2 and all(Path(f"/proc/{p}").exists() for p in jvms):
            failed_before = failed_tasks(tracker, stages)
            os.kill(jvms[0], signal.SIGKILL)
            if task_lost(tracker, stages, failed_before):
                (ctrl / "killed").write_text(f"{jvms[0]} {batch} {running}")
                return
            print(f"the kill of {jvms[0]} came after its task ended: again", file=sys.stderr)
            jvms = []
        elif running == 0 and time.monotonic() - scanned > 0.5:
            jvms, scanned = (
                executor_jvms(),
                time.monotonic(),
            )  # scanned between tasks, not on the hot path
        time.sleep(0.01)


def main() -> None:
    url, mirror, checkpoint, ctrl_dir, kill_batch = sys.argv[1:6]
    ctrl = Path(ctrl_dir)
    example = load_example()
    spark = (
        SparkSession.builder.master("local-cluster[2,1,1024]")
        .appName("changebus cluster test")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1")
        .config("spark.executor.extraJavaOptions", "-XX:TieredStopAtLevel=1")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("WARN")  # the log shows the lost executor and the retries
    args = {
        "relays": url,
        "source": "public.acct",
        "key": ["id"],
        "mirror": mirror,
        "checkpoint": checkpoint,
        "num_partitions": 2,
    }
    watcher = threading.Thread(
        target=kill_in_batch,
        args=(spark, Path(checkpoint), ctrl, int(kill_batch)),
        daemon=True,
    )
    watcher.start()
    query = example.start_mirror(spark, trigger_s=0.5, **args)
    (ctrl / "started").write_text(str(os.getpid()))
    while not (ctrl / "stop").exists():
        if query.awaitTermination(0.2):
            raise RuntimeError(f"the query ended: {query.exception()}")
    query.stop()
    (ctrl / "stopped").write_text("")
    wait_for(ctrl / "restart")
    query = example.start_mirror(spark, available_now=True, **args)
    query.awaitTermination()
    if query.exception() is not None:
        raise RuntimeError(f"the restarted query failed: {query.exception()}")
    progress = [
        {"batchId": p.batchId, "numInputRows": p.numInputRows} for p in query.recentProgress
    ]
    (ctrl / "progress.json").write_text(json.dumps(progress))
    spark.stop()


if __name__ == "__main__":
    main()
