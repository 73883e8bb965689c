"""``ClusterMember``: a relay's membership in its cluster (session, registry, routing, roles).

One job: owning the relay's one :class:`~changebus.cluster.ZkSession`, its
:class:`~changebus.cluster.Registry` entry and
:class:`~changebus.cluster.RoutingTable`, and one
:class:`~._cluster.PartitionRole` per partition (which decides, per
partition, whether this relay leads, follows or waits; see
:mod:`._cluster`). It publishes the roles' states to the registry every
``_TICK_S`` when they changed, and kicks every role when the routing table
changes.

Thread-safety: the event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from changebus.cluster import ClusterConfig, PartitionState, Registry, RoutingTable, ZkSession
from changebus.schemas import stop_task
from changebus.schemas.security import ClientAuth

from ._cluster import _TICK_S, PartitionRole
from ._config import FetcherConfig
from ._host import PartitionHost

__all__ = ["ClusterMember"]

log = logging.getLogger("changebus.relay.cluster")

#: the registry's write throttle
_REGISTRY_INTERVAL_S = 0.5


class ClusterMember:
    """A relay's membership in its cluster: session, registry, routing table, roles."""

    def __init__(
        self,
        config: ClusterConfig,
        hosts: Mapping[str, PartitionHost],
        sources: Mapping[str, FetcherConfig],
        *,
        upstream: ClientAuth | None = None,
    ) -> None:
        self.config = config
        #: TLS and token of a follower's chain to the leader (the relay's ``[upstream]``)
        self.upstream = upstream or ClientAuth()
        self.session = ZkSession(config)
        self.registry = Registry(self.session, "relay", min_interval_s=_REGISTRY_INTERVAL_S)
        self.table = RoutingTable(self.session, refresh_s=2.0)
        self.roles = {
            name: PartitionRole(self, host, sources[name]) for name, host in hosts.items()
        }
        self._task: asyncio.Task[None] | None = None
        self._remove_listener: Any = None

    async def start(self) -> None:
        """Connect, register, read the routing table, stand for election in every partition."""
        await self.session.start()
        try:
            self.registry.update(self._states())
            await self.registry.start()
            await self.table.start()
            self._remove_listener = self.table.add_listener(self._changed)
            for role in self.roles.values():
                await role.start()
        except BaseException:
            await self.stop()
            raise
        self._task = asyncio.create_task(self._publish(), name="cluster-registry")
        log.info(
            "relay %s joined cluster %s (%s)",
            self.config.member_id,
            self.config.name,
            self.config.advertised_url,
        )

    async def stop(self) -> None:
        """Leave: stop the roles (a leader's source stops), deregister, close the session."""
        task, self._task = self._task, None
        await stop_task(task)
        if self._remove_listener is not None:
            self._remove_listener()
            self._remove_listener = None
        for role in self.roles.values():
            try:
                await role.stop()
            except Exception:
                log.exception("partition %s: leaving the election failed", role.name)
        with contextlib.suppress(Exception):
            await self.table.stop()
        with contextlib.suppress(Exception):
            await self.registry.stop()
        await self.session.stop()

    def status(self) -> dict[str, Any]:
        """The member's view, for /v1/status."""
        return {
            "member_id": self.config.member_id,
            "cluster": self.config.name,
            "session": self.session.state,
            "partitions": {
                name: {
                    "role": role.plan[0],
                    "epoch": role.plan[1],
                    "leader_url": role.plan[2],
                    "min_epoch": role.min_epoch,
                    "terms": role.terms,
                    "step_down_reason": role.step_down_reason,
                }
                for name, role in self.roles.items()
            },
        }

    def _changed(self, _snapshot: object) -> None:
        for role in self.roles.values():
            role.kick()

    def _states(self) -> dict[str, PartitionState]:
        return {name: role.state() for name, role in self.roles.items() if role.registered()}

    async def _publish(self) -> None:
        last: dict[str, PartitionState] = {}
        while True:
            states = self._states()
            if states != last:
                self.registry.update(states)
                last = states
            await asyncio.sleep(_TICK_S)
