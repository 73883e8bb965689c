"""The relay under the server frame's connection limits (issue 17, item 8).

Disconnected long-polls and follow streams stop at once, a disconnect is no
server error, the connection cap applies to the relay's configured
``[http]`` table, and ``/v1/status`` remembers a bounded number of client ids.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from changebus.relay import HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.relay._http import BROADCASTS
from changebus.schemas._server_stats import CONNECTION_STATS
from changebus.schemas.server import HTTP_METRICS
from waiting import wait_until

pytestmark = pytest.mark.usefixtures("no_blocking")


def config(tmp_path: Path, **http: object) -> RelayConfig:
    return RelayConfig(
        data_dir=tmp_path / "relay",
        http=HttpConfig(port=0, max_wait_s=60, **http),  # type: ignore[arg-type]
        partitions=(PartitionConfig("idle", 1, capacity_bytes=1 << 20),),
        flush_interval_s=0,
    )


@pytest.fixture
async def relay(tmp_path: Path) -> AsyncIterator[Relay]:
    async with Relay(config(tmp_path)) as r:
        yield r


async def test_disconnected_long_polls_and_follow_streams_stop(
    relay: Relay, caplog: pytest.LogCaptureFixture
) -> None:
    stats = relay.server.app[HTTP_METRICS]
    host = relay.hosts["idle"]
    writers = []
    for i in range(50):
        _, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        follow = "&follow=1" if i % 5 == 0 else ""  # a few follow streams among them
        writer.write(
            f"GET /v1/stream?partition=idle&from=earliest&wait=30&client=c{i}{follow} HTTP/1.1\r\n"
            "Host: relay\r\n\r\n".encode()
        )
        writers.append(writer)
    await wait_until(lambda: stats.in_flight == 50, 10, "50 long-polls waiting")
    broadcasts = relay.server.app[BROADCASTS]

    def parked() -> int:
        broadcast = broadcasts.get("idle")
        return 0 if broadcast is None else len(broadcast)

    # the long-polls wait for a window, the follow streams are parked at the tail
    await wait_until(
        lambda: (host.wakeups.waiters, parked()) == (40, 10), 10, "all waiting for a window"
    )
    for writer in writers:
        writer.close()
    start = time.monotonic()
    await wait_until(lambda: stats.in_flight == 0, 2, "the long-polls stopped")
    assert time.monotonic() - start < 2
    assert host.wakeups.waiters == 0 and parked() == 0
    assert stats.requests[("/v1/stream", 499)] == 50  # follow streams too: cancelled waiting
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_status_remembers_a_bounded_number_of_clients(relay: Relay) -> None:
    host = relay.hosts["idle"]
    long_id = "x" * 5000
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=32), timeout=aiohttp.ClientTimeout(total=60)
    ) as http:
        url = f"{relay.url}/v1/stream"

        async def poll(client: str) -> None:
            params = {"partition": "idle", "from": "earliest", "client": client}
            async with http.get(url, params=params) as r:
                assert r.status == 204

        await poll(long_id)
        for start in range(0, 5000, 250):
            await asyncio.gather(*(poll(f"client-{i}") for i in range(start, start + 250)))
        await poll("client-0")  # seen again: the most recent now
        async with http.get(f"{relay.url}/v1/status") as r:
            body = await r.read()
    consumers = json.loads(body)["partitions"][0]["consumers"]
    # (as many as may be connected at once, at least 1,000; the oldest forgotten, counted)
    assert host.max_consumers == max(1000, relay.config.http.max_connections)
    assert len(host.consumers) == len(consumers) == host.max_consumers
    assert host.consumers_forgotten == 5002 - host.max_consumers
    names = {c["client"] for c in consumers}
    assert "client-0" in names and "client-4999" in names and "client-3900" not in names
    assert all(len(name) <= 128 for name in host.consumers)
    assert len(body) < 400_000  # about 200 bytes per consumer, whatever the clients send


async def test_the_relay_applies_its_connection_cap(tmp_path: Path) -> None:
    async with Relay(config(tmp_path, max_connections=3, header_timeout_s=30)) as relay:
        held = [await asyncio.open_connection("127.0.0.1", relay.port) for _ in range(3)]
        stats = relay.server.app[CONNECTION_STATS]
        await wait_until(lambda: stats.open == 3, 5, "three connections open")
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        writer.write(b"GET /v1/status HTTP/1.1\r\nHost: relay\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)
        assert answer.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in answer
        for _, w in [*held, (reader, writer)]:
            w.close()


async def test_a_principal_flooding_client_ids_forgets_its_own(relay: Relay) -> None:
    """With the table full, the least recently seen of all went: a principal sending a
    thousand made-up ids pushed another principal's lagging consumer out of /v1/status
    and the lag metrics (review). The owner holding the most entries loses its own."""
    host = relay.hosts["idle"]
    host.max_consumers = 50
    host.saw_consumer("payroll/etl", 10, "10.0.0.1")  # lagging, seen once, long ago
    host.saw_consumer("10.0.0.9", 11, "10.0.0.9")  # an id without a principal
    for i in range(500):
        host.saw_consumer(f"reader/made-up-{i}", 12, "10.0.0.2")
    assert "payroll/etl" in host.consumers and "10.0.0.9" in host.consumers
    assert len(host.consumers) == 50
    assert host.consumers_forgotten == 502 - 50
    mine = [c for c in host.consumers if c.startswith("reader/")]
    assert mine[-1] == "reader/made-up-499" and "reader/made-up-0" not in mine
    # the owners' counts stay right through moves and forgetting
    host.saw_consumer("payroll/etl", 13, "10.0.0.1")
    assert host._owned == {"payroll": 1, "": 1, "reader": 48}
    # an anonymous client cannot pose as an owner ("/" names a principal)
    async with aiohttp.ClientSession() as http:
        params = {"partition": "idle", "from": "earliest", "client": "a1/x"}
        async with http.get(f"{relay.url}/v1/stream", params=params) as r:
            assert r.status == 204
    assert "a1_x" in host.consumers and "a1/x" not in host.consumers
