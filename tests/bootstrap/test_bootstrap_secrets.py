"""The bootstrap server never shows its store's or its seed source's password.

Store and seed DSNs with a known password: a Postgres store that works (the
test server trusts loopback, the password is carried and ignored), a seed
source libpq cannot parse (its error quotes the password), stores that fail
(a role that does not exist, a malformed DSN), and the daemon that cannot
start because of one. Logs (caplog, the daemon's output), ``/v1/status``,
``/metrics`` and error answers are searched for the password.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from changebus.bootstrap import (
    BootstrapConfig,
    BootstrapServer,
    HttpConfig,
    SeedConfig,
    StoreConfig,
)
from changebus.relay import (
    FetcherConfig,
    HttpConfig as RelayHttp,
    PartitionConfig,
    Relay,
    RelayConfig,
)
from changebus.schemas import ChangebusError
from fix_pg import PgServer, wait_until

pytestmark = pytest.mark.pg

PASSWORD = "cb-Boot-S3cret-4Wx"
SPACED = f"{PASSWORD} tail"
ROOT = Path(__file__).resolve().parents[2]
DAEMON = (sys.executable, "-m", "changebus.schemas", "bootstrap")


def assert_clean(text: str, where: str) -> None:
    for needle in (PASSWORD, SPACED):
        assert needle not in text, f"{where} shows a secret: ...{text[:3000]}"


def relay_config(tmp: Path) -> RelayConfig:
    return RelayConfig(
        data_dir=tmp / "relay",
        http=RelayHttp(port=0),
        partitions=(
            PartitionConfig(
                "syn",
                1,
                capacity_bytes=1 << 20,
                fetcher=FetcherConfig("synthetic", {"windows_per_s": 50, "tables": 1}),
            ),
        ),
        flush_interval_s=0,
    )


async def test_store_and_seed_passwords_stay_secret(
    tmp_path: Path, pg_dsn: str, pg_server: PgServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    bad_seed = f"postgresql://postgres:{SPACED}@127.0.0.1:{pg_server.port}/postgres"
    async with Relay(relay_config(tmp_path)) as relay:
        cfg = BootstrapConfig(
            relays=(relay.url,),
            data_dir=tmp_path / "boot",
            store=StoreConfig(kind="postgres", dsn=f"{pg_dsn} password={PASSWORD}"),
            http=HttpConfig(port=0),
            seed=SeedConfig(dsn=bad_seed),
        )
        async with BootstrapServer(cfg) as boot, aiohttp.ClientSession() as s:
            w = boot.service.workers["syn"]
            await wait_until(lambda: w.producer_scn > 0, 30, "the producer")
            async with s.post(f"{boot.url}/v1/seed?tables=synthetic.t0") as r:
                assert r.status == 202, await r.text()
            await wait_until(lambda: w.seed.state == "failed", 30, "the seed to fail")
            error = w.seed.error
            texts = {}
            for path in ("/v1/status", "/metrics", "/readyz", "/v1/bootstrap/start?partition=x"):
                async with s.get(boot.url + path) as r:
                    texts[path] = await r.text()
            async with s.post(f"{boot.url}/v1/seed?tables=synthetic.t0") as r:
                texts["seed again"] = await r.text()
    for path, text in texts.items():
        assert_clean(text, path)
    assert "seed.dsn is not a valid Postgres connection string" in error
    assert_clean(caplog.text, "the log")


@pytest.mark.parametrize("kind", ["wrong", "malformed"])
async def test_a_store_that_cannot_open_says_why_without_the_password(
    tmp_path: Path, pg_server: PgServer, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    caplog.set_level(logging.DEBUG)
    dsn = {
        "wrong": f"host=127.0.0.1 port={pg_server.port} user=cb_nobody password={PASSWORD}",
        "malformed": f"host=127.0.0.1 password={PASSWORD} {PASSWORD}",
    }[kind]
    cfg = BootstrapConfig(
        relays=("http://127.0.0.1:9",),
        partitions=("p",),
        data_dir=tmp_path / "boot",
        store=StoreConfig(kind="postgres", dsn=dsn),
        http=HttpConfig(port=0),
    )
    with pytest.raises(ChangebusError) as info:
        async with BootstrapServer(cfg):
            pass
    assert "store" in info.value.message
    assert_clean(info.value.message, "the error")
    assert_clean(caplog.text, "the log")


def test_the_daemon_with_a_malformed_store_dsn_fails_in_one_clean_line(tmp_path: Path) -> None:
    cfg = tmp_path / "bootstrap.toml"
    cfg.write_text(
        f'relays = ["http://127.0.0.1:9"]\npartitions = ["p"]\ndata_dir = "{tmp_path / "b"}"\n'
        f'[store]\nkind = "postgres"\ndsn = "host=127.0.0.1 password={PASSWORD} {PASSWORD}"\n'
        "[http]\nport = 0\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            str(ROOT / s)
            for s in ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client")
        ),
    }
    done = subprocess.run(
        [*DAEMON, "--config", str(cfg), "--log-format", "json", "--log-level", "debug"],
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    output = done.stdout.decode() + done.stderr.decode()
    assert done.returncode == 2, output
    assert "store.dsn is not a valid Postgres connection string" in output
    assert_clean(output, "the daemon's output")
