"""A small aiohttp server on loopback for tests that need a server to answer oddly.

:func:`serve_routes` serves ``GET`` handlers by path on 127.0.0.1 (a free port)
and yields the base URL; the server is stopped on exit. The tests use it to
play an older server, a hostile one, or one that restarted.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def serve_routes(routes: Mapping[str, Handler]) -> AsyncIterator[str]:
    """Serve ``routes`` (path -> GET handler) on 127.0.0.1; the base URL."""
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
