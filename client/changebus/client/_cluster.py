"""Relays and bootstrap servers from a cluster's routing table in ZooKeeper.

A consumer configured with ``zookeeper`` and ``cluster`` (instead of, or
besides, a static ``relays`` list) reads who serves its partition from the
cluster's routing table (:class:`changebus.cluster.RoutingTable`, kept
current by ZooKeeper watches) and follows it::

    route = ClusterRoute(zookeeper, cluster, partition, prefer_followers=False)
    await route.start()                            # a read-only ZooKeeper session
    relays = await route.wait_relays(max_attempts, backoff)   # waits while none serves
    remove = route.on_change(lambda relays: stream.set_relays(relays))
    ...
    await route.stop()

Order of :meth:`ClusterRoute.relays`: the partition's leader first, then its
followers (by member id); with ``prefer_followers`` the followers first and
the leader last (reads move load off the member that reads the source; the
leader stays as the last resort). Members of kind ``bootstrap`` are the
bootstrap servers (:meth:`ClusterRoute.bootstrap_servers`). ``static`` URLs
(a configured ``relays`` list given together with ZooKeeper) follow the
table's, so they are used when the table lists nobody.

ZooKeeper work runs in the cluster session's own worker threads, never on
the event loop (:class:`changebus.cluster.ZkSession`). The session is
read-only: it creates no znode (``create_paths=False``), so a client can
watch a cluster that does not exist yet. The connect string holds no secret
(a member's ZooKeeper credentials are separate config fields, and a consumer
reads the world-readable routing table without any); relay URLs are logged
through :func:`~._http.safe_url` only. A member whose URL is not http(s)
(an ``advertised_url`` registered without its scheme) is skipped, relay or
bootstrap server, with a warning naming it without user and password: a
bootstrap server's made every consumer of the cluster fail at start, or was
retried for ever (found by review).

One-look readers (:func:`read_route`, :func:`read_routes`: the Spark
driver and executors, which ask once per decision and per partition) share
the snapshots they read for :data:`SNAPSHOT_TTL_S` per (ZooKeeper,
cluster) in the process: a plan over a thousand partitions opens one
ZooKeeper session, not a thousand. A snapshot that old is a routing hint
like any other: a relay that no longer serves sends the reader to the next.

Thread-safety: on the event loop that called :meth:`ClusterRoute.start`;
the shared snapshots are guarded by a lock (any thread, any loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from changebus.cluster import (
    ClusterConfig,
    CoordinationError,
    RoutingSnapshot,
    RoutingTable,
    ZkSession,
)
from changebus.schemas.config import scrub

from ._backoff import Backoff
from ._errors import RelayUnavailableError
from ._http import safe_url

if TYPE_CHECKING:
    from ._config import ConsumerConfig

__all__ = [
    "ClusterRoute",
    "open_route",
    "read_route",
    "read_routes",
    "relays_serving",
    "retry_coordination",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: a member's URL must be one of these to be used (others are skipped)
_SCHEMES = ("http://", "https://")
#: the unusable URLs warned of already (each once per process), at most _WARNED_MAX
_WARNED: set[str] = set()
_WARNED_MAX = 256


def _shown(url: str) -> str:
    """``url`` for a log line: without user and password, also with no scheme
    (where :func:`~._http.safe_url` cannot parse it), and scrubbed."""
    shown = safe_url(url)
    if shown == "<unparsable url>" or "@" in shown:
        head, sep, rest = url.partition("://")
        shown = f"{head}{sep}{rest.rpartition('@')[2]}" if sep else url.rpartition("@")[2]
    return scrub(shown)[:200]


def _usable(urls: list[str], what: str) -> list[str]:
    """``urls`` that are http(s); the others are skipped, with a warning (once each)."""
    good = [u for u in urls if u.startswith(_SCHEMES)]
    for url in urls:
        if not url.startswith(_SCHEMES) and url not in _WARNED:
            if len(_WARNED) < _WARNED_MAX:
                _WARNED.add(url)
            log.warning(
                "the cluster's routing table lists %s %r, not an http:// or https:// URL"
                " (its advertised_url lacks the scheme?): skipped",
                what,
                _shown(url),
            )
    return good


def relays_serving(
    snapshot: RoutingSnapshot, partition: str, *, prefer_followers: bool = False
) -> tuple[str, ...]:
    """The URLs of the relays serving ``partition`` in the order to try them (module docstring).

    Members whose URL is not http(s) are skipped. The leader is the elected one; when the partition has no election (or
    no live leader) a member whose payload says ``leader`` counts as it.
    """
    urls = set(_usable([m.url for m in snapshot.serving(partition) if m.url], "relay"))
    members = [m for m in snapshot.serving(partition) if m.url in urls]
    elected = snapshot.leaders.get(partition)
    leader = elected.member_id if elected is not None else None
    if leader is None:
        leader = next(
            (m.member_id for m in members if m.partitions[partition].role == "leader"), None
        )
    members.sort(key=lambda m: (m.member_id == leader) == prefer_followers)
    return tuple(dict.fromkeys(m.url.rstrip("/") for m in members))


class ClusterRoute:
    """One partition's relays and bootstrap servers, from a cluster (module docstring)."""

    def __init__(
        self,
        zookeeper: str,
        cluster: str,
        partition: str,
        *,
        prefer_followers: bool = False,
        static: tuple[str, ...] = (),
        session_timeout_s: float = 10.0,
        connect_timeout_s: float = 15.0,
    ) -> None:
        self.partition = partition
        self.prefer_followers = prefer_followers
        self.static = static
        self.session = ZkSession(
            ClusterConfig(
                zookeeper=zookeeper,
                name=cluster,
                session_timeout_s=session_timeout_s,
                connect_timeout_s=connect_timeout_s,
            )
        )
        self.table = RoutingTable(self.session, create_paths=False)
        self._removers: list[Callable[[], None]] = []

    @property
    def where(self) -> str:
        """The cluster, as named in messages."""
        cfg = self.session.config
        return f"cluster {cfg.name!r} (ZooKeeper {cfg.zookeeper})"

    async def start(self) -> None:
        """Connect and read the table (raises a retriable ``CoordinationError``)."""
        await self.session.start()
        try:
            await self.table.start()
        except BaseException:
            await self.session.stop()
            raise

    async def stop(self) -> None:
        for remove in self._removers:
            remove()
        self._removers.clear()
        await self.table.stop()
        await self.session.stop()

    def relays(self, snapshot: RoutingSnapshot | None = None) -> tuple[str, ...]:
        """The relays to try now, in order (then the static ones not listed)."""
        snap = snapshot if snapshot is not None else self.table.snapshot()
        found = relays_serving(snap, self.partition, prefer_followers=self.prefer_followers)
        return tuple(dict.fromkeys(found + self.static))

    def bootstrap_servers(self) -> tuple[str, ...]:
        """The bootstrap servers the table lists for the partition (registration order: by id)."""
        snap = self.table.snapshot()
        found = _serving(snap, self.partition, "bootstrap", False)
        if not found:  # a bootstrap server may register without naming partitions
            found = _serving_all(snap, "bootstrap")
        return tuple(dict.fromkeys(found))

    async def wait_relays(self, max_attempts: int, backoff: Backoff) -> tuple[str, ...]:
        """The relays serving the partition, waiting while there are none.

        Each wait of one backoff delay without a relay counts one attempt;
        ``max_attempts`` of them (0: no limit) raise
        :class:`~changebus.client.RelayUnavailableError`.
        """
        attempts = 0
        while True:
            snapshot = self.table.snapshot()
            relays = self.relays(snapshot)
            if relays:
                if attempts:
                    log.info(
                        "%s: partition %s is served by %s",
                        self.where,
                        self.partition,
                        ", ".join(safe_url(u) for u in relays),
                    )
                return relays
            attempts += 1
            if max_attempts and attempts >= max_attempts:
                raise RelayUnavailableError(
                    f"no relay of {self.where} serves partition {self.partition!r}"
                    f" after {attempts} attempts; start one or check the cluster name"
                )
            delay = backoff.next_delay()
            if attempts == 1:
                log.warning(
                    "no relay of %s serves partition %s yet; waiting for one to register",
                    self.where,
                    self.partition,
                )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self.table.wait_changed(snapshot.version)

    def on_change(
        self, callback: Callable[[tuple[str, ...]], None], initial: tuple[str, ...]
    ) -> None:
        """Call ``callback(relays)`` whenever the partition's relays differ from the last ones.

        ``initial`` is the list the caller started with (a change since then
        is passed on at once). An empty list is not passed on (the last known
        relays are kept and fail over among themselves until someone
        registers); it is logged. Removed by :meth:`stop`.
        """
        self._follow(self.relays, callback, initial, "relay")

    def on_bootstrap_change(
        self, callback: Callable[[tuple[str, ...]], None], initial: tuple[str, ...]
    ) -> None:
        """The same as :meth:`on_change` for the registered bootstrap servers."""
        self._follow(lambda _snap: self.bootstrap_servers(), callback, initial, "bootstrap server")

    def _follow(
        self,
        compute: Callable[[RoutingSnapshot], tuple[str, ...]],
        callback: Callable[[tuple[str, ...]], None],
        initial: tuple[str, ...],
        what: str,
    ) -> None:
        last = [initial]

        def changed(snapshot: RoutingSnapshot) -> None:
            urls = compute(snapshot)
            if urls == last[0]:
                return
            last[0] = urls
            if not urls:
                log.warning(
                    "%s lists no %s for partition %s now; keeping the last known ones",
                    self.where,
                    what,
                    self.partition,
                )
                return
            log.info(
                "%s: partition %s: %s %s",
                self.where,
                self.partition,
                what,
                ", ".join(safe_url(u) for u in urls),
            )
            callback(urls)

        self._removers.append(self.table.add_listener(changed))
        changed(self.table.snapshot())


