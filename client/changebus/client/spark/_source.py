"""The PySpark data source ``changebus``: streaming and batch readers over the relays.

Where each piece runs (PySpark's Python data source API, 4.2+):

* :class:`ChangebusDataSource` is created in a short-lived Python worker and
  pickled to the JVM; ``schema()`` asks a relay for the tables' newest
  schemas (with ``schemaTrackingLocation``: reads the query's schema log)
  and maps them to Spark types (:mod:`._arrow`).
* :class:`ChangebusStreamReader` lives in the driver's long-lived Python
  runner, which calls ``initialOffset``, ``latestOffset``, ``partitions``,
  ``commit``; a second copy is pickled into the tasks, where ``read()`` runs
  on the executors. Instances therefore hold only plain data set in
  ``__init__`` (options, the Arrow schema, table schemas); clients are made
  inside the calls. State the driver copy gains later (the resolved start,
  the AvailableNow target) never reaches ``read()``, which depends on its
  :class:`ScnRangePartition` alone.

Offsets are ``{partition: scn}`` (JSON of primitives, written by Spark to
``offsets/`` in the checkpoint): the SCN of the last window included per
physical partition. A micro-batch reads windows ``(start, end]``; since all
events of a transaction share one window SCN, a batch never splits a
transaction. ``partitions(start, end)`` cuts every partition's range into
``numPartitions`` SCN sub-ranges of similar volume (``splitBy=scn``, the
default: the relay answers the cut points from its SCN index) or key-hash
slices that the relay filters server-side (``splitBy=key``).

With bootstrap servers (``bootstrapUrl``) ``earliest`` is SCN -1, and a
range starting before the relays' oldest window (-1 included) is one batch
read by one task through the client's bootstrap switching (snapshot,
catch-up, relays up to the end; :func:`_needs_bootstrap`, module
:mod:`._read`). Such a batch ends at the relay's newest window, or under a
rows or bytes limit at the bootstrap server's newest SCN (it is never cut by
rows or bytes, and ``minRowsPerTrigger`` never holds it back).

Read limits (:meth:`ChangebusStreamReader.latestOffset`): ``maxRowsPerTrigger``
and ``maxBytesPerTrigger`` end a batch on a window boundary within both
(:func:`~._relay.end_within`); ``minRowsPerTrigger`` skips a trigger (returns
the start as the end, so Spark plans no batch) while fewer change events are
available, until ``maxTriggerDelay`` has passed since the last trigger that
was not skipped. That clock lives in the driver's reader only.

Schema changes (:mod:`._evolution`): the query reads with the table schemas
of its schema log (``schemaTrackingLocation``, :mod:`._schemalog`) or the
relays' newest at start; ``latestOffset`` ends a batch before the first
transaction holding rows of a newer version and stops the query at it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, Literal

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from changebus.schemas import ConfigError, TableSchema

from .._errors import FellOffRelayError
from ._arrow import NOT_SENT_COLUMN, union_schema
from ._evolution import (
    SchemaGuard,
    check_marked_schema,
    check_options,
    mark_schema,
    query_tables,
)
from ._options import AtTime, SourceOptions
from ._plan import (
    ScnRangePartition,
    _needs_bootstrap,
    _offsets_key,
    _range_partitions,
    _resolve,
    _split_points,
)
from ._read import RangeSpec, read_range
from ._relay import (
    PartitionBounds,
    bootstrap_target,
    end_within,
    partition_bounds,
    resolve_cluster,
    run_sync,
)

__all__ = [
    "ChangebusBatchReader",
    "ChangebusDataSource",
    "ChangebusStreamReader",
    "source_schema",
]

log = logging.getLogger(__name__)


def _tables(opts: SourceOptions) -> tuple[dict[str, TableSchema], list[str]]:
    bounds = run_sync(partition_bounds(opts))
    names = list(bounds)
    return query_tables(opts, names), names


def _schema(opts: SourceOptions, tables: dict[str, TableSchema]) -> pa.Schema:
    """The columns of ``tables`` + metadata, + ``_not_sent`` with ``includeNotSent``."""
    schema = union_schema(tables.values())
    if not opts.include_not_sent:
        return schema
    if NOT_SENT_COLUMN.name in schema.names:
        raise ConfigError(
            f"a table read has a column {NOT_SENT_COLUMN.name!r}, the name of the column that"
            " includeNotSent=true adds: leave the option out for this table"
        )
    return schema.append(NOT_SENT_COLUMN)


def source_schema(opts: SourceOptions) -> pa.Schema:
    """The Arrow schema of what ``opts`` reads (asks a relay for the table schemas)."""
    tables, names = _tables(opts)
    if not tables:
        raise ConfigError(
            f"the relay has no table schemas yet in partitions {names}"
            + (f" for sources {list(opts.sources)}" if opts.sources else "")
            + "; give the schema with .schema(...) or start when the source has written"
        )
    return _schema(opts, tables)


def _check_user_schema(given: StructType, derived: pa.Schema | None) -> pa.Schema:
    """The Arrow form of a user-given schema, which must be a subset of ``derived``.

    With no ``derived`` schema (the relay has seen no table yet) the user's
    schema is taken as it is: columns are filled by name.
    """
    wanted = to_arrow_schema(given, timezone="UTC")
    if derived is None:
        return wanted
    have = {f.name: f for f in derived}
    for f in wanted:
        d = have.get(f.name)
        if d is None:
            hint = " (it needs includeNotSent=true)" if f.name == NOT_SENT_COLUMN.name else ""
            raise ConfigError(
                f"schema column {f.name!r} is not a column of the changebus source{hint}"
                f" (columns: {[x.name for x in derived]})"
            )
        if d.type != f.type:
            raise ConfigError(f"schema column {f.name!r}: the source gives {d.type}, not {f.type}")
        if d.nullable and not f.nullable:
            # (taken as it is, Spark would trust the flag on rows that hold nulls there: a
            # truncate, a delete's unkeyed columns, an unsent value; found by review)
            raise ConfigError(
                f"schema column {f.name!r} is NOT NULL, but the source gives nulls in it"
                " (truncates, deletes, values not sent): declare it nullable"
            )
    return wanted


class _ReaderBase:
    """What the batch and stream readers share: options, schemas, read()."""

    def __init__(self, opts: SourceOptions, schema: StructType) -> None:
        self.opts = opts
        tables, _ = _tables(opts)
        self.tables = tables
        derived = _schema(opts, tables) if tables else None
        check_marked_schema(schema, derived)
        self.arrow_schema = _check_user_schema(schema, derived)

    def read(self, partition: ScnRangePartition) -> Iterator[pa.RecordBatch]:
        """Runs on an executor: the rows of one SCN range and key slice."""
        return read_range(self.opts, partition.spec, self.arrow_schema, self.tables)


class ChangebusStreamReader(_ReaderBase, DataSourceStreamReader, SupportsTriggerAvailableNow):  # type: ignore[misc]
    """Micro-batch reader with admission control and Trigger.AvailableNow (module docstring)."""

    def __init__(self, opts: SourceOptions, schema: StructType) -> None:
        super().__init__(opts, schema)
        self._initial: dict[str, int] | None = None
        #: the first batch of a new query ends where it starts (see :meth:`initialOffset`)
        self._hold_first = False
        self._target: dict[str, int] | None = None
        #: time.monotonic() of the last trigger minRowsPerTrigger did not skip
        self._last_trigger = -math.inf
        #: the bounds latestOffset used, for partitions() of the same batch (its start)
        self._planned: tuple[tuple[tuple[str, int], ...], dict[str, PartitionBounds]] | None = None
        #: stops the query at a newer table schema version (module _evolution)
        self._guard = SchemaGuard(opts, self.tables)

    def _bounds(self) -> dict[str, PartitionBounds]:
        return run_sync(partition_bounds(self.opts))

    def initialOffset(self) -> dict[str, int]:
        """Where a new query starts (``startingScn``), resolved once to concrete SCNs.

        Spark logs only the ends of batches: a replay of the first batch (it
        failed before its commit) asks for this again, in a new reader, and
        ``latest``, ``earliest`` (without a bootstrap server) or a start time
        resolve elsewhere then: rows were lost (found by review). So when the
        start may move, the first batch ends where it starts (it is empty, and
        its end is logged): every batch with rows starts at a logged end.
        """
        if self._initial is None:
            self._initial = _resolve(self.opts, self.opts.starting, self._bounds(), "startingScn")
            starting = self.opts.starting
            self._hold_first = isinstance(starting, AtTime) or (
                starting in ("latest", "earliest")
                and not (starting == "earliest" and self.opts.bootstrap)
            )
            log.info("changebus stream starts after %s", self._initial)
        return dict(self._initial)

    def getDefaultReadLimit(self) -> ReadLimit:
        """One of the options' read limits in Spark's terms (:meth:`_limits` applies them all).

        Spark has no composite limit for Python sources: it hands this value
        back to :meth:`latestOffset`, or :class:`ReadAllAvailable` where a
        trigger reads everything (``Trigger.Once``).
        """
        o = self.opts
        if o.min_rows_per_trigger:
            return ReadMinRows(o.min_rows_per_trigger)
        if o.max_rows_per_trigger:
            return ReadMaxRows(o.max_rows_per_trigger)
        if o.max_bytes_per_trigger:
            return ReadMaxBytes(o.max_bytes_per_trigger)
        return ReadAllAvailable()

    def _limits(self, limit: ReadLimit) -> tuple[int, int, int]:
        """``(max rows, max bytes, min rows)`` of one trigger (0: none).

        :class:`ReadAllAvailable` lifts them all; a limit Spark passes wins
        over the option of its kind; under ``Trigger.AvailableNow`` no trigger
        is skipped (the query must reach its target and stop).
        """
        if isinstance(limit, ReadAllAvailable):
            return 0, 0, 0
        o = self.opts
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else o.max_rows_per_trigger
        max_bytes = limit.max_bytes if isinstance(limit, ReadMaxBytes) else o.max_bytes_per_trigger
        min_rows = limit.min_rows if isinstance(limit, ReadMinRows) else o.min_rows_per_trigger
        return max_rows, max_bytes, 0 if self._target is not None else min_rows

    def prepareForTriggerAvailableNow(self) -> None:
        """Pin the newest SCN of every partition: the query drains up to there and stops."""
        # (reached: an empty buffer's -1 pinned a query at -1 there, and its bootstrap
        # batch never came: the run ended with nothing read; found by review)
        self._target = {n: b.reached for n, b in self._bounds().items()}
        log.info("changebus AvailableNow target %s", self._target)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, int]:
        """The end of the next batch: the newest windows, capped by ``limit`` and the target.

        One event loop and one bounds request per trigger: the bounds are kept
        for :meth:`partitions` of the same batch (same ``start``).
        """
        return run_sync(self._latest(start, limit))

    async def _latest(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, int]:
        if self._hold_first:
            self._hold_first = False
            if self._initial is not None and _offsets_key(start) == _offsets_key(self._initial):
                # the held first batch is the reader's first trigger: minRowsPerTrigger
                # counts from it (else the next trigger, never skipped, took what came)
                self._last_trigger = time.monotonic()
                return {str(k): int(v) for k, v in start.items()}  # (initialOffset)
        max_rows, max_bytes, min_rows = self._limits(limit)
        bounds = await partition_bounds(self.opts)
        self._planned = (_offsets_key(start), bounds)
        end: dict[str, int] = {}
        heads: dict[str, int] = {}
        boot = _needs_bootstrap(self.opts, start, bounds)
        for name, b in bounds.items():
            if name not in start:
                # a partition that appeared after the query started: it enters the
                # offsets and is read from the next batch on, from its start
                end[name] = _new_partition_start(self.opts, b)
                continue
            since = int(start[name])
            head = b.reached
            if self._target is not None:
                head = min(head, self._target.get(name, since))
            if name in boot:
                end[name] = await self._boot_end(name, since, head, b, bool(max_rows or max_bytes))
                continue
            heads[name] = max(head, since)
        for name, value in start.items():
            if name not in bounds:
                end[name] = int(value)  # a partition the relay no longer lists: stays put
        booting = any(end[n] > int(start[n]) for n in boot)
        if min_rows and not booting and await self._delay(start, heads, min_rows):
            return {str(k): int(v) for k, v in start.items()}
        busy = {name: head for name, head in heads.items() if head > int(start[name])}
        if (max_rows or max_bytes) and busy:
            # shared by the partitions with something new: an idle one's share went unused,
            # and eight partitions with one busy read an eighth of the limit (review)
            rows = max(1, max_rows // len(busy)) if max_rows else 0
            size = max(1, max_bytes // len(busy)) if max_bytes else 0
            end.update(heads)
            for name, head in busy.items():
                since = int(start[name])
                try:
                    end[name] = await self._limited_end(name, since, head, rows, size)
                except FellOffRelayError:
                    if not self.opts.bootstrap:
                        raise
                    # evicted since the bounds were read: this batch goes through the
                    # bootstrap server, planned as one task (partitions() reads the bounds).
                    # It ends at most at the head planned above: under AvailableNow that is
                    # capped by the target (the relay's newest went past it, found by review)
                    bounds = await partition_bounds(self.opts)
                    self._planned = (_offsets_key(start), bounds)
                    boot = _needs_bootstrap(self.opts, start, bounds)
                    b = bounds[name]
                    end[name] = await self._boot_end(name, since, min(head, b.reached), b, True)
        else:
            end.update(heads)
        return await self._guard.check(start, end, boot)

    async def _boot_end(
        self, name: str, since: int, head: int, b: PartitionBounds, limited: bool
    ) -> int:
        """The end of a batch read through the bootstrap server: with a read limit the
        server's newest SCN (snapshot + catch-up), else the head."""
        if limited:
            target = await bootstrap_target(self.opts, name)
            head = min(head, max(target, b.prev_scn))
        end = max(head, since)
        log.info(
            "changebus partition %s: (%d, %d] is read through the bootstrap server",
            name,
            since,
            end,
        )
        return end

    async def _delay(self, start: dict[str, Any], heads: dict[str, int], min_rows: int) -> bool:
        """Whether to skip this trigger (``minRowsPerTrigger``, Kafka source semantics).

        Not when ``maxTriggerDelay`` has passed since the last trigger that
        was not skipped (the first trigger of a reader never is), nor when
        ``min_rows`` change events are available over all partitions; the
        count reads event headers only until it reaches ``min_rows``.
        """
        now = time.monotonic()
        if now - self._last_trigger >= self.opts.max_trigger_delay_s:
            self._last_trigger = now
            return False
        available = 0
        for name, head in heads.items():
            try:
                extent = await end_within(
                    self.opts, name, int(start[name]), head, max_events=min_rows - available
                )
            except FellOffRelayError:
                break  # the range is gone: planning the batch reports or skips it
            available += extent.events
            # a batch that ends before the head stopped at the count: at least that many
            if available >= min_rows or extent.end < head:
                break
        else:
            log.debug("changebus: %d change event(s) < minRowsPerTrigger; waiting", available)
            return True
        self._last_trigger = now
        return False

    async def _limited_end(
        self, name: str, since: int, head: int, max_events: int, max_bytes: int
    ) -> int:
        try:
            return (
                await end_within(
                    self.opts, name, since, head, max_events=max_events, max_bytes=max_bytes
                )
            ).end
        except FellOffRelayError as exc:
            if self.opts.bootstrap or self.opts.fail_on_data_loss or exc.prev_scn <= since:
                raise  # (with a bootstrap server the caller reads the range there)
            # the windows up to prev_scn are gone: read() skips them too (with a warning)
            extent = await end_within(
                self.opts, name, exc.prev_scn, head, max_events=max_events, max_bytes=max_bytes
            )
            return extent.end

    def reportLatestOffset(self) -> dict[str, int] | None:
        """The newest SCN per partition (Spark shows it as the source's latestOffset: lag)."""
        try:
            return {n: b.max_scn for n, b in self._bounds().items()}
        except Exception as exc:  # noqa: BLE001 - monitoring must not fail the query
            log.warning("changebus: reportLatestOffset failed: %r", exc)
            return None

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        """``numPartitions`` sub-ranges (or key-hash slices) of every partition's ``(start, end]``.

        A range that starts before what the relays keep is one task when a
        bootstrap server is configured (:func:`_needs_bootstrap`). A batch
        replayed after a restart, which ``latestOffset`` did not plan, is held
        against the schema guard: its planning may have missed a newer version
        (a lagging relay answered it), which its executors then refuse on every
        replay, and a range through the bootstrap server comes at the newest
        versions. The guard stops the query at such a version and logs it.
        """
        whole: set[str] = set()
        planned, self._planned = self._planned, None
        replayed = planned is None or planned[0] != _offsets_key(start)
        if self.opts.bootstrap:
            # (latestOffset of this batch asked already, unless replayed after a restart)
            bounds = self._bounds() if replayed or planned is None else planned[1]
            whole = _needs_bootstrap(self.opts, start, bounds)
        if replayed:  # versions checked now (the query was down: found by review)
            ends = {str(n): int(e) for n, e in end.items()}
            run_sync(self._guard.check(start, ends, whole, logged=True))
        cuts = _split_points(self.opts, start, end, whole)
        parts = _range_partitions(self.opts, start, end, whole, cuts)
        if self.opts.zookeeper and any(not p.spec.may_bootstrap for p in parts):
            # SCN sub-ranges do not follow the cluster's table (see RangeSpec.relays): they
            # get its relays as they are now, not as they were when the query started
            relays = run_sync(resolve_cluster(self.opts)).relays
            parts = [ScnRangePartition(replace(p.spec, relays=relays)) for p in parts]
        return parts

    def commit(self, end: dict[str, Any]) -> None:
        """Spark finished everything up to ``end`` (its checkpoint is the record; nothing to do)."""
        log.debug("changebus batch committed up to %s", end)

    def stop(self) -> None:
        """Nothing is held between calls."""


