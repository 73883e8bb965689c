"""One process at a time in a relay partition's directory (``DirLock``).

A second relay started on the same ``data_dir`` (an overlapping restart, a
rollout starting the new process before the old one exits) opened and
recovered the partition's files before it failed to bind its port: it
republished ``meta.dat`` and repaired event records under the live relay's
readers (found by review). Now it stops at once, naming the directory and
the pid holding it, and touches nothing; a holder killed with SIGKILL
leaves no stale lock.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from changebus.relay import (
    FetcherConfig,
    HttpConfig as RelayHttp,
    PartitionConfig,
    Relay,
    RelayConfig,
)
from changebus.schemas import ConfigError, DirLock, stop_task
from waiting import wait_until


def synthetic_relay(data_dir: Path, windows: int) -> RelayConfig:
    fetcher = {"windows_per_s": 0, "max_windows": windows, "events_per_window": 4, "tables": 1}
    part = PartitionConfig(
        "syn", 1, capacity_bytes=1 << 20, fetcher=FetcherConfig("synthetic", fetcher)
    )
    return RelayConfig(
        data_dir=data_dir, http=RelayHttp(port=0), partitions=(part,), flush_interval_s=0
    )


async def test_a_second_relay_on_the_same_directory_is_refused_and_touches_nothing(
    tmp_path: Path,
) -> None:
    cfg = synthetic_relay(tmp_path / "relay", 50)
    async with Relay(cfg) as relay:
        host = relay.hosts["syn"]
        await wait_until(lambda: host.buffer.meta.windows >= 50, what="the windows")
        part = tmp_path / "relay" / "syn"
        before = {p.name: p.read_bytes() for p in part.iterdir() if p.is_file()}
        other = Relay(cfg)
        with pytest.raises(ConfigError, match=rf"in use by process {os.getpid()}"):
            await other.start()
        after = {p.name: p.read_bytes() for p in part.iterdir() if p.is_file()}
        assert after == before  # nothing opened, recovered or republished
        assert host.buffer.meta.windows == 50  # the first relay goes on
        first, last = host.buffer.meta.prev_scn, host.buffer.meta.last_scn
    # stopped, the directory is free again
    async with Relay(cfg) as again:
        meta = again.hosts["syn"].buffer.meta
        assert meta.prev_scn == first and meta.last_scn >= last and meta.head_event == 0


def test_a_holder_killed_with_sigkill_leaves_no_stale_lock(tmp_path: Path) -> None:
    code = (
        "import sys, time\nfrom pathlib import Path\nfrom changebus.schemas import DirLock\n"
        "lock = DirLock(Path(sys.argv[1]), 'test')\nprint('held', flush=True)\ntime.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, env=os.environ
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"held\n"
        with pytest.raises(ConfigError, match=rf"in use by process {proc.pid}"):
            DirLock(tmp_path, "test")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        began = time.monotonic()
        with DirLock(tmp_path, "test") as lock:  # at once: the kernel dropped it
            assert lock.path.read_text().strip() == str(os.getpid())
        assert time.monotonic() - began < 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


async def test_a_stop_whose_fetcher_fails_to_close_still_frees_the_directory(
    tmp_path: Path,
) -> None:
    cfg = synthetic_relay(tmp_path / "relay", 20)
    relay = Relay(cfg)
    await relay.start()
    host = relay.hosts["syn"]
    await wait_until(lambda: host.buffer.meta.windows >= 20, what="the windows")
    assert host.fetcher is not None

    async def broken_close() -> None:
        raise RuntimeError("the fetcher did not close")

    host.fetcher.close = broken_close  # type: ignore[method-assign]
    await relay.stop()  # (logged: the partition did not stop cleanly)
    with DirLock(tmp_path / "relay" / "syn", "test"):  # free, and the files closed
        pass
    async with Relay(cfg) as again:
        assert again.hosts["syn"].buffer.meta.windows >= 20


async def test_a_stop_cancelled_while_the_ingest_task_runs_keeps_the_files_and_the_lock(
    tmp_path: Path,
) -> None:
    """``stop()`` cancelled while it waited for the ingest task (which goes on a while):
    its clean-up closed the buffer and freed the directory under the running task
    (review). Both stay until a stop that saw the task end."""
    cfg = synthetic_relay(tmp_path / "relay", 20)
    relay = Relay(cfg)
    await relay.start()
    host = relay.hosts["syn"]
    await wait_until(lambda: host.buffer.meta.windows >= 20, what="the windows")
    await stop_task(host._task)
    done = asyncio.Event()

    async def slow_to_end() -> None:
        while True:
            try:
                await done.wait()
                return
            except asyncio.CancelledError:
                continue  # (still busy: ends once done)

    host._task = task = asyncio.create_task(slow_to_end())
    try:
        stopping = asyncio.create_task(host.stop())
        await asyncio.sleep(0.05)
        stopping.cancel()
        await asyncio.wait({stopping})
        assert stopping.cancelled()
        await asyncio.sleep(0.05)
        assert not task.done()
        with pytest.raises(ConfigError, match="in use"):
            DirLock(tmp_path / "relay" / "syn", "test")
        assert host.buffer.meta.windows >= 20  # still mapped
    finally:
        done.set()
        await asyncio.wait({task})
    await relay.stop()  # the task ended: files closed, directory freed
    with DirLock(tmp_path / "relay" / "syn", "test"):
        pass