async def read_route(
    zookeeper: str,
    cluster: str,
    partitions: tuple[str, ...],
    *,
    kind: str = "relay",
    prefer_followers: bool = False,
    session_timeout_s: float = 10.0,
) -> tuple[str, ...]:
    """One look at the routing table: the URLs of ``kind`` serving ``partitions``.

    For planners that ask once per decision (the Spark driver): the members
    serving every partition named (all the table knows when none is), each
    partition's in :func:`relays_serving` order, without duplicates. For
    ``bootstrap`` also the bootstrap servers that name no partition, last.
    """

    def route(snap: RoutingSnapshot) -> tuple[str, ...]:
        found: list[str] = []
        for p in _route_names(snap, partitions, kind):
            found.extend(_serving(snap, p, kind, prefer_followers))
        found.extend(_serving_all(snap, kind))
        return tuple(dict.fromkeys(found))

    return await _look(zookeeper, cluster, partitions, session_timeout_s, route, bool)


async def read_routes(
    zookeeper: str,
    cluster: str,
    partitions: tuple[str, ...],
    *,
    kind: str = "relay",
    prefer_followers: bool = False,
    session_timeout_s: float = 10.0,
) -> dict[str, tuple[str, ...]]:
    """One look at the routing table: per partition, the URLs of ``kind`` serving it.

    The partitions named, or every one the table knows when none is (a
    partition nobody serves now maps to an empty tuple). Relays come in
    :func:`relays_serving` order; for ``bootstrap`` each partition's URLs end
    with the bootstrap servers that name no partition (they serve all).
    """

    def routes(snap: RoutingSnapshot) -> dict[str, tuple[str, ...]]:
        everywhere = _serving_all(snap, kind)
        return {
            p: tuple(dict.fromkeys([*_serving(snap, p, kind, prefer_followers), *everywhere]))
            for p in _route_names(snap, partitions, kind)
        }

    return await _look(
        zookeeper,
        cluster,
        partitions,
        session_timeout_s,
        routes,
        lambda found: bool(found) and all(found.values()),
    )


