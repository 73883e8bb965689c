"""The consumer group's leader: the member with the lowest sequence number.

Every member runs :func:`run_leader`: it lists ``members/`` with a child
watch and finds out whether its own node is the lowest. The leader then
recomputes the sticky assignment (:func:`~changebus.cluster.assign`) from
the live members and the stored assignment -- which may still name members
that are gone: their units are handed out again -- and writes it when it
differs, with :func:`write_assignment`: a transaction that checks the
leader's own member node and sets ``assignment`` with a compare-and-set on
its version. A deposed leader (its node gone with its session) cannot
overwrite the assignment of the new one, and two writers never interleave.

The leader recomputes on each change of the member list (after a short
settling pause, so members joining together cause one rebalance), on a new
registration, and every few seconds in case a watch was lost.

Thread-safety: coroutines of the session's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from kazoo.exceptions import NodeExistsError, NoNodeError

from ._assign import assign, moved_units
from ._errors import CoordinationError
from ._group_layout import (
    Assignment,
    assignment_path,
    decode_assignment,
    encode_assignment,
    group_members_path,
    member_seq,
)
from ._session import ZkSession

if TYPE_CHECKING:
    from ._group import GroupMember

__all__ = ["run_leader", "write_assignment"]

log = logging.getLogger("changebus.cluster.group")

#: pause after a change of the member list before the leader recomputes
_SETTLE_S = 0.05
_RETRY_S = (0.05, 0.1, 0.2, 0.5, 1.0)


async def write_assignment(
    session: ZkSession, group: str, member_path: str, assignment: Assignment, version: int
) -> bool:
    """Write ``assignment`` if ``member_path`` exists and the node is at ``version``.

    False when the write was refused (the writer's member node is gone, or
    someone wrote the assignment since ``version`` was read).
    """
    node, data = assignment_path(group), encode_assignment(assignment)

    def build(tx: Any) -> None:
        tx.check(member_path, -1)
        tx.set_data(node, data, version)

    results = await session.commit(build)
    if isinstance(results[0], Exception):
        log.warning("group %s: assignment write refused: %s is gone", group, member_path)
        return False
    if isinstance(results[1], Exception):
        log.info("group %s: assignment write lost a race (%s)", group, type(results[1]).__name__)
        return False
    return True


async def run_leader(member: GroupMember) -> None:
    """Find out whether ``member`` leads and, while it does, keep the assignment current."""
    session, group = member.session, member.group
    parent, loop = group_members_path(group), asyncio.get_running_loop()
    wake = member._wake_leader
    failures = 0
    settle = False

    def watch(_event: Any) -> None:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(wake.set)

    while not member._stopping:
        try:
            await member._registered.wait()
            await session.wait_connected()
            if settle:
                await asyncio.sleep(_SETTLE_S)
            wake.clear()
            path, me = member._member_path, member.member_id
            if not path:
                continue
            names = await session.op("get_children", parent, watch=watch)
            ordered = sorted((n for n in names if member_seq(n) >= 0), key=member_seq)
            if path != member._member_path:
                continue
            if me not in ordered:
                member._member_gone(path, "member node gone")
                continue
            leading = ordered[0] == me
            if leading and not member.is_leader:
                log.info("group %s: %s leads (%d members)", group, me, len(ordered))
            member.is_leader = leading
            if leading and not await _rebalance(member, path, me, ordered):
                await asyncio.sleep(_SETTLE_S)  # lost a race or was deposed: look again
                continue
            failures = 0
        except CoordinationError as exc:
            if session.state == "closed":
                return
            delay = _RETRY_S[min(failures, len(_RETRY_S) - 1)]
            failures += 1
            log.info("group %s: leader retry in %.2f s: %s", group, delay, exc)
            await asyncio.sleep(delay)
            continue
        settle = False
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(2.0, session.op_timeout_s * 2)):
                await wake.wait()
                settle = True


async def _rebalance(member: GroupMember, path: str, me: str, ordered: list[str]) -> bool:
    """Write the new assignment when it differs; False if the write was refused."""
    session, group = member.session, member.group
    node = assignment_path(group)
    try:
        data, stat = await session.op("get", node)
    except NoNodeError:
        with contextlib.suppress(NodeExistsError):
            await session.op("create", node, b"")
        return False
    try:
        previous = decode_assignment(data, node)
    except CoordinationError as exc:
        log.error("group %s: %s; writing a new assignment", group, exc)
        previous = Assignment()
    members = assign(member.units, ordered, previous.members)
    if members == dict(previous.members) and previous.leader == me:
        return True
    new = Assignment(previous.generation + 1, me, members)
    if not await write_assignment(session, group, path, new, stat.version):
        return False
    log.info(
        "group %s: assignment %d by %s: %d members, %d units moved",
        group,
        new.generation,
        me,
        len(ordered),
        len(moved_units(previous.members, members)),
    )
    return True
