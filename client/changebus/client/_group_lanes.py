"""A group member's set of lanes: creating, narrowing and merging them, and their relays.

:class:`LaneSet` holds the running :class:`~._group_lane.Lane` objects of
one member and the relays (and bootstrap servers) of each partition, kept
current by the consumer (static, or from a cluster's routing table). The
unit bookkeeping (:class:`~._group_units.UnitOwner`) asks it for lanes and
hands it its ``held`` map (unit -> lane), which :meth:`LaneSet.narrow` and
:meth:`LaneSet.merge` update when they replace lanes:

* **narrow**: a lane that keeps some units after a revoke is replaced by one
  filtering for those only, so the relay stops sending the events of the
  units given away (a member keeping a quarter of its units would otherwise
  still receive and decode all of them);
* **merge**: lanes of one partition whose last dequeued batch is the same
  window, while the member is idle, become one lane (with fewer lanes the
  relay sends each window's control events fewer times).

Either way the new lane starts after the last window the old lanes' units
were handed (:meth:`~._group_lane.Lane.restart_point`), so it neither skips
nor repeats a window of them; an old lane is retired at once (its batches
still queued are dropped and move no position).

The event loop of the consumer only.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from typing import Any

import aiohttp

from changebus.schemas import PartitionCheckpoint, Unit

from ._config import ConsumerConfig
from ._group_lane import Lane, LaneBatch, lane_config
from ._queue import BoundedQueue

__all__ = ["LaneSet"]

log = logging.getLogger(__name__)

Spawn = Callable[[Coroutine[Any, Any, None]], None]


class LaneSet:
    """The running lanes of one member (module docstring); iterable."""

    def __init__(
        self,
        config: ConsumerConfig,
        http: aiohttp.ClientSession,
        queue: BoundedQueue[LaneBatch],
        spawn: Spawn,
    ) -> None:
        self.config = config
        self._http = http
        self._queue = queue
        self._spawn = spawn
        self._running: set[Lane] = set()
        self._numbers = itertools.count()
        #: relays and bootstrap servers per partition
        self.relays: dict[str, tuple[str, ...]] = {}
        self.bootstrap: dict[str, tuple[str, ...]] = {}

    def __iter__(self) -> Iterator[Lane]:
        return iter(list(self._running))

    def __len__(self) -> int:
        return len(self._running)

    def new(self, partition: str, units: Sequence[Unit], start: PartitionCheckpoint | None) -> Lane:
        """A lane for ``units`` from ``start`` (not started yet)."""
        cfg = lane_config(
            self.config,
            partition,
            frozenset(u.bucket for u in units),
            self.relays[partition],
            self.bootstrap.get(partition, ()),
        )
        lane = Lane(
            cfg, self._http, self._queue, units, start, self.config.buckets, next(self._numbers)
        )
        self._running.add(lane)
        return lane

    def retire(self, lane: Lane) -> None:
        """Stop ``lane`` now (its fetcher task ends in the background)."""
        self._running.discard(lane)
        lane.retire()
        self._spawn(lane.stop())

    def narrow(self, lanes: Iterable[Lane], held: dict[Unit, Lane]) -> dict[Lane, Lane]:
        """Replace each of ``lanes`` by one filtering for its remaining units; old -> new.

        The new lane starts after the old lane's last dequeued batch: the
        windows of that batch not handed out yet are the new lane's (the
        caller re-labels them).
        """
        replaced: dict[Lane, Lane] = {}
        for lane in lanes:
            possible, start = lane.restart_point()
            if not possible or lane.stopped:
                continue
            units = sorted(lane.units.values())
            new = self.new(lane.partition, units, start)
            for unit in units:
                held[unit] = new
            self.retire(lane)
            new.start()
            replaced[lane] = new
            log.info(
                "group %s: lane %s now reads %s only", self.config.group, new.name, new.describe()
            )
        return replaced

    def merge(self, held: dict[Unit, Lane]) -> None:
        """Merge the lanes of a partition standing at one window (call when idle, see above).

        Lanes bootstrapping, and lanes that received nothing yet, are left alone.
        """
        at: dict[tuple[str, int, int], list[Lane]] = {}
        for lane in self._running:
            batch = lane.dequeued
            if batch is None or batch.checkpoint is not None or lane.stopped or not lane.units:
                continue
            at.setdefault((lane.partition, batch.scn, batch.timestamp_ns), []).append(lane)
        for (partition, scn, ts), lanes in at.items():
            if len(lanes) < 2:
                continue
            units = sorted(u for lane in lanes for u in lane.units.values())
            start = PartitionCheckpoint(window_scn=scn, prev_scn=scn, timestamp_ns=ts)
            new = self.new(partition, units, start)
            for unit in units:
                held[unit] = new
            for lane in lanes:
                self.retire(lane)
            new.start()
            log.info(
                "group %s: lanes %s merged into %s (%s) after SCN %d",
                self.config.group,
                ", ".join(lane.name for lane in lanes),
                new.name,
                new.describe(),
                scn,
            )

    # ---- relays -----------------------------------------------------------------

    def set_relays(self, partition: str, relays: tuple[str, ...]) -> None:
        """Read ``partition`` from ``relays`` (running lanes switch; see RelayStream.set_relays)."""
        self.relays[partition] = relays
        for lane in self._running:
            if lane.partition == partition:
                lane.fetcher.set_relays(relays)

    def set_bootstrap(self, partition: str, servers: tuple[str, ...]) -> None:
        """Bootstrap ``partition`` from ``servers`` from now on."""
        self.bootstrap[partition] = servers
        for lane in self._running:
            if lane.partition == partition:
                lane.fetcher.set_bootstrap_servers(servers)

    async def stop(self) -> None:
        """Stop every lane and wait for their tasks."""
        lanes, self._running = self._running, set()
        for lane in lanes:
            await lane.stop()
