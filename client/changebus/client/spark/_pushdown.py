"""Filter push-down for batch reads: SCN ranges, sources and partitions read from the relays.

``spark.read.format("changebus")...where(...)`` hands the reader the query's
conjuncts as :class:`pyspark.sql.datasource.Filter` objects
(:meth:`DataSourceReader.pushFilters`, PySpark >= 4.1). The reader takes those
it can answer exactly from what it asks the relays for, and returns the rest
to Spark, which evaluates them on the rows (so a result never depends on what
was pushed):

* ``_commit_scn`` ``>``, ``>=``, ``<``, ``<=``, ``=``, ``IN``: the window
  range ``(since, until]`` of every physical partition shrinks to the
  filters' bounds; ``=`` / ``IN`` read one sub-range per value (at most
  :data:`MAX_SCN_RANGES` sub-ranges: beyond that neighbouring values share
  one, and the task drops the windows between them);
* ``_source`` ``=`` / ``IN``: the relay is asked for those tables only (the
  ``sources`` option narrowed; a name the relay does not have reads nothing);
* ``_partition`` ``=`` / ``IN``: only those physical partitions are read;
* ``IS NOT NULL`` of the three: always true (the columns are never null).

With a bootstrap server (``bootstrapUrl``) SCN filters stay with Spark: a
snapshot row carries its newest SCN, which may lie outside a range read.

Spark calls ``pushFilters`` only when ``spark.sql.python.filterPushdown.enabled``
is true (false by default in PySpark 4.1-4.3), and then in a planning worker
of its own (``pyspark.sql.worker.data_source_pushdown_filters``). With the
setting off it refuses a reader that implements ``pushFilters`` at all, so
:func:`pushdown_planning` tells :meth:`ChangebusDataSource.reader` which of
the two readers to make: :class:`PushdownBatchReader` only in that worker.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from types import FrameType
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (
    EqualNullSafe,
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    InputPartition,
    IsNotNull,
    LessThan,
    LessThanOrEqual,
)

from ._plan import ScnRangePartition, _needs_bootstrap, _range_partitions, _resolve, _split_points
from ._read import RangeSpec
from ._relay import partition_bounds, run_sync
from ._source import ChangebusBatchReader

__all__ = ["MAX_SCN_RANGES", "PushdownBatchReader", "Pushed", "pushdown_planning", "split_filters"]

#: at most this many SCN sub-ranges per physical partition for ``=`` / ``IN`` filters
MAX_SCN_RANGES = 16

_SCN, _SOURCE, _PARTITION = "_commit_scn", "_source", "_partition"
_WORKER_FILE = "data_source_pushdown_filters.py"


def pushdown_planning() -> bool:
    """Whether this call runs inside Spark's filter push-down planning worker."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_WORKER_FILE):
            return True
        frame = frame.f_back
    return False


@dataclass(frozen=True, slots=True)
class Pushed:
    """What the pushed filters allow (None: no constraint of that kind).

    ``after``: only windows with SCN > after; ``upto``: only SCN <= upto;
    ``scns``: only these SCNs; ``sources`` / ``partitions``: only these names.
    """

    after: int | None = None
    upto: int | None = None
    scns: frozenset[int] | None = None
    sources: frozenset[str] | None = None
    partitions: frozenset[str] | None = None

    def bounds(self, since: int, until: int) -> list[tuple[int, int]]:
        """The sub-ranges ``(a, b]`` of ``(since, until]`` holding every allowed SCN."""
        lo = since if self.after is None else max(since, self.after)
        hi = until if self.upto is None else min(until, self.upto)
        if hi <= lo:
            return []
        if self.scns is None:
            return [(lo, hi)]
        values = sorted(v for v in self.scns if lo < v <= hi)
        if not values:
            return []
        # cut at the widest gaps between neighbouring values: at most MAX_SCN_RANGES ranges
        gaps = sorted(range(1, len(values)), key=lambda i: values[i] - values[i - 1])
        cuts = sorted(gaps[len(gaps) - (MAX_SCN_RANGES - 1) :] if len(gaps) >= MAX_SCN_RANGES
                      else gaps)  # fmt: skip
        out = []
        first = 0
        for cut in [*cuts, len(values)]:
            out.append((values[first] - 1, values[cut - 1]))
            first = cut
        return out


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _names(f: Filter) -> frozenset[str] | None:
    """The names an ``=`` / ``IN`` filter on a string column allows (None: not such a filter)."""
    if isinstance(f, EqualTo | EqualNullSafe) and isinstance(f.value, str):
        return frozenset((f.value,))
    if isinstance(f, In) and f.value and all(isinstance(v, str) for v in f.value):
        return frozenset(f.value)
    return None


def _scn_filter(f: Filter, pushed: Pushed) -> Pushed | None:
    """``pushed`` narrowed by one filter on ``_commit_scn`` (None: not one it takes)."""
    if isinstance(f, In):
        values = [_int(v) for v in f.value]
        if not values or any(v is None for v in values):
            return None
        allowed = frozenset(v for v in values if v is not None)
        return replace(pushed, scns=allowed if pushed.scns is None else pushed.scns & allowed)
    value = _int(getattr(f, "value", None))
    if value is None:
        return None
    if isinstance(f, EqualTo | EqualNullSafe):
        allowed = frozenset((value,))
        return replace(pushed, scns=allowed if pushed.scns is None else pushed.scns & allowed)
    if isinstance(f, GreaterThan | GreaterThanOrEqual):
        after = value if isinstance(f, GreaterThan) else value - 1
        return replace(pushed, after=after if pushed.after is None else max(pushed.after, after))
    if isinstance(f, LessThan | LessThanOrEqual):
        upto = value if isinstance(f, LessThanOrEqual) else value - 1
        return replace(pushed, upto=upto if pushed.upto is None else min(pushed.upto, upto))
    return None


