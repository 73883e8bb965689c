"""One partition's figures: the state its producer, applier and seed share with the HTTP side.

A :class:`PartitionWorker` is a plain mutable record: the producer, log
writer, applier and seed tasks of its partition update it, ``/v1/status``
and ``/metrics`` read it. Its SCNs mirror what the store has committed
(they are set from a :class:`~._store.PartitionState` after each store
call), so they never run ahead of the store.

Thread-safety: event loop only. The store threads never touch it; the
seeder's thread updates only :attr:`PartitionWorker.seed` (a
:class:`~._seedtypes.SeedProgress`, see there).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from ._lost import Gap
from ._seedtypes import SeedProgress

__all__ = ["PartitionWorker"]


@dataclass
class PartitionWorker:
    """Producer and applier of one partition, and their figures (event loop only)."""

    name: str
    state: str = "starting"
    producer_scn: int = -1
    applier_scn: int = -1
    log_min_scn: int = -1
    base_scn: int = -1
    lag_events: int = 0
    windows_appended: int = 0
    events_appended: int = 0
    events_applied: int = 0
    #: tombstones purged (:mod:`._purge`) and the SCN up to which they may be gone
    tombstones_purged: int = 0
    tomb_scn: int = -1
    fell_off: int = 0
    #: DATA_LOSS windows received from the relay
    data_loss: int = 0
    last_error: str = ""
    #: a gap in the log not repaired yet: positions before it are refused
    gap: Gap | None = None
    last_window_ts_ns: int = 0
    applied_at: float = field(default_factory=time.monotonic)
    seed: SeedProgress = field(default_factory=SeedProgress)
    seeding: asyncio.Task[None] | None = None
    #: rows and chunks the seed runs before :attr:`seed` read (``/metrics`` counters)
    seed_rows_before: int = 0
    seed_chunks_before: int = 0
    #: the tables the current seed run copies (empty until it knows: all of them)
    seed_tables: frozenset[str] = frozenset()
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    #: the producer's relay stream while it reads (its ``answering`` and ``last_error``)
    stream: Any = None
    #: bytes of windows between the producer and their log transaction (``/v1/status``)
    queued_bytes: int = 0

    def current_state(self) -> str:
        """:attr:`state`, but ``connecting`` while the producer's stream gets no answer
        from any relay: it retries for ever, so a server whose relays were all down
        said ``streaming`` and ready (found by review)."""
        stream = self.stream
        if self.state == "streaming" and stream is not None and not stream.answering:
            return "connecting"
        return self.state

    def current_error(self) -> str:
        """:attr:`last_error`, or the stream's while it is connecting."""
        if self.current_state() == "connecting":
            return str(self.stream.last_error) or self.last_error
        return self.last_error

    def new_seed(self) -> SeedProgress:
        """A new seed run's progress (state ``starting``) replaces :attr:`seed`, whose
        rows and chunks are added to the totals before it."""
        self.seed_rows_before += self.seed.rows
        self.seed_chunks_before += self.seed.chunks
        self.seed = SeedProgress(state="starting")
        self.seed_tables = frozenset()
        return self.seed

    def status(self) -> dict[str, Any]:
        return {
            "partition": self.name,
            "state": self.current_state(),
            "producer_scn": self.producer_scn,
            "applier_scn": self.applier_scn,
            "log_min_scn": self.log_min_scn,
            "base_scn": max(self.base_scn, self.tomb_scn),
            "tomb_scn": self.tomb_scn,
            "tombstones_purged": self.tombstones_purged,
            "applier_lag_events": self.lag_events,
            "queued_bytes": self.queued_bytes,
            "windows_appended": self.windows_appended,
            "events_appended": self.events_appended,
            "events_applied": self.events_applied,
            "fell_off": self.fell_off,
            "data_loss": self.data_loss,
            "last_error": self.current_error(),
            "gap": self.gap.as_dict() if self.gap is not None else None,
            "seed": self.seed.as_dict(),
        }
