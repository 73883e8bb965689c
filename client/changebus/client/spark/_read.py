"""Executor-side reading: one SCN range of one partition slice into Arrow batches.

:func:`read_range` is what a Spark task runs for one input partition. It
creates its client lazily (a :class:`~changebus.client.Consumer` started at
``since``, on a private event loop driven from this generator, no extra
thread), reads the windows ``(since, until]`` of one physical partition
restricted to one key-hash slice, and yields :class:`pyarrow.RecordBatch`
objects of the declared schema, decoded column-wise (the consumer is
columnar; see :mod:`._columns`; with ``includeNotSent`` row-wise, through
:class:`~._arrow.BatchBuilder`, which builds the ``_not_sent`` column). It stops at the first window past ``until``
and never reads further, so a replayed batch (same offsets after a crash or
a restart from the checkpoint) gives the same rows: the relay's windows are
immutable, and a range the relay no longer keeps fails loudly
(:class:`~changebus.client.FellOffRelayError`) instead of yielding fewer rows.

With ``fail_on_data_loss`` false, an evicted range continues after the
relay's newest evicted window and a DATA_LOSS window is skipped, each with a
warning (Spark's Kafka source behaves the same way with ``failOnDataLoss``).

With bootstrap servers (``bootstrapUrl``) the consumer recovers by itself: a
range starting before everything (``since`` -1) or before the relays' oldest
window is read as a snapshot (every page taken whole: its rows are at their
latest version, possibly newer than ``until``), then the catch-up log and the
relays up to ``until``. Such a replayed range gives the same keys but maybe
newer row versions; the windows after ``until`` follow in the next batch, so
an upsert sink ordered by ``_commit_scn`` converges to the same state. An
SCN sub-range (``splitBy=scn``, :attr:`RangeSpec.may_bootstrap` false) whose
start the relays evicted reads the bootstrap server's log from there instead,
the same windows the relays had.

Nothing here is shared between threads; each call owns its loop and client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Iterator, Mapping
from dataclasses import dataclass, replace

import pyarrow as pa

from changebus.schemas import BootstrapFailedError, Op, TableSchema

from .._config import ConsumerConfig
from .._consumer import Consumer
from .._errors import DataLossDetectedError, FellOffRelayError
from .._model import ChangeOp, RawEvents, Window
from ._arrow import BatchBuilder
from ._columns import ArrowDecoder
from ._options import SourceOptions

#: the op of a TRUNCATE event header
_TRUNCATE = int(Op.TRUNCATE)

__all__ = ["RangeSpec", "read_range"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RangeSpec:
    """One unit of reading: windows ``(since, until]`` of ``partition``, key slice ``key_filter``.

    ``key_filter`` is the text form of a :class:`~changebus.schemas.PartitionFilter`
    (None: every key). Plain data, pickled into Spark tasks.
    """

    partition: str
    since: int
    until: int
    key_filter: str | None = None
    #: False for one of several SCN sub-ranges of a range (``splitBy=scn``): it may not
    #: take a snapshot when the relays evicted its start (a snapshot is of every row
    #: changed since, up to now: each sub-range's would repeat the others' rows); it
    #: reads the bootstrap server's log instead, window for window
    #: (``bootstrap_catchup_only``), or fails when that log was pruned too
    may_bootstrap: bool = True
    #: False for all but the first of the key slices of a range (``splitBy=key``): a
    #: TRUNCATE passes every key filter, and each slice's task made it a row (review)
    truncates: bool = True
    #: the relays to read from (empty: the options'); a streaming query sets them at each
    #: plan for the SCN sub-ranges that do not follow a cluster's table themselves
    relays: tuple[str, ...] = ()


def read_range(
    opts: SourceOptions,
    spec: RangeSpec,
    schema: pa.Schema,
    tables: Mapping[str, TableSchema],
) -> Iterator[pa.RecordBatch]:
    """Yield the rows of ``spec`` as record batches of ``schema`` (module docstring)."""
    if spec.until <= spec.since:
        return
    loop = asyncio.new_event_loop()
    agen = _read(opts, spec, schema, tables)
    try:
        while True:
            try:
                batch = loop.run_until_complete(agen.__anext__())
            except StopAsyncIteration:
                break
            yield batch
    finally:
        try:
            loop.run_until_complete(agen.aclose())
        finally:
            loop.close()


def _config(
    opts: SourceOptions, spec: RangeSpec, position: int, tables: Mapping[str, TableSchema]
) -> ConsumerConfig:
    # a sub-range that may not take a snapshot reads the relays resolved when it was
    # planned (a consumer following the cluster's table takes its bootstrap servers from
    # there), and a start the relays evicted from the bootstrap server's log as it is
    routed = spec.may_bootstrap or not opts.relays
    return ConsumerConfig(
        relays=spec.relays or opts.relays,
        partition=spec.partition,
        sources=opts.sources,
        filter=spec.key_filter,
        # -1 without a bootstrap server: the very start, SCN 0 (every SCN is past it),
        # so that a relay that evicted windows meanwhile answers 410 instead of
        # serving from its oldest ("earliest") and skipping them
        start="earliest" if position < 0 and opts.bootstrap else str(max(position, 0)),
        client_id=f"spark:{spec.partition}:{spec.key_filter or 'all'}",
        follow=False,
        until_scn=spec.until,  # fetch nothing past the range
        wait_s=1.0,
        max_bytes=opts.max_bytes_per_request,
        max_window_bytes=opts.max_window_bytes,
        connect_timeout_s=min(opts.request_timeout_s, 10.0),
        read_margin_s=opts.request_timeout_s,
        max_attempts=10,
        backoff_max_s=5.0,
        on_data_loss="deliver",
        yield_empty_windows=True,
        auto_commit=False,
        reader_schemas=dict(tables),
        # rows of a newer version than the driver planned with (the range's start
        # evicted, so a snapshot at the newest versions; a guard scan that ended early)
        # stop the task instead of losing their new columns (found by review)
        refuse_newer_writers=True,
        columnar=not opts.include_not_sent,
        bootstrap_servers=opts.bootstrap,
        bootstrap_catchup_only=not spec.may_bootstrap,
        zookeeper=opts.zookeeper if routed else "",
        cluster=opts.cluster if routed else "",
        prefer_followers=opts.prefer_followers,
        auth=opts.auth,
    )


def _no_truncate(window: Window) -> Window:
    """``window`` without its TRUNCATE events (a key slice other than the first)."""
    raw = window.raw_events
    if raw is not None:
        keep = raw.headers["op"] != _TRUNCATE
        if bool(keep.all()):
            return window
        events = RawEvents(raw.body, raw.offsets[keep], raw.headers[keep], raw.decoders)
        return replace(window, raw_events=events)
    if not any(e.op is ChangeOp.TRUNCATE for e in window.events):
        return window
    return replace(window, events=tuple(e for e in window.events if e.op is not ChangeOp.TRUNCATE))


def _check_loss(opts: SourceOptions, spec: RangeSpec, window: Window) -> None:
    if window.data_loss is None:
        return
    if opts.fail_on_data_loss:
        raise DataLossDetectedError.reported_in(window, " (failOnDataLoss=true)")
    log.warning("%s; skipped (failOnDataLoss=false)", DataLossDetectedError.reported_in(window))


async def _read(
    opts: SourceOptions,
    spec: RangeSpec,
    schema: pa.Schema,
    tables: Mapping[str, TableSchema],
) -> AsyncGenerator[pa.RecordBatch, None]:
    builder: ArrowDecoder | BatchBuilder
    if opts.include_not_sent:
        # the _not_sent column is built by the row path only (its consumer decodes rows)
        builder = BatchBuilder(
            schema, include_preimage=opts.include_preimage, include_not_sent=True
        )
    else:
        builder = ArrowDecoder(schema, include_preimage=opts.include_preimage)
    position = spec.since
    gathered = 0  # wire bytes of the windows in the batch being built

    def full() -> bool:
        # by bytes too: 65,536 rows of 64 KB made a 4 GB batch, past what an executor
        # holds and Arrow's 2 GiB string columns, failing the task on every retry
        return builder.rows >= opts.arrow_batch_rows or gathered >= opts.arrow_batch_bytes

    # a relay that stops answering usefully fails the task after this long
    idle_s = max(4 * opts.request_timeout_s, 60.0)
    while position < spec.until:
        consumer = Consumer(_config(opts, spec, position, tables))
        try:
            async with consumer:
                loop = asyncio.get_running_loop()
                it = aiter(consumer)
                while position < spec.until:
                    # the timeout covers the reading between two yields only: a generator
                    # step runs in a task of its own, and a timeout belongs to one task
                    async with asyncio.timeout(idle_s) as deadline:
                        moved = loop.time()
                        while position < spec.until and not full():
                            window = await anext(it)
                            gathered += window.nbytes
                            now = loop.time()
                            if now - moved > 1.0:  # not per window: a window may take 10 us
                                deadline.reschedule(now + idle_s)
                                moved = now
                            if window.phase == "snapshot":
                                # a snapshot page: rows at their latest version, whatever
                                # the range's end; the position moves with the catch-up
                                builder.add_window(window)
                                continue
                            if window.scn > spec.until:
                                position = spec.until
                                break
                            position = window.scn
                            _check_loss(opts, spec, window)
                            builder.add_window(window if spec.truncates else _no_truncate(window))
                    if full():
                        gathered = 0
                        yield builder.flush()
        except TimeoutError:
            raise TimeoutError(
                f"partition {spec.partition}: no window after SCN {position} within"
                f" {idle_s:g} s while reading up to {spec.until} (a range's end the source has"
                " not reached yet, such as an endingScn past the relay's newest window, is"
                " waited for: give an end the relay holds, or endingScn=latest)"
            ) from None
        except BootstrapFailedError as exc:
            if spec.may_bootstrap:
                raise
            raise BootstrapFailedError(
                f"partition {spec.partition}: the relays evicted SCN {position} while this"
                f" batch's range ({spec.since}, {spec.until}] was read in SCN sub-ranges"
                " (splitBy=scn), and the bootstrap server's log no longer holds it either"
                f" ({exc.message}). Run the batch again: with its start evicted it is planned"
                " as one task through the bootstrap server's snapshot"
            ) from exc
        except FellOffRelayError as exc:
            if opts.fail_on_data_loss:
                raise _fell_off(
                    exc,
                    f"partition {spec.partition}: the batch's range ({spec.since}, {spec.until}]"
                    f" starts at SCN {exc.requested_scn}, older than the relays keep (oldest"
                    f" window {exc.oldest_scn}); the rows in between are gone from the relays."
                    " Restart the query from a newer startingScn with a new checkpoint, or set"
                    " failOnDataLoss=false to skip them",
                ) from exc
            log.warning(
                "partition %s: SCNs after %d up to %d are gone from the relays; skipped"
                " (failOnDataLoss=false)",
                spec.partition,
                position,
                exc.prev_scn,
            )
            if exc.prev_scn <= position:
                raise
            position = exc.prev_scn
    if builder.rows:
        yield builder.flush()


def _fell_off(exc: FellOffRelayError, message: str) -> FellOffRelayError:
    """``exc`` with the reader's own ``message`` (the positions it names kept)."""
    return FellOffRelayError(
        message,
        partition=exc.partition,
        requested_scn=exc.requested_scn,
        oldest_scn=exc.oldest_scn,
        prev_scn=exc.prev_scn,
        relay=exc.relay,
    )
