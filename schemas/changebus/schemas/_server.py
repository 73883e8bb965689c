"""Running a daemon's aiohttp application: runner, site, start-up, shutdown, signals.

A daemon is an application (:func:`~._server_app.server_app` plus its own
routes) whose moving parts start and stop through aiohttp's
``app.cleanup_ctx``: each step is an async generator that starts something,
``yield``\\ s, then stops it. Written as ``try: <start>; yield / finally:
<stop>``, a step also releases what it started when start-up fails or is
cancelled halfway; aiohttp runs the steps in order at start-up and the
stops of the steps that completed in reverse order at cleanup.

:class:`Server` drives one application:

* :meth:`Server.start` -- ``AppRunner.setup()`` (the start-up halves of the
  steps), then the listening socket (``TCPSite``; port 0 picks a free port,
  read back into :attr:`Server.port`). Any failure or cancellation on the
  way cleans up what was started before it propagates.
* :meth:`Server.stop` -- stop listening, finish (or after
  ``shutdown_timeout`` cancel) the requests in flight, then the stop halves
  of the steps in reverse. Idempotent.

:func:`serve` is a daemon's main loop: SIGTERM or SIGINT stop it
gracefully, *also during start-up* -- the start-up is cancelled where it
is (e.g. while a partition opens, or while waiting for a relay), the steps
release what they started, and the daemon ends normally (exit status 0),
whatever the daemon. A second signal while stopping changes nothing.
Once the daemon has started, :func:`serve` collects the garbage of the
start-up and freezes what is left (``gc.freeze``): the modules, the
configuration, the application and its partitions are then out of reach of
the cyclic garbage collector, whose full collections otherwise stopped the
event loop for 20-55 ms each, now and then, while serving (a tail latency
every consumer saw). Only the daemon's process does this: :func:`serve` is
its main loop, and nothing else calls it.

TLS: a :class:`Server` given a ``security`` config with a ``[security.tls]``
table listens with a :class:`~._tls_server.ServerTls` (HTTPS; SIGHUP to
:func:`serve` reloads the certificate for new connections, see
:mod:`._tls_server`); an explicit ``ssl_context`` is used as it is. Given a
``security`` config, the server also refuses a non-loopback host without
TLS and principals (:func:`~._security_config.check_bind`). Authentication
is a middleware of :func:`~._server_app.server_app`.
Connection limits (keep-alive and header
timeouts, connection caps, handlers cancelled when their client goes away)
are the ``limits`` of :class:`Server`, applied by :mod:`._server_limits`.

Thread-safety: a :class:`Server` belongs to the event loop that started it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import ssl
from types import TracebackType
from typing import Protocol, Self

from aiohttp import web

from ._sdnotify import notify
from ._security_config import SecurityConfig, TlsConfig, check_bind
from ._server_limits import ConnectionLimits, LimitedSite, runner_options
from ._server_log import protocol_log
from ._tls_server import ServerTls, reload_all

__all__ = ["Server", "Service", "serve"]


class Service(Protocol):
    """Something :func:`serve` can run: ``start()`` then, later, ``stop()``."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class Server:
    """One aiohttp application listening on ``host:port`` (module docstring).

    ``name`` ("relay", "bootstrap server") is used in the log lines
    ``<name> listening on <url>`` and ``<name> stopped``, written to
    ``logger``. ``limits`` bound the connections (default:
    :class:`~._server_limits.ConnectionLimits`'s defaults).
    """

    def __init__(
        self,
        app: web.Application,
        *,
        name: str,
        host: str,
        port: int,
        logger: logging.Logger,
        ssl_context: ssl.SSLContext | None = None,
        security: SecurityConfig | None = None,
        shutdown_timeout: float = 2.0,
        limits: ConnectionLimits | None = None,
    ) -> None:
        #: the reloadable TLS of ``security.tls``, loaded by :meth:`start` (None: plain
        #: HTTP or ``ssl_context``)
        self.tls: ServerTls | None = None
        self._tls_config: TlsConfig | None = None
        if security is not None:
            check_bind(host, security)
            if ssl_context is None:
                self._tls_config = security.tls
        self.app = app
        self.name = name
        self.host = host
        #: the configured port until started, then the one listened on
        self.port = port
        self._log = logger
        self._ssl = ssl_context
        self._shutdown_timeout = shutdown_timeout
        self._limits = limits or ConnectionLimits()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        """The base URL clients use (``http://host:port``, IPv6 hosts in brackets)."""
        scheme = "https" if self._ssl is not None or self._tls_config is not None else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    async def start(self) -> None:
        """Run the start-up steps, then listen (module docstring)."""
        if self._runner is not None:
            raise RuntimeError(f"{self.name} is already started")
        self._runner = web.AppRunner(
            self.app,
            logger=protocol_log(),  # malformed requests: no tracebacks (._server_log)
            access_log=None,
            handle_signals=False,
            shutdown_timeout=self._shutdown_timeout,
            **runner_options(self._limits),
        )
        try:
            if self._tls_config is not None and self.tls is None:
                # the files are read in a thread; a bad one is a ConfigError
                self.tls = await asyncio.to_thread(ServerTls, self._tls_config)
                self._ssl = self.tls.context
            await self._runner.setup()
            site = LimitedSite(
                self._runner,
                self.host,
                self.port,
                limits=self._limits,
                log=self._log,
                ssl_context=self._ssl,
            )
            await site.start()
        except BaseException:
            await self.stop()
            raise
        addresses = self._runner.addresses  # the real port when 0 was asked for
        if addresses:
            self.port = int(addresses[0][1])
        if self.tls is not None:
            self.tls.register()
        self._log.info("%s listening on %s", self.name, self.url)

    async def stop(self) -> None:
        """Stop listening, finish the requests in flight, run the stop steps."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        if self.tls is not None:
            self.tls.unregister()
        try:
            await runner.cleanup()
        finally:
            self._log.info("%s stopped", self.name)

    async def reload_tls(self) -> bool:
        """Reload the TLS certificate (what SIGHUP does); False when none or it failed."""
        return self.tls is not None and await self.tls.reload()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


async def serve(service: Service, *, name: str, logger: logging.Logger) -> None:
    """Start ``service``, run until SIGTERM or SIGINT, stop it (module docstring).

    A start-up error propagates (after what was started is stopped); a
    signal during start-up cancels the start-up and returns normally.
    SIGHUP reloads the TLS certificates (:func:`~._tls_server.reload_all`).
    A service manager (``NOTIFY_SOCKET``) hears ``READY=1`` once the daemon
    serves, ``RELOADING=1``/``READY=1`` around a reload and ``STOPPING=1``
    (:mod:`._sdnotify`). SIGHUP is ignored once the handler is removed.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    reloads: set[asyncio.Task[int]] = set()
    serving = asyncio.Event()  # READY=1 sent: a reload says RELOADING=1, then READY=1 again
    loop.add_signal_handler(signal.SIGHUP, _reload_on_signal, reloads, serving)
    try:
        starting = asyncio.create_task(service.start(), name=f"{name}-start")
        stopping = asyncio.create_task(stop.wait(), name=f"{name}-signal")
        try:
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                logger.info("%s shutting down (signal during start-up)", name)
                starting.cancel()
                try:
                    await starting
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise  # serve() itself is being cancelled
            else:
                starting.result()  # a start-up error ends the daemon
                _settle_heap(logger)
                notify("READY=1", f"STATUS={name} serving")
                serving.set()
                await stopping
                logger.info("%s shutting down", name)
        finally:
            stopping.cancel()
            serving.clear()
            notify("STOPPING=1", f"STATUS={name} shutting down")
            await service.stop()
    finally:
        for sig in (*signals, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        # a reload request while the daemon winds down is not a reason to die
        signal.signal(signal.SIGHUP, signal.SIG_IGN)


async def _reload(serving: asyncio.Event) -> int:
    """Reload the certificates; the service manager hears of it once the daemon serves."""
    if not serving.is_set():
        return await reload_all()  # still starting: READY=1 is not this reload's to send
    notify("RELOADING=1")
    try:
        return await reload_all()
    finally:
        if serving.is_set():
            notify("READY=1")


def _settle_heap(logger: logging.Logger) -> None:
    """Collect the start-up's garbage and freeze the rest (module docstring)."""
    gc.collect()
    gc.freeze()
    logger.debug(
        "%d objects of the start-up frozen out of garbage collection", gc.get_freeze_count()
    )


def _reload_on_signal(tasks: set[asyncio.Task[int]], serving: asyncio.Event) -> None:
    task = asyncio.get_running_loop().create_task(_reload(serving), name="tls-reload")
    tasks.add(task)  # held until done
    task.add_done_callback(tasks.discard)
