"""Consumer-group work units and the contract of their checkpoint stores.

A consumer group splits each physical partition it reads into ``buckets``
key buckets (``key_hash % buckets``, the relay's mod filter). One
(partition, bucket) pair is a :class:`Unit`: the smallest piece of work a
member owns, with its own checkpoint. The text form is
``<partition>.<bucket>`` (for example ``orders.17``); it is a valid
checkpoint entry name and a valid znode name.

A :class:`UnitStore` keeps one checkpoint per unit of a group and *fences*
it: :meth:`UnitStore.claim` starts a new ownership of a unit (it raises the
unit's generation and returns a token), and :meth:`UnitStore.commit` writes a
checkpoint only while the token is still the newest one. A member that lost
a unit (a zombie paused past its ZooKeeper session, a member whose unit was
given to another) thus cannot overwrite the new owner's checkpoint: its
commit comes back in :attr:`CommitResult.fenced`.

Claims are fenced too. A claim carries a *fence*: a number that grows with
every ownership of the unit (a group member passes its ZooKeeper owner
node's creation zxid, which is larger for each later owner node of the
unit). A store keeps the highest fence it has seen per unit and refuses a
claim with a lower one (:class:`~changebus.schemas.FencedError`). So a
member that paused between taking the unit's owner node and claiming the
unit, and whose session expired meanwhile, cannot claim after the unit's
next owner did: its late claim would otherwise fence the rightful owner's
commits.

Implementations: ``changebus.cluster.ZkUnitStore`` (the default, a znode per
unit, the token is the znode version), ``changebus.client.FileUnitStore``,
``changebus.client.PostgresUnitStore`` and the replicas
(``SqliteReplica``/``PostgresReplica``, which write the unit checkpoints in
the transaction that applies the rows).

Thread-safety: the value classes are immutable; a store is used from one
event loop.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol, runtime_checkable

from ._checkpoint import PartitionCheckpoint
from .errors import ConfigError

__all__ = [
    "MAX_BUCKETS",
    "CommitResult",
    "StoredUnit",
    "Unit",
    "UnitClaim",
    "UnitCommit",
    "UnitStore",
    "check_group_name",
]

#: the largest bucket count a group may use (the relay's mod filter allows 65,536)
MAX_BUCKETS: Final = 4096

_NAME_RE: Final = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def check_group_name(name: str) -> str:
    """``name`` when it is a valid group name (letters, digits, ``_.-``, 1..128), else ConfigError."""
    if not _NAME_RE.fullmatch(name) or name in (".", ".."):
        raise ConfigError(f"group: {name!r} is not a valid group name ([A-Za-z0-9_.-], 1..128)")
    return name


@dataclass(frozen=True, order=True, slots=True)
class Unit:
    """One work unit of a consumer group: a physical partition and a key bucket."""

    partition: str
    bucket: int

    def __post_init__(self) -> None:
        if not _NAME_RE.fullmatch(self.partition):
            raise ConfigError(f"unit: {self.partition!r} is not a partition name")
        if not 0 <= self.bucket < MAX_BUCKETS:
            raise ConfigError(f"unit: bucket {self.bucket} is out of 0..{MAX_BUCKETS - 1}")

    def __str__(self) -> str:
        return f"{self.partition}.{self.bucket}"

    @classmethod
    def parse(cls, text: str) -> Unit:
        """The unit of text ``<partition>.<bucket>`` (ConfigError when malformed)."""
        partition, dot, bucket = text.rpartition(".")
        if not dot or not (bucket.isascii() and bucket.isdigit()) or len(bucket) > 4:
            raise ConfigError(f"unit: {text[:160]!r} is not <partition>.<bucket>")
        return cls(partition, int(bucket))

    @staticmethod
    def all_of(partitions: Sequence[str], buckets: int) -> tuple[Unit, ...]:
        """Every unit of a group reading ``partitions`` with ``buckets`` buckets, sorted."""
        return tuple(sorted(Unit(p, b) for p in partitions for b in range(buckets)))


@dataclass(frozen=True, slots=True)
class UnitClaim:
    """A new ownership of ``unit``: where to start and the token that fences it.

    ``checkpoint`` is None when nothing was stored yet (the consumer then
    starts as configured by ``start``). ``token`` is opaque to the consumer:
    it hands it back with each commit. ``generation`` counts the claims of
    the unit (for status pages and logs).
    """

    unit: Unit
    checkpoint: PartitionCheckpoint | None
    token: int
    generation: int


@dataclass(frozen=True, slots=True)
class UnitCommit:
    """One checkpoint write: ``unit`` is after ``checkpoint``, fenced by ``token``."""

    unit: Unit
    checkpoint: PartitionCheckpoint
    token: int


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What :meth:`UnitStore.commit` did: new tokens of the written units, the refused ones."""

    tokens: Mapping[Unit, int] = field(default_factory=dict)
    fenced: frozenset[Unit] = frozenset()


@dataclass(frozen=True, slots=True)
class StoredUnit:
    """A unit's stored state, as status pages show it.

    ``checkpoint.timestamp_ns`` is the source commit time of the window the
    checkpoint is after (lag in seconds); ``owner`` the member that claimed
    it last; ``updated_ns`` the wall-clock time of the last write.
    """

    unit: Unit
    checkpoint: PartitionCheckpoint | None
    owner: str
    generation: int
    updated_ns: int = 0
    #: the highest claim fence seen (-1: none; module docstring)
    fence: int = -1


@runtime_checkable
class UnitStore(Protocol):
    """Fenced checkpoints of a consumer group's units (module docstring)."""

    async def claim(self, group: str, unit: Unit, owner: str, fence: int = -1) -> UnitClaim:
        """Start a new ownership of ``unit`` by ``owner``: raise its generation, return the claim.

        Any token handed out before for this unit is refused from now on.
        ``fence`` (-1: none) below the highest fence the store has seen for
        the unit: :class:`~changebus.schemas.FencedError`, nothing written.
        """
        ...

    async def commit(self, group: str, commits: Sequence[UnitCommit]) -> CommitResult:
        """Write each checkpoint whose token is still the newest; report the others as fenced.

        A store error (the database or ZooKeeper unreachable) raises a
        retriable :class:`~changebus.schemas.ChangebusError`; nothing is
        then known to be written.
        """
        ...

    async def read(self, group: str) -> dict[Unit, StoredUnit]:
        """Every stored unit of ``group`` (status pages)."""
        ...

    async def close(self) -> None:
        """Release connections (the store is not used afterwards)."""
        ...
