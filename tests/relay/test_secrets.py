"""A fetcher DSN's password never reaches a log line, /v1/status, /metrics or an error body.

The relay hosts Postgres fetchers whose DSNs hold a known password: one that
connects (the test server trusts loopback, so the password is carried and
ignored), one for a role that does not exist (a failing login), and two that
libpq cannot parse (psycopg's ProgrammingError quotes the piece it choked on:
here the password itself). Everything the relay says, in process (caplog)
and as a daemon (``--log-format json`` on stderr), is searched for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from fix_pg import PgServer, wait_until

PASSWORD = "cb-Relay-S3cret-9Kq"
#: libpq refuses blanks in a URL's password and quotes it whole in its error
SPACED = f"{PASSWORD} tail"
ROOT = Path(__file__).resolve().parents[2]


def dsns(pg_dsn: str, port: int) -> dict[str, str]:
    return {
        "good": f"{pg_dsn} password={PASSWORD}",
        "wrong": f"host=127.0.0.1 port={port} user=cb_nobody password={PASSWORD} dbname=postgres",
        "badkv": f"host=127.0.0.1 port={port} password={PASSWORD} {PASSWORD}",
        "badurl": f"postgresql://postgres:{SPACED}@127.0.0.1:{port}/postgres",
    }


def relay_config(tmp: Path, pg_dsn: str, port: int) -> RelayConfig:
    parts = tuple(
        PartitionConfig(
            name,
            i + 1,
            capacity_bytes=1 << 20,
            fetcher=FetcherConfig(
                "postgres",
                {"dsn": dsn, "status_interval_s": 0.2, "slot": f"cb_{name}"},
                retry_initial_s=0.05,
                retry_max_s=0.2,
            ),
        )
        for i, (name, dsn) in enumerate(dsns(pg_dsn, port).items())
    )
    return RelayConfig(data_dir=tmp / "relay", http=HttpConfig(port=0), partitions=parts)


def assert_clean(text: str, where: str) -> None:
    for needle in (PASSWORD, SPACED, "tail@"):
        assert needle not in text, f"{where} shows a secret: ...{text[:3000]}"


@pytest.mark.pg
async def test_no_password_in_logs_status_metrics_or_errors(
    tmp_path: Path, pg_dsn: str, pg_server: PgServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with Relay(relay_config(tmp_path, pg_dsn, pg_server.port)) as relay:
        hosts = relay.hosts
        await wait_until(lambda: hosts["good"].state == "streaming", 30, "the good fetcher")
        await wait_until(
            lambda: all(hosts[n].last_error for n in ("wrong", "badkv", "badurl")),
            30,
            "the failing fetchers",
        )
        await wait_until(lambda: hosts["wrong"].stats["fetcher_restarts"] >= 2, 30, "retries")
        texts = {}
        async with aiohttp.ClientSession() as s:
            for path in (
                "/v1/status",
                "/metrics",
                "/readyz",
                "/v1/sources",
                "/v1/stream?partition=badurl&scn=1",
                "/v1/stream?partition=nope",
                "/v1/stream?partition=..",
                "/v1/stream?partition=good&filter=bogus",
            ):
                async with s.get(relay.url + path) as r:
                    texts[path] = f"{r.status} {await r.text()}"
        status = json.loads(texts["/v1/status"].split(" ", 1)[1])
        errors = {p["name"]: p.get("last_error", "") for p in status["partitions"]}
    for path, text in texts.items():
        assert_clean(text, path)
    assert_clean(caplog.text, "the log")
    for record in caplog.records:
        assert_clean(record.getMessage(), "a log record")
        if record.exc_info:
            assert_clean(logging.Formatter().formatException(record.exc_info), "a traceback")
    # the errors still say what is wrong
    assert "cb_nobody" in errors["wrong"], errors
    assert "not a valid Postgres connection string" in errors["badkv"], errors
    assert "not a valid Postgres connection string" in errors["badurl"], errors
    assert texts["/v1/stream?partition=..".strip()].startswith("400")


def get(port: int, path: str) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return bytes(resp.read()).decode()
    except urllib.error.HTTPError as exc:
        return bytes(exc.read()).decode()


@pytest.mark.pg
def test_daemon_json_log_shows_no_password(
    tmp_path: Path, pg_dsn: str, pg_server: PgServer
) -> None:
    """The relay daemon logs its configuration at start: DSNs inside fetcher options too."""
    lines = [f'data_dir = "{tmp_path / "data"}"', "flush_interval_s = 0", "[http]", "port = 0"]
    for i, (name, dsn) in enumerate(dsns(pg_dsn, pg_server.port).items()):
        lines += [
            "[[partitions]]",
            f'name = "{name}"',
            f"id = {i + 1}",
            'capacity_bytes = "1MiB"',
            "[partitions.fetcher]",
            'kind = "postgres"',
            "retry_initial_s = 0.05",
            "retry_max_s = 0.2",
            f'options = {{ dsn = {json.dumps(dsn)}, slot = "cbd_{name}" }}',
        ]
    cfg = tmp_path / "relay.toml"
    cfg.write_text("\n".join(lines) + "\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            str(ROOT / s)
            for s in ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client")
        ),
    }
    cmd = [sys.executable, "-m", "changebus.schemas", "relay", "--config", str(cfg)]
    proc = subprocess.Popen(
        [*cmd, "--log-format", "json", "--log-level", "debug"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        port = 0
        deadline = time.monotonic() + 60
        seen: list[str] = []
        assert proc.stderr is not None
        os.set_blocking(proc.stderr.fileno(), False)
        buffered = b""
        status = ""
        while time.monotonic() < deadline:
            chunk = proc.stderr.read() or b""
            buffered += chunk
            *done, buffered = buffered.split(b"\n")
            seen += [d.decode() for d in done]
            if not port:
                for line in seen:
                    msg = json.loads(line)["message"]
                    if "listening on http://" in msg:
                        port = int(msg.rsplit(":", 1)[1].split("/")[0])
            if port:
                status = get(port, "/v1/status")
                parts = json.loads(status)["partitions"]
                if all(p.get("last_error") for p in parts if p["name"] != "good") and any(
                    "retrying" in line for line in seen
                ):
                    break
            assert proc.poll() is None, "\n".join(seen)
            time.sleep(0.1)
        else:
            raise AssertionError("the relay did not report its fetchers' errors:\n" + status)
        metrics = get(port, "/metrics")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        seen += (buffered + err).decode().splitlines()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    text = "\n".join(seen)
    assert any("relay configuration" in line for line in seen), text[:2000]
    for line in seen:
        json.loads(line)  # every line is a JSON record (nothing printed around the logger)
    assert_clean(text, "the daemon's stderr")
    assert_clean(out.decode(), "the daemon's stdout")
    assert_clean(status, "/v1/status")
    assert_clean(metrics, "/metrics")
    assert proc.returncode == 0


async def test_a_bad_dsn_at_start_up_is_one_clean_line(tmp_path: Path) -> None:
    """A fetcher that cannot even be configured fails the start-up without the DSN."""
    cfg = RelayConfig(
        data_dir=tmp_path / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "p", 1, fetcher=FetcherConfig("postgres", {"dsn": f"password={PASSWORD}", "x": 1})
            ),
        ),
    )
    with pytest.raises(Exception) as info:  # any error: its text is what matters
        async with Relay(cfg):
            await asyncio.sleep(0)
    assert_clean(str(info.value), "the start-up error")


@pytest.mark.mysql
async def test_mysql_fetcher_password_stays_secret(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, caplog: pytest.LogCaptureFixture
) -> None:
    """A MySQL fetcher refused its login (a wrong password for a known user)."""
    caplog.set_level(logging.DEBUG)
    options = {
        "host": "127.0.0.1",
        "port": mysql_server.port,
        "user": "root",
        "password": PASSWORD,
        "reconnect_attempts": 0,
        "connect_timeout_s": 5,
    }
    cfg = RelayConfig(
        data_dir=tmp_path / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "my",
                1,
                capacity_bytes=1 << 20,
                fetcher=FetcherConfig("mysql", options, retry_initial_s=0.05, retry_max_s=0.2),
            ),
        ),
    )
    async with Relay(cfg) as relay:
        host = relay.hosts["my"]
        await wait_until(lambda: host.state in ("failed", "retrying"), 30, "a failed login")
        async with aiohttp.ClientSession() as s:
            texts = []
            for path in ("/v1/status", "/metrics", "/readyz"):
                async with s.get(relay.url + path) as r:
                    texts.append(await r.text())
        assert host.last_error
    for text in texts:
        assert_clean(text, "an answer")
    assert_clean(caplog.text, "the log")