class ChangebusBatchReader(_ReaderBase, DataSourceReader):  # type: ignore[misc]
    """``spark.read.format("changebus")``: windows ``(startingScn, endingScn]``."""

    def partitions(self) -> Sequence[InputPartition]:
        """Resolve the range now (``latest`` = the newest window at planning time)."""
        bounds = run_sync(partition_bounds(self.opts))
        start = _resolve(self.opts, self.opts.starting, bounds, "startingScn")
        end = _resolve(self.opts, self.opts.ending, bounds, "endingScn")
        for name, b in bounds.items():
            newest = max(b.max_scn, b.prev_scn)
            if end[name] > newest:
                log.warning(
                    "changebus: the batch's end %d of partition %s is past the relay's newest"
                    " window %d: the read waits for the source to reach it",
                    end[name],
                    name,
                    newest,
                )
        whole = _needs_bootstrap(self.opts, start, bounds)
        cuts = _split_points(self.opts, start, end, whole)
        parts = _range_partitions(self.opts, start, end, whole, cuts)
        return parts or [ScnRangePartition(RangeSpec(next(iter(bounds)), 0, 0))]


class ChangebusDataSource(DataSource):
    """``format("changebus")``: change events of the relays' tables as rows (docs/spark.md)."""

    @classmethod
    def name(cls) -> str:
        return "changebus"

    def schema(self) -> StructType:
        opts = SourceOptions.parse(self.options, mode="batch")  # the most permissive
        derived = source_schema(opts)
        return mark_schema(from_arrow_schema(derived, prefer_timestamp_ntz=True), derived)

    def _options(self, mode: Literal["stream", "batch"]) -> SourceOptions:
        """The parsed options; with ``zookeeper`` the cluster's relays filled in (planning)."""
        opts = SourceOptions.parse(self.options, mode=mode)
        return run_sync(resolve_cluster(opts)) if opts.zookeeper else opts

    def reader(self, schema: StructType) -> DataSourceReader:
        from ._pushdown import PushdownBatchReader, pushdown_planning

        opts = self._options("batch")
        check_options(opts)
        if pushdown_planning():  # Spark asks for filters only there (see ._pushdown)
            return PushdownBatchReader(opts, schema)
        return ChangebusBatchReader(opts, schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return ChangebusStreamReader(self._options("stream"), schema)


def _new_partition_start(opts: SourceOptions, b: PartitionBounds) -> int:
    """Where a partition that appeared after the query started enters its offsets.

    All of it is new to the query (as Kafka reads an added partition from its
    earliest offset). Its relays' oldest position when they evicted nothing
    before it; else through a bootstrap server (-1: a snapshot first); else
    its windows before are gone, which ``failOnDataLoss`` refuses (it was only
    a warning: found by review).
    """
    if not b.evicted:
        return b.prev_scn
    if opts.bootstrap:
        return -1
    text = (
        f"partition {b.name} appeared after the query started, and its relays evicted its"
        f" windows up to SCN {b.prev_scn}: they are gone"
    )
    if not opts.fail_on_data_loss:
        log.warning("%s; it is read from there on (failOnDataLoss=false)", text)
        return b.prev_scn
    raise FellOffRelayError(
        f"{text}: give the query a bootstrap server (bootstrapUrl) to read it whole, or set"
        " failOnDataLoss=false to read it from its relays' oldest window",
        partition=b.name,
        requested_scn=-1,
        oldest_scn=b.min_scn,
        prev_scn=b.prev_scn,
        relay="",
        retriable=False,
    )
