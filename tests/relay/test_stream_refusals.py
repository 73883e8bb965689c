"""Refused /v1/stream requests leave nothing behind (found by review).

1. A checkpoint whose ``prev_scn`` is past the window the answer ends in was
   refused (400) after the selection was pinned, and the pin stayed: every
   later eviction reaching it waited ``pin_timeout_s`` for a reader that was
   gone, and the pins piled up.
2. HTTP/1.0 requests whose answer is chunked (follow, ndjson, large binary
   answers) were a 500 with a logged traceback each: aiohttp refuses chunks to
   HTTP/1.0. They are a 400 now (a cut close-delimited body would look whole).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from test_hardening import big_window, ring_config

from changebus.relay import Relay

pytestmark = pytest.mark.usefixtures("no_blocking")


async def test_a_refused_checkpoint_leaves_no_pin(tmp_path: Path) -> None:
    async with Relay(ring_config(tmp_path, 8 << 20)) as relay, aiohttp.ClientSession() as http:
        buffer = relay.hosts["ring"].buffer
        # windows over 256 KiB: answers are sent from the ring (pinned), not copied
        await asyncio.to_thread(
            lambda: [buffer.append_window(big_window(s, payload=140_000)) for s in (10, 11)]
        )
        checkpoint = json.dumps({"v": 1, "partitions": {"ring": {"prev_scn": 10**12}}})
        params = {"partition": "ring", "max_bytes": "300000", "checkpoint": checkpoint}
        for _ in range(20):
            async with http.get(f"{relay.url}/v1/stream", params=params) as resp:
                body = await resp.json()
                assert resp.status == 400 and body["error"] == "bad_checkpoint", body
        assert not buffer.pinned
        # and a good request after them is served
        params = {"partition": "ring", "max_bytes": "300000"}
        async with http.get(f"{relay.url}/v1/stream", params=params) as resp:
            assert resp.status == 200 and len(await resp.read()) > 256 << 10
        assert not buffer.pinned


@pytest.mark.parametrize("query", ["follow=1", "format=ndjson", "max_bytes=300000"])
async def test_http_1_0_stream_requests_are_a_clear_400(tmp_path: Path, query: str) -> None:
    async with Relay(ring_config(tmp_path, 8 << 20)) as relay:
        buffer = relay.hosts["ring"].buffer
        await asyncio.to_thread(buffer.append_window, big_window(10, payload=140_000))
        port = relay.url.rsplit(":", 1)[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", int(port))
        writer.write(f"GET /v1/stream?partition=ring&{query} HTTP/1.0\r\n\r\n".encode())
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.split(b" ")[1] == b"400", answer[:300]
        assert b"HTTP/1.1" in body and b"bad_request" in body
        assert not buffer.pinned
