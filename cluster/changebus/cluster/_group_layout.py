"""The ZooKeeper layout of consumer groups, and the JSON their znodes hold.

A group's tree does not depend on any cluster name::

    /changebus/groups/<group>/                persistent (created on demand)
      meta                                    persistent, JSON GroupMeta:
                                                {"version": 1, "buckets": 64,
                                                 "partitions": ["orders", ...]}
      members/                                persistent
        m-0000000007                          EPHEMERAL_SEQUENTIAL, JSON MemberRecord:
                                                {"name": ..., "host": ..., "pid": ...,
                                                 "started_ns": ...}
      assignment                              persistent, JSON Assignment:
                                                {"version": 1, "generation": n,
                                                 "leader": "m-...",
                                                 "members": {"m-...": ["orders.0", ...]}}
      owners/                                 persistent
        <partition>.<bucket>                  EPHEMERAL, JSON {"member": "m-..."}
      checkpoints/                            persistent (ZkUnitStore)
        <partition>.<bucket>                  persistent, JSON UnitRecord:
                                                {"checkpoint": {...} | null, "owner": "m-...",
                                                 "generation": g, "updated_ns": t}

Invariants:

* ``meta`` is written once, by the first member; every member's bucket count
  and partition list must equal it (the units, and so every checkpoint, depend
  on them).
* The *member id* is the name of the member's node; the node lives exactly as
  long as the session that created it, so a member that lost its session
  comes back with a new id. Members are ordered by sequence number; the
  lowest is the group's leader.
* ``assignment`` is written only by the leader, in one transaction that also
  checks that the leader's member node still exists (a deposed leader's write
  fails) with a compare-and-set on the node's version.
* An ``owners/<unit>`` node exists while a member reads the unit: a member
  creates it before it claims the unit and deletes it after its last commit,
  and the node dies with its session. At most one member owns a unit.
* ``checkpoints/<unit>``: the znode version is the fencing token (see
  :class:`~changebus.cluster.ZkUnitStore`).

Decoding never raises anything but a non-retriable
:class:`~changebus.cluster.CoordinationError` naming the node.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from changebus.schemas import PartitionCheckpoint, Unit, check_group_name
from changebus.schemas.errors import ChangebusError

from ._errors import CoordinationError

__all__ = [
    "GROUPS_ROOT",
    "LAYOUT_VERSION",
    "MEMBER_PREFIX",
    "Assignment",
    "GroupMeta",
    "UnitRecord",
    "assignment_path",
    "checkpoint_path",
    "checkpoints_path",
    "decode_assignment",
    "decode_member_record",
    "decode_meta",
    "decode_owner",
    "decode_unit_record",
    "encode_assignment",
    "encode_member_record",
    "encode_meta",
    "encode_owner",
    "encode_unit_record",
    "group_members_path",
    "group_root",
    "member_seq",
    "meta_path",
    "owner_path",
    "owners_path",
    "units_text",
]

#: the parent of every group's tree
GROUPS_ROOT: Final = "/changebus/groups"
#: the ``version`` field written in ``meta`` and ``assignment``
LAYOUT_VERSION: Final = 1
#: the name of a member node before its 10-digit sequence number
MEMBER_PREFIX: Final = "m-"


def group_root(group: str) -> str:
    """``/changebus/groups/<group>`` (ConfigError when the name is not a group name)."""
    return f"{GROUPS_ROOT}/{check_group_name(group)}"


def meta_path(group: str) -> str:
    """``.../<group>/meta``."""
    return f"{group_root(group)}/meta"


def group_members_path(group: str) -> str:
    """``.../<group>/members`` (member nodes: ephemeral sequential)."""
    return f"{group_root(group)}/members"


def assignment_path(group: str) -> str:
    """``.../<group>/assignment``."""
    return f"{group_root(group)}/assignment"


def owners_path(group: str) -> str:
    """``.../<group>/owners``."""
    return f"{group_root(group)}/owners"


def owner_path(group: str, unit: Unit) -> str:
    """``.../<group>/owners/<unit>`` (ephemeral)."""
    return f"{owners_path(group)}/{unit}"


def checkpoints_path(group: str) -> str:
    """``.../<group>/checkpoints``."""
    return f"{group_root(group)}/checkpoints"


def checkpoint_path(group: str, unit: Unit) -> str:
    """``.../<group>/checkpoints/<unit>``."""
    return f"{checkpoints_path(group)}/{unit}"


def member_seq(name: str) -> int:
    """The sequence number of a member node name (``m-0000000007`` -> 7); -1 if foreign."""
    if not name.startswith(MEMBER_PREFIX):
        return -1
    digits = name[len(MEMBER_PREFIX) :]
    return int(digits) if digits.isdigit() and digits.isascii() else -1


def _dump(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _load(data: bytes | None, node: str) -> dict[str, Any]:
    try:
        body = json.loads(data or b"")
    except (ValueError, RecursionError) as exc:
        raise _bad(node, f"not JSON ({str(exc)[:120]})") from None
    if not isinstance(body, dict):
        raise _bad(node, "not a JSON object")
    return body


def _bad(node: str, why: str) -> CoordinationError:
    return CoordinationError(f"ZooKeeper node {node}: {why}", retriable=False)


def _count(body: Mapping[str, Any], key: str, node: str) -> int:
    value = body.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise _bad(node, f"{key} {str(value)[:40]!r} is not a non-negative integer")


def _units(values: object, node: str) -> tuple[Unit, ...]:
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise _bad(node, "a unit list is not a list of strings")
    try:
        return tuple(sorted(Unit.parse(v) for v in values))
    except ChangebusError as exc:
        raise _bad(node, str(exc)) from None


# -- meta ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GroupMeta:
    """What fixes a group's units: the bucket count and the partitions (sorted)."""

    buckets: int
    partitions: tuple[str, ...]


