"""Lanes: a group member's relay streams, and the splitting of their windows into unit windows.

A :class:`Lane` reads some units (key buckets) of one physical partition
through one :class:`~._fetch.RelayFetcher` with the relay's mod filter
(``PartitionFilter.mod(buckets, lane_buckets)``), from one position: units
whose claimed checkpoints are equal share a lane; units claimed later start
a new lane, so the lanes already running never pause. Revoking a unit takes
it out of its lane (its windows are no longer split out, and those already
queued are dropped at dequeue); a lane left without units is stopped.

Splitting (:meth:`Lane.split`, the fetcher's sink, so it runs in the lane's
task): a decoded window holds events of several units. Their buckets come
from the raw window's ``key_hash`` header column in one numpy operation
(``key_hash % buckets``); the events go to one :class:`~._model.Window` per
unit that has some (``unit`` set, ``partition`` the physical partition).
Logical messages and schema changes go with the window of the partition's
bucket-0 unit (so the group delivers each once; no other member has bucket
0), a data-loss signal with every unit's window. The result is a
:class:`LaneBatch`: the unit windows plus the source window's position, by
which the units of the lane without events advance (position only, see
:meth:`~._group_position.GroupPositions.advance_to`).

Bootstrap (``bootstrap_servers``) works per lane: the lane's filter goes to
the bootstrap server, snapshot and catch-up windows are split like relay
windows (the bootstrapper hands the raw pages along), and every unit of the
lane carries the bootstrap progress as its checkpoint. A lane resumes a
bootstrap when its units' shared checkpoint is in a bootstrap mode.

Not thread-safe: a lane belongs to its member's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import aiohttp
import numpy as np

from changebus.schemas import (
    FIRST_CONTROL_OP,
    Op,
    PartitionCheckpoint,
    PartitionFilter,
    ProtocolError,
    Unit,
)

from ._assembler import RawWindow
from ._config import ConsumerConfig
from ._decode import SchemaCache
from ._fetch import RelayFetcher, start_point
from ._model import ChangeEvent, ChangeOp, Window
from ._queue import BoundedQueue, QueueClosed

if TYPE_CHECKING:
    from ._group_position import GroupPositions

__all__ = ["Lane", "LaneBatch", "lane_config"]

#: windows with at least this many events are split with numpy, smaller ones with lists
_VECTOR_MIN = 16

#: the op code of a TRUNCATE event in a raw window's headers
_TRUNCATE = int(Op.TRUNCATE)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, eq=False)
class LaneBatch:
    """What one source window of a lane gives: unit windows and the window's position.

    ``windows`` are ``(unit, window)`` for the units with something to
    deliver; the lane's other units advance to ``scn`` (``checkpoint``: the
    bootstrap progress after the window, when bootstrapping). ``nbytes`` is
    the source window's wire size (flow control of the member's queue).
    """

    lane: Lane | None
    scn: int
    timestamp_ns: int
    checkpoint: PartitionCheckpoint | None
    windows: tuple[tuple[Unit, Window], ...]
    nbytes: int


#: a batch of no lane: wakes up a consumer waiting for windows (a rebalance to handle)
WAKE = LaneBatch(None, -1, 0, None, (), 0)


def lane_config(
    group: ConsumerConfig,
    partition: str,
    buckets: frozenset[int],
    relays: tuple[str, ...],
    bootstrap: tuple[str, ...],
) -> ConsumerConfig:
    """The plain consumer configuration of one lane: one partition, the lane's buckets."""
    key_filter = (
        None if len(buckets) == group.buckets else PartitionFilter.mod(group.buckets, buckets)
    )
    return replace(
        group,
        group="",
        partitions=(),
        zookeeper="",
        cluster="",
        partition=partition,
        filter=key_filter,
        relays=relays,
        bootstrap_servers=bootstrap,
    )


class _LaneSink:
    """The lane fetcher's :class:`~._queue.WindowSink`: split, then queue the batch."""

    def __init__(self, lane: Lane, queue: BoundedQueue[LaneBatch]) -> None:
        self._lane = lane
        self._queue = queue

    async def put(self, window: Window, raw: RawWindow | None = None) -> None:
        await self._queue.put(self._lane.split(window, raw))

    async def fail(self, error: BaseException) -> None:
        await self._queue.fail(error)


