"""A group member following ``assignment``: its own units there are its *target*.

:func:`run_follower` reads ``assignment`` with a data watch whenever the
watch fires, the member registers again (a new member id) or the session
reconnects (kazoo drops watches on a suspension), and at least every few
seconds. It hands the member's units to ``GroupMember._set_target``, which
calls the ``on_target`` callbacks when they changed. An unreadable
assignment is logged and leaves the target as it is (the leader writes a
new one).

Thread-safety: a coroutine of the session's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from kazoo.exceptions import NoNodeError

from ._errors import CoordinationError
from ._group_layout import assignment_path, decode_assignment
from ._group_nodes import LOOP_ERRORS, retry_pause

if TYPE_CHECKING:
    from ._group import GroupMember

__all__ = ["run_follower"]

log = logging.getLogger("changebus.cluster.group")


async def run_follower(member: GroupMember) -> None:
    """Keep ``member.target`` equal to its units in the group's assignment."""
    session, group = member.session, member.group
    node, loop = assignment_path(group), asyncio.get_running_loop()
    wake = member._wake_assignment
    failures = 0
    #: what the target was last set from: (the node's last change, the member id, its
    #: units); the same again is not decoded again (the decode is on the event loop, and
    #: an assignment of 16k units over 100 members takes 20 ms of it, every wake)
    done: tuple[int, str, object, object] | None = None

    def watch(_event: Any) -> None:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(wake.set)

    while not member._stopping:
        try:
            await member._registered.wait()
            await session.wait_connected()
            wake.clear()
            me = member.member_id
            changed = -1  # (no node: decoded every time, as an empty assignment)
            try:
                data, stat = await session.op("get", node, watch=watch)
                changed = int(stat.mzxid)
            except NoNodeError:
                await session.op("exists", node, watch=watch)
                data = b""
            failures = 0
            seen = (changed, me, member._unit_set, member.target)
            if changed >= 0 and done is not None and done[:3] == seen[:3] and done[3] is seen[3]:
                pass  # the same assignment and member, the target as it was set from it
            else:
                try:
                    assignment = decode_assignment(data, node)
                except CoordinationError as exc:
                    log.error("group %s: %s (the target stays as it is)", group, exc)
                else:
                    if me and me == member.member_id:
                        member._set_target(assignment.units_of(me) & member._unit_set)
                        done = (changed, me, member._unit_set, member.target)
        except LOOP_ERRORS as exc:
            if not await retry_pause(session, failures, f"group {group}: assignment", exc):
                return
            failures += 1
            continue
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(2.0, session.op_timeout_s * 2)):
                await wake.wait()
