"""kill -9 of the Spark driver in the middle of a batch: the restart replays it, nothing is lost.

The driver (tests/client/spark_crash_job.py) runs in its own process group with
its own JVM; the relay runs here. The batch in flight at the kill is written but
not committed; the restarted query must run it again with the same batch id and
the same rows, then drain the rest.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from changebus.client import ConsumerConfig, SyncConsumer
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, RelayConfig
from fix_spark import RelayThread, spark_env

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(600)]

JOB = Path(__file__).with_name("spark_crash_job.py")
WINDOWS = 3000


def relay_keys(url: str) -> list[tuple[int, int]]:
    keys: list[tuple[int, int]] = []
    cfg = ConsumerConfig(relays=(url,), partition="syn", follow=False, wait_s=0.2)
    with SyncConsumer(cfg) as consumer:
        for i, window in enumerate(consumer):
            keys.extend((e.scn, e.seq) for e in window.events)
            if i + 1 == WINDOWS:
                break
    return keys


def run_job(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as err:  # a file, not a pipe: Spark's output must never block it
        return subprocess.Popen(
            [sys.executable, str(JOB), *args],
            env=spark_env(),
            start_new_session=True,  # the JVM is the job's child: one process group to kill
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


def test_driver_killed_mid_batch_replays_it(tmp_path: Path) -> None:
    synthetic = {
        "windows_per_s": 0,
        "max_windows": WINDOWS,
        "events_per_window": 3,
        "row_bytes": 40,
        "tables": 2,
        "keys": 1000,
    }
    cfg = RelayConfig(
        data_dir=tmp_path / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "syn", 1, capacity_bytes=16 << 20, fetcher=FetcherConfig("synthetic", synthetic)
            ),
        ),
        flush_interval_s=0,
    )
    out, ck, marker = tmp_path / "out", tmp_path / "ck", tmp_path / "hanging"
    with RelayThread(cfg) as relay:
        deadline = time.monotonic() + 60
        while relay.state("syn") != "finished":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        expected = relay_keys(relay.url)
        log = tmp_path / "job.log"
        job = run_job([relay.url, str(ck), str(out), "2", str(marker)], log)
        try:
            deadline = time.monotonic() + 300
            while not marker.exists():
                assert job.poll() is None, tail(log)
                assert time.monotonic() < deadline, "the job never reached batch 2"
                time.sleep(0.2)
        finally:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(60)
        assert not (ck / "commits" / "2").exists() and (ck / "offsets" / "2").exists()
        job = run_job([relay.url, str(ck), str(out), "-1", str(marker)], log)
        try:
            job.wait(400)
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
        assert job.returncode == 0, tail(log)
    ledger = [tuple(map(int, line.split())) for line in (out / "ledger").read_text().splitlines()]
    ids = [b for b, _ in ledger]
    assert ids.count(2) == 2  # batch 2 ran twice: before the kill and as the replay
    counts = {b: [n for i, n in ledger if i == b] for b in set(ids)}
    assert counts[2][0] == counts[2][1]  # ... with the same rows
    got: list[tuple[int, int]] = []
    for d in sorted(out.glob("batch_id=*")):
        table: Any = pq.read_table(d, columns=["_commit_scn", "_txn_seq"])
        got.extend(zip(table.column(0).to_pylist(), table.column(1).to_pylist(), strict=True))
    assert len(got) == len(set(got)), "duplicates"
    assert sorted(got) == sorted(expected)