def encode_meta(meta: GroupMeta) -> bytes:
    """The JSON bytes of ``meta``."""
    return _dump(
        {"version": LAYOUT_VERSION, "buckets": meta.buckets, "partitions": list(meta.partitions)}
    )


def decode_meta(data: bytes | None, node: str) -> GroupMeta:
    """Parse ``meta`` (CoordinationError naming ``node`` if malformed)."""
    body = _load(data, node)
    buckets = _count(body, "buckets", node)
    partitions = body.get("partitions")
    if not isinstance(partitions, list) or not all(isinstance(p, str) for p in partitions):
        raise _bad(node, "partitions is not a list of strings")
    return GroupMeta(buckets, tuple(sorted(partitions)))


# -- members ---------------------------------------------------------------------


def encode_member_record(name: str, host: str, pid: int, started_ns: int) -> bytes:
    """The JSON bytes of a member node."""
    return _dump({"name": name, "host": host, "pid": pid, "started_ns": started_ns})


def decode_member_record(data: bytes | None, node: str) -> dict[str, Any]:
    """A member node's fields (``name``, ``host``, ``pid``, ``started_ns``)."""
    body = _load(data, node)
    return {
        "name": str(body.get("name", ""))[:256],
        "host": str(body.get("host", ""))[:256],
        "pid": _count(body, "pid", node) if "pid" in body else 0,
        "started_ns": _count(body, "started_ns", node) if "started_ns" in body else 0,
    }


# -- assignment ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Assignment:
    """The leader's assignment: ``members`` maps member ids to their sorted units.

    ``generation`` counts the leaders' writes; ``leader`` is the member that
    wrote it.
    """

    generation: int = 0
    leader: str = ""
    members: Mapping[str, tuple[Unit, ...]] = field(default_factory=dict)

    def units_of(self, member_id: str) -> frozenset[Unit]:
        """The units assigned to ``member_id`` (empty when it is not named)."""
        return frozenset(self.members.get(member_id, ()))


def encode_assignment(assignment: Assignment) -> bytes:
    """The JSON bytes of ``assignment`` (members and units sorted)."""
    return _dump(
        {
            "version": LAYOUT_VERSION,
            "generation": assignment.generation,
            "leader": assignment.leader,
            "members": {
                m: [str(u) for u in sorted(units)]
                for m, units in sorted(assignment.members.items())
            },
        }
    )


def decode_assignment(data: bytes | None, node: str) -> Assignment:
    """Parse ``assignment``; an empty node is the empty assignment of generation 0."""
    if not data:
        return Assignment()
    body = _load(data, node)
    members = body.get("members", {})
    if not isinstance(members, dict):
        raise _bad(node, "members is not an object")
    return Assignment(
        generation=_count(body, "generation", node),
        leader=str(body.get("leader", "")),
        members={str(m): _units(units, node) for m, units in members.items()},
    )


# -- owners ----------------------------------------------------------------------


def encode_owner(member_id: str) -> bytes:
    """The JSON bytes of an owner node."""
    return _dump({"member": member_id})


def decode_owner(data: bytes | None, node: str) -> str:
    """The member id an owner node names."""
    member = _load(data, node).get("member")
    if not isinstance(member, str):
        raise _bad(node, "member is not a string")
    return member


# -- unit checkpoints --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UnitRecord:
    """The content of ``checkpoints/<unit>``."""

    checkpoint: PartitionCheckpoint | None
    owner: str
    generation: int
    updated_ns: int


def encode_unit_record(record: UnitRecord) -> bytes:
    """The JSON bytes of a unit checkpoint node."""
    return _dump(
        {
            "checkpoint": None if record.checkpoint is None else record.checkpoint.to_dict(),
            "owner": record.owner,
            "generation": record.generation,
            "updated_ns": record.updated_ns,
        }
    )


def decode_unit_record(data: bytes | None, node: str) -> UnitRecord:
    """Parse a unit checkpoint node (CoordinationError naming ``node`` if malformed)."""
    body = _load(data, node)
    raw = body.get("checkpoint")
    checkpoint = None
    if raw is not None:
        try:
            checkpoint = PartitionCheckpoint.from_dict(raw, node)
        except ChangebusError as exc:
            raise _bad(node, str(exc)) from None
        except (TypeError, ValueError) as exc:
            raise _bad(node, f"bad checkpoint ({exc})") from None
    owner = body.get("owner", "")
    if not isinstance(owner, str):
        raise _bad(node, "owner is not a string")
    return UnitRecord(
        checkpoint=checkpoint,
        owner=owner,
        generation=_count(body, "generation", node),
        updated_ns=_count(body, "updated_ns", node) if "updated_ns" in body else 0,
    )


def units_text(units: Sequence[Unit]) -> str:
    """A short text of ``units`` for logs (``orders.0 orders.1 ... (+n)``)."""
    ordered = sorted(units)
    head = " ".join(str(u) for u in ordered[:8])
    return head + (f" ... (+{len(ordered) - 8})" if len(ordered) > 8 else "")
