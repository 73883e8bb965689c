"""The chaos harness's process supervisor with real child processes: kill -9 and exits are
recorded and restarted like systemd's Restart=always, SIGSTOP freezes, shutdown ends all."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import _chaos_procs
from _chaos_procs import ProcSpec, Supervisor
from waiting import wait_until

TICKER = (
    "import os, sys, time\n"
    "print('started', os.environ.get('CHAOS_MARK'), os.getcwd(), file=sys.stderr, flush=True)\n"
    "i = 0\n"
    "while True:\n"
    "    print(i, flush=True); i += 1; time.sleep(0.02)\n"
)


def spec(name: str, kind: str, code: str, cwd: Path, delay: float = 0.2, **env: str) -> ProcSpec:
    return ProcSpec(name, kind, [sys.executable, "-c", code], dict(env), cwd, delay)


@pytest.fixture
async def sup(tmp_path: Path) -> AsyncIterator[Supervisor]:
    s = Supervisor(tmp_path / "procs")
    watcher = asyncio.create_task(s.watch())
    yield s
    await s.shutdown()
    watcher.cancel()
    for pid in {e.name: s.pid(e.name) for e in s.exits}.values():
        assert pid is None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


def proc_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


async def test_kill9_is_recorded_and_restarted_after_the_delay(
    sup: Supervisor, tmp_path: Path
) -> None:
    sup.add(spec("relay-1", "relay", TICKER, tmp_path, delay=0.5, CHAOS_MARK="m1"))
    hooks: list[tuple[str, int, float]] = []
    sup.before_restart = lambda name, n: hooks.append((name, n, time.monotonic()))
    await sup.start_all()
    first = sup.pid("relay-1")
    assert first is not None and alive(first)
    assert sup.incarnations == {"relay-1": 1}
    log1 = sup.base / "relay-1.1.log"
    await wait_until(lambda: log1.exists() and "started m1" in log1.read_text(), 10)
    assert str(tmp_path) in log1.read_text()  # cwd and env of the spec
    sup.kill9("relay-1")
    await wait_until(lambda: sup.incarnations["relay-1"] == 2, 10, "restart")
    second = sup.pid("relay-1")
    assert second is not None and second != first and alive(second)
    assert not alive(first)
    [ended] = sup.exits
    assert (ended.name, ended.incarnation, ended.returncode) == ("relay-1", 1, -9)
    assert ended.killed_by_harness
    assert "started m1" in ended.log_tail
    assert hooks[0][:2] == ("relay-1", 2)
    assert hooks[0][2] - ended.at >= 0.45  # RestartSec
    await wait_until(lambda: (sup.base / "relay-1.2.log").exists(), 5)


async def test_a_process_that_exits_on_its_own_is_restarted_and_reported(
    sup: Supervisor, tmp_path: Path
) -> None:
    code = "import sys; print('giving up: config broken', file=sys.stderr); sys.exit(3)"
    sup.add(spec("bootstrap", "bootstrap", code, tmp_path, delay=0.1))
    await sup.start("bootstrap")
    await wait_until(lambda: len(sup.exits) >= 3, 10, "several exits")
    for n, ended in enumerate(sup.exits[:3], start=1):
        assert (ended.incarnation, ended.returncode, ended.killed_by_harness) == (n, 3, False)
        assert "giving up: config broken" in ended.log_tail
    assert sup.incarnations["bootstrap"] >= 3


async def test_a_failing_hook_does_not_stop_the_restart(sup: Supervisor, tmp_path: Path) -> None:
    sup.add(spec("c", "consumer", TICKER, tmp_path, delay=0.05))

    def hook(name: str, n: int) -> None:
        raise RuntimeError("hook broke")

    sup.before_restart = hook
    await sup.start("c")
    sup.kill9("c")
    await wait_until(lambda: sup.incarnations["c"] == 2 and sup.is_running("c"), 10)


async def test_sigstop_freezes_and_sigcont_resumes(sup: Supervisor, tmp_path: Path) -> None:
    sup.add(spec("t", "tail", TICKER, tmp_path))
    await sup.start("t")
    [out] = sup.outputs("t")
    assert out.name == "t.1.out"
    await wait_until(lambda: lines(out) > 5, 10)
    pid = sup.pid("t")
    assert pid is not None
    sup.stop("t")
    assert sup.is_stopped("t")
    await wait_until(lambda: proc_state(pid) == "T", 5, "stopped state")
    frozen = lines(out)
    await asyncio.sleep(0.4)
    assert lines(out) == frozen
    assert sup.exits == []  # a stopped process is not dead
    sup.cont("t")
    assert not sup.is_stopped("t")
    await wait_until(lambda: lines(out) > frozen + 5, 10, "resumed")
    # stderr of a tail goes to the .log, stdout only to the .out
    log = (sup.base / "t.1.log").read_text()
    assert "started" in log and "\n1\n" not in log
    # a stopped process can be killed; the new incarnation runs and writes its own output
    sup.stop("t")
    sup.kill9("t")
    await wait_until(lambda: sup.incarnations["t"] == 2 and sup.is_running("t"), 10)
    assert not sup.is_stopped("t")
    assert [p.name for p in sup.outputs("t")] == ["t.1.out", "t.2.out"]
    await wait_until(lambda: lines(sup.outputs("t")[1]) > 2, 10)
    assert sup.exits[0].killed_by_harness and sup.exits[0].returncode == -9


async def test_shutdown_ends_stopped_and_stubborn_processes_by_pid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_chaos_procs, "_TERM_WAIT_S", 1.0)
    stubborn = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ignoring SIGTERM', flush=True)\n"
        "while True: time.sleep(1)\n"
    )
    sup = Supervisor(tmp_path / "p")
    watcher = asyncio.create_task(sup.watch())
    sup.add(spec("polite", "relay", TICKER, tmp_path))
    sup.add(spec("frozen", "consumer", TICKER, tmp_path))
    sup.add(spec("stubborn", "relay", stubborn, tmp_path))
    await sup.start_all()
    log = sup.base / "stubborn.1.log"
    await wait_until(lambda: log.exists() and "ignoring" in log.read_text(), 10)
    pids = {name: sup.pid(name) for name in sup.specs}
    sup.stop("frozen")
    t0 = time.monotonic()
    await sup.shutdown()
    assert time.monotonic() - t0 < 5
    watcher.cancel()
    for pid in pids.values():
        assert pid is not None and not alive(pid)
    codes = {e.name: e.returncode for e in sup.exits}
    assert codes == {"polite": -15, "frozen": -15, "stubborn": -9}
    assert all(e.killed_by_harness for e in sup.exits)
    await asyncio.sleep(0.3)
    assert sup.incarnations == {"polite": 1, "frozen": 1, "stubborn": 1}  # no restarts
    assert not any(sup.is_running(name) for name in sup.specs)


async def test_signals_to_a_process_that_is_down_are_ignored(
    sup: Supervisor, tmp_path: Path
) -> None:
    sup.add(spec("once", "relay", "pass", tmp_path, delay=30))
    await sup.start("once")
    await wait_until(lambda: len(sup.exits) == 1, 10)
    sup.kill9("once")
    sup.stop("once")
    sup.cont("once")
    assert not sup.is_stopped("once") and not sup.is_running("once")
    assert sup.exits[0].returncode == 0 and not sup.exits[0].killed_by_harness
    with pytest.raises(ValueError, match="duplicate"):
        sup.add(spec("once", "relay", "pass", tmp_path))


async def test_the_process_group_is_frozen_together_and_cleaned_up_after_a_kill(
    sup: Supervisor, tmp_path: Path
) -> None:
    # a daemon with a worker process of its own (like the MySQL fetcher's decoding pool)
    parent = (
        "import subprocess, sys, time\n"
        "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "print('worker', w.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    sup.add(spec("relay-m", "relay", parent, tmp_path, delay=0.1))
    await sup.start("relay-m")
    log = sup.base / "relay-m.1.log"
    # (the whole line: "worker" alone was read once, before its pid was written)
    await wait_until(lambda: log.exists() and re.search(r"worker \d+\n", log.read_text()), 10)
    worker = int(re.search(r"worker (\d+)\n", log.read_text())[1])  # type: ignore[index]
    assert alive(worker)
    sup.stop("relay-m")
    await wait_until(lambda: proc_state(worker) == "T", 5, "the worker frozen too")
    sup.cont("relay-m")
    await wait_until(lambda: proc_state(worker) != "T", 5, "the worker thawed")
    sup.kill9("relay-m")
    # the worker was left behind by the kill; the watcher kills it before the restart
    await wait_until(lambda: not alive(worker), 5, "the leftover worker killed")
    await wait_until(lambda: sup.incarnations["relay-m"] == 2, 10)


async def test_a_kill_after_the_process_ended_on_its_own_is_not_blamed(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "p")  # no watcher: poll() by hand, to hold the race open
    sup.add(spec("crashy", "consumer", "import sys; sys.exit(5)", tmp_path, delay=60))
    await sup.start("crashy")
    pid = sup.pid("crashy")
    assert pid is not None
    await wait_until(lambda: proc_state(pid) == "Z", 10, "ended, not yet reaped")
    sup.kill9("crashy")
    await sup.poll()
    [ended] = sup.exits
    assert (ended.returncode, ended.killed_by_harness) == (5, False)
    await sup.shutdown()
