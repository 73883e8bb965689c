"""The consumer's position: processed versus persisted checkpoint.

:class:`PositionTracker` holds two :class:`~changebus.schemas.Checkpoint`
values:

* ``current`` -- after the last window the application finished;
* ``committed`` -- the last one handed to the persister successfully.

Invariant: ``committed`` is ``current`` or an earlier position of it, and
windows are advanced in strictly increasing SCN order per partition.
:meth:`advance` moves ``current`` past a window, :meth:`persist` stores it,
:meth:`rollback` returns ``current`` to ``committed`` (the windows between
are to be replayed). Entries of other partitions in a loaded checkpoint are
kept as they were.

:class:`Positions` is the interface the :class:`~._dispatch.Dispatcher`
works on; a consumer group's tracker (:mod:`._group_position`, entries
keyed by unit) implements it too.

Used from the consumer's event loop only.
"""

from __future__ import annotations

import logging
from typing import Protocol

from changebus.schemas import Checkpoint

from ._model import Window
from ._persist import CheckpointPersister

__all__ = ["PositionTracker", "Positions"]


class Positions(Protocol):
    """Processed (``current``) and persisted (``committed``) positions of a consumer."""

    @property
    def current(self) -> Checkpoint: ...

    @property
    def committed(self) -> Checkpoint: ...

    def advance(self, window: Window) -> None: ...

    async def persist(self) -> None: ...

    def rollback(self) -> None: ...


log = logging.getLogger(__name__)


class PositionTracker:
    """Processed and persisted checkpoints of one consumer (module docstring)."""

    def __init__(self, checkpoint: Checkpoint, persister: CheckpointPersister) -> None:
        self.current = checkpoint
        self.committed = checkpoint
        self._persister = persister
        self.persisted = 0

    def advance(self, window: Window) -> None:
        """``current`` moves past ``window`` (which the application finished)."""
        pc = self.current.get(window.partition)
        self.current = self.current.with_partition(window.partition, window.position_after(pc))

    @property
    def dirty(self) -> bool:
        """Whether ``current`` is ahead of ``committed``."""
        return self.current != self.committed

    async def persist(self) -> None:
        """Store ``current`` (no-op when it is already stored)."""
        if not self.dirty:
            return
        checkpoint = self.current
        await self._persister.store(checkpoint)
        self.committed = checkpoint
        self.persisted += 1

    def rollback(self) -> None:
        """``current`` back to ``committed``."""
        if self.dirty:
            log.debug("position rolls back to %s", self.committed.to_json())
        self.current = self.committed
