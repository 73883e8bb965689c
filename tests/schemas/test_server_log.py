"""Malformed requests (answered 400) and clients that went away log one quiet line, no traceback."""

from __future__ import annotations

import asyncio
import logging

import pytest

from changebus.schemas.server import Server, server_app

log = logging.getLogger("changebus.test.server_log")

TOKEN = "tok-0123456789abcdef0123456789abcdef"

MALFORMED = [
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nNoColonHere\r\n\r\n",
    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
    + TOKEN.encode()
    + b"\nX: y\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
    b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
]


async def _ask(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
        await writer.wait_closed()


async def test_malformed_requests_are_answered_400_without_tracebacks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = server_app("logtest", readiness=lambda: (True, {}), logger=log)
    caplog.set_level(logging.DEBUG, logger="aiohttp")
    async with Server(app, name="t", host="127.0.0.1", port=0, logger=log) as server:
        for data in MALFORMED:
            answer = await _ask(server.port, data)
            assert answer.split(b"\r\n")[0].endswith(b" 400 Bad Request"), (data[:60], answer[:200])
        ok = await _ask(
            server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        assert ok.startswith(b"HTTP/1.1 200 ")  # and the server goes on
        # a client that closes before the "100 Continue" it asked for is no server error
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /healthz HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n")
        writer.write(b"Content-Length: 5\r\n\r\n")
        writer.write_eof()
        await asyncio.wait_for(reader.read(), 10)
        writer.close()
        await writer.wait_closed()
    records = [r for r in caplog.records if r.name.startswith("aiohttp")]
    loud = [r for r in records if r.levelno >= logging.WARNING or r.exc_info]
    assert loud == [], [r.getMessage() for r in loud]
    quiet = [r.getMessage() for r in records if "malformed request" in r.getMessage()]
    assert len(quiet) >= len(MALFORMED) - 1, quiet  # a chunk error may end the body quietly
    assert all(TOKEN not in r.getMessage() for r in caplog.records)
