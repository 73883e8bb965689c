"""The relay daemon as a process: kill -9 and restart, SIGTERM, bad configs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from changebus.schemas import Op, parse_stream

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        str(ROOT / s) for s in ("schemas", "fetchers", "relay", "bootstrap", "client")
    ),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(tmp: Path, port: int, rate: int = 300) -> Path:
    cfg = tmp / "relay.toml"
    cfg.write_text(
        f'data_dir = "{tmp / "data"}"\nflush_interval_s = 0\n'
        f"[http]\nport = {port}\n"
        f'[[partitions]]\nname = "syn"\nid = 1\ncapacity_bytes = "4MiB"\n'
        f'[partitions.fetcher]\nkind = "synthetic"\n'
        f"options = {{ windows_per_s = {rate}, events_per_window = 2, row_bytes = 64 }}\n"
    )
    return cfg


def start(cfg: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "changebus.schemas", "relay", "--config", str(cfg), *extra],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def get(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def wait_ready(port: int, proc: subprocess.Popen[bytes], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        try:
            if get(port, "/readyz")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError("relay did not become ready")


def window_scns(port: int) -> list[int]:
    """Every window SCN the relay holds, oldest first."""
    scns: list[int] = []
    scn = -1
    while True:
        status, headers, body = get(port, f"/v1/stream?partition=syn&scn={scn}&max_bytes=1000000")
        if status == 204:
            return scns
        assert status == 200, body
        _, hdr = parse_stream(body)
        scns.extend(int(h["scn"]) for h in hdr if h["op"] == Op.END_OF_WINDOW)
        scn = int(headers["X-Changebus-Next-Scn"])


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(10)
        if p.stdout is not None:
            p.stdout.close()


def test_kill_9_and_restart_loses_nothing(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    port = free_port()
    cfg = write_config(tmp_path, port)
    relay = start(cfg)
    procs.append(relay)
    wait_ready(port, relay)
    time.sleep(1.0)
    before = window_scns(port)
    assert len(before) > 50
    relay.send_signal(signal.SIGKILL)
    relay.wait(10)
    relay2 = start(cfg)
    procs.append(relay2)
    wait_ready(port, relay2)
    time.sleep(0.5)
    after = window_scns(port)
    # what was served before the crash is still there, and the fetcher went on
    # right after the last window the buffer held: no gap, no duplicate
    assert after[: len(before)] == before
    assert after == list(range(after[0], after[0] + len(after)))
    assert len(after) > len(before)
    status = json.loads(get(port, "/v1/status")[2])["partitions"][0]
    assert status["prev_scn"] == after[0] - 1


def test_sigterm_is_graceful(tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    port = free_port()
    relay = start(write_config(tmp_path, port), "--log-format", "json")
    procs.append(relay)
    wait_ready(port, relay)
    relay.send_signal(signal.SIGTERM)
    assert relay.wait(20) == 0
    out = relay.stdout.read().decode() if relay.stdout else ""
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    messages = [line["message"] for line in lines]
    assert any("listening on http://127.0.0.1:" in m for m in messages)
    assert "relay stopped" in messages


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("[http]\nport = 'high'\n", "expected an integer"),
        (
            "[[partitions]]\nname = 'a'\n[partitions.fetcher]\nkind = 'synthetic'\noptions = { tables = 0 }\n",
            "tables",
        ),
        ("bogus = 1\n", "unknown config key"),
        ("[[partitions]]\nname = 'bad name'\n", "must match"),
        (
            "[[partitions]]\nname = 'a'\n[partitions.fetcher]\nkind = 'oracle'\n",
            "unknown fetcher kind",
        ),
    ],
)
def test_bad_configs_fail_clearly(tmp_path: Path, body: str, needle: str) -> None:
    cfg = tmp_path / "relay.toml"
    cfg.write_text(f'data_dir = "{tmp_path / "data"}"\n' + body)
    result = subprocess.run(
        [sys.executable, "-m", "changebus.schemas", "relay", "--config", str(cfg)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert needle in result.stdout + result.stderr
