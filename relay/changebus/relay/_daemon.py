"""Running a relay: embedded (``async with Relay(config)``) or as the daemon.

:class:`Relay` opens every partition (buffer, registry, fetcher), serves the
HTTP API and closes all of it again in reverse order. :func:`run` is the
daemon's main: it adds SIGTERM/SIGINT handling (graceful: stop accepting,
finish or cancel requests, stop fetchers, msync buffers) and periodic flushes.
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

from ._config import RelayConfig
from ._host import PartitionHost
from ._http import build_app

__all__ = ["Relay", "run"]

log = logging.getLogger("changebus.relay")


class Relay:
    """A relay inside the current event loop."""

    def __init__(self, config: RelayConfig) -> None:
        self.config = config
        self.hosts: dict[str, PartitionHost] = {}
        self._runner: web.AppRunner | None = None
        self._flusher: asyncio.Task[None] | None = None
        self.port = config.http.port

    @property
    def url(self) -> str:
        return f"http://{self.config.http.host}:{self.port}"

    async def start(self) -> None:
        cfg = self.config
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            for part in cfg.partitions:
                host = PartitionHost(part, cfg.data_dir)
                self.hosts[part.name] = host
                await host.start()
            app = build_app(cfg, self.hosts)
            self._runner = web.AppRunner(
                app, access_log=None, handle_signals=False, shutdown_timeout=2.0
            )
            await self._runner.setup()
            site = web.TCPSite(self._runner, cfg.http.host, cfg.http.port, reuse_address=True)
            await site.start()
        except BaseException:
            await self.stop()
            raise
        addresses = self._runner.addresses  # the real port when 0 was asked for
        if addresses:
            self.port = int(addresses[0][1])
        if cfg.flush_interval_s > 0:
            self._flusher = asyncio.create_task(self._flush_loop(), name="relay-flush")
        log.info(
            "relay listening on %s with partitions %s", self.url, ", ".join(self.hosts) or "(none)"
        )

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.flush_interval_s)
            for host in self.hosts.values():
                host.flush()

    async def stop(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for host in reversed(list(self.hosts.values())):
            await host.stop()
        self.hosts.clear()
        log.info("relay stopped")

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


async def run(config: RelayConfig) -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully."""
    log.info("relay configuration: %s", redacted(config))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with Relay(config):
        await stop.wait()
        log.info("relay shutting down")
