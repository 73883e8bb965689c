"""Planning a read: concrete positions, the ranges and slices Spark's tasks read.

One job, on the driver: :func:`_resolve` turns ``earliest`` / ``latest`` /
an SCN / JSON / a commit time into ``{partition: scn}`` (refusing a start time
older than evicted windows, :func:`_start_time_evicted`);
:func:`_range_partitions` cuts ``(start, end]`` into :class:`ScnRangePartition`
tasks (SCN sub-ranges at the relays' split points, or key slices; one task
for a range read through a bootstrap server, :func:`_needs_bootstrap`).
Used by the stream and batch readers (:mod:`._source`) and the push-down
planner (:mod:`._pushdown`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from typing import Any

from pyspark.sql.datasource import InputPartition

from changebus.schemas import ConfigError

from .._errors import FellOffRelayError
from ._options import AtTime, Position, SourceOptions
from ._read import RangeSpec
from ._relay import PartitionBounds, position_at_time, run_sync, split_points

__all__ = ["ScnRangePartition"]

log = logging.getLogger(__name__)


class ScnRangePartition(InputPartition):
    """One Spark input partition: a :class:`~._read.RangeSpec` (picklable)."""

    def __init__(self, spec: RangeSpec) -> None:
        super().__init__(spec)
        self.spec = spec

    def __repr__(self) -> str:
        s = self.spec
        return f"ScnRangePartition({s.partition}, ({s.since}, {s.until}], {s.key_filter or 'all'})"


def _resolve(
    opts: SourceOptions, position: Position, bounds: dict[str, PartitionBounds], what: str
) -> dict[str, int]:
    """A concrete ``{partition: scn}`` for ``earliest`` / ``latest`` / SCN / JSON / time."""
    out: dict[str, int] = {}
    for name, b in bounds.items():
        if isinstance(position, AtTime):
            ending = what.startswith("ending")
            out[name] = run_sync(position_at_time(opts, b, position.time_ms * 1_000_000))
            if not ending and out[name] == b.prev_scn >= 0 and _lost_since(position, b):
                _start_time_evicted(opts, position, b)
        elif position == "earliest":
            # with a bootstrap server: before everything (a snapshot comes first)
            out[name] = -1 if opts.bootstrap else b.prev_scn
        elif position == "latest":
            out[name] = b.reached
        elif isinstance(position, int):
            out[name] = position
        elif isinstance(position, dict):
            if name not in position:
                raise ConfigError(
                    f"{what}: no SCN for partition {name!r} (have {sorted(position)})"
                )
            out[name] = int(position[name])
        else:  # pragma: no cover - parse_position returns nothing else
            raise ConfigError(f"{what}: bad position {position!r}")
    return out


def _lost_since(position: AtTime, b: PartitionBounds) -> bool:
    """Whether windows committed at or after ``position`` may have been evicted: the
    relay evicted some, and the newest of them was committed then or later (or its
    time is not known)."""
    if not b.evicted:
        return False
    return b.evicted_timestamp_ns <= 0 or b.evicted_timestamp_ns >= position.time_ms * 1_000_000


def _start_time_evicted(opts: SourceOptions, position: AtTime, b: PartitionBounds) -> None:
    """``startingTimestamp`` is at or before the oldest window the relays keep, and they
    evicted older ones: changes committed at or after that time may be among those.
    An error with ``failOnDataLoss`` (the default), else a warning (start at the oldest
    window kept, like Spark's Kafka source). It started there silently (review)."""
    when = (
        f", committed at {b.evicted_timestamp_ns // 1_000_000} ms"
        if b.evicted_timestamp_ns > 0
        else ""
    )
    text = (
        f"startingTimestamp {position.time_ms}: partition {b.name}: every window the relays "
        f"keep was committed at or after it, and they evicted older ones (the newest "
        f"evicted is SCN {b.prev_scn}{when}), so changes committed since that time are gone"
    )
    if not opts.fail_on_data_loss:
        log.warning("%s; starting at the oldest window kept (failOnDataLoss=false)", text)
        return
    raise FellOffRelayError(
        f"{text}: start from an SCN instead (startingScn; 'earliest' with a bootstrap "
        "server reads a snapshot first), or set failOnDataLoss=false to start at the "
        "oldest window kept",
        partition=b.name,
        requested_scn=b.prev_scn,
        oldest_scn=b.min_scn,
        prev_scn=b.prev_scn,
        relay="",
        retriable=False,
    )


def _needs_bootstrap(
    opts: SourceOptions, start: dict[str, Any], bounds: dict[str, PartitionBounds]
) -> set[str]:
    """Partitions whose next range starts before what the relays keep (bootstrap reads it)."""
    if not opts.bootstrap:
        return set()
    return {
        name
        for name, b in bounds.items()
        if name in start and (int(start[name]) < 0 or int(start[name]) < b.prev_scn)
    }


def _range_partitions(
    opts: SourceOptions,
    start: dict[str, Any],
    end: dict[str, Any],
    whole: set[str] | frozenset[str] = frozenset(),
    cuts: Mapping[str, list[int]] | None = None,
) -> list[ScnRangePartition]:
    """Input partitions of ``(start, end]``; a partition in ``whole`` is read by one task.

    ``whole`` names the ranges that go through a bootstrap server: one
    consumer reads the snapshot, the catch-up and the relays up to the end.
    ``cuts`` (``splitBy=scn``) are the relays' split points of a partition's
    range (:func:`_split_points`); a partition without them is cut evenly by
    SCN distance (from an ``earliest`` start, not at all).
    """
    out: list[ScnRangePartition] = []
    slices = opts.slices() if opts.split_by == "key" else [opts.key_filter]
    filters = [str(f) if f else None for f in slices]
    for name, until_raw in sorted(end.items()):
        until = int(until_raw)
        since = int(start.get(name, until))
        if until <= since:
            continue
        if name in whole:
            f = str(opts.key_filter) if opts.key_filter else None
            out.append(ScnRangePartition(RangeSpec(name, since, until, f)))
            continue
        if opts.split_by == "scn":
            given = (cuts or {}).get(name)
            if given is not None:
                points = [since, *(c for c in given if since < c < until), until]
            else:
                n = max(min(opts.num_partitions, until - max(since, 0)) if since >= 0 else 1, 1)
                points = [since + (until - since) * i // n for i in range(n + 1)]
            ranges = [(a, b) for a, b in itertools.pairwise(points) if b > a]
            # (several sub-ranges: none may bootstrap, see RangeSpec.may_bootstrap)
            alone = len(ranges) == 1
            out.extend(
                ScnRangePartition(RangeSpec(name, a, b, filters[0], may_bootstrap=alone))
                for a, b in ranges
            )
        else:
            # (a TRUNCATE passes every key filter: the first slice alone keeps it)
            out.extend(
                ScnRangePartition(RangeSpec(name, since, until, f, truncates=i == 0))
                for i, f in enumerate(filters)
            )
    return out


def _split_points(
    opts: SourceOptions,
    start: dict[str, Any],
    end: dict[str, Any],
    whole: set[str] | frozenset[str] = frozenset(),
) -> dict[str, list[int]]:
    """The relays' split points of the ranges :func:`_range_partitions` cuts by SCN."""
    if opts.split_by != "scn" or opts.num_partitions < 2:
        return {}
    ranges = {
        name: (int(start.get(name, until)), int(until))
        for name, until in end.items()
        if name not in whole and int(start.get(name, until)) < int(until)
    }
    return run_sync(split_points(opts, ranges, opts.num_partitions)) if ranges else {}


def _offsets_key(offsets: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    """``offsets`` in a comparable form (Spark may hand them back as a new dict)."""
    return tuple(sorted((str(k), int(v)) for k, v in offsets.items()))
