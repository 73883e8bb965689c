"""``read_group``: a consumer group as ZooKeeper has it now, for status pages.

One thread hop reads ``meta``, the member nodes, ``assignment`` and the
owner nodes (pipelined). A malformed member or owner node does not stop the
page: the member shows ``{"error": ...}``, the owner an empty member id. A
group without ``meta`` does not exist (:class:`ConfigError`); a malformed
``meta`` is a non-retriable :class:`CoordinationError` naming the node.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kazoo.exceptions import NoNodeError

from changebus.schemas import Unit
from changebus.schemas.errors import ChangebusError, ConfigError

from ._errors import CoordinationError
from ._group_layout import (
    assignment_path,
    decode_assignment,
    decode_member_record,
    decode_meta,
    decode_owner,
    group_members_path,
    group_root,
    member_seq,
    meta_path,
    owners_path,
)
from ._group_nodes import mapped
from ._session import ZkSession

__all__ = ["GroupState", "read_group"]

log = logging.getLogger("changebus.cluster.group")


@dataclass(frozen=True)
class GroupState:
    """A snapshot of consumer group ``group``.

    * ``members``: member id -> its node's fields (``name``, ``host``, ``pid``,
      ``started_ns``), ordered by sequence number;
    * ``assignment``: member id -> units of the newest assignment (it may name
      members that are gone until the leader writes again);
    * ``owners``: unit -> member id of the owner node (the units being read now);
    * ``leader``: the member with the lowest sequence number, None without members;
    * ``generation``: the assignment's generation (0 before the first).
    """

    group: str
    buckets: int
    partitions: tuple[str, ...]
    members: dict[str, dict[str, Any]] = field(default_factory=dict)
    assignment: dict[str, tuple[Unit, ...]] = field(default_factory=dict)
    owners: dict[Unit, str] = field(default_factory=dict)
    leader: str | None = None
    generation: int = 0

    @property
    def units(self) -> tuple[Unit, ...]:
        """Every unit of the group, sorted."""
        return Unit.all_of(self.partitions, self.buckets)


async def read_group(session: ZkSession, group: str) -> GroupState:
    """Read group ``group`` (see the module docstring)."""
    meta_node, members_node = meta_path(group), group_members_path(group)
    assignment_node, owners_node = assignment_path(group), owners_path(group)
    timeout = session.op_timeout_s

    def run(zk: Any) -> tuple[bytes, list[tuple[str, bytes]], bytes, list[tuple[str, bytes]]]:
        meta_answer = zk.get_async(meta_node)
        assignment_answer = zk.get_async(assignment_node)
        members_answer = zk.get_children_async(members_node)
        owners_answer = zk.get_children_async(owners_node)
        try:
            meta = meta_answer.get(timeout=timeout)[0]
        except NoNodeError:
            raise ConfigError(f"there is no consumer group {group} in ZooKeeper") from None
        try:
            assignment = assignment_answer.get(timeout=timeout)[0]
        except NoNodeError:
            assignment = b""
        members = _children(zk, members_node, members_answer, timeout)
        return meta, members, assignment, _children(zk, owners_node, owners_answer, timeout)

    answer = await mapped(f"reading {group_root(group)}", session.call(run))
    meta_data, member_nodes, assignment_data, owner_nodes = answer
    meta = decode_meta(meta_data, meta_node)
    members: dict[str, dict[str, Any]] = {}
    for name, data in sorted(member_nodes, key=lambda item: (member_seq(item[0]), item[0])):
        if member_seq(name) < 0:
            continue
        try:
            members[name] = decode_member_record(data, f"{members_node}/{name}")
        except CoordinationError as exc:
            members[name] = {"error": str(exc)}
    try:
        assignment = decode_assignment(assignment_data, assignment_node)
    except CoordinationError as exc:
        log.warning("group %s: %s", group, exc)
        assignment = decode_assignment(b"", assignment_node)
    owners: dict[Unit, str] = {}
    for name, data in owner_nodes:
        try:
            unit = Unit.parse(name)
        except ChangebusError:
            continue
        try:
            owners[unit] = decode_owner(data, f"{owners_node}/{name}")
        except CoordinationError:
            owners[unit] = ""
    return GroupState(
        group=group,
        buckets=meta.buckets,
        partitions=meta.partitions,
        members=members,
        assignment=dict(assignment.members),
        owners=dict(sorted(owners.items())),
        leader=next(iter(members), None),
        generation=assignment.generation,
    )


def _children(zk: Any, parent: str, answer: Any, timeout: float) -> list[tuple[str, bytes]]:
    """(name, data) of ``parent``'s children (pipelined; vanished ones left out)."""
    try:
        names = answer.get(timeout=timeout)
    except NoNodeError:
        return []
    pending = [(name, zk.get_async(f"{parent}/{name}")) for name in names]
    found = []
    for name, data_answer in pending:
        try:
            found.append((name, data_answer.get(timeout=timeout)[0]))
        except NoNodeError:
            continue
    return found
