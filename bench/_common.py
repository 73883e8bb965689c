"""Shared plumbing for the benchmarks: checkout paths, relay processes, the raw push server."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PATHS = [
    str(ROOT / s)
    for s in ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client", "discovery")
]
sys.path[:0] = [p for p in PATHS if p not in sys.path]


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_relay(
    config: Path, port: int, seconds: float = 60, profile: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start ``changebus relay --config config`` and wait until ``port`` accepts.

    ``profile``: run the relay under cProfile (its event loop thread's CPU
    time, ``bench/_profile_relay.py``), the statistics written to that file
    when the relay stops (:func:`stop_relay`).
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(PATHS)}
    command = ["-m", "changebus.schemas"]
    if profile is not None:
        command = [str(ROOT / "bench" / "_profile_relay.py"), str(profile)]
    relay = subprocess.Popen([sys.executable, *command, "relay", "--config", str(config)], env=env)
    deadline = time.time() + seconds
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return relay
        except OSError:
            if time.time() > deadline or relay.poll() is not None:
                relay.kill()
                raise
            time.sleep(0.1)


def stop_relay(relay: subprocess.Popen[bytes]) -> None:
    relay.terminate()
    relay.wait(30)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_kib(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``RssAnon`` (the process's own memory, no file pages) of ``pid``, KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon"):
            out[name] = int(value.split()[0])
    return out


#: one connection of the raw push server: (reader, writer) -> sends until done
PushHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def push_server(
    port: int, ready: Any, setup: Callable[[], Awaitable[PushHandler]], run_s: float = 3600
) -> None:
    """The raw asyncio push server: the baseline of relay_throughput and relay_fanout.

    A plain ``asyncio.start_server`` on 127.0.0.1:``port``; ``setup`` runs on
    the server's loop first (starting whatever feeds the pushes) and returns
    the per-connection handler. ``ready`` (a multiprocessing event) is set once
    the port accepts. Runs in its own process until killed (or ``run_s``).
    """

    async def main() -> None:
        handle = await setup()
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
        ready.set()
        async with server:
            await asyncio.sleep(run_s)

    asyncio.run(main())
