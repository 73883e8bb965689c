"""A group member's keeper: its registration, its stale owner nodes and its lease.

:func:`run_keeper` registers the member again after a loss (checking the
group's ``meta`` first: the group may have been deleted meanwhile), deletes
the stale owner nodes (:meth:`._group_owners.OwnerNodes.drop_stale`), and
beats.

Lease. Every ``lease_s / 3`` (or when woken) a heartbeat syncs the server
with the ensemble's leader and checks that the member node still exists
(one round trip, two pipelined requests; the sync keeps a server cut off
from the quorum from confirming the lease out of its own stale copy). A
heartbeat that finds the node moves ``GroupMember.confirmed_at`` to the
time it was *sent*, which :meth:`GroupMember.lease_valid
<._group.GroupMember.lease_valid>` counts from; one that finds it gone (or
of another session) ends the membership (``GroupMember._member_gone``). The
exists request sets the member's node watch, which ends the lease the moment
the node is deleted.

Thread-safety: a coroutine of the session's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

from ._group_layout import GroupMeta
from ._group_nodes import LOOP_ERRORS, check_meta, retry_pause

if TYPE_CHECKING:
    from ._group import GroupMember

__all__ = ["run_keeper"]


async def run_keeper(member: GroupMember) -> None:
    """Registration (again after a loss), stale owner nodes, and the heartbeat."""
    session, owners = member.session, member._owners
    failures = 0
    while not member._stopping:
        try:
            if not member.member_path:
                await session.wait_connected()
                await owners.try_drop_stale()
                if member.registrations:  # the group may have been deleted meanwhile
                    meta = GroupMeta(member.buckets, member.partitions)
                    await check_meta(session, member.group, meta)
                await member._register()
            member._wake_keeper.clear()
            await _beat(member)
            failures = 0
        except LOOP_ERRORS as exc:
            if not await retry_pause(session, failures, f"group {member.group}", exc):
                return
            failures += 1
            continue
        if owners.stale:
            await owners.try_drop_stale()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(member.lease_s / 3):
                await member._wake_keeper.wait()


async def _beat(member: GroupMember) -> None:
    """One heartbeat of the member's current registration (module docstring)."""
    path, sid = member.member_path, member._member_sid
    if not path:
        return
    t0 = time.monotonic()
    watch, timeout = member._node_watch, member.session.op_timeout_s

    def beat(zk: Any) -> Any:
        # a sync first, as the election's heartbeat does: the answer is the quorum's
        pending_sync = zk.sync_async(path)
        pending = zk.exists_async(path, watch=watch)
        pending_sync.get(timeout=timeout)
        return pending.get(timeout=timeout)

    stat = await member.session.call(beat)
    if path != member.member_path:
        return
    if stat is None or stat.ephemeralOwner != sid or member._deleted_path == path:
        member._member_gone(path, "member node gone")
    elif t0 > member.confirmed_at:
        member.confirmed_at = t0
