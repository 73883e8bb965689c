"""Bootstrap pages cut on the way (a proxy ending a body at an event boundary).

The client compared a relay answer's events with its ``X-Changebus-Events``
header, but not a bootstrap page's: a snapshot page cut short was taken whole,
its position header moved past the rows cut off, and they were never delivered
(review). Now such a page is refused (retriably) and fetched again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from synthetic_boot import synthetic_boot

from changebus.client import Consumer, ConsumerConfig
from changebus.schemas import parse_stream

_HOP = frozenset({"content-length", "transfer-encoding", "content-encoding", "connection"})


@contextlib.asynccontextmanager
async def cutting_proxy(upstream: str, cuts: list[str]) -> AsyncIterator[str]:
    """Forwards GETs to ``upstream``; the first answer of each path in ``cuts`` loses the
    second half of its events (its headers kept)."""
    pending = list(cuts)
    session = aiohttp.ClientSession()

    async def forward(request: web.Request) -> web.Response:
        async with session.get(f"{upstream}{request.path_qs}") as resp:
            body = await resp.read()
            headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
            status = resp.status
        if status == 200 and request.path in pending:
            offsets, _ = parse_stream(body)
            if offsets.size >= 2:
                pending.remove(request.path)
                body = body[: int(offsets[offsets.size // 2])]
        return web.Response(status=status, body=body, headers=headers)

    app = web.Application()
    app.router.add_get("/{tail:.*}", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        await session.close()
    assert not pending, f"the proxy cut nothing of {pending}"


async def _read(relay_url: str, boot_url: str, until: int) -> dict[str, Any]:
    """Every key and its last values, bootstrapped from nothing, up to SCN ``until``."""
    cfg = ConsumerConfig(
        relays=(relay_url,),
        partition="syn",
        bootstrap_servers=(boot_url,),
        bootstrap_page_bytes=2_000,
        backoff_initial_s=0.05,
        backoff_max_s=0.2,
        wait_s=0.2,
    )
    rows: dict[str, Any] = {}
    async with Consumer(cfg) as consumer:
        async for window in consumer:
            for e in window.events:
                if e.after is None:
                    rows.pop(repr(e.key), None)
                else:
                    rows[repr(e.key)] = e.after
            if window.scn >= until:
                return rows
    raise AssertionError("the stream ended")


async def test_a_cut_snapshot_page_is_read_again(tmp_path: Path) -> None:
    async with synthetic_boot(tmp_path, windows=60) as (relay, boot):
        last = relay.hosts["syn"].buffer.meta.last_scn
        want = await asyncio.wait_for(_read(relay.url, boot.url, last), 60)
        assert len(want) >= 4
        cuts = ["/v1/bootstrap/snapshot"]
        async with cutting_proxy(boot.url, cuts) as proxy:
            got = await asyncio.wait_for(_read(relay.url, proxy, last), 60)
        assert got == want
