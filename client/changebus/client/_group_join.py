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

import logging

from changebus.cluster import ClusterConfig, ZkSession

from ._cluster import ClusterRoute, open_route, retry_coordination
from ._config import ConsumerConfig
from ._group_lanes import LaneSet

__all__ = ["connect", "follow_relays"]

log = logging.getLogger(__name__)


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
    await retry_coordination(cfg, session.start, f"ZooKeeper {cfg.zookeeper}")
    return session


async def follow_relays(cfg: ConsumerConfig, partition: str, lanes: LaneSet) -> ClusterRoute | None:
    """Give ``lanes`` the relays of ``partition`` now and on changes; the route to stop later."""
    if not cfg.cluster:
        lanes.set_relays(partition, cfg.relays)
        lanes.set_bootstrap(partition, cfg.bootstrap_servers)
        return None
    route, relays = await open_route(cfg, partition)
    lanes.set_relays(partition, relays)
    route.on_change(lambda r: lanes.set_relays(partition, r), relays)
    boot = cfg.bootstrap_servers or route.bootstrap_servers()
    lanes.set_bootstrap(partition, boot)
    if not cfg.bootstrap_servers and boot:
        route.on_bootstrap_change(lambda s: lanes.set_bootstrap(partition, s), boot)
    return route
