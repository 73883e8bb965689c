"""Shared plumbing for the benchmarks: checkout paths and relay processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

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


def start_relay(config: Path, port: int, seconds: float = 60) -> subprocess.Popen[bytes]:
    """Start ``changebus relay --config config`` and wait until ``port`` accepts."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(PATHS)}
    relay = subprocess.Popen(
        [sys.executable, "-m", "changebus.schemas", "relay", "--config", str(config)], env=env
    )
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
