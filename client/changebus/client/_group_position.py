"""A group member's positions: one checkpoint per owned unit, written through a ``UnitStore``.

:class:`GroupPositions` implements the :class:`~._position.Positions`
interface of the :class:`~._dispatch.Dispatcher` over entries keyed by unit
text (``orders.17``): ``current`` and ``committed`` are
:class:`~changebus.schemas.Checkpoint` values with one entry per owned unit.
Three positions per unit (``_Entry``):

* ``current`` -- after the last window of the unit the application finished;
* ``accepted`` -- the last one the application committed (``persist``:
  iterator commit, callbacks ``on_checkpoint``); ``committed`` shows these.
  A rollback returns ``current`` here;
* ``stored`` -- the last one written to the store, with the fencing
  ``token`` of the unit's claim (the store hands a new token back with each
  write).

Invariant per unit: ``stored`` <= ``accepted`` <= ``current`` (SCN order).
``persist`` accepts at once and writes to the store at most every
``commit_interval_s`` (:meth:`flush` does the writing; the engine also calls
it on a timer, on revoke and on close). A crash therefore replays the
windows after the last *stored* position: at-least-once.

Units without events in a lane window advance by :meth:`advance_to`
(position only). Such an advance is accepted too when nothing processed of
the unit waits for a commit, so idle units' positions reach the store.

A write the store refuses (the unit was claimed by another member) is
reported to ``on_fenced``; the engine drops the unit.

Used from one event loop; :meth:`flush` calls never overlap (a lock).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from types import MappingProxyType
from typing import Any

from changebus.schemas import (
    Checkpoint,
    CheckpointError,
    Mode,
    PartitionCheckpoint,
    Unit,
    UnitClaim,
    UnitCommit,
    UnitStore,
)

from ._model import Window

__all__ = ["GroupPositions"]

log = logging.getLogger(__name__)

_EMPTY = PartitionCheckpoint()


class _Entry:
    """One owned unit's positions and claim token (module docstring)."""

    __slots__ = ("accepted", "current", "stored", "token", "unit")

    def __init__(self, claim: UnitClaim) -> None:
        self.unit = claim.unit
        self.token = claim.token
        self.stored = claim.checkpoint
        start = claim.checkpoint if claim.checkpoint is not None else _EMPTY
        self.current = start
        self.accepted = start


def _checkpoint(entries: dict[str, PartitionCheckpoint]) -> Checkpoint:
    """A Checkpoint of ``entries`` without validating the names again (unit texts are valid)."""
    cp = object.__new__(Checkpoint)
    object.__setattr__(cp, "partitions", MappingProxyType(entries))
    return cp


