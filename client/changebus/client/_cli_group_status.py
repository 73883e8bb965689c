"""What ``changebus group status`` shows: a consumer group's members, units, checkpoints and lag.

:func:`build_report` is pure: it joins three reads into one immutable
:class:`GroupReport`:

* the group's tree in ZooKeeper (``changebus.cluster.GroupState``: meta,
  live members, the leader's assignment, the owner nodes);
* the unit checkpoints of its store (``UnitStore.read``: checkpoint, owner of
  the last claim, generation);
* the relay head of each partition (:class:`Head`, from the relays'
  ``/v1/status``, see :func:`relay_heads`).

Lag of a unit: ``lag_scn`` is the head's SCN minus the SCN of the last
complete window of the unit's checkpoint (0 when at or past the head);
``lag_s`` is the head window's commit time minus the checkpoint's
``timestamp_ns`` in seconds (0 when caught up). Either is None when it
cannot be known (no checkpoint yet, no relay answered, a checkpoint of a
bootstrap without an online position).

A unit's ``state`` says how it stands: ``ok`` (owned by the member the
assignment gives it to), ``moving`` (owned by one member, assigned to
another: the owner is releasing it), ``starting`` (assigned, not owned yet),
``unassigned`` (no assignment names it: no live member, or the leader has
not written one yet) or ``orphaned`` (owned by a member the assignment does
not name for it and no one else is assigned).

:func:`render_text` and :meth:`GroupReport.to_json` are the two output forms.
Nothing here does I/O but :func:`relay_heads` (aiohttp, on the event loop).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from changebus.schemas import PartitionCheckpoint, StoredUnit, Unit

from ._http import safe_url
from ._info import RelayInfo, RelayQueries

__all__ = [
    "GroupReport",
    "Head",
    "MemberRow",
    "UnitRow",
    "build_report",
    "relay_heads",
    "render_text",
]

log = logging.getLogger("changebus.client.group_status")


@dataclass(frozen=True, slots=True)
class Head:
    """The newest window a relay holds of one partition: its SCN and commit time (ns, 0: unknown)."""

    scn: int
    timestamp_ns: int


@dataclass(frozen=True, slots=True)
class MemberRow:
    """One live member: its id (the znode name), what it registered, its unit counts."""

    member_id: str
    name: str
    host: str
    pid: int | None
    started_ns: int
    owned: int
    assigned: int
    leader: bool


@dataclass(frozen=True, slots=True)
class UnitRow:
    """One unit: who owns it and who should, its stored checkpoint, its lag (module docstring)."""

    unit: Unit
    owner: str | None
    assigned: str | None
    state: str
    generation: int | None
    checkpoint: PartitionCheckpoint | None
    updated_ns: int
    lag_scn: int | None
    lag_s: float | None

    @property
    def checkpoint_scn(self) -> int | None:
        """The SCN of the last complete window the checkpoint is after (None: no position)."""
        return completed_scn(self.checkpoint)


@dataclass(frozen=True, slots=True)
class GroupReport:
    """One look at a group: members, units and relay heads (immutable, plain data)."""

    group: str
    buckets: int
    partitions: tuple[str, ...]
    leader: str | None
    #: the leader's assignment generation (0: none written yet)
    generation: int
    members: tuple[MemberRow, ...]
    units: tuple[UnitRow, ...]
    heads: Mapping[str, Head]
    #: where the heads came from ("" when no relay was asked), without credentials
    relays: str

    def to_json(self) -> dict[str, Any]:
        """The report as one JSON object (``--json``)."""
        return {
            "group": self.group,
            "buckets": self.buckets,
            "partitions": list(self.partitions),
            "leader": self.leader,
            "generation": self.generation,
            "members": [
                {
                    "id": m.member_id,
                    "name": m.name,
                    "host": m.host,
                    "pid": m.pid,
                    "started_ns": m.started_ns,
                    "units": m.owned,
                    "assigned": m.assigned,
                    "leader": m.leader,
                }
                for m in self.members
            ],
            "units": [
                {
                    "unit": str(u.unit),
                    "owner": u.owner,
                    "assigned": u.assigned,
                    "state": u.state,
                    "generation": u.generation,
                    "checkpoint_scn": u.checkpoint_scn,
                    "checkpoint_timestamp_ns": u.checkpoint.timestamp_ns if u.checkpoint else None,
                    "mode": u.checkpoint.mode.value if u.checkpoint else None,
                    "updated_ns": u.updated_ns or None,
                    "lag_scn": u.lag_scn,
                    "lag_s": None if u.lag_s is None else round(u.lag_s, 3),
                }
                for u in self.units
            ],
            "heads": {
                p: {"scn": h.scn, "timestamp_ns": h.timestamp_ns} for p, h in self.heads.items()
            },
            "relays": self.relays or None,
        }


def completed_scn(checkpoint: PartitionCheckpoint | None) -> int | None:
    """The SCN of the last complete window of ``checkpoint`` (None: it has no online position)."""
    if checkpoint is None:
        return None
    scn = checkpoint.window_scn if checkpoint.is_window_complete else checkpoint.prev_scn
    return scn if scn >= 0 else None


def unit_lag(
    checkpoint: PartitionCheckpoint | None, head: Head | None
) -> tuple[int | None, float | None]:
    """``(lag_scn, lag_s)`` of a unit at ``checkpoint`` behind ``head`` (module docstring)."""
    done = completed_scn(checkpoint)
    if checkpoint is None or done is None or head is None:
        return None, None
    lag_scn = max(0, head.scn - done)
    if lag_scn == 0:
        return 0, 0.0
    if head.timestamp_ns <= 0 or checkpoint.timestamp_ns <= 0:
        return lag_scn, None
    return lag_scn, max(0.0, (head.timestamp_ns - checkpoint.timestamp_ns) / 1e9)


def _state(owner: str | None, assigned: str | None, assigned_any: bool) -> str:
    if owner is not None and owner == assigned:
        return "ok"
    if owner is not None and assigned is not None:
        return "moving"
    if owner is None and assigned is not None:
        return "starting"
    if owner is not None:
        return "orphaned" if assigned_any else "unassigned"
    return "unassigned"


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def build_report(
    *,
    group: str,
    buckets: int,
    partitions: Sequence[str],
    leader: str | None,
    generation: int = 0,
    members: Mapping[str, Mapping[str, Any]],
    assignment: Mapping[str, Sequence[Unit]],
    owners: Mapping[Unit, str],
    stored: Mapping[Unit, StoredUnit],
    heads: Mapping[str, Head],
    relays: str = "",
) -> GroupReport:
    """Join the reads (module docstring) into a :class:`GroupReport`, units sorted."""
    assigned_to: dict[Unit, str] = {}
    for member_id, units in assignment.items():
        if member_id in members:  # an assignment naming a departed member gives it nothing
            for unit in units:
                assigned_to[unit] = member_id
    owned_by: dict[str, int] = {}
    for member_id in owners.values():
        owned_by[member_id] = owned_by.get(member_id, 0) + 1
    member_rows = tuple(
        MemberRow(
            member_id=member_id,
            name=str(info.get("name", "")),
            host=str(info.get("host", "")),
            pid=_int_or_none(info.get("pid")),
            started_ns=_int_or_none(info.get("started_ns")) or 0,
            owned=owned_by.get(member_id, 0),
            assigned=sum(1 for m in assigned_to.values() if m == member_id),
            leader=member_id == leader,
        )
        for member_id, info in sorted(members.items())
    )
    rows: list[UnitRow] = []
    assigned_any = bool(assigned_to)
    for unit in Unit.all_of(tuple(partitions), buckets):
        entry = stored.get(unit)
        checkpoint = entry.checkpoint if entry is not None else None
        lag_scn, lag_s = unit_lag(checkpoint, heads.get(unit.partition))
        owner = owners.get(unit)
        assigned = assigned_to.get(unit)
        rows.append(
            UnitRow(
                unit=unit,
                owner=owner,
                assigned=assigned,
                state=_state(owner, assigned, assigned_any),
                generation=entry.generation if entry is not None else None,
                checkpoint=checkpoint,
                updated_ns=entry.updated_ns if entry is not None else 0,
                lag_scn=lag_scn,
                lag_s=lag_s,
            )
        )
    return GroupReport(
        group=group,
        buckets=buckets,
        partitions=tuple(partitions),
        leader=leader,
        generation=generation,
        members=member_rows,
        units=tuple(rows),
        heads=dict(heads),
        relays=relays,
    )


async def relay_heads(
    session: aiohttp.ClientSession, urls: Sequence[str], partitions: Sequence[str]
) -> dict[str, Head]:
    """The newest window of each of ``partitions`` over the relays at ``urls`` that answer.

    Each relay's ``/v1/status`` is asked once; a partition's head is the
    highest SCN any relay holds (a follower may lag its leader). Relays that
    fail retriably are skipped (logged at debug level); a partition no relay
    serves has no head.
    """
    if not urls:
        return {}
    wanted = set(partitions)
    heads: dict[str, Head] = {}
    async for status in RelayQueries(session, tuple(urls)).answers(RelayInfo.status):
        for name, p in status.items():
            if name not in wanted:
                continue
            scn = max(p.max_scn, p.prev_scn)
            if scn < 0:
                continue
            ts = p.newest_timestamp_ns if p.max_scn >= 0 else 0
            if name not in heads or scn > heads[name].scn:
                heads[name] = Head(scn, ts)
    if not heads:
        log.debug("no relay of %s answered", ", ".join(safe_url(u) for u in urls))
    return heads


def _cell(value: object) -> str:
    return "-" if value is None or value == "" else str(value)


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [head, *rows]
    ]


def _when(ns: int) -> str:
    if ns <= 0:
        return "-"
    t = datetime.datetime.fromtimestamp(ns / 1e9, tz=datetime.UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def render_text(report: GroupReport) -> str:
    """The report as one screen of aligned text (members, then one line per unit)."""
    n_units = len(report.units)
    lines = [
        f"group {report.group}: {len(report.partitions)} partition(s) x {report.buckets} "
        f"bucket(s) = {n_units} unit(s); {len(report.members)} member(s); "
        f"leader {report.leader or '-'}; assignment generation {report.generation}"
    ]
    if report.relays:
        heads = ", ".join(
            f"{p} {h.scn} ({_when(h.timestamp_ns)})" if (h := report.heads.get(p)) else f"{p} -"
            for p in report.partitions
        )
        lines.append(f"relay heads ({report.relays}): {heads}")
    else:
        lines.append("relay heads: not asked (give --relay or --cluster for the lag)")
    lines.append("")
    if report.members:
        lines += _table(
            ("MEMBER", "NAME", "HOST", "PID", "UNITS", "ASSIGNED", "LEADER"),
            [
                (
                    m.member_id,
                    _cell(m.name),
                    _cell(m.host),
                    _cell(m.pid),
                    str(m.owned),
                    str(m.assigned),
                    "yes" if m.leader else "",
                )
                for m in report.members
            ],
        )
    else:
        lines.append("no live member")
    lines.append("")
    lines += _table(
        ("UNIT", "OWNER", "STATE", "GENERATION", "CHECKPOINT_SCN", "LAG_SCN", "LAG_S"),
        [
            (
                str(u.unit),
                _cell(u.owner),
                u.state if u.state != "moving" else f"moving to {u.assigned}",
                _cell(u.generation),
                _cell(u.checkpoint_scn),
                _cell(u.lag_scn),
                "-" if u.lag_s is None else f"{u.lag_s:.1f}",
            )
            for u in report.units
        ],
    )
    return "\n".join(lines)
