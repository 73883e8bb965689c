"""The bootstrap server under the server frame's connection limits (issue 17, item 8)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from changebus.bootstrap import BootstrapConfig, BootstrapServer, HttpConfig, StoreConfig
from changebus.schemas._server_stats import CONNECTION_STATS
from waiting import wait_until

pytestmark = pytest.mark.usefixtures("no_blocking")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_the_bootstrap_server_applies_its_http_limits(tmp_path: Path) -> None:
    cfg = BootstrapConfig(
        relays=(f"http://127.0.0.1:{closed_port()}",),
        partitions=("p",),
        data_dir=tmp_path / "boot",
        store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
        http=HttpConfig(port=0, max_connections=2, header_timeout_s=0.5),
    )
    async with BootstrapServer(cfg) as boot:
        stats = boot.server.app[CONNECTION_STATS]
        held = [await asyncio.open_connection("127.0.0.1", boot.port) for _ in range(2)]
        await wait_until(lambda: stats.open == 2, 5, "two connections open")
        reader, writer = await asyncio.open_connection("127.0.0.1", boot.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: boot\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)
        assert answer.startswith(b"HTTP/1.1 503 ") and b'"overloaded"' in answer
        # the two silent connections are closed by the header timeout
        for r, _ in held:
            assert await asyncio.wait_for(r.read(), 5) == b""
        await wait_until(lambda: stats.open == 0, 5, "the silent connections closed")
        assert stats.header_timeouts == 2
        for _, w in [*held, (reader, writer)]:
            w.close()
