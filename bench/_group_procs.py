"""The processes of a bench/consumer_group.py run and their readings.

:class:`Bench` holds the run's ZooKeeper, its ``changebus relay`` processes
(synthetic fetcher) and its member processes (``consumer_group.py --member``,
see _group_member.py), and stops them all at the end; a :class:`Member` reads
its process's JSON-lines log. Also: the CPU seconds of a process and of the
whole machine (``/proc``), a relay's status, and whether a set of members holds
the buckets evenly.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common
from _group_member import BUCKETS
from _zk import ZkServer
from client import relay_toml

#: the script whose ``--member`` mode runs a member process
SCRIPT = Path(__file__).with_name("consumer_group.py")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU seconds all processes of the machine were busy so far (every core, ``/proc/stat``)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = sum(fields[:8]) - fields[3] - fields[4]  # all but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


@dataclass
class Member:
    """One member process (held until :meth:`go`) and its log."""

    name: str
    log: Path
    proc: subprocess.Popen[bytes]
    _seen: int = 0
    _lines: list[dict[str, Any]] = field(default_factory=list)

    def lines(self, ev: str | None = None) -> list[dict[str, Any]]:
        if self.log.exists():
            raw = self.log.read_text().splitlines()
            for text in raw[self._seen :]:
                if not text.endswith("}"):
                    break
                self._lines.append(json.loads(text))
                self._seen += 1
        return [x for x in self._lines if ev is None or x["ev"] == ev]

    @property
    def member_id(self) -> str:
        ids = [x["m"] for x in self.lines("assigned") if x["m"]]
        return ids[-1] if ids else ""

    def owned(self) -> set[str]:
        units: set[str] = set()
        for x in self.lines():
            if x["ev"] == "assigned":
                units |= set(x["units"])
            elif x["ev"] in ("revoked", "lost"):
                units -= set(x["units"])
        return units

    def go(self) -> None:
        wait_for(lambda: self.lines("ready"), 60, f"{self.name} ready")
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def wait_for(pred: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


class Bench:
    """The run's ZooKeeper, its relays, its members; all stopped at the end."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.zk = ZkServer(base / "zk")
        self.members: list[Member] = []
        self.relays: list[subprocess.Popen[bytes]] = []

    def relay(self, name: str, options: dict[str, Any]) -> tuple[str, subprocess.Popen[bytes]]:
        port = _common.free_port()
        config = self.base / f"{name}.toml"
        config.write_text(relay_toml(self.base / name, port, "synthetic", options))
        proc = _common.start_relay(config, port)
        self.relays.append(proc)
        return f"http://127.0.0.1:{port}", proc

    def member(self, group: str, relay: str, name: str) -> Member:
        log = self.base / f"{group}-{name}.log"
        proc = subprocess.Popen(
            [
                sys.executable,
                str(SCRIPT),
                "--member",
                *("--zookeeper", self.zk.hosts, "--group", group, "--relay", relay),
                *("--buckets", str(BUCKETS), "--log", str(log), "--name", name, "--hold"),
            ],
            stdin=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(_common.PATHS)},
        )
        m = Member(name, log, proc)
        self.members.append(m)
        return m

    def close(self) -> None:
        for m in self.members:
            with contextlib.suppress(ProcessLookupError):
                m.proc.send_signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                m.proc.wait(10)
        for r in self.relays:
            _common.stop_relay(r)
        self.zk.stop()


def relay_status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/v1/status", timeout=5) as resp:
        part: dict[str, Any] = json.loads(resp.read())["partitions"][0]
        return part


def balanced(members: list[Member]) -> bool:
    held = [m.owned() for m in members]
    quota = {BUCKETS // len(members), -(-BUCKETS // len(members))}
    return (
        all(len(h) in quota for h in held)
        and sum(map(len, held)) == BUCKETS
        and len(set().union(*held)) == BUCKETS
    )
