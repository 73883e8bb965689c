"""Running a bootstrap server: embedded (``async with BootstrapServer(config)``) or as the daemon.

:class:`BootstrapServer` opens the store, starts the producer and applier of
every partition (:class:`~._service.BootstrapService`), serves the HTTP API
and closes all of it again in reverse order. :func:`run` is the daemon's
main: SIGTERM/SIGINT stop accepting requests, finish the ones in flight, stop
the producers and appliers (each store transaction either commits or does
not: nothing is half-written) and close the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from types import TracebackType
from typing import Self

from aiohttp import web

from changebus.schemas.config import redacted

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
        self._runner: web.AppRunner | None = None
        self.port = config.http.port

    @property
    def url(self) -> str:
        return f"http://{self.config.http.host}:{self.port}"

    async def start(self) -> None:
        cfg = self.config
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            await self.service.start()
            self._runner = web.AppRunner(
                build_app(self.service), access_log=None, handle_signals=False, shutdown_timeout=2.0
            )
            await self._runner.setup()
            site = web.TCPSite(self._runner, cfg.http.host, cfg.http.port, reuse_address=True)
            await site.start()
        except BaseException:
            await self.stop()
            raise
        addresses = self._runner.addresses
        if addresses:
            self.port = int(addresses[0][1])
        log.info("bootstrap server listening on %s", self.url)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.service.stop()
        log.info("bootstrap server stopped")

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
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = BootstrapServer(config)
    starting = asyncio.create_task(server.start())
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()  # a start-up error ends the daemon
            await stopping
        else:
            starting.cancel()  # e.g. still waiting for a relay
            with contextlib.suppress(asyncio.CancelledError):
                await starting
        log.info("bootstrap server shutting down")
    finally:
        stopping.cancel()
        await server.stop()