def split_filters(filters: Iterable[Filter], *, scn: bool = True) -> tuple[Pushed, list[Filter]]:
    """``(what the reader applies, the filters left to Spark)`` (module docstring).

    ``scn`` false leaves every ``_commit_scn`` filter to Spark (a bootstrap
    server's snapshot rows carry SCNs outside the range read).
    """
    pushed = Pushed()
    rest: list[Filter] = []
    for f in filters:
        column = getattr(f, "attribute", None)
        name = column[0] if isinstance(column, tuple) and len(column) == 1 else None
        if isinstance(f, IsNotNull) and name in (_SCN, _SOURCE, _PARTITION):
            continue  # never null
        if name == _SCN and scn:
            narrowed = _scn_filter(f, pushed)
            if narrowed is not None:
                pushed = narrowed
                continue
        elif name in (_SOURCE, _PARTITION):
            allowed = _names(f)
            if allowed is not None:
                if name == _SOURCE:
                    have = pushed.sources
                    pushed = replace(pushed, sources=allowed if have is None else have & allowed)
                else:
                    have = pushed.partitions
                    pushed = replace(pushed, partitions=allowed if have is None else have & allowed)
                continue
        rest.append(f)
    return pushed, rest


class PushdownBatchReader(ChangebusBatchReader):
    """:class:`ChangebusBatchReader` taking SCN, source and partition filters (module docstring).

    ``pushFilters`` runs on the driver before ``partitions``; what it keeps is
    plain data pickled with the reader into the tasks.
    """

    def __init__(self, opts: Any, schema: Any) -> None:
        super().__init__(opts, schema)
        self.pushed = Pushed()

    def pushFilters(self, filters: list[Filter]) -> Iterator[Filter]:
        have = set(self.arrow_schema.names)
        pushed, rest = split_filters(filters, scn=not self.opts.bootstrap)
        if pushed.sources is not None and not self.tables:
            # no table schemas to check the names against: the relay might refuse them
            rest.extend(f for f in filters if _column(f) == _SOURCE and f not in rest)
            pushed = replace(pushed, sources=None)
        if pushed.scns is not None and _SCN not in have:  # pragma: no cover - Spark pushes
            rest.extend(f for f in filters if _column(f) == _SCN and f not in rest)
            pushed = replace(pushed, scns=None, after=None, upto=None)
        self.pushed = pushed
        if pushed.sources is not None:
            wanted = pushed.sources & set(self.opts.sources or self.tables)
            # keep the relay's order; an empty tuple would mean every source: see partitions()
            order = self.opts.sources or tuple(self.tables)
            self.opts = replace(self.opts, sources=tuple(s for s in order if s in wanted))
        return iter(rest)

    def partitions(self) -> Sequence[InputPartition]:
        """The ranges of :meth:`ChangebusBatchReader.partitions`, narrowed by the filters."""
        p = self.pushed
        bounds = run_sync(partition_bounds(self.opts))
        empty = [ScnRangePartition(RangeSpec(next(iter(bounds)), 0, 0))]
        if p.sources is not None and not self.opts.sources:
            return empty  # no table of the relay's matches
        if p.partitions is not None:
            bounds = {n: b for n, b in bounds.items() if n in p.partitions}
            if not bounds:
                return empty
        start = _resolve(self.opts, self.opts.starting, bounds, "startingScn")
        end = _resolve(self.opts, self.opts.ending, bounds, "endingScn")
        whole = _needs_bootstrap(self.opts, start, bounds)
        out: list[ScnRangePartition] = []
        for name in sorted(end):
            since = int(start.get(name, end[name]))
            if name in whole:  # SCN filters are not pushed with a bootstrap server
                out.extend(_range_partitions(self.opts, {name: since}, {name: end[name]}, whole))
                continue
            ranges = p.bounds(since, int(end[name]))
            for a, b in ranges:
                # one range (the common "_commit_scn > x"): cut where the relay says
                cuts = _split_points(self.opts, {name: a}, {name: b}) if len(ranges) == 1 else {}
                out.extend(_range_partitions(self.opts, {name: a}, {name: b}, cuts=cuts))
        return out or empty

    def read(self, partition: ScnRangePartition) -> Iterator[pa.RecordBatch]:  # type: ignore[override]
        """The range's rows; with an SCN set, the windows between its values dropped."""
        batches = super().read(partition)
        s = partition.spec
        scns = self.pushed.scns
        if scns is None or (s.until - s.since == 1 and s.until in scns):
            return batches  # one allowed SCN: nothing else in the range
        return _only_scns(batches, sorted(scns))


def _column(f: Filter) -> str | None:
    column = getattr(f, "attribute", None)
    return column[0] if isinstance(column, tuple) and len(column) == 1 else None


def _only_scns(batches: Iterator[pa.RecordBatch], scns: list[int]) -> Iterator[pa.RecordBatch]:
    allowed = pa.array(scns, pa.int64())
    for batch in batches:
        keep = pc.is_in(batch.column(_SCN), value_set=allowed)
        yield batch.filter(keep)
