"""The consumer group's leader: the member with the lowest sequence number.

Every member runs :func:`run_leader`: it lists ``members/`` with a child
watch and finds out whether its own node is the lowest. The leader then
recomputes the sticky assignment (:func:`~changebus.cluster.assign`) from
the live members and the stored assignment -- which may still name members
that are gone: their units are handed out again; when it is unreadable, the
owner nodes say who reads what -- and writes it when it
differs, with :func:`write_assignment`: a transaction that checks the
leader's own member node and sets ``assignment`` with a compare-and-set on
its version. A deposed leader (its node gone with its session) cannot
overwrite the assignment of the new one, and two writers never interleave.

The leader recomputes on each change of the member list (after a short
settling pause, so members joining together cause one rebalance), on each
change of ``assignment`` (its own writes included: that look finds nothing
to do), on a new registration, and every few seconds in case a watch was lost.

Thread-safety: coroutines of the session's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kazoo.exceptions import NodeExistsError, NoNodeError

from changebus.schemas import Unit
from changebus.schemas.errors import ChangebusError

from ._assign import assign, moved_units
from ._errors import CoordinationError
from ._group_layout import (
    Assignment,
    assignment_path,
    decode_assignment,
    decode_owner,
    encode_assignment,
    group_members_path,
    member_seq,
    owners_path,
)
from ._group_nodes import LOOP_ERRORS, retry_pause
from ._session import ZkSession, failed_op

if TYPE_CHECKING:
    from ._group import GroupMember

__all__ = ["run_leader", "write_assignment"]

log = logging.getLogger("changebus.cluster.group")

#: pause after a change of the member list before the leader recomputes
_SETTLE_S = 0.05


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
    failed = failed_op(results)
    if failed == 0:
        log.warning("group %s: assignment write refused: %s is gone", group, member_path)
        return False
    if failed is not None:
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
            if leading and not await _rebalance(member, path, me, ordered, watch):
                await asyncio.sleep(_SETTLE_S)  # lost a race or was deposed: look again
                continue
            failures = 0
        except LOOP_ERRORS as exc:
            if not await retry_pause(session, failures, f"group {group}: leader", exc):
                return
            failures += 1
            continue
        settle = False
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(2.0, session.op_timeout_s * 2)):
                await wake.wait()
                settle = True


async def _rebalance(
    member: GroupMember, path: str, me: str, ordered: list[str], watch: Callable[[Any], None]
) -> bool:
    """Write the new assignment when it differs; False if the write was refused.

    ``watch`` is set on ``assignment``: a foreign write (or damage) wakes the leader.
    """
    session, group = member.session, member.group
    node = assignment_path(group)
    try:
        data, stat = await session.op("get", node, watch=watch)
    except NoNodeError:
        with contextlib.suppress(NodeExistsError):
            await session.op("create", node, b"")
        return False
    # (every wake decoded the whole assignment and balanced the units again on the event
    # loop: 57 ms for 16k units over 100 members; the same node and members are not)
    seen = (int(stat.mzxid), tuple(ordered), me)
    if member._balanced == seen:
        return True
    try:
        previous = decode_assignment(data, node)
    except CoordinationError as exc:
        log.error("group %s: %s; writing a new one from the owner nodes", group, exc)
        previous = Assignment(stat.version, "", await _owners(session, group))
    members = assign(member.units, ordered, previous.members)
    if members == dict(previous.members) and previous.leader == me:
        member._balanced = seen
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


async def _owners(session: ZkSession, group: str) -> dict[str, tuple[Unit, ...]]:
    """Who reads which unit now, from the owner nodes (unreadable ones left out)."""
    parent, timeout = owners_path(group), session.op_timeout_s

    def run(zk: Any) -> dict[str, list[Unit]]:
        names = zk.get_children_async(parent).get(timeout=timeout)
        pending = [(name, zk.get_async(f"{parent}/{name}")) for name in names]
        found: dict[str, list[Unit]] = {}
        for name, answer in pending:
            with contextlib.suppress(NoNodeError, ChangebusError):
                node = f"{parent}/{name}"
                member = decode_owner(answer.get(timeout=timeout)[0], node)
                found.setdefault(member, []).append(Unit.parse(name))
        return found

    return {m: tuple(sorted(units)) for m, units in (await session.call(run)).items()}
