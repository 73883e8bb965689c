"""Running a relay: embedded (``async with Relay(config)``) or as the daemon.

:class:`Relay` is the relay's HTTP app (:func:`~._http.build_app`) inside the
server frame (:class:`changebus.schemas.server.Server`) with two start-up
steps (``cleanup_ctx``): open every partition (buffer, registry, fetcher) in
order, then the periodic msync of the buffers. Stopping runs them backwards
after the listener closed and the requests in flight finished: flushing
stops, then the partitions close in reverse order (fetchers stop, buffers are
msynced and unmapped). A failed or cancelled start-up closes the partitions
it had opened. With a ``[cluster]`` table the partitions open without their
fetchers; once the relay listens (its URL is known: the default advertised
URL) a :class:`~._cluster_member.ClusterMember` joins the cluster and decides per
partition whether the source fetcher or a chain to the leader runs; it
leaves first when the relay stops. :func:`run` is the daemon's main (:func:`~changebus.schemas.server.serve`:
SIGTERM/SIGINT stop it gracefully, during start-up too).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import Self

from aiohttp import web

from changebus.cluster import ClusterConfig, CoordinationError, warn_loopback_advertised
from changebus.schemas.config import redacted
from changebus.schemas.files import private_dir
from changebus.schemas.security import ClientAuth
from changebus.schemas.server import Server, serve

from ._cluster_member import ClusterMember
from ._config import FetcherConfig, PartitionConfig, RelayConfig
from ._host import PartitionHost
from ._http import build_app

__all__ = ["Relay", "run"]

log = logging.getLogger("changebus.relay")


def _new_host(
    config: PartitionConfig, data_dir: Path, replayable: bool, resize: bool
) -> PartitionHost:
    return PartitionHost(config, data_dir, replayable=replayable, resize=resize)


async def _open_host(
    config: PartitionConfig, data_dir: Path, *, replayable: bool = False, resize: bool = False
) -> PartitionHost:
    """A new :class:`PartitionHost`, built in a thread (it opens and maps files).

    Cancelled meanwhile, it waits for the thread, closes what it opened and
    re-raises: a cancelled start-up leaks no buffer.
    """
    opening = asyncio.ensure_future(
        asyncio.to_thread(_new_host, config, data_dir, replayable, resize)
    )
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        try:
            host = await opening
        except Exception:  # noqa: BLE001 - it failed to open: nothing to close
            raise asyncio.CancelledError from None
        await host.stop()
        raise


def with_upstream(part: PartitionConfig, upstream: ClientAuth) -> PartitionConfig:
    """``part`` whose ``relay`` fetcher gets the relay's ``[upstream]`` as its default auth.

    Passed in process as the ``auth`` option (like ``min_epoch``); the
    fetcher's own ``ca_file``, ``token_file``, ... options refine it.
    """
    fetcher = part.fetcher
    if fetcher.kind != "relay" or "auth" in fetcher.options or not upstream.enabled:
        return part
    options = {**fetcher.options, "auth": upstream}
    return dataclasses.replace(part, fetcher=dataclasses.replace(fetcher, options=options))


class Relay:
    """A relay inside the current event loop.

    ``hosts`` maps partition names to their :class:`PartitionHost`; it is
    filled during :meth:`start` and emptied by :meth:`stop`.
    """

    def __init__(self, config: RelayConfig) -> None:
        self.config = config
        self.hosts: dict[str, PartitionHost] = {}
        #: the cluster membership while started with a ``[cluster]`` table
        self.cluster: ClusterMember | None = None
        #: joins the cluster in the background when ZooKeeper did not answer at start-up
        self._joining: asyncio.Task[None] | None = None
        app = build_app(config, self.hosts)
        app.cleanup_ctx.append(self._partitions)
        if config.flush_interval_s > 0:
            app.cleanup_ctx.append(self._flushing)
        self.server = Server(
            app,
            name="relay",
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

    async def _partitions(self, app: web.Application) -> AsyncIterator[None]:
        cfg = self.config
        try:
            await asyncio.to_thread(private_dir, cfg.data_dir)
            for part in cfg.partitions:
                if cfg.cluster is not None:  # the cluster member starts the fetchers
                    part = dataclasses.replace(part, fetcher=FetcherConfig())
                part = with_upstream(part, cfg.upstream)
                # a cluster member's recovery drops no window as lost: as a follower it
                # reads them again from the leader; as a leader its source's own check
                # (Postgres: a slot confirmed past the buffer) says what is gone (review)
                host = await _open_host(
                    part,
                    cfg.data_dir,
                    replayable=cfg.cluster is not None,
                    resize=cfg.resize_buffers,
                )
                # (a consumer that polls holds at most one connection at a time: room for
                # as many as may be connected, so /v1/status and the lag series see them all)
                host.max_consumers = max(host.max_consumers, cfg.http.max_connections)
                self.hosts[part.name] = host
                await host.start()
            log.info("relay partitions: %s", ", ".join(self.hosts) or "(none)")
            yield
        finally:
            for host in reversed(list(self.hosts.values())):
                try:
                    await host.stop()
                except Exception:
                    log.exception("partition %s did not stop cleanly", host.name)
            self.hosts.clear()

    async def _flushing(self, app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(self._flush_loop(), name="relay-flush")
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _flush_loop(self) -> None:
        # a task per partition and tick: one slow partition's flush (behind its appends,
        # or a slow disk) holds back no other's; its next tick is skipped meanwhile
        running: set[asyncio.Task[None]] = set()
        try:
            while True:
                await asyncio.sleep(self.config.flush_interval_s)
                for host in list(self.hosts.values()):
                    task = asyncio.create_task(host.flush(), name=f"relay-flush-{host.name}")
                    running.add(task)
                    task.add_done_callback(running.discard)
        finally:
            await asyncio.gather(*running, return_exceptions=True)

    async def start(self) -> None:
        """Open the partitions, listen, join the cluster (stops what it started when it fails).

        A ZooKeeper that does not answer at start-up does not stop the relay:
        it serves what its buffers hold, with no fetcher (``/readyz`` says
        why), and joins the cluster in the background once ZooKeeper answers.
        """
        await self.server.start()
        cluster = self.config.cluster
        if cluster is None:
            return
        if not cluster.advertised_url:
            cluster = dataclasses.replace(cluster, advertised_url=self.url)
            warn_loopback_advertised(self.url)
        try:
            self.cluster = await self._join(cluster)
        except CoordinationError as exc:
            log.warning(
                "%s; serving what the buffers hold, joining the cluster when ZooKeeper answers",
                exc.message,
            )
            self._not_joined(exc.message)
            self._joining = asyncio.create_task(self._join_later(cluster), name="cluster-join")
        except BaseException:
            await self.server.stop()
            raise

    async def _join(self, cluster: ClusterConfig) -> ClusterMember:
        upstream = self.config.upstream
        sources = {p.name: with_upstream(p, upstream).fetcher for p in self.config.partitions}
        member = ClusterMember(cluster, self.hosts, sources, upstream=upstream)
        await member.start()  # stops what it started when it fails
        return member

    async def _join_later(self, cluster: ClusterConfig) -> None:
        delay = 0.5
        while True:
            await asyncio.sleep(delay)
            try:
                self.cluster = await self._join(cluster)
            except CoordinationError as exc:
                self._not_joined(exc.message)
                delay = min(delay * 2, 10.0)
                continue
            except Exception as exc:  # noqa: BLE001 - kazoo's own (NoAuthError...): try again
                # (only CoordinationError was caught: anything else ended this task for
                # good, and the relay never joined; review)
                why = f"{type(exc).__name__}: {str(exc)[:200]}"
                log.error("joining cluster %s failed: %s; trying again", cluster.name, why)
                self._not_joined(why)
                delay = min(delay * 2, 10.0)
                continue
            log.info("joined cluster %s after ZooKeeper came back", cluster.name)
            return

    def _not_joined(self, why: str) -> None:
        for host in self.hosts.values():
            host.state = "fenced"
            host.last_error = f"not in the cluster: {why}"

    async def stop(self) -> None:
        """Leave the cluster, stop listening, finish the requests, close the partitions.

        Idempotent.
        """
        joining, self._joining = self._joining, None
        if joining is not None:
            joining.cancel()
            await asyncio.gather(joining, return_exceptions=True)
        member, self.cluster = self.cluster, None
        if member is not None:
            try:
                await member.stop()
            except Exception:
                log.exception("leaving the cluster failed")
        await self.server.stop()

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
    await serve(Relay(config), name="relay", logger=log)
