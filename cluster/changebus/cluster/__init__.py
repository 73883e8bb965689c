"""changebus.cluster: coordination of relays and bootstrap servers through ZooKeeper.

The pieces, each on one :class:`ZkSession` (an asyncio wrapper over kazoo):

* :class:`ClusterConfig`: the ``[cluster]`` config table;
* :class:`PartitionElection`: this member's candidacy for one partition;
  when it wins it raises the partition's epoch and holds a
  :class:`Leadership`, whose ``valid()`` is the lease to check before every
  source acknowledgement and window publication (fencing);
* :func:`current_leader`: who leads a partition now;
* :class:`Registry`: this member's ephemeral node (kind, URL, partitions with
  role, epoch and SCN range), re-created by itself after a session loss;
* :class:`RoutingTable`: every member and leader, kept current by watches,
  as immutable :class:`RoutingSnapshot` values.

Consumer groups (their tree ``/changebus/groups/<group>/`` does not depend on
the cluster name; layout in ``changebus.cluster._group_layout``):

* :class:`GroupMember`: one member of a consumer group: registration, the
  target units the group's leader assigns it, owner nodes of the units it
  reads (:meth:`GroupMember.acquire` / :meth:`GroupMember.release`) and
  its lease (:meth:`GroupMember.lease_valid`);
* :func:`assign`: the sticky assignment (even quotas, fewest moves);
* :class:`ZkUnitStore`: the fenced unit checkpoints
  (:class:`changebus.schemas.UnitStore`) in ZooKeeper;
* :func:`read_group`: a :class:`GroupState` snapshot for status pages.

The ZooKeeper layout (``/changebus/<cluster>/members/<id>``,
``partitions/<p>/election/c-<seq>``, ``partitions/<p>/epoch``) and its
invariants are documented in ``changebus.cluster._layout``; the election
in ``changebus.cluster._election``, the lease in ``changebus.cluster._leadership``.
"""

from __future__ import annotations

from ._assign import assign as assign
from ._config import (
    ClusterConfig as ClusterConfig,
    warn_loopback_advertised as warn_loopback_advertised,
)
from ._election import (
    LeaderInfo as LeaderInfo,
    PartitionElection as PartitionElection,
    current_leader as current_leader,
)
from ._errors import CoordinationError as CoordinationError
from ._group import GroupMember as GroupMember
from ._group_layout import GROUPS_ROOT as GROUPS_ROOT, group_root as group_root
from ._group_state import GroupState as GroupState, read_group as read_group
from ._group_store import ZkUnitStore as ZkUnitStore
from ._layout import (
    EpochRecord as EpochRecord,
    MemberInfo as MemberInfo,
    PartitionState as PartitionState,
    cluster_root as cluster_root,
    election_path as election_path,
    epoch_path as epoch_path,
    member_path as member_path,
)
from ._leadership import Leadership as Leadership
from ._registry import Registry as Registry
from ._routing import RoutingSnapshot as RoutingSnapshot, RoutingTable as RoutingTable
from ._session import (
    SessionState as SessionState,
    StateChange as StateChange,
    ZkSession as ZkSession,
)

__all__ = [
    "GROUPS_ROOT",
    "ClusterConfig",
    "CoordinationError",
    "EpochRecord",
    "GroupMember",
    "GroupState",
    "LeaderInfo",
    "Leadership",
    "MemberInfo",
    "PartitionElection",
    "PartitionState",
    "Registry",
    "RoutingSnapshot",
    "RoutingTable",
    "SessionState",
    "StateChange",
    "ZkSession",
    "ZkUnitStore",
    "assign",
    "cluster_root",
    "current_leader",
    "election_path",
    "epoch_path",
    "group_root",
    "member_path",
    "read_group",
    "warn_loopback_advertised",
]
