"""A bootstrap server as a member of a relay cluster (``[cluster]`` in its config).

:class:`ClusterMember` holds one ZooKeeper session (:class:`changebus.cluster.ZkSession`)
for two jobs:

* **registration**: a :class:`~changebus.cluster.Registry` node of kind
  ``bootstrap`` (``members/<member_id>``) with the server's URL and, per
  partition it serves, a :class:`~changebus.cluster.PartitionState` of role
  ``follower`` (it follows the partition's stream, it never leads it; epoch
  0) whose ``min_scn`` is the applier's SCN (what the snapshot holds) and
  ``max_scn`` the producer's (the newest window in the log). Consumers that
  look for bootstrap servers in the table
  (:meth:`changebus.client.cluster.ClusterRoute.bootstrap_servers`) find it,
  and ``changebus cluster status`` lists it with its lag behind the leader.
  The registry re-creates the node by itself after a session loss;
* **relays**: with no ``relays`` configured, the relays come from the
  routing table (:class:`~changebus.cluster.RoutingTable`), in the client's
  order (:func:`changebus.client.cluster.relays_serving`: the leader first),
  followed by watches: :meth:`ClusterMember.follow` calls back with a
  partition's new relays whenever they change. Configured ``relays`` come
  after the table's (used when the table lists nobody).

Thread-safety: everything on the event loop that called :meth:`ClusterMember.start`
(ZooKeeper requests run in the session's worker threads).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping

from changebus.client import safe_url
from changebus.client.cluster import relays_serving
from changebus.cluster import (
    ClusterConfig,
    PartitionState,
    Registry,
    RoutingSnapshot,
    RoutingTable,
    ZkSession,
    warn_loopback_advertised,
)

__all__ = ["ClusterMember"]

log = logging.getLogger("changebus.bootstrap.cluster")


class ClusterMember:
    """Registers a bootstrap server and reads its relays from the routing table."""

    def __init__(self, config: ClusterConfig, static: tuple[str, ...] = ()) -> None:
        self.config = config
        self.static = static
        self.session = ZkSession(config)
        self.table = RoutingTable(self.session)
        #: the node, once :meth:`register` ran (the URL is known once the server listens)
        self.registry: Registry | None = None
        self._removers: list[Callable[[], None]] = []
        self._published: dict[str, PartitionState] = {}

    @property
    def where(self) -> str:
        return f"cluster {self.config.name!r} (ZooKeeper {self.config.zookeeper})"

    async def start(self) -> None:
        """Connect and read the table (raises a retriable ``CoordinationError``)."""
        await self.session.start()
        try:
            await self.table.start()
        except BaseException:
            await self.session.stop()
            raise

    async def register(self, url: str) -> None:
        """Create the member node (``advertised_url`` or ``url``) with what was published."""
        if not self.config.advertised_url:
            warn_loopback_advertised(url)
        registry = Registry(self.session, "bootstrap", url=self.config.advertised_url or url)
        registry.update(self._published)
        await registry.start()
        self.registry = registry

    async def stop(self) -> None:
        """Leave the cluster: the node goes at once (the session closes)."""
        for remove in self._removers:
            remove()
        self._removers.clear()
        registry, self.registry = self.registry, None
        if registry is not None:
            await registry.stop()
        await self.table.stop()
        await self.session.stop()

    # ---- relays ---------------------------------------------------------------

    def relays(
        self, partition: str | None = None, snap: RoutingSnapshot | None = None
    ) -> tuple[str, ...]:
        """The relays of ``partition`` (None: of every partition), then the static ones."""
        snap = snap if snap is not None else self.table.snapshot()
        if partition is not None:
            found = relays_serving(snap, partition)
        else:
            names = sorted(
                set(snap.partitions).union(
                    *(m.partitions for m in snap.members.values() if m.kind == "relay")
                )
            )
            found = tuple(u for p in names for u in relays_serving(snap, p))
        return tuple(dict.fromkeys(found + self.static))

    async def wait_relays(self, partition: str | None = None) -> tuple[str, ...]:
        """The relays of ``partition`` (None: of any), waiting until the table lists one."""
        warned = False
        while True:
            snap = self.table.snapshot()
            found = self.relays(partition, snap)
            if found:
                if warned:
                    log.info("%s: relays %s", self.where, ", ".join(safe_url(u) for u in found))
                return found
            if not warned:
                log.warning(
                    "%s lists no relay%s yet; waiting for one to register",
                    self.where,
                    f" for partition {partition}" if partition else "",
                )
                warned = True
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5.0):
                    await self.table.wait_changed(snap.version)

    def follow(self, partition: str, callback: Callable[[tuple[str, ...]], None]) -> None:
        """Call ``callback(relays)`` whenever ``partition``'s relays change (never with none)."""
        last = [self.relays(partition)]

        def changed(snap: RoutingSnapshot) -> None:
            urls = self.relays(partition, snap)
            if urls == last[0] or not urls:
                return
            last[0] = urls
            log.info(
                "%s: partition %s: relays %s",
                self.where,
                partition,
                ", ".join(safe_url(u) for u in urls),
            )
            callback(urls)

        self._removers.append(self.table.add_listener(changed))

    # ---- registration -----------------------------------------------------------

    def publish(self, scns: Mapping[str, tuple[int, int]]) -> None:
        """Publish ``{partition: (applier SCN, producer SCN)}`` (written when changed, throttled)."""
        states = {
            p: PartitionState("follower", 0, max(applier, 0), max(producer, 0))
            for p, (applier, producer) in scns.items()
        }
        if states != self._published:
            self._published = states
            if self.registry is not None:
                self.registry.update(states)
