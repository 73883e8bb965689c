"""``RoutingTable``: the members and partition leaders of a cluster, kept current.

A refresh reads, in one thread hop with pipelined requests, the children of
``members/`` and each member's node, the children of ``partitions/``, and
each partition's ``epoch`` and ``election/`` children (layout in
:mod:`changebus.cluster._layout`). Every read leaves a one-shot watch; any
watch firing, a new session, or ``refresh_s`` passing schedules the next
refresh (coalesced: a burst of changes costs one or two refreshes). When
only member nodes' data changed (members rewrite theirs twice a second while
their SCNs move), only those nodes are read again; anything else, a new
session, a failed read or ``refresh_s`` passing reads the whole table.

Each refresh that sees something different publishes a new immutable
:class:`RoutingSnapshot` with a higher ``version``: read it with
:meth:`RoutingTable.snapshot`, wait for the next with
:meth:`RoutingTable.wait_changed`, or get called back
(:meth:`RoutingTable.add_listener`). The leader of a partition is the holder
of its newest epoch while the holder's candidate is first in line
(:func:`~changebus.cluster.current_leader` has the same rule).

Thread-safety: on the session's event loop (the watches only hand a wake-up
to it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kazoo.exceptions import NoNodeError

from changebus.schemas import stop_task

from ._election import LeaderInfo
from ._errors import CoordinationError
from ._layout import (
    EpochRecord,
    MemberInfo,
    candidate_seq,
    decode_candidate,
    decode_epoch,
    decode_member,
    members_path,
    partitions_path,
)
from ._session import StateChange, ZkSession

__all__ = ["RoutingSnapshot", "RoutingTable"]

log = logging.getLogger("changebus.cluster.routing")


@dataclass(frozen=True, slots=True)
class RoutingSnapshot:
    """The cluster at one moment: members by id, live leaders by partition.

    ``partitions`` lists every partition that has an election (led or not);
    ``leaders`` only those with a live leader.
    """

    version: int = 0
    members: Mapping[str, MemberInfo] = field(default_factory=dict)
    leaders: Mapping[str, LeaderInfo] = field(default_factory=dict)
    partitions: tuple[str, ...] = ()

    def serving(self, partition: str, kind: str = "relay") -> list[MemberInfo]:
        """Members of ``kind`` that report ``partition``, the leader first."""
        leader = self.leaders.get(partition)
        found = [
            m
            for _, m in sorted(self.members.items())
            if m.kind == kind and partition in m.partitions
        ]
        found.sort(key=lambda m: leader is None or m.member_id != leader.member_id)
        return found

    def lag(self, member_id: str, partition: str) -> int | None:
        """The leader's ``max_scn`` minus the member's, None when either is unknown."""
        leader = self.leaders.get(partition)
        member = self.members.get(member_id)
        if leader is None or member is None or partition not in member.partitions:
            return None
        head = self.members.get(leader.member_id)
        if head is None or partition not in head.partitions:
            return None
        return max(0, head.partitions[partition].max_scn - member.partitions[partition].max_scn)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready form (what ``changebus cluster status --json`` prints)."""
        members = []
        for member_id, m in sorted(self.members.items()):
            parts = {}
            for p, s in sorted(m.partitions.items()):
                parts[p] = {**s.to_json(), "lag": self.lag(member_id, p)}
            members.append(
                {"member_id": member_id, "kind": m.kind, "url": m.url, "partitions": parts}
            )
        partitions = {}
        for p in self.partitions:
            leader = self.leaders.get(p)
            partitions[p] = {
                "leader": leader.member_id if leader else None,
                "url": leader.url if leader else None,
                "epoch": leader.epoch if leader else None,
            }
        return {"members": members, "partitions": partitions}


