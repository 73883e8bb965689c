"""Running a bootstrap server: embedded (``async with BootstrapServer(config)``) or as the daemon.

:class:`BootstrapServer` is the bootstrap HTTP app (:func:`~._http.build_app`)
inside the server frame (:class:`changebus.schemas.server.Server`) with one
start-up step (``cleanup_ctx``): the :class:`~._service.BootstrapService`
(open the store, find the partitions, start every producer and applier).
Stopping closes the listener, finishes the requests in flight, then stops the
producers and appliers (each store transaction either commits or does not:
nothing is half-written) and closes the store. A failed or cancelled
start-up (e.g. SIGTERM while still waiting for a relay) stops what it had
started. :func:`run` is the daemon's main
(:func:`~changebus.schemas.server.serve`: SIGTERM/SIGINT stop it gracefully,
during start-up too).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Self

from aiohttp import web

from changebus.schemas import DirLock
from changebus.schemas.config import redacted
from changebus.schemas.server import Server, serve

from ._config import BootstrapConfig
from ._http import build_app
from ._service import BootstrapService

__all__ = ["BootstrapServer", "run"]

log = logging.getLogger("changebus.bootstrap")


class BootstrapServer:
    """A bootstrap server inside the current event loop."""

    def __init__(self, config: BootstrapConfig) -> None:
        self.config = config
        self.service = BootstrapService(config)
        app = build_app(self.service)
        app.cleanup_ctx.append(self._running)
        self.server = Server(
            app,
            name="bootstrap server",
            host=config.http.host,
            port=config.http.port,
            logger=log,
            limits=config.http,
            security=config.security,
        )

    @property
    def port(self) -> int:
        """The port listened on (the configured one until started)."""
        return self.server.port

    @property
    def url(self) -> str:
        return self.server.url

    async def _running(self, app: web.Application) -> AsyncIterator[None]:
        # one process at a time in the data directory (its SQLite store, seed state):
        # taken before anything there is opened, dropped after the service stopped
        taking = asyncio.ensure_future(
            asyncio.to_thread(DirLock, self.config.data_dir, "bootstrap server")
        )
        try:
            lock = await asyncio.shield(taking)
        except asyncio.CancelledError:  # (the thread goes on: its lock must not stay held)
            with contextlib.suppress(Exception):
                (await taking).release()
            raise
        try:
            await self.service.start()
            yield
        finally:
            try:
                await self.service.stop()
            finally:
                lock.release()

    async def start(self) -> None:
        """Start the service, then listen (stops what it started when it fails).

        In a cluster the server registers once it listens (its URL is known then).
        """
        await self.server.start()
        if self.service.member is not None:
            try:
                await self.service.member.register(self.url)
            except BaseException:
                await self.server.stop()
                raise

    async def stop(self) -> None:
        """Stop listening, finish the requests, stop the service. Idempotent."""
        await self.server.stop()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


async def run(config: BootstrapConfig) -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully."""
    log.info("bootstrap configuration: %s", redacted(config))
    await serve(BootstrapServer(config), name="bootstrap server", logger=log)