class Lane:
    """Some units of one partition read through one relay stream (module docstring).

    ``start`` is the units' shared claimed checkpoint (None: nothing stored,
    start as ``config.start`` says).
    """

    def __init__(
        self,
        config: ConsumerConfig,
        session: aiohttp.ClientSession,
        queue: BoundedQueue[LaneBatch],
        units: Sequence[Unit],
        start: PartitionCheckpoint | None,
        buckets: int,
        number: int,
    ) -> None:
        self.partition = config.partition or ""
        self.buckets = buckets
        self.name = f"{self.partition}#{number}"
        #: bucket -> unit, and bucket -> unit text, of the units still in the lane
        self.units: dict[int, Unit] = {u.bucket: u for u in units}
        self.texts = {u.bucket: str(u) for u in units}
        # the lane's filter keeps one bucket: every event is that unit's
        self._only = units[0].bucket if len(units) == 1 else None
        #: the last batch dequeued whose position the units without events did not take yet
        self.unadvanced: LaneBatch | None = None
        self.advanced_at = 0.0
        #: the last batch dequeued (every window of the lane up to it was handed out)
        self.dequeued: LaneBatch | None = None
        self.start_checkpoint = start
        self._start_setting = config.start
        self.cache = SchemaCache.for_config(config)
        position, latest, resume = start_point(start, config, f"units {self.describe()}")
        self.fetcher = RelayFetcher(
            config,
            session,
            _LaneSink(self, queue),
            self.cache,
            position=position,
            latest=latest,
            partition=self.partition,
            resume=resume,
        )
        self._task: asyncio.Task[None] | None = None
        self.stopped = False

    def restart_point(self) -> tuple[bool, PartitionCheckpoint | None]:
        """``(possible, start)``: where a lane for (some of) these units would go on from.

        After the last batch dequeued: a new lane started there neither skips
        nor repeats a window of the units. Not while bootstrapping, nor, when the
        lane started at the newest window, before the relay said where that is.
        """
        batch = self.dequeued
        if batch is None:
            if self.start_checkpoint is not None or self._start_setting != "latest":
                return True, self.start_checkpoint
            resolved = self.fetcher.stream.resolved_latest  # (the relay said where)
            if resolved is None or resolved < 0 or self.fetcher.phase != "online":
                # (-1: an empty buffer, a start that means "latest" again; a bootstrap
                # moved past it)
                return False, None
            return True, PartitionCheckpoint(window_scn=resolved, prev_scn=resolved)
        if batch.checkpoint is not None:
            return False, None
        return True, PartitionCheckpoint(
            window_scn=batch.scn, prev_scn=batch.scn, timestamp_ns=batch.timestamp_ns
        )

    def describe(self) -> str:
        return ", ".join(str(u) for _, u in sorted(self.units.items()))

    def start(self) -> None:
        self._task = asyncio.create_task(self.fetcher.run(), name=f"changebus-lane-{self.name}")

    def retire(self) -> None:
        """Stop at once: no unit any more, batches still queued are dropped at dequeue."""
        self.stopped = True
        self.units = {}
        self.unadvanced = None
        if self._task is not None:
            self._task.cancel()

    async def stop(self) -> None:
        """:meth:`retire` and wait for the fetcher task to end (idempotent)."""
        self.retire()
        task, self._task = self._task, None
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError, QueueClosed):
                await task

    def drop(self, units: Sequence[Unit]) -> bool:
        """Take ``units`` out of the lane; whether it has none left."""
        kept = {b: u for b, u in self.units.items() if u not in units}
        self.units = kept
        return not kept

    # ---- positions of units without events ------------------------------------

    def advance_idle(
        self, batch: LaneBatch, positions: GroupPositions, held: dict[str, Window] | None
    ) -> None:
        """The lane's units without a window in ``batch`` move past it (position only).

        Every window of those units before ``batch`` was handed out (the
        batches of a lane are dequeued in order, and the next one only once
        the windows of the last are handed out), so this skips nothing.
        ``held`` (iterator mode) are the windows yielded and not committed,
        by unit: such a unit's pending window is replaced by an empty one at
        ``batch`` (committing it covers both). The consumer calls this at most
        every 50 ms per lane and when idle: a position-only advance saves
        re-reading windows without events after a move, nothing else, and
        costs a pass over the lane's units.
        """
        self.unadvanced = None
        units = self.units
        if len(batch.windows) == len(units):
            return
        got = {u.bucket for u, _ in batch.windows}
        online = PartitionCheckpoint(
            window_scn=batch.scn, prev_scn=batch.scn, timestamp_ns=batch.timestamp_ns
        )
        for bucket, text in self.texts.items():
            if bucket in got or bucket not in units:
                continue
            if held is not None and text in held:
                held[text] = Window(
                    batch.scn,
                    batch.timestamp_ns,
                    self.partition,
                    checkpoint=batch.checkpoint,
                    unit=text,
                )
            else:
                positions.advance_to(text, batch.scn, batch.timestamp_ns, batch.checkpoint, online)

    # ---- splitting ------------------------------------------------------------

    def split(self, window: Window, raw: RawWindow | None) -> LaneBatch:
        """``window`` as unit windows (module docstring)."""
        units = self.units
        events = window.events
        groups: dict[int, Sequence[ChangeEvent]] = {}
        if events:
            if self._only is not None:
                groups = {self._only: events}  # the relay filters for the one bucket
            else:
                groups = self._group(events, raw)
        if (
            groups
            and self._only is None
            and raw is not None
            and (raw.headers["op"] == _TRUNCATE).any()
        ):
            groups = _truncates_everywhere(events, groups, units)
        extra = bool(window.schema_changes or window.messages)
        loss = window.data_loss
        if loss is not None:
            keys: Any = units
        elif extra and 0 in units and 0 not in groups:
            keys = (*groups, 0)
        else:
            keys = groups
        out: list[tuple[Unit, Window]] = []
        total = len(events) or 1
        for bucket in keys:
            unit = units.get(bucket)
            if unit is None:
                continue  # revoked meanwhile
            evs = groups.get(bucket, ())
            first = bucket == 0
            out.append(
                (
                    unit,
                    Window(
                        window.scn,
                        window.timestamp_ns,
                        window.partition,
                        tuple(evs),
                        window.source_position,
                        window.schema_changes if first else (),
                        window.messages if first else (),
                        loss,
                        window.nbytes * len(evs) // total,
                        window.phase,
                        window.checkpoint,
                        self.texts[bucket],
                    ),
                )
            )
        return LaneBatch(
            self, window.scn, window.timestamp_ns, window.checkpoint, tuple(out), window.nbytes
        )

    def _group(
        self, events: tuple[ChangeEvent, ...], raw: RawWindow | None
    ) -> dict[int, Sequence[ChangeEvent]]:
        """The events by bucket, from the raw window's key hashes (one numpy pass)."""
        if raw is None:
            raise ProtocolError(f"lane {self.name}: a window with events came without its raw form")
        headers = raw.headers
        n = len(events)
        bks: list[int]
        if n < _VECTOR_MIN:
            # a handful of events: plain lists beat numpy's per-call cost (as in _decode)
            m = self.buckets
            bks = [
                h % m
                for h, op in zip(headers["key_hash"].tolist(), headers["op"].tolist(), strict=True)
                if op < FIRST_CONTROL_OP
            ]
            if len(bks) != n:
                raise ProtocolError(f"lane {self.name}: window {raw.scn} does not match its events")
            first = bks[0]
            if bks.count(first) == n:
                return {first: events}
        else:
            hashes = headers["key_hash"]
            if len(hashes) != n:
                hashes = hashes[headers["op"] < FIRST_CONTROL_OP]
                if len(hashes) != n:
                    raise ProtocolError(
                        f"lane {self.name}: window {raw.scn} does not match its events"
                    )
            vec = hashes % np.uint64(self.buckets)
            first = int(vec[0])
            if not (vec != first).any():
                return {first: events}
            bks = vec.tolist()
        groups: dict[int, list[ChangeEvent]] = {}
        for event, bucket in zip(events, bks, strict=True):
            found = groups.get(bucket)
            if found is None:
                groups[bucket] = [event]
            else:
                found.append(event)
        return dict(groups)


def _truncates_everywhere(
    events: Sequence[ChangeEvent],
    groups: dict[int, Sequence[ChangeEvent]],
    units: Mapping[int, Unit],
) -> dict[int, Sequence[ChangeEvent]]:
    """Every owned bucket gets the window's TRUNCATE events, in their place.

    A TRUNCATE has no key: its hash (the empty key's) names one bucket, but it
    empties the table for all of them. Each unit's window keeps the window's
    order: its own events, and the truncates between them.
    """
    bucket_of = {id(e): b for b, evs in groups.items() for e in evs}
    return {
        b: [e for e in events if e.op is ChangeOp.TRUNCATE or bucket_of.get(id(e)) == b]
        for b in units
    }
