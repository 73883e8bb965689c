"""The relay daemon as a process: kill -9 and restart, SIGTERM, bad configs.

Also both daemons (relay, bootstrap server) stopped by SIGTERM during start-up.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from changebus.schemas import Op, parse_stream

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        str(ROOT / s) for s in ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client")
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


def test_the_daemon_freezes_its_start_up_heap(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """Once started, the daemon takes its start-up objects out of the garbage collector's
    full collections (``gc.freeze``), which otherwise stopped the loop for 20-55 ms."""
    port = free_port()
    relay = start(write_config(tmp_path, port), "--log-format", "json", "--log-level", "debug")
    procs.append(relay)
    wait_ready(port, relay)
    relay.send_signal(signal.SIGTERM)
    assert relay.wait(20) == 0
    out = relay.stdout.read().decode() if relay.stdout else ""
    messages = [json.loads(line)["message"] for line in out.splitlines() if line.startswith("{")]
    frozen = [m for m in messages if "frozen out of garbage collection" in m]
    assert len(frozen) == 1, messages
    # the modules, the configuration, the application: far more than a few objects
    assert int(frozen[0].split()[0]) > 10_000
    listening = next(i for i, m in enumerate(messages) if "listening on http://" in m)
    assert messages.index(frozen[0]) > listening  # after the start, not before


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


def _relay(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "changebus.schemas", "relay", *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_files_and_ports_that_fail_are_one_line_not_a_traceback(tmp_path: Path) -> None:
    """A config that is a directory or not UTF-8, a port in use, a data_dir that cannot be
    made: a traceback and exit 1 before (review); one line and exit 2 now."""
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b"# caf\xe9\nbogus = 1\n")
    blocked = tmp_path / "file"
    blocked.write_text("")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (tmp_path / "busy").mkdir()
        busy = write_config(tmp_path / "busy", port)
        (tmp_path / "free").mkdir()
        free = write_config(tmp_path / "free", free_port())
        cases = [
            (("--config", str(tmp_path), "--check"), "cannot be read"),
            (("--config", str(latin), "--check"), "is not UTF-8 text"),
            (("--config", str(busy)), "address already in use"),
            (
                (
                    "--config",
                    str(free),
                    "--set",
                    f"data_dir={blocked / 'data'}",
                ),
                "Not a directory",
            ),
        ]
        for args, needle in cases:
            result = _relay(*args)
            out = result.stdout + result.stderr
            assert result.returncode == 2, (args, out)
            assert needle in out, (args, out)
            assert "Traceback" not in out, (args, out)


#: ``python -c`` program: the relay daemon, with the opening of partition
#: "slow" made to take a while (so that a signal surely arrives meanwhile)
SLOW_OPEN = """
import sys, time
from changebus.relay import _daemon

real = _daemon._new_host

def slow(config, data_dir, *more):
    host = real(config, data_dir, *more)
    if config.name == "slow":
        print("opening partition slow", flush=True)
        time.sleep(1.5)
    return host

_daemon._new_host = slow
from changebus.schemas._cli import main
sys.exit(main(sys.argv[1:]))
"""


class Output:
    """Collects a process's output lines in a thread; waits for one to appear."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        assert proc.stdout is not None
        stdout = proc.stdout
        threading.Thread(target=self._read, args=(stdout,), daemon=True).start()

    def _read(self, stdout: Any) -> None:
        for raw in stdout:
            with self._changed:
                self.lines.append(raw.decode(errors="replace").rstrip())
                self._changed.notify_all()

    def wait_for(self, needle: str, seconds: float = 60) -> None:
        with self._changed:
            found = self._changed.wait_for(
                lambda: any(needle in line for line in self.lines), seconds
            )
        assert found, f"no {needle!r} in:\n" + "\n".join(self.lines[-30:])

    @property
    def text(self) -> str:
        with self._changed:
            return "\n".join(self.lines)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_sigterm_during_startup_ends_both_daemons_alike(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    # the relay: SIGTERM while its second partition opens (the first is open)
    port = free_port()
    cfg = tmp_path / "relay.toml"
    cfg.write_text(
        f'data_dir = "{tmp_path / "data"}"\nflush_interval_s = 0\n[http]\nport = {port}\n'
        '[[partitions]]\nname = "fast"\nid = 1\ncapacity_bytes = "1MiB"\n'
        '[partitions.fetcher]\nkind = "synthetic"\noptions = { windows_per_s = 100 }\n'
        '[[partitions]]\nname = "slow"\nid = 2\ncapacity_bytes = "1MiB"\n'
    )
    relay = subprocess.Popen(
        [sys.executable, "-c", SLOW_OPEN, "relay", "--config", str(cfg)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    procs.append(relay)
    out = Output(relay)
    out.wait_for("opening partition slow")
    relay.send_signal(signal.SIGTERM)
    relay_status = relay.wait(30)
    out.wait_for("relay stopped", 5)
    assert "signal during start-up" in out.text
    assert "Traceback" not in out.text
    assert "listening on" not in out.text and not listening(port)
    # both partitions were closed properly: a new relay opens them and serves
    relay2 = start(cfg)
    procs.append(relay2)
    wait_ready(port, relay2)
    status = json.loads(get(port, "/v1/status")[2])
    assert {p["name"] for p in status["partitions"]} == {"fast", "slow"}
    relay2.send_signal(signal.SIGTERM)
    assert relay2.wait(20) == 0

    # the bootstrap server: SIGTERM while it waits for a relay (its store is open)
    boot_port = free_port()
    boot_cfg = tmp_path / "bootstrap.toml"
    boot_cfg.write_text(
        f'relays = ["http://127.0.0.1:{free_port()}"]\ndata_dir = "{tmp_path / "boot"}"\n'
        f"[http]\nport = {boot_port}\n"
    )
    boot = subprocess.Popen(
        [sys.executable, "-m", "changebus.schemas", "bootstrap", "--config", str(boot_cfg)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    procs.append(boot)
    boot_out = Output(boot)
    boot_out.wait_for("every relay failed")  # it is waiting for one
    boot.send_signal(signal.SIGTERM)
    boot_status = boot.wait(30)
    boot_out.wait_for("bootstrap server stopped", 5)
    assert "signal during start-up" in boot_out.text
    assert "Traceback" not in boot_out.text
    assert not listening(boot_port)
    assert (tmp_path / "boot" / "bootstrap.db").exists()  # the store had been opened

    assert relay_status == boot_status == 0
