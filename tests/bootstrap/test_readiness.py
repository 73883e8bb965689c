"""A bootstrap server is ready only while a relay answers its producer.

Its producer's stream retries for ever and never raised, and the partition
said ``streaming`` before any relay was asked: pointed at relays that are all
down, ``/readyz`` answered 200, ``changebus_bootstrap_ready`` was 1 and
``last_error`` was empty, so the alert on readiness could never fire (found
by review). The state is ``connecting`` until a relay answers, and again
after a failure until the next answer.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import aiohttp
import pytest
from synthetic_boot import synthetic_boot

from changebus.bootstrap import BootstrapConfig, BootstrapServer, HttpConfig, StoreConfig
from waiting import wait_until

pytestmark = pytest.mark.usefixtures("no_blocking")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_not_ready_while_no_relay_answers(tmp_path: Path) -> None:
    cfg = BootstrapConfig(
        relays=(f"http://127.0.0.1:{closed_port()}",),
        partitions=("syn",),
        data_dir=tmp_path / "boot",
        store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
        http=HttpConfig(port=0),
    )
    async with BootstrapServer(cfg) as boot, aiohttp.ClientSession() as http:
        worker = boot.service.workers["syn"]
        await wait_until(lambda: bool(worker.current_error()), what="a failed request")
        async with http.get(f"{boot.url}/readyz") as resp:
            assert resp.status == 503
            assert json.loads(await resp.text())["partitions"] == {"syn": "connecting"}
        async with http.get(f"{boot.url}/v1/status") as resp:
            status = await resp.json()
        text = json.dumps(status)
        assert '"state": "connecting"' in text and "Cannot connect" in text
        async with http.get(f"{boot.url}/metrics") as resp:
            text = await resp.text()
        assert 'changebus_bootstrap_partition_ready{partition="syn",state="connecting"} 0.0' in text
        assert "changebus_bootstrap_ready 0.0" in text


async def test_ready_once_a_relay_answers(tmp_path: Path) -> None:
    async with synthetic_boot(tmp_path) as (_relay, boot), aiohttp.ClientSession() as http:
        async with http.get(f"{boot.url}/readyz") as resp:
            assert resp.status == 200
        assert boot.service.workers["syn"].current_state() == "streaming"
