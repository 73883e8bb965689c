"""The relay daemon with [security]: SIGHUP reloads its certificate; a network bind needs security."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import trustme

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        str(ROOT / s) for s in ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client")
    ),
}

#: the ``tls_files`` fixture's type (tests/fix_tls.py)
TlsFiles = Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def relay(cfg: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "changebus.schemas", "relay", "--config", str(cfg), *extra],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def healthz(port: int, ca: Path) -> int | str:
    ctx = ssl.create_default_context(cafile=str(ca))
    try:
        with urllib.request.urlopen(
            f"https://127.0.0.1:{port}/healthz", context=ctx, timeout=5
        ) as r:
            return int(r.status)
    except urllib.error.URLError as exc:
        return str(exc.reason)


def wait_for(check: Any, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_sighup_reloads_the_certificate(tmp_path: Path, tls_files: TlsFiles) -> None:
    port = free_port()
    cfg = tmp_path / "relay.toml"
    cfg.write_text(
        f'data_dir = "{tmp_path / "data"}"\nflush_interval_s = 0\n[http]\nport = {port}\n'
        f'[security.tls]\ncert_file = "{tls_files.server_cert}"\nkey_file = "{tls_files.server_key}"\n'
    )
    proc = relay(cfg)
    try:
        wait_for(lambda: healthz(port, tls_files.ca) == 200)
        new_ca = trustme.CA()
        new_ca_file = tmp_path / "new-ca.pem"
        new_ca.cert_pem.write_to_path(str(new_ca_file))
        cert = new_ca.issue_cert("127.0.0.1")
        cert.cert_chain_pems[0].write_to_path(str(tls_files.server_cert))
        cert.private_key_pem.write_to_path(str(tls_files.server_key))
        assert healthz(port, tls_files.ca) == 200  # nothing changes before the signal
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: healthz(port, new_ca_file) == 200, 10)
        assert "CERTIFICATE_VERIFY_FAILED" in str(healthz(port, tls_files.ca))
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out.decode()
    assert b"TLS certificate reloaded" in out
    assert b"relay listening on https://127.0.0.1" in out


def test_network_bind_without_security_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "relay.toml"
    cfg.write_text(f'data_dir = "{tmp_path / "data"}"\n[http]\nport = {free_port()}\n')
    proc = relay(cfg, "--set", "http.host=0.0.0.0")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert b"non-loopback" in out and b"allow_insecure" in out
