"""Local Spark and background relays for the Spark source tests (pytest plugin).

* ``spark`` (session scope) -- one ``local[2]`` SparkSession for the whole
  run (a cold start costs 10-20 s), bound to 127.0.0.1, Python workers on
  this interpreter, with the source roots on the workers' ``PYTHONPATH`` so
  that Spark's automatic discovery finds ``pyspark_changebus`` (the session
  never calls ``register``); stopped at the end.
* :class:`RelayThread` -- a real relay running on its own event loop in a
  background thread, so that blocking Spark calls in the test can read from
  it (Spark's Python workers are other processes that connect over HTTP).
* :func:`pg_relay_config` -- a relay's configuration over one Postgres database
  (partition ``pg``); :meth:`RelayThread.wait_streaming` waits for its fetcher.
* :func:`spark_env` -- the environment a separate Spark driver process needs.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig

ROOT = Path(__file__).resolve().parent.parent
SOURCE_ROOTS = ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client", "discovery")
T = TypeVar("T")


def spark_env() -> dict[str, str]:
    """Environment for Spark: loopback only, this Python, the source roots importable."""
    env = dict(os.environ)
    env["SPARK_LOCAL_IP"] = "127.0.0.1"
    env["PYSPARK_PYTHON"] = sys.executable
    env["PYSPARK_DRIVER_PYTHON"] = sys.executable
    roots = [str(ROOT / r) for r in SOURCE_ROOTS]
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join([*roots, *([old] if old else [])])
    return env


def pg_relay_config(tmp_path: Path, dsn: str, capacity_bytes: int) -> RelayConfig:
    """A relay with one partition ``pg`` (id 1) fed by the Postgres fetcher from ``dsn``."""
    fetcher = FetcherConfig("postgres", {"dsn": dsn, "status_interval_s": 0.2})
    return RelayConfig(
        data_dir=tmp_path / "relay",
        http=HttpConfig(port=0),
        partitions=(PartitionConfig("pg", 1, capacity_bytes=capacity_bytes, fetcher=fetcher),),
        flush_interval_s=0,
    )


class RelayThread:
    """A :class:`Relay` served from a background thread's event loop."""

    def __init__(self, config: RelayConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="test-relay", daemon=True
        )
        self._thread.start()
        self.relay = Relay(config)
        self.call(self.relay.start())

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        """Run ``coro`` on the relay's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def url(self) -> str:
        return self.relay.url

    def meta(self, partition: str) -> Any:
        return self.relay.hosts[partition].buffer.meta

    def state(self, partition: str) -> str:
        return self.relay.hosts[partition].state

    def wait_streaming(self, partition: str = "pg", timeout: float = 60) -> None:
        """Wait until ``partition``'s fetcher streams (the source's changes from now on
        reach the relay)."""
        deadline = time.monotonic() + timeout
        while self.state(partition) != "streaming":
            assert time.monotonic() < deadline, f"{partition} did not start streaming"
            time.sleep(0.05)

    def stop(self) -> None:
        try:
            self.call(self.relay.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30)
            self.loop.close()

    def __enter__(self) -> RelayThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    from pyspark.sql import SparkSession

    os.environ.update(spark_env())
    session = (
        SparkSession.builder.master("local[2]")
        .appName("changebus-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()