class RoutingTable:
    """Watches a cluster's members and leaders (see the module docstring)."""

    def __init__(
        self, session: ZkSession, *, refresh_s: float = 10.0, create_paths: bool = True
    ) -> None:
        self.session = session
        self.refresh_s = refresh_s
        self.create_paths = create_paths
        self._snapshot = RoutingSnapshot()
        self._kick = asyncio.Event()
        self._changed = asyncio.Event()
        self._listeners: list[Callable[[RoutingSnapshot], None]] = []
        self._task: asyncio.Task[None] | None = None
        self._remove_listener: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: member nodes whose data changed since the last read, and whether anything
        #: else fired (then the whole table is read again): members rewrite their nodes
        #: twice a second while their SCNs move, and a whole read is 2 + M + 3P requests
        self._dirty: set[str] = set()
        self._full = False

    async def start(self) -> None:
        """Read the table once (raises :class:`CoordinationError`), then keep it current."""
        self._loop = asyncio.get_running_loop()
        if self.create_paths:
            cluster = self.session.config.name
            await self.session.ensure_path(members_path(cluster))
            await self.session.ensure_path(partitions_path(cluster))
        await self._refresh()
        self._remove_listener = self.session.add_listener(self._on_state)
        self._task = asyncio.create_task(self._keep(), name="routing-table")

    async def stop(self) -> None:
        if self._remove_listener is not None:
            self._remove_listener()
        task, self._task = self._task, None
        await stop_task(task)

    def snapshot(self) -> RoutingSnapshot:
        """The newest snapshot (immutable)."""
        return self._snapshot

    def leader(self, partition: str) -> LeaderInfo | None:
        return self._snapshot.leaders.get(partition)

    async def leader_changes(self, partition: str) -> AsyncIterator[LeaderInfo | None]:
        """The leader of ``partition`` now, then each time it changes (None: no leader).

        A follower's loop: ``async for leader in table.leader_changes(p): ...``
        (a new epoch of the same member counts as a change).
        """
        snapshot = self._snapshot
        current = snapshot.leaders.get(partition)
        yield current
        while True:
            snapshot = await self.wait_changed(snapshot.version)
            leader = snapshot.leaders.get(partition)
            if leader != current:
                current = leader
                yield leader

    async def wait_changed(self, after: int) -> RoutingSnapshot:
        """Wait for a snapshot with ``version > after``."""
        while self._snapshot.version <= after:
            await self._changed.wait()
        return self._snapshot

    def add_listener(self, callback: Callable[[RoutingSnapshot], None]) -> Callable[[], None]:
        """Call ``callback(snapshot)`` on the event loop at each change; returns the remover."""
        self._listeners.append(callback)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._listeners.remove(callback)

        return remove

    # -- refreshing ------------------------------------------------------------------

    def _watch(self, event: Any) -> None:  # kazoo's thread
        loop = self._loop
        if loop is not None:
            kind, path = getattr(event, "type", None), getattr(event, "path", "") or ""
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._watched, str(kind), path)

    def _watched(self, kind: str, path: str) -> None:
        """A watch fired (event loop): a member node's data alone, or anything else."""
        root = members_path(self.session.config.name) + "/"
        member = path[len(root) :] if path.startswith(root) else ""
        if kind == "CHANGED" and member and "/" not in member:
            self._dirty.add(member)
        else:  # (a member coming or going fires its parent's children watch too)
            self._full = True
        self._kick.set()

    async def _refresh_members(self, ids: set[str]) -> None:
        """Read again only the member nodes in ``ids`` (re-arming their watches)."""
        timeout, watch = self.session.op_timeout_s, self._watch
        mroot = members_path(self.session.config.name)

        def read(zk: Any) -> dict[str, MemberInfo | None]:
            pending = [(i, zk.get_async(f"{mroot}/{i}", watch=watch)) for i in sorted(ids)]
            out: dict[str, MemberInfo | None] = {}
            for member_id, result in pending:
                try:
                    data, _stat = result.get(timeout=timeout)
                    out[member_id] = decode_member(member_id, data)
                except NoNodeError:
                    out[member_id] = None
            return out

        changed = await self.session.call(read)
        old = self._snapshot
        members = dict(old.members)
        for member_id, info in changed.items():
            if info is None:
                members.pop(member_id, None)
            else:
                members[member_id] = info
        self._publish(members, dict(old.leaders), list(old.partitions))

    def _on_state(self, change: StateChange) -> None:
        if change.state == "connected":
            self._full = True
            self._kick.set()

    async def _keep(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.refresh_s):
                    await self._kick.wait()
            except TimeoutError:
                self._full = True  # (the periodic whole read, whatever fired)
            await asyncio.sleep(0.02)  # coalesce a burst of watch events
            self._kick.clear()
            if self.session.state != "connected":
                continue
            full, dirty = self._full or not self._dirty, self._dirty
            self._full, self._dirty = False, set()
            try:
                if full:
                    await self._refresh()
                else:
                    await self._refresh_members(dirty)
            except CoordinationError as exc:
                log.info("routing table refresh failed: %s", exc)
                self._full = True
                await asyncio.sleep(0.2)
                self._kick.set()
            except Exception as exc:  # noqa: BLE001 - ZooKeeper said no, bad data: keep going
                # (a task that ended here would leave every reader a frozen table)
                log.error("routing table refresh failed: %s: %s", type(exc).__name__, exc)
                self._full = True
                await asyncio.sleep(1.0)
                self._kick.set()

    async def _refresh(self) -> None:
        cluster, timeout, watch = self.session.config.name, self.session.op_timeout_s, self._watch
        mroot, proot = members_path(cluster), partitions_path(cluster)

        def children(zk: Any, path: str) -> list[str]:
            try:
                names: list[str] = zk.get_children_async(path, watch=watch).get(timeout=timeout)
            except NoNodeError:  # no such cluster (yet): watch for its creation
                zk.exists_async(path, watch=watch).get(timeout=timeout)
                return []
            return names

        def read(zk: Any) -> tuple[dict[str, MemberInfo], dict[str, LeaderInfo], list[str]]:
            ids = children(zk, mroot)
            pending = [(i, zk.get_async(f"{mroot}/{i}", watch=watch)) for i in ids]
            parts = sorted(children(zk, proot))
            pending_parts = [
                (
                    p,
                    zk.get_async(f"{proot}/{p}/epoch", watch=watch),
                    zk.get_children_async(f"{proot}/{p}/election", watch=watch),
                )
                for p in parts
            ]
            members: dict[str, MemberInfo] = {}
            for member_id, result in pending:
                try:
                    data, _stat = result.get(timeout=timeout)
                    members[member_id] = decode_member(member_id, data)
                except NoNodeError:
                    continue
                except CoordinationError as exc:
                    log.warning("routing table: %s", exc)
            # each partition's first candidate, asked for all at once too (one round trip
            # a partition, in turn, was seconds a refresh at a thousand partitions: review)
            firsts: list[tuple[str, EpochRecord, Any]] = []
            for p, epoch_result, election_result in pending_parts:
                try:
                    record = decode_epoch(epoch_result.get(timeout=timeout)[0])
                    names = election_result.get(timeout=timeout)
                except (NoNodeError, CoordinationError):
                    continue
                ordered = sorted((n for n in names if candidate_seq(n) >= 0), key=candidate_seq)
                if not record.member_id or not ordered:
                    continue
                firsts.append((p, record, zk.get_async(f"{proot}/{p}/election/{ordered[0]}")))
            leaders: dict[str, LeaderInfo] = {}
            for p, record, first in firsts:
                try:
                    data, _ = first.get(timeout=timeout)
                except NoNodeError:
                    continue
                if decode_candidate(data)[0] == record.member_id:
                    leaders[p] = LeaderInfo(p, record.member_id, record.url, record.epoch)
            return members, leaders, parts

        members, leaders, parts = await self.session.call(read)
        self._publish(members, leaders, parts)

    def _publish(
        self, members: dict[str, MemberInfo], leaders: dict[str, LeaderInfo], parts: list[str]
    ) -> None:
        """A new snapshot when anything differs from the current one; listeners told."""
        old = self._snapshot
        if old.members == members and old.leaders == leaders and old.partitions == tuple(parts):
            return
        self._snapshot = RoutingSnapshot(old.version + 1, members, leaders, tuple(parts))
        self._changed.set()
        self._changed = asyncio.Event()
        for callback in list(self._listeners):
            try:
                callback(self._snapshot)
            except Exception:
                log.exception("a routing-table listener failed")