#: how long one-look readers reuse a routing snapshot (seconds; module docstring)
SNAPSHOT_TTL_S = 2.0
#: (zookeeper, cluster) -> (monotonic time read, snapshot), under ``_SNAPSHOTS_LOCK``
_SNAPSHOTS: dict[tuple[str, str], tuple[float, RoutingSnapshot]] = {}
_SNAPSHOTS_LOCK = threading.Lock()


async def _look(
    zookeeper: str,
    cluster: str,
    partitions: tuple[str, ...],
    session_timeout_s: float,
    answer: Callable[[RoutingSnapshot], T],
    whole: Callable[[T], bool],
) -> T:
    """``answer`` of the shared snapshot; of a fresh one when it is not ``whole`` (a
    member that registered meanwhile is not kept waiting)."""
    snap, cached = await _table_snapshot(zookeeper, cluster, partitions, session_timeout_s)
    found = answer(snap)
    if cached and not whole(found):
        snap, _ = await _table_snapshot(
            zookeeper, cluster, partitions, session_timeout_s, fresh=True
        )
        found = answer(snap)
    return found


async def _table_snapshot(
    zookeeper: str,
    cluster: str,
    partitions: tuple[str, ...],
    session_timeout_s: float,
    fresh: bool = False,
) -> tuple[RoutingSnapshot, bool]:
    """The routing table now (``fresh``), or as read less than :data:`SNAPSHOT_TTL_S` ago;
    and whether it is that older one (a reader that finds nobody serving in it looks
    again, fresh: members that came meanwhile are not kept waiting)."""
    key = (zookeeper, cluster)
    with _SNAPSHOTS_LOCK:
        hit = _SNAPSHOTS.get(key)
    if not fresh and hit is not None and time.monotonic() - hit[0] < SNAPSHOT_TTL_S:
        return hit[1], True
    snap = await _read_table(zookeeper, cluster, partitions, session_timeout_s)
    now = time.monotonic()
    with _SNAPSHOTS_LOCK:
        for old in [k for k, (at, _s) in _SNAPSHOTS.items() if now - at >= SNAPSHOT_TTL_S]:
            del _SNAPSHOTS[old]
        _SNAPSHOTS[key] = (now, snap)
    return snap, False


