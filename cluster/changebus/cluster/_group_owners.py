"""A group member's owner nodes: one create or delete per unit at a time, and what is left.

:class:`OwnerNodes` is the bookkeeping behind :meth:`GroupMember.acquire
<._group.GroupMember.acquire>` and :meth:`GroupMember.release
<._group.GroupMember.release>` (the znode requests themselves are
:func:`._group_nodes.create_owner` and :func:`._group_nodes.delete_owners`):

* a lock per unit: the member's creates and deletes of a unit's owner node
  run one at a time, so a delete sent earlier cannot land after a create that
  took the node over (the unit would be owned without its node);
* the fences: per owned unit, its owner node's creation zxid (what the unit's
  claim is fenced with);
* the creates asked for, numbered per unit: a cancelled acquire whose create
  went through after all is undone, unless a newer acquire of the unit came
  since (the node is that one's);
* the *stale* units: owner nodes that this member's live session may still
  hold but no registration owns (a registration that ended while the session
  lives, a create whose answer never came, a release ZooKeeper did not
  answer). The keeper deletes them (:meth:`OwnerNodes.drop_stale`), unless the
  unit is owned again by then.

A create for the current registration marks the unit owned
(``GroupMember.owned``) before its lock is let go, so a delete waiting for
the lock sees it owned.

Thread-safety: everything runs on the member's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from changebus.schemas import Unit

from ._errors import CoordinationError
from ._group_nodes import CreateOutcome, create_owner, delete_owners

if TYPE_CHECKING:
    from ._group import GroupMember

__all__ = ["OwnerNodes"]

log = logging.getLogger("changebus.cluster.group")


class OwnerNodes:
    """The owner-node state of one :class:`~._group.GroupMember` (module docstring).

    All of it is bounded by the group's units.
    """

    def __init__(self, member: GroupMember) -> None:
        self._member = member
        #: per owned unit, its owner node's creation zxid (the claim's fence)
        self.fences: dict[Unit, int] = {}
        #: owner nodes of a dropped registration (or of an unknown create), session alive
        self.stale: set[Unit] = set()
        #: per unit, the number of the newest create asked for (an undo of an older,
        #: cancelled one must not delete what a newer one made)
        self.creates: dict[Unit, int] = {}
        #: the undo tasks of cancelled acquires (stop waits for them)
        self.background: set[asyncio.Task[None]] = set()
        # one lock per unit (module docstring)
        self._locks: dict[Unit, asyncio.Lock] = {}

    def lock(self, unit: Unit) -> asyncio.Lock:
        """The lock of ``unit``'s owner node (made at its first use)."""
        lock = self._locks.get(unit)
        if lock is None:  # (bounded: units are the group's)
            lock = self._locks[unit] = asyncio.Lock()
        return lock

    async def create(self, path: str, sid: int, unit: Unit, watch: Any) -> CreateOutcome:
        """Create (or take over) the unit's owner node; "created" for the current
        registration marks the unit owned before the lock is let go, so a delete
        waiting for the lock sees it owned."""
        member = self._member
        async with self.lock(unit):
            outcome, czxid = await create_owner(
                member.session, member.group, path, sid, unit, watch
            )
            if outcome == "created" and path == member.member_path:
                self.fences[unit] = czxid
                member.owned = member.owned | {unit}
                self.stale.discard(unit)  # (a node of this session taken over)
            return outcome

    async def delete(
        self, path: str, units: frozenset[Unit], *, unless_owned: bool = False
    ) -> None:
        """Delete the owner nodes of ``units``; ``unless_owned``: not those owned by the
        time the locks are held (taken again meanwhile: the node is the owner's now)."""
        member = self._member
        async with contextlib.AsyncExitStack() as stack:
            for unit in sorted(units):  # (one order everywhere: no deadlock)
                await stack.enter_async_context(self.lock(unit))
            if unless_owned:
                units = units - member.owned
            await delete_owners(member.session, member.group, path, units)

    async def _undo(self, path: str, unit: Unit, number: int) -> None:
        member = self._member
        async with self.lock(unit):
            if self.creates.get(unit) != number:
                return  # a newer acquire: the node is its
            member.owned = member.owned - {unit}  # (nobody holds it: its acquire was cancelled)
            await delete_owners(member.session, member.group, path, frozenset({unit}))

    def unknown_create(self, unit: Unit) -> None:
        """A create whose answer never came may have made the node: delete it later unless
        the unit is acquired by then (else it blocks its next owner while the session lives)."""
        if unit not in self._member.owned:
            self.stale.add(unit)
            self._member._wake_keeper.set()

    def undo_create(
        self, attempt: asyncio.Future[CreateOutcome], *, unit: Unit, path: str, number: int
    ) -> None:
        """A cancelled acquire's create that succeeded after all (or whose outcome is
        unknown): delete the node, unless a newer acquire of the unit came since."""
        if attempt.cancelled() or (attempt.exception() is None and attempt.result() != "created"):
            return
        if attempt.exception() is not None:
            self.unknown_create(unit)
            return
        task = asyncio.ensure_future(self._undo(path, unit, number))
        self.background.add(task)

        def done(t: asyncio.Future[None]) -> None:
            self.background.discard(t)
            if not t.cancelled() and t.exception() is not None:
                self.stale.add(unit)

        task.add_done_callback(done)

    async def try_drop_stale(self) -> None:
        """:meth:`drop_stale`, its failure logged (tried again on the next round)."""
        try:
            await self.drop_stale()
        except CoordinationError as exc:
            log.info("group %s: stale owner nodes stay for now: %s", self._member.group, exc)

    async def drop_stale(self) -> None:
        """Delete owner nodes of an ended registration that the live session still holds."""
        owned = self._member.owned
        stale = frozenset(self.stale) - owned
        self.stale -= owned
        if not stale:
            return
        await self.delete("", stale, unless_owned=True)
        self.stale -= stale
