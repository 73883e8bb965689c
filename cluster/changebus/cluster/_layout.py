"""The ZooKeeper layout of a changebus cluster, and the JSON its znodes hold.

Every znode of cluster ``<name>`` lives under ``/changebus/<name>/``::

    /changebus/<name>/
      members/                       persistent
        <member_id>                  EPHEMERAL, JSON MemberInfo:
                                       {"kind": "relay" | "bootstrap", "url": "...",
                                        "partitions": {"<p>": {"role": "leader" | "follower",
                                                               "epoch": 3,
                                                               "min_scn": 10, "max_scn": 99}}}
      partitions/                    persistent
        <p>/                         persistent, one per physical partition
          election/                  persistent
            c-0000000007             EPHEMERAL_SEQUENTIAL, JSON {"member_id": ..., "url": ...}
          epoch                      persistent, JSON EpochRecord:
                                       {"epoch": 3, "member_id": "r2", "url": "..."}

Invariants:

* A member's node exists exactly while its ZooKeeper session lives; its
  payload is what the member last published (throttled), so SCNs in it lag.
* The candidates of ``election/`` are ordered by their sequence number; the
  lowest one is next in line. A candidate becomes leader only by raising
  ``epoch`` in one ZooKeeper transaction that also checks that its own
  candidate node still exists, with a compare-and-set on the epoch node's
  version. So epochs strictly increase, each epoch has exactly one holder,
  and the holder's candidate node was alive when it took the epoch.
* The leader of a partition is the member named in ``epoch`` while that
  member's candidate node is still in ``election/``; otherwise the
  partition is between leaders. ``epoch`` is never deleted and never goes
  down; ``0`` (no holder) is its initial value.
* Windows and source acknowledgements are fenced by the epoch: a leader
  whose epoch is no longer the one in ZooKeeper must not act as leader
  (:class:`~changebus.cluster.Leadership`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from ._errors import CoordinationError

__all__ = [
    "CANDIDATE_PREFIX",
    "EpochRecord",
    "MemberInfo",
    "PartitionState",
    "candidate_seq",
    "cluster_root",
    "decode_candidate",
    "decode_epoch",
    "decode_member",
    "election_path",
    "encode_candidate",
    "encode_epoch",
    "encode_member",
    "epoch_path",
    "member_path",
    "members_path",
    "partition_path",
    "partitions_path",
]

#: the name of an election candidate before its 10-digit sequence number
CANDIDATE_PREFIX: Final = "c-"

Role = Literal["leader", "follower"]
Kind = Literal["relay", "bootstrap"]


def cluster_root(cluster: str) -> str:
    """``/changebus/<cluster>``."""
    return f"/changebus/{cluster}"


def members_path(cluster: str) -> str:
    """``/changebus/<cluster>/members``."""
    return f"{cluster_root(cluster)}/members"


def member_path(cluster: str, member_id: str) -> str:
    """``/changebus/<cluster>/members/<member_id>`` (ephemeral)."""
    return f"{members_path(cluster)}/{member_id}"


def partitions_path(cluster: str) -> str:
    """``/changebus/<cluster>/partitions``."""
    return f"{cluster_root(cluster)}/partitions"


def partition_path(cluster: str, partition: str) -> str:
    """``/changebus/<cluster>/partitions/<partition>``."""
    if not partition or "/" in partition or partition in (".", ".."):
        raise ValueError(f"{partition!r} is not a partition name")
    return f"{partitions_path(cluster)}/{partition}"


def election_path(cluster: str, partition: str) -> str:
    """``.../partitions/<partition>/election`` (candidates: ephemeral sequential)."""
    return f"{partition_path(cluster, partition)}/election"


def epoch_path(cluster: str, partition: str) -> str:
    """``.../partitions/<partition>/epoch`` (persistent :class:`EpochRecord`)."""
    return f"{partition_path(cluster, partition)}/epoch"


def candidate_seq(name: str) -> int:
    """The sequence number of a candidate node name (``c-0000000007`` -> 7); -1 if foreign."""
    if not name.startswith(CANDIDATE_PREFIX):
        return -1
    digits = name[len(CANDIDATE_PREFIX) :]
    return int(digits) if digits.isdigit() else -1


@dataclass(frozen=True, slots=True)
class PartitionState:
    """One partition as a member reports it: its role, the epoch it follows or
    leads, and the SCN range its buffer holds (0, 0 when empty)."""

    role: Role
    epoch: int = 0
    min_scn: int = 0
    max_scn: int = 0

    def to_json(self) -> dict[str, Any]:
        """The JSON form stored in a member node."""
        return {
            "role": self.role,
            "epoch": self.epoch,
            "min_scn": self.min_scn,
            "max_scn": self.max_scn,
        }


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """What a member publishes in its ephemeral node ``members/<member_id>``."""

    member_id: str
    kind: Kind
    url: str
    partitions: dict[str, PartitionState] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EpochRecord:
    """The content of ``partitions/<p>/epoch``: the newest epoch and who took it."""

    epoch: int
    member_id: str = ""
    url: str = ""


def encode_member(info: MemberInfo) -> bytes:
    """The JSON bytes of a member node (``member_id`` is the node's name, not stored)."""
    body = {
        "kind": info.kind,
        "url": info.url,
        "partitions": {p: s.to_json() for p, s in sorted(info.partitions.items())},
    }
    return json.dumps(body, separators=(",", ":")).encode()


def _int(value: Any, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise CoordinationError(f"{what}: {value!r} is not a non-negative integer", retriable=False)


def decode_member(member_id: str, data: bytes) -> MemberInfo:
    """Parse a member node; raises a non-retriable :class:`CoordinationError` if malformed."""
    try:
        body = json.loads(data)
        kind = body["kind"]
        if kind not in ("relay", "bootstrap"):
            raise ValueError(f"kind {kind!r}")
        url = str(body.get("url", ""))
        parts: dict[str, PartitionState] = {}
        for name, p in dict(body.get("partitions") or {}).items():
            role = p.get("role")
            if role not in ("leader", "follower"):
                raise ValueError(f"role {role!r}")
            parts[str(name)] = PartitionState(
                role=role,
                epoch=_int(p.get("epoch", 0), "epoch"),
                min_scn=_int(p.get("min_scn", 0), "min_scn"),
                max_scn=_int(p.get("max_scn", 0), "max_scn"),
            )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CoordinationError(
            f"member {member_id}: malformed node ({exc})", retriable=False
        ) from None
    return MemberInfo(member_id=member_id, kind=kind, url=url, partitions=parts)


def encode_epoch(record: EpochRecord) -> bytes:
    """The JSON bytes of an epoch node."""
    body = {"epoch": record.epoch, "member_id": record.member_id, "url": record.url}
    return json.dumps(body, separators=(",", ":")).encode()


def decode_epoch(data: bytes | None) -> EpochRecord:
    """Parse an epoch node (empty or missing: epoch 0, no holder)."""
    if not data:
        return EpochRecord(0)
    try:
        body = json.loads(data)
        if isinstance(body, int):
            return EpochRecord(_int(body, "epoch"))
        return EpochRecord(
            _int(body["epoch"], "epoch"), str(body.get("member_id", "")), str(body.get("url", ""))
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise CoordinationError(f"malformed epoch node ({exc})", retriable=False) from None


def encode_candidate(member_id: str, url: str, candidacy: str = "") -> bytes:
    """The JSON bytes of an election candidate node.

    ``candidacy``: a token unique to the election object that creates the node, so
    its nodes are told from those of a later election of the same member in the same
    session (readers ignore it; older versions wrote none).
    """
    body = {"member_id": member_id, "url": url}
    if candidacy:
        body["candidacy"] = candidacy
    return json.dumps(body, separators=(",", ":")).encode()


def decode_candidate(data: bytes) -> tuple[str, str]:
    """(member_id, url) of a candidate node; ("", "") if unreadable."""
    try:
        body = json.loads(data)
        return str(body["member_id"]), str(body.get("url", ""))
    except (ValueError, KeyError, TypeError):
        return "", ""
