"""The relays a bootstrap server reads, and the JSON questions it asks them.

:class:`Upstream` is the base of :class:`~._service.BootstrapService`: it
knows which relays to ask now (the configured ones, or in a relay cluster
those the routing table lists, through the service's
:class:`~._member.ClusterMember`) and asks them, over the service's one
HTTP session, for their partitions, a partition's "complete after" SCN, its
id and its fetcher status. Every question has a timeout (``_INFO_TIMEOUT``);
questions to "the relays" go to each relay in order until one answers.

It owns no state of its own: ``config``, ``member`` and ``_session`` are the
service's (the session and member exist from
:meth:`~._service.BootstrapService.start` on). Thread-safety: event loop
only.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp

from changebus.client import RelayInfo, RelayQueries, safe_url
from changebus.schemas import UnknownSourceError

from ._config import BootstrapConfig
from ._member import ClusterMember
from ._worker import PartitionWorker

__all__ = ["Upstream"]

log = logging.getLogger("changebus.bootstrap")

#: per JSON question to a relay (status, sources, schemas)
_INFO_TIMEOUT = aiohttp.ClientTimeout(total=10)


class Upstream:
    """The relays now, and questions to them (module docstring); a base of the service."""

    config: BootstrapConfig
    #: membership of a relay cluster (``[cluster]``), from ``start`` on
    member: ClusterMember | None
    _session: aiohttp.ClientSession | None

    def _relay_urls(self, partition: str | None = None) -> tuple[str, ...]:
        """The relays now: the routing table's (then the configured ones) in a cluster."""
        if self.member is None:
            return self.config.relays
        return self.member.relays(partition)

    def _relays(self, *, max_attempts: int | None = None) -> RelayQueries:
        """The relays, asked in order (each once unless ``max_attempts``)."""
        assert self._session is not None
        return RelayQueries(
            self._session,
            self._relay_urls(),
            timeout=_INFO_TIMEOUT,
            max_attempts=max_attempts,
            backoff_initial_s=0.2,
            backoff_max_s=2.0,
        )

    async def _relay_partitions(self) -> list[str]:
        """The partitions of the first relay that answers; waits for one (with backoff)."""
        if self.member is not None:
            await self.member.wait_relays()
        log.info(
            "no partitions configured: asking the relays (%s) for theirs, waiting for one to answer",
            ", ".join(safe_url(u) for u in self._relay_urls()),
        )
        return list(await self._relays(max_attempts=0).first(RelayInfo.sources))

    async def _relay_prev_scn(self, w: PartitionWorker, url: str) -> int:
        """The relay's "complete after" SCN: the log's history starts there."""
        assert self._session is not None
        status = await RelayInfo(self._session, url, timeout=_INFO_TIMEOUT).status()
        part = status.get(w.name)
        return part.prev_scn if part is not None else -1

    async def _relay_fetcher(self, name: str) -> dict[str, Any] | None:
        """The source fetcher's status of partition ``name``: the first relay reading the source.

        A relay that chains (kind ``relay``: a cluster's follower) is skipped: its
        status says nothing of the source (a MySQL seed needs the reading relay's
        server id and SCN base), so the search goes on to the leader.
        """

        async def fetcher(info: RelayInfo) -> dict[str, Any] | None:
            part = (await info.status()).get(name)
            if part is None or part.fetcher is None or part.fetcher.get("kind") == "relay":
                return None
            return dict(part.fetcher)

        return await self._relays().search(fetcher)

    async def _relay_partition_id(self, name: str) -> int:
        """The id of partition ``name`` on the first relay that names it."""

        async def partition_id(info: RelayInfo) -> int | None:
            part = (await info.sources()).get(name)
            return part.id if part is not None else None

        found = await self._relays().search(partition_id)
        if found is None:
            raise UnknownSourceError(f"no relay names partition {name!r}", retriable=True)
        return found
