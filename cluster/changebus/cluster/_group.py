"""``GroupMember``: one member of a consumer group, coordinated through ZooKeeper.

Layout and invariants: :mod:`changebus.cluster._group_layout`. A member

1. checks the group's ``meta`` (creating it when it is the first member): a
   different bucket count or partition list fails :meth:`GroupMember.start`
   with a :class:`ConfigError` naming both values;
2. registers an ephemeral sequential node ``members/m-<seq>``; its name is
   the :attr:`GroupMember.member_id`;
3. follows ``assignment`` (a watch) and reports its own units, the *target*,
   to :meth:`GroupMember.on_target` callbacks whenever they change;
4. leads when its sequence number is the lowest (``_group_leader``): the
   leader recomputes the sticky assignment (:func:`~changebus.cluster.assign`)
   on every change of the member list and writes it when it differs;
5. takes a unit with :meth:`GroupMember.acquire` (the ephemeral
   ``owners/<unit>``, waiting while another member still holds it) and gives
   it back with :meth:`GroupMember.release`. The consumer acquires a unit
   before it claims its checkpoint and releases it after its last commit, so
   a unit moving from one member to another is never read by both. The
   per-unit locks, fences and stale owner nodes behind them are
   :mod:`._group_owners`.

Lease. Every ``lease_s / 3`` a heartbeat (``_group_keeper``, which also
registers the member again after a loss) syncs the server with the
ensemble's leader and checks that the member node still exists (one round
trip, two pipelined requests; the sync keeps a server cut off from the
quorum from confirming the lease out of its own stale copy).
:meth:`GroupMember.lease_valid` is true only while kazoo reports the
connection up and the newest heartbeat that found the node was *sent* less
than ``lease_s`` (``lease_fraction`` x the session timeout the server
granted) ago: ZooKeeper cannot expire the session, and so cannot let another
member take the units, sooner than a session timeout after that. A member frozen past its
session (SIGSTOP, a long pause) sees ``lease_valid() == False`` the moment it
runs again. The consumer checks it before it hands a window to the
application.

Membership loss. When the session is LOST (or a new session replaced it),
or the member node is gone, every owner node of the member is gone (or is
deleted at once when the session still lives): :attr:`GroupMember.owned`
becomes empty, the :meth:`GroupMember.on_lost` callbacks get the units it
held, the target becomes empty (``on_target(frozenset())``), and the member
registers again with a new member id, to which the leader gives units.

Driving a member (what a group consumer does; callbacks run on the loop and
must not block, so they start tasks)::

    member = GroupMember(session, "orders-indexer", ["orders"], 64)
    member.on_target(lambda target: spawn(retarget(target)))
    member.on_lost(lambda units: drop(units))     # owner nodes gone: stop at once
    await member.start()

    async def retarget(target):
        for unit in member.owned - target:        # revoke: commit, then release
            await commit_last_positions(unit)
            await member.release([unit])
        for unit in target - member.owned:        # assign: own, claim, then read
            fence = await member.acquire(unit)    # waits for the previous owner
            claim = await store.claim(group, unit, member.member_id, fence)
            start_reading(unit, claim)

and before handing a window of ``unit`` to the application:
``member.lease_valid() and unit in member.owned``.

Thread-safety: everything runs on the event loop of the session except
:meth:`GroupMember.lease_valid`, which any thread may call.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kazoo.exceptions import NodeExistsError, NoNodeError

from changebus.schemas import MAX_BUCKETS, Unit
from changebus.schemas.errors import ConfigError

from ._errors import CoordinationError
from ._group_calls import UnitsCallback, add_callback, fire_callbacks, report_crash
from ._group_follow import run_follower
from ._group_keeper import run_keeper
from ._group_layout import (
    GroupMeta,
    assignment_path,
    encode_member_record,
    group_members_path,
    group_root,
    owners_path,
    units_text,
)
from ._group_leader import run_leader
from ._group_nodes import check_meta, create_member, leave_for_later, mapped
from ._group_owners import OwnerNodes
from ._session import StateChange, ZkSession

__all__ = ["GroupMember"]

log = logging.getLogger("changebus.cluster.group")

#: the groups with a started member on each session: ownership is per session (an
#: owner node of the session counts as the member's own, :mod:`._group_nodes`), so two
#: members of one group on one session would take each other's units (review)
_GROUPS_ON: weakref.WeakKeyDictionary[ZkSession, set[str]] = weakref.WeakKeyDictionary()


class GroupMember:
    """One member of consumer group ``group`` (see the module docstring).

    ``partitions`` and ``buckets`` define the group's units and must match
    what the group stored in ZooKeeper; ``name`` is shown on status pages
    (default ``host:pid``). The session is the caller's: :meth:`stop` leaves
    it running. One member of a group per session: :meth:`start` refuses a
    second (:class:`ConfigError`).
    """

    def __init__(
        self,
        session: ZkSession,
        group: str,
        partitions: Sequence[str],
        buckets: int,
        *,
        name: str = "",
    ) -> None:
        self.root = group_root(group)
        if not partitions:
            raise ConfigError(f"group {group}: no partitions to read")
        if not 1 <= buckets <= MAX_BUCKETS:
            raise ConfigError(f"group {group}: buckets {buckets} is out of 1..{MAX_BUCKETS}")
        self.session = session
        self.group = group
        self.partitions = tuple(sorted(set(partitions)))
        self.buckets = buckets
        #: every unit of the group, sorted
        self.units = Unit.all_of(self.partitions, buckets)
        self._unit_set = frozenset(self.units)
        self._host = socket.gethostname()
        self._pid = os.getpid()
        self.name = name or f"{self._host}:{self._pid}"
        #: the current member node name ("" while not registered)
        self.member_id = ""
        #: this member's units in the newest assignment
        self.target: frozenset[Unit] = frozenset()
        #: the units whose owner node this member holds now
        self.owned: frozenset[Unit] = frozenset()
        #: True while this member is the group's leader
        self.is_leader = False
        #: how many times the member node was created
        self.registrations = 0
        #: monotonic send time of the newest heartbeat that found the member node
        self.confirmed_at = float("-inf")
        # the registration: full member node path and the session that created it
        self._member_path = ""
        self._member_sid = 0
        self._deleted_path = ""  # set by the member node's watch (kazoo's thread)
        self._started_ns = time.time_ns()
        #: locks, fences, numbered creates and stale units of the owner nodes
        self._owners = OwnerNodes(self)
        self._target_cbs: list[UnitsCallback] = []
        self._lost_cbs: list[UnitsCallback] = []
        self._registered = asyncio.Event()
        self._wake_keeper = asyncio.Event()
        self._wake_assignment = asyncio.Event()
        self._wake_leader = asyncio.Event()
        #: (the assignment node's last change, the members in order, this member) when
        #: the leader last found the assignment balanced: the same again is not decoded
        #: and balanced again (:mod:`._group_leader`)
        self._balanced: tuple[int, tuple[str, ...], str] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._remove_listener: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    # -- public API ------------------------------------------------------------------

    async def start(self) -> None:
        """Check the group's meta, register, and start following the group.

        Raises :class:`ConfigError` when the stored meta disagrees, and a
        retriable :class:`CoordinationError` when ZooKeeper does not answer.
        """
        if self._tasks:
            return
        # a start after a stop registers anew: a record unlike the one the stop left to delete
        self._started_ns = max(time.time_ns(), self._started_ns + 1)
        groups = _GROUPS_ON.setdefault(self.session, set())
        if self.group in groups:
            raise ConfigError(
                f"group {self.group}: another member of it runs on this ZooKeeper session;"
                " each member needs a session of its own"
            )
        groups.add(self.group)
        try:
            await self._start()
        except BaseException:
            groups.discard(self.group)
            raise

    async def _start(self) -> None:
        self._stopping = False
        self._loop = asyncio.get_running_loop()
        await self.session.wait_connected()
        if await check_meta(self.session, self.group, GroupMeta(self.buckets, self.partitions)):
            log.info(
                "group %s: created (%d buckets of %s)", self.group, self.buckets, self.partitions
            )
        session = self.session
        for path in (group_members_path(self.group), owners_path(self.group)):
            await mapped(f"creating {path}", session.ensure_path(path))
        with contextlib.suppress(NodeExistsError):
            await session.op("create", assignment_path(self.group), b"")
        await self._register()
        self._remove_listener = session.add_listener(self._on_state)
        loop_name = f"group-{self.group}"
        self._tasks = [
            asyncio.create_task(run_keeper(self), name=f"{loop_name}-keeper"),
            asyncio.create_task(run_follower(self), name=f"{loop_name}-assignment"),
            asyncio.create_task(run_leader(self), name=f"{loop_name}-leader"),
        ]
        for task in self._tasks:
            task.add_done_callback(report_crash)

    async def stop(self) -> None:
        """Release the owner nodes, delete the member node and stop (the session stays)."""
        self._stopping = True
        _GROUPS_ON.get(self.session, set()).discard(self.group)
        if self._remove_listener is not None:
            self._remove_listener()
            self._remove_listener = None
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in [*tasks, *self._owners.background]:  # undoing cancelled acquires: let them end
            with contextlib.suppress(asyncio.CancelledError, CoordinationError):
                await task
        path, owned, member_id = self._member_path, self.owned, self.member_id
        if path and self.session.connected:
            with contextlib.suppress(CoordinationError):
                await self._owners.delete(path, owned)
                owned = frozenset()
            with contextlib.suppress(CoordinationError):
                await self._owners.drop_stale()
            with contextlib.suppress(CoordinationError, NoNodeError):
                await self.session.op("delete", path)
                path = ""
        mine = self._member_sid and self._member_sid == self.session.session_id  # (not deleted)
        fences, stale = self._owners.fences, self._owners.stale
        units = {u: fences.get(u, -1) for u in owned | stale} if mine else {}
        leave_for_later(
            self.session, self.group, path if mine else "", member_id, units, self._record()
        )
        self.owned = frozenset()
        self._member_path, self.member_id, self._member_sid = "", "", 0
        self.is_leader = False
        self.confirmed_at = float("-inf")
        self._registered.clear()
        log.info("group %s: member %s stopped", self.group, self.name)

    def on_target(self, callback: UnitsCallback) -> Callable[[], None]:
        """Call ``callback(target)`` on the event loop when the target changes; returns the remover."""
        return add_callback(self._target_cbs, callback)

    def on_lost(self, callback: UnitsCallback) -> Callable[[], None]:
        """Call ``callback(units)`` when the membership is lost with the owner nodes of ``units``."""
        return add_callback(self._lost_cbs, callback)

    @property
    def member_path(self) -> str:
        """This member's node now ("" while it has none; a claim's fence)."""
        return self._member_path

    @property
    def lease_s(self) -> float:
        """How long a confirmed heartbeat keeps the lease (see the module docstring)."""
        return self.session.lease_s

    def lease_valid(self) -> bool:
        """True while this member may act on its units (a lease; thread-safe)."""
        path = self._member_path
        return (
            bool(path)
            # (the watch's mark, for good: a heartbeat answer under way cannot renew it)
            and self._deleted_path != path
            and self.session.thread_state == "connected"
            and time.monotonic() - self.confirmed_at < self.lease_s
        )

    async def acquire(self, unit: Unit) -> int:
        """Create ``owners/<unit>`` for this member, waiting while another member holds it.

        Returns the owner node's creation zxid: the fence to claim the unit
        with (:meth:`changebus.schemas.UnitStore.claim`); each later owner
        node of the unit has a larger one. Cancellable. Raises a retriable :class:`CoordinationError` when the
        membership is lost while waiting (the unit then is not acquired), and
        :class:`ConfigError` for a unit outside the group.
        """
        if unit not in self._unit_set:
            raise ConfigError(f"group {self.group}: {unit} is not one of its units")
        owners = self._owners
        registration = ""
        loop = asyncio.get_running_loop()
        freed = asyncio.Event()

        def watch(_event: Any) -> None:  # one function per call: kazoo keeps it once
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(freed.set)

        while True:
            if unit in self.owned:
                return owners.fences.get(unit, -1)
            if self._stopping:
                raise CoordinationError(
                    f"group {self.group}: the member is stopped", retriable=False
                )
            if not self._member_path:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):  # to notice stop()
                        await self._registered.wait()
                continue
            await self.session.wait_connected()
            path, sid = self._member_path, self._member_sid
            if not path:
                continue
            if registration and path != registration:
                raise CoordinationError(
                    f"group {self.group}: membership lost while acquiring {unit}"
                )
            registration = path
            freed.clear()
            number = owners.creates[unit] = owners.creates.get(unit, 0) + 1
            attempt = asyncio.ensure_future(owners.create(path, sid, unit, watch))
            try:
                outcome = await asyncio.shield(attempt)
            except asyncio.CancelledError:
                attempt.add_done_callback(
                    functools.partial(owners.undo_create, unit=unit, path=path, number=number)
                )
                raise
            except Exception:
                owners.unknown_create(unit)
                raise
            if outcome == "created":
                if unit in self.owned:  # (marked by owners.create, under the unit's lock)
                    return owners.fences.get(unit, -1)
                owners.stale.add(unit)  # made for a registration that ended meanwhile
                continue
            if outcome == "member gone":
                self._member_gone(path, "member node gone")
                continue
            if outcome == "held":
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.session.op_timeout_s * 2):
                        await freed.wait()

    async def release(self, units: Iterable[Unit]) -> None:
        """Delete this member's owner nodes of ``units`` (idempotent; never raises on I/O).

        When ZooKeeper does not answer, the nodes are deleted later (or go
        with the session).
        """
        mine = frozenset(units) & self.owned
        if not mine:
            return
        self.owned = self.owned - mine
        try:
            await self._owners.delete(self._member_path, mine)
        except CoordinationError as exc:
            log.info("group %s: releasing %s later: %s", self.group, units_text(list(mine)), exc)
            self._owners.stale |= mine
            self._wake_keeper.set()
            return
        log.debug("group %s: %s released %s", self.group, self.member_id, units_text(list(mine)))

    # -- meta and registration ----------------------------------------------------------

    def _record(self) -> bytes:
        """This registration's member node data (unique: pid and start time)."""
        return encode_member_record(self.name, self._host, self._pid, self._started_ns)

    async def _register(self) -> None:
        """Create the member node (a new member id)."""
        t0 = time.monotonic()
        path, sid = await create_member(
            self.session, self.group, self._record(), self._started_ns, self._pid
        )
        self._member_path, self._member_sid = path, sid
        self.member_id = path.rpartition("/")[2]
        self.confirmed_at = t0
        self.registrations += 1
        self._registered.set()
        for event in (self._wake_keeper, self._wake_assignment, self._wake_leader):
            event.set()
        log.info("group %s: %s joined as %s", self.group, self.name, self.member_id)

    def _member_gone(self, path: str, reason: str) -> None:
        """The registration ``path`` ended (on the loop; idempotent)."""
        if not path or path != self._member_path:
            return
        log.warning(
            "group %s: member %s lost its membership (%s); it held %s",
            self.group,
            self.member_id,
            reason,
            units_text(list(self.owned)) or "no units",
        )
        lost = self.owned
        if self.session.session_id == self._member_sid and self.session.thread_state != "lost":
            self._owners.stale |= lost  # the session lives: its owner nodes too, until deleted
        self._member_path, self.member_id, self._member_sid = "", "", 0
        self.confirmed_at = float("-inf")
        self.is_leader = False
        self.owned = frozenset()
        self._registered.clear()
        fire_callbacks(self._lost_cbs, lost, "on_lost")
        self._set_target(frozenset())
        for event in (self._wake_keeper, self._wake_assignment, self._wake_leader):
            event.set()

    def _on_state(self, change: StateChange) -> None:
        if change.state == "lost" or (
            change.state == "connected"
            and self._member_sid
            and change.session_id != self._member_sid
        ):
            self._member_gone(self._member_path, f"ZooKeeper session {change.state}")
        for event in (self._wake_keeper, self._wake_assignment, self._wake_leader):
            event.set()

    # -- the lease and the target ----------------------------------------------------------

    def _node_watch(self, event: Any) -> None:
        """The member node's watch (kazoo's thread; one function, so kazoo keeps it once)."""
        path = getattr(event, "path", None)
        if getattr(event, "type", None) == "DELETED" and path and path == self._member_path:
            self._deleted_path = path  # the lease ends now
            self.confirmed_at = float("-inf")
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._wake_keeper.set)

    def _set_target(self, target: frozenset[Unit]) -> None:
        """Adopt a new target and tell the ``on_target`` callbacks (on the loop)."""
        if target == self.target:
            return
        added, removed = target - self.target, self.target - target
        log.info(
            "group %s: %s target %d units (+%d -%d)",
            self.group,
            self.member_id or self.name,
            len(target),
            len(added),
            len(removed),
        )
        self.target = target
        fire_callbacks(self._target_cbs, target, "on_target")

    def __repr__(self) -> str:
        who, lead = self.member_id or "unregistered", ", leader" if self.is_leader else ""
        return f"GroupMember({self.group!r}, {who}, target={len(self.target)}, owned={len(self.owned)}{lead})"