async def _read_table(
    zookeeper: str, cluster: str, partitions: tuple[str, ...], session_timeout_s: float
) -> RoutingSnapshot:
    route = ClusterRoute(
        zookeeper,
        cluster,
        partitions[0] if partitions else "",
        session_timeout_s=session_timeout_s,
    )
    await route.start()
    try:
        return route.table.snapshot()
    finally:
        await route.stop()


def _route_names(snap: RoutingSnapshot, partitions: tuple[str, ...], kind: str) -> tuple[str, ...]:
    """``partitions``, or every partition the table knows of ``kind``."""
    if partitions:
        return partitions
    served = (m.partitions for m in snap.members.values() if m.kind == kind)
    return tuple(sorted(set(snap.partitions).union(*served)))


def _serving(snap: RoutingSnapshot, partition: str, kind: str, prefer_followers: bool) -> list[str]:
    if kind == "relay":
        return list(relays_serving(snap, partition, prefer_followers=prefer_followers))
    urls = [m.url.rstrip("/") for m in snap.serving(partition, kind) if m.url]
    return _usable(urls, f"{kind} server" if kind == "bootstrap" else kind)


def _serving_all(snap: RoutingSnapshot, kind: str) -> list[str]:
    """Members of ``kind`` naming no partition (bootstrap servers serving all); none for relays."""
    if kind == "relay":
        return []
    urls = [
        m.url.rstrip("/")
        for _, m in sorted(snap.members.items())
        if m.kind == kind and m.url and not m.partitions
    ]
    return _usable(urls, f"{kind} server" if kind == "bootstrap" else kind)


def config_backoff(cfg: ConsumerConfig) -> Backoff:
    """The consumer's backoff (``backoff_*`` settings)."""
    return Backoff(cfg.backoff_initial_s, cfg.backoff_max_s, cfg.backoff_multiplier)


async def retry_coordination(
    cfg: ConsumerConfig, start: Callable[[], Awaitable[None]], where: str
) -> None:
    """``await start()`` until it does not raise a CoordinationError.

    ZooKeeper away at start-up is waited for like a relay: with the
    consumer's backoff, and ``max_attempts`` (0: no limit) failed attempts
    raise :class:`~._errors.RelayUnavailableError`.
    """
    backoff = config_backoff(cfg)
    attempts = 0
    while True:
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


async def open_route(cfg: ConsumerConfig, partition: str) -> tuple[ClusterRoute, tuple[str, ...]]:
    """The started route of ``partition`` in ``cfg.cluster`` and the relays it lists (waits for one).

    The caller stops the route; it is stopped here when waiting for relays fails.
    """

    def make() -> ClusterRoute:
        return ClusterRoute(
            cfg.zookeeper,
            cfg.cluster,
            partition,
            prefer_followers=cfg.prefer_followers,
            static=cfg.relays,
            session_timeout_s=cfg.zookeeper_session_timeout_s,
            connect_timeout_s=max(cfg.connect_timeout_s, 1.0),
        )

    route = make()

    async def attempt() -> None:
        nonlocal route
        try:
            await route.start()
        except CoordinationError:
            route = make()  # a fresh session for the next attempt
            raise

    await retry_coordination(cfg, attempt, route.where)
    try:
        relays = await route.wait_relays(cfg.max_attempts, config_backoff(cfg))
    except BaseException:
        await route.stop()
        raise
    return route, relays