class GroupPositions:
    """The owned units' checkpoints (module docstring)."""

    def __init__(
        self,
        store: UnitStore,
        group: str,
        commit_interval_s: float,
    ) -> None:
        self._store = store
        self._group = group
        self._interval = commit_interval_s
        #: told the units whose commit the store refused (the consumer drops them)
        self.on_fenced: Callable[[frozenset[Unit]], None] = lambda units: None
        self._entries: dict[str, _Entry] = {}
        # entries whose current is ahead of accepted (persist and rollback touch only these)
        self._moved: set[_Entry] = set()
        self._online = _EMPTY  # the newest online position made by advance()
        self._lock = asyncio.Lock()
        self._last_flush = time.monotonic()
        #: store writes done, and units refused by the store
        self.persisted = 0
        self.fenced_commits = 0

    # ---- units ------------------------------------------------------------

    def add(self, claim: UnitClaim) -> None:
        """Track a newly claimed unit from its claimed checkpoint."""
        self._entries[str(claim.unit)] = _Entry(claim)

    def remove(self, units: Iterable[Unit]) -> None:
        """Stop tracking ``units`` (nothing is written)."""
        for unit in units:
            entry = self._entries.pop(str(unit), None)
            if entry is not None:
                self._moved.discard(entry)

    def __contains__(self, unit: str) -> bool:
        return unit in self._entries

    def position(self, unit: Unit) -> PartitionCheckpoint | None:
        """The current position of ``unit`` (None when not tracked)."""
        entry = self._entries.get(str(unit))
        return entry.current if entry is not None else None

    def stored(self) -> dict[Unit, PartitionCheckpoint | None]:
        """What the store holds of each tracked unit (as far as this member wrote it)."""
        return {e.unit: e.stored for e in self._entries.values()}

    # ---- the Positions interface --------------------------------------------

    @property
    def current(self) -> Checkpoint:
        return _checkpoint({k: e.current for k, e in self._entries.items()})

    @property
    def committed(self) -> Checkpoint:
        return _checkpoint({k: e.accepted for k, e in self._entries.items()})

    def advance(self, window: Window) -> None:
        """``current`` of ``window.unit`` moves past ``window``."""
        entry = self._entries.get(window.unit)
        if entry is None:
            return
        before = entry.current
        if (
            window.checkpoint is None
            and before.mode is Mode.ONLINE
            and window.scn > before.window_scn
        ):
            # the unit windows of one source window come one after another: one
            # checkpoint object serves them all (equal to before.on_end_of_window)
            last = self._online
            if last.window_scn != window.scn or last.timestamp_ns != window.timestamp_ns:
                last = self._online = PartitionCheckpoint(
                    window_scn=window.scn, prev_scn=window.scn, timestamp_ns=window.timestamp_ns
                )
            entry.current = last
        else:
            entry.current = window.position_after(before)
        self._moved.add(entry)

    def advance_to(
        self,
        unit: str,
        scn: int,
        timestamp_ns: int,
        checkpoint: PartitionCheckpoint | None,
        online: PartitionCheckpoint,
    ) -> None:
        """A lane window without events of ``unit``: its position moves past it.

        ``online`` is the online checkpoint after the window (shared by the
        lane's units); ``checkpoint`` the window's own (bootstrap progress;
        None: a relay window, after which the unit is online).
        Accepted as well when nothing of the unit waits for a commit.
        """
        entry = self._entries.get(unit)
        if entry is None:
            return
        before = entry.current
        if checkpoint is not None:
            after = checkpoint
        elif before.mode is Mode.ONLINE and scn <= before.window_scn:
            return
        else:
            # a relay window (a bootstrap's windows carry their checkpoint): online
            # whatever ``before`` says, as Window.position_after. The lane's last catch-up
            # batch, which carries the online checkpoint, may have been passed over (the
            # advances are throttled): a unit left in bootstrap-catchup past the target
            # went back to the target after a restart or a move, read the relays again
            # from there, and showed the wrong mode (found by review)
            if scn < before.window_scn:
                raise CheckpointError(
                    f"window SCN {scn} goes back before checkpoint {before.window_scn}"
                )
            after = online
        entry.current = after
        if entry.accepted is before:
            entry.accepted = after
        else:
            self._moved.add(entry)

    def settle_unstarted(self, unit: Unit, checkpoint: PartitionCheckpoint) -> None:
        """A unit with no position yet (claimed without a checkpoint, its lane started at
        the newest window and handed nothing out): ``checkpoint``, where that lane's
        windows start, becomes it, so a final flush writes it. Without it the next owner
        started at its own newest window and the windows between were read by nobody
        (review)."""
        entry = self._entries.get(str(unit))
        if entry is not None and entry.accepted == _EMPTY and entry.current == _EMPTY:
            entry.current = entry.accepted = checkpoint

    async def persist(self) -> None:
        """Accept every current position; write to the store when ``commit_interval_s`` passed."""
        for entry in self._moved:
            entry.accepted = entry.current
        self._moved.clear()
        if time.monotonic() - self._last_flush >= self._interval and not self._lock.locked():
            await self.flush(quiet=True)

    def rollback(self) -> None:
        """``current`` back to the accepted positions."""
        for entry in self._moved:
            entry.current = entry.accepted
        self._moved.clear()

    def accept(self, units: Iterable[Unit]) -> None:
        """Accept the current positions of ``units`` (iterator mode: they hold no uncommitted window)."""
        for unit in units:
            entry = self._entries.get(str(unit))
            if entry is not None:
                entry.accepted = entry.current
                self._moved.discard(entry)

    # ---- writing ------------------------------------------------------------

    async def flush(
        self, units: Iterable[Unit] | None = None, *, quiet: bool = False
    ) -> frozenset[Unit]:
        """Write the accepted positions that differ from the stored ones; the fenced units.

        ``units`` limits the write (revoke). ``quiet``: a store error is
        logged (the next flush tries again) instead of raised.

        A cancelled caller does not cancel the write: it runs on in a task of
        its own, holding the lock until the store answered and ``stored`` /
        ``token`` say what it wrote. Cancelled mid-write, the write went on
        in the store's thread while the lock was free, and the next flush
        (the final one of a shutdown) could land first and be overwritten by
        the older checkpoint (found by review).
        """
        task = asyncio.ensure_future(self._flush(units, quiet))
        task.add_done_callback(_retrieved)
        return await asyncio.shield(task)

    async def _flush(self, units: Iterable[Unit] | None, quiet: bool) -> frozenset[Unit]:
        """:meth:`flush`'s write, under the lock."""
        async with self._lock:
            self._last_flush = time.monotonic()
            if units is None:
                entries = list(self._entries.values())
            else:
                entries = [e for u in units if (e := self._entries.get(str(u))) is not None]
            todo = [
                (e, e.accepted) for e in entries if e.accepted != e.stored and e.accepted != _EMPTY
            ]
            if not todo:
                return frozenset()
            commits = [UnitCommit(e.unit, pc, e.token) for e, pc in todo]
            try:
                result = await self._store.commit(self._group, commits)
            except Exception as exc:
                if not quiet:
                    raise
                log.warning(
                    "group %s: checkpoint write failed (%s); trying again later", self._group, exc
                )
                return frozenset()
            self.persisted += 1
            for entry, pc in todo:
                token = result.tokens.get(entry.unit)
                if token is not None:
                    entry.token = token
                    entry.stored = pc
            # a unit dropped (or dropped and claimed again) meanwhile is not this write's business
            fenced = frozenset(
                e.unit
                for e, _ in todo
                if e.unit in result.fenced and self._entries.get(str(e.unit)) is e
            )
            if fenced:
                self.fenced_commits += len(fenced)
                log.warning(
                    "group %s: the store refused the checkpoints of %s (claimed by another member)",
                    self._group,
                    ", ".join(sorted(map(str, fenced))),
                )
                self.on_fenced(fenced)
            return fenced


def _retrieved(task: asyncio.Future[Any]) -> None:
    """A flush whose caller was cancelled has nobody to raise to: what it did not
    write stays unwritten (``stored`` unchanged), and the next flush writes it."""
    if not task.cancelled():
        task.exception()
