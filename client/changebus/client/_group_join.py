"""What a group member connects to: its ZooKeeper session and each partition's relays.

* :func:`connect` opens the member's :class:`~changebus.cluster.ZkSession`
  (``ClusterConfig`` from the consumer's settings: ``zookeeper``, the
  session timeout; the group's znodes do not depend on the cluster name),
  waiting with backoff while ZooKeeper does not answer (``max_attempts``
  bounds the wait as it bounds failed relay requests).
* :func:`follow_relays` gives the member's :class:`~._group_lanes.LaneSet` the
  relays and bootstrap servers of one partition: the static ``relays`` and
  ``bootstrap_servers``, or with ``cluster`` the cluster's routing table,
  followed as :class:`~._cluster.ClusterRoute` does for a plain consumer
  (the lanes of the partition switch relays when the table changes).

The event loop of the consumer only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from changebus.cluster import ClusterConfig, CoordinationError, ZkSession

from ._backoff import Backoff
from ._cluster import ClusterRoute
from ._config import ConsumerConfig
from ._errors import RelayUnavailableError
from ._group_lanes import LaneSet

__all__ = ["connect", "follow_relays"]

log = logging.getLogger(__name__)


def _backoff(cfg: ConsumerConfig) -> Backoff:
    return Backoff(cfg.backoff_initial_s, cfg.backoff_max_s, cfg.backoff_multiplier)


async def _retry(cfg: ConsumerConfig, start: Callable[[], Awaitable[None]], where: str) -> None:
    """``await start()`` until it does not raise a CoordinationError (or ``max_attempts``)."""
    backoff = _backoff(cfg)
    attempts = 0
    while True:  # ZooKeeper away at start-up: wait for it like for a relay
        try:
            await start()
            return
        except CoordinationError as exc:
            attempts += 1
            if cfg.max_attempts and attempts >= cfg.max_attempts:
                raise RelayUnavailableError(
                    f"{where} did not answer in {attempts} attempts: {exc.message}"
                ) from exc
            delay = backoff.next_delay()
            log.warning("%s; trying again in %.2fs", exc.message, delay)
            await asyncio.sleep(delay)


async def connect(cfg: ConsumerConfig) -> ZkSession:
    """The member's ZooKeeper session, started."""
    session = ZkSession(
        ClusterConfig(
            zookeeper=cfg.zookeeper,
            name=cfg.cluster or "groups",
            session_timeout_s=cfg.zookeeper_session_timeout_s,
            connect_timeout_s=max(cfg.connect_timeout_s, 1.0),
        )
    )
    await _retry(cfg, session.start, f"ZooKeeper {cfg.zookeeper}")
    return session


async def follow_relays(cfg: ConsumerConfig, partition: str, lanes: LaneSet) -> ClusterRoute | None:
    """Give ``lanes`` the relays of ``partition`` now and on changes; the route to stop later."""
    if not cfg.cluster:
        lanes.set_relays(partition, cfg.relays)
        lanes.set_bootstrap(partition, cfg.bootstrap_servers)
        return None
    route = ClusterRoute(
        cfg.zookeeper,
        cfg.cluster,
        partition,
        prefer_followers=cfg.prefer_followers,
        static=cfg.relays,
        session_timeout_s=cfg.zookeeper_session_timeout_s,
        connect_timeout_s=max(cfg.connect_timeout_s, 1.0),
    )
    await _retry(cfg, route.start, route.where)
    try:
        relays = await route.wait_relays(cfg.max_attempts, _backoff(cfg))
    except BaseException:
        await route.stop()
        raise
    lanes.set_relays(partition, relays)
    route.on_change(lambda r: lanes.set_relays(partition, r), relays)
    boot = cfg.bootstrap_servers or route.bootstrap_servers()
    lanes.set_bootstrap(partition, boot)
    if not cfg.bootstrap_servers and boot:
        route.on_bootstrap_change(lambda s: lanes.set_bootstrap(partition, s), boot)
    return route
