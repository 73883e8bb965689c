"""The bootstrap service: owns the store threads, the relay session and the partitions' tasks.

Structure::

    relay --HTTP--> producer (RelayStream, raw windows) --asyncio.Queue--> log writer
                                                                               |
                     applier (log -> snapshot) <---- wake-up ------------------+
    HTTP handlers --> reader threads (own store connections) --> pages

:class:`BootstrapService` starts and stops everything: the store threads
(:mod:`._storethreads`), one HTTP session to the relays, the cluster
membership, and per partition a :class:`~._worker.PartitionWorker` with its
producer and applier tasks. Its parts, one job each, are its bases:
:class:`~._pipeline.Pipelines` (producer, log writer, applier) over
:class:`~._seeding.Seeding` (seeds, gap repair) over
:class:`~._upstream.Upstream` (which relays, questions to them).

Crash safety comes from the store: a batch of windows and the producer SCN
commit together, and the applier moves the snapshot and its position in one
transaction. On restart the producer resumes after the log's newest window
(the relay skips what came before) and the applier after its last one, so a
``kill -9`` anywhere loses or doubles nothing. A gap recorded before a
restart is reported again at start-up and repaired when ``seed.dsn`` is set;
chunked snapshots stored in progress resume after their last chunk
(:meth:`~._seeding.Seeding.resume_snapshots`).

In a relay cluster (``[cluster]``) the service holds a
:class:`~._member.ClusterMember`: without configured ``relays`` the
producers read the relays the routing table lists for their partition and
are moved (:meth:`~changebus.client.RelayStream.set_relays`) when the table
changes; every ``_PUBLISH_S`` the applier and producer SCNs of each
partition are published in the server's member node.

Thread-safety: event loop only (see the parts for their threads).
"""

from __future__ import annotations

import asyncio
import logging
import threading

import aiohttp

from changebus.client import open_session, safe_url
from changebus.schemas import ChangebusError, ended, stop_task
from changebus.schemas.config import secret_values

from ._config import BootstrapConfig
from ._lost import Gap, repair_hint
from ._member import ClusterMember
from ._pipeline import Pipelines
from ._storethreads import StoreThreads
from ._worker import PartitionWorker

__all__ = ["BootstrapService", "PartitionWorker"]

log = logging.getLogger("changebus.bootstrap")

#: how often the partitions' SCNs are published in a cluster (ZooKeeper writes are throttled)
_PUBLISH_S = 0.5


class BootstrapService(Pipelines):
    """Producers and appliers of every partition, over one store (module docstring)."""

    def __init__(self, config: BootstrapConfig) -> None:
        self.config = config
        #: what error texts must never show (store and seed DSNs, their passwords)
        self.secrets = secret_values(config)
        self.stores = StoreThreads(config)
        self.workers: dict[str, PartitionWorker] = {}
        #: the partitions served, from :meth:`start` on (:meth:`seeds`)
        self.partition_names: tuple[str, ...] = ()
        self._session: aiohttp.ClientSession | None = None
        self._stop_seed = threading.Event()
        #: membership of a relay cluster (``[cluster]``), from :meth:`start` on
        self.member: ClusterMember | None = None
        self._publisher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        cfg = self.config
        await self.stores.write(lambda s: None)  # open the writer store (creates tables)
        self._session = await open_session(cfg.upstream)
        if cfg.cluster is not None:
            self.member = ClusterMember(cfg.cluster, static=cfg.relays)
            await self.member.start()
            self._publisher = asyncio.create_task(self._publish(), name="cluster-publisher")
        names = list(cfg.partitions) or await self._relay_partitions()
        self.partition_names = tuple(names)
        for name in names:
            w = PartitionWorker(name)
            st = await self.stores.write(lambda s, n=name: s.state(n))  # type: ignore[misc]
            w.producer_scn, w.applier_scn = st.producer_scn, st.applier_scn
            w.log_min_scn, w.base_scn = st.log_min_scn, st.base_scn
            w.tomb_scn = await self.stores.write(
                lambda s, n=name: s.tomb_scn(n)  # type: ignore[misc]
            )
            w.lag_events = await self.stores.write(
                lambda s, n=name: s.unapplied_events(n)  # type: ignore[misc]
            )
            gap = await self.stores.write(lambda s, n=name: s.gap(n))  # type: ignore[misc]
            if gap is not None:
                hint = repair_hint(name, seed_source=self.seeds(name))
                w.gap = Gap(gap, "recorded before this server restarted", hint)
            self.workers[name] = w
            w.tasks.append(asyncio.create_task(self._produce(w), name=f"producer-{name}"))
            w.tasks.append(asyncio.create_task(self._apply(w), name=f"applier-{name}"))
        if cfg.seed.on_start:
            try:
                part = self._seed_partition()
            except ChangebusError as exc:
                # (partitions = [] and the relays serve several: raised, the daemon exited,
                # and its supervisor restarted it into the same failure; review)
                log.error("seed.on_start: no seed at start-up: %s", exc.message)
            else:
                self.start_seed(part, list(cfg.seed.tables), again=False)
        for w in self.workers.values():
            if w.gap is not None:  # still open from before: repair it now (or say how)
                log.error(
                    "partition %s: the snapshot misses changes up to SCN %d (a gap recorded "
                    "before this restart); %s",
                    w.name,
                    w.gap.before_scn,
                    w.gap.repair,
                )
                if self.seeds(w.name) and (w.seeding is None or w.seeding.done()):
                    self.start_seed(w.name, [], again=False)
        await self.resume_snapshots()  # after those: one seed task per partition
        log.info(
            "bootstrap serving partitions %s from %s",
            ", ".join(self.workers) or "(none)",
            ", ".join(safe_url(u) for u in self._relay_urls()) or "(the routing table)",
        )

    async def stop(self) -> None:
        self._stop_seed.set()
        for w in self.workers.values():
            if w.seeding is not None:
                w.tasks.append(w.seeding)
            for t in w.tasks:
                t.cancel()
        for w in self.workers.values():
            for t in w.tasks:
                await ended(t)
        if self._publisher is not None:
            await stop_task(self._publisher)
            self._publisher = None
        if self.member is not None:
            await self.member.stop()
            self.member = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        await asyncio.get_running_loop().run_in_executor(None, self.stores.close)

    @property
    def ready(self) -> bool:
        workers = self.workers.values()
        return bool(self.workers) and all(w.current_state() == "streaming" for w in workers)

    async def _publish(self) -> None:
        """Publish each partition's applier and producer SCNs in the member node."""
        assert self.member is not None
        while True:
            self.member.publish(
                {n: (w.applier_scn, w.producer_scn) for n, w in self.workers.items()}
            )
            await asyncio.sleep(_PUBLISH_S)
