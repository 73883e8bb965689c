"""One term of a partition's leadership, and its lease (fencing).

A :class:`Leadership` is what :class:`~._election.PartitionElection` gives
its member for one epoch (a term). It is lost for good (``lost_reason`` set,
callbacks and :meth:`Leadership.wait_lost` fire) when the election ends it:
the session is SUSPENDED, LOST or closed, the epoch node changes or the
candidate node is gone (both watched, and read by every heartbeat), or the
election stops (see :mod:`._election`).

Fencing: :meth:`Leadership.valid` is a *lease*. It is true only while the
leadership is not lost, kazoo reports the connection up, and the newest
heartbeat that confirmed "the epoch is still ours and our candidate exists"
was *sent* less than ``lease_fraction x session timeout`` ago (the timeout the
server granted, :attr:`ZkSession.session_timeout_s`) (monotonic
clock). ZooKeeper cannot expire the session sooner than a session timeout
after it last heard from us, and a new leader needs that expiry first, so no
other leader exists while the lease holds. A leader frozen (SIGSTOP, a GC or
VM pause) past its session sees ``valid() == False`` the moment it runs
again, before kazoo has noticed anything. Check ``valid()`` right before
every source acknowledgement and every publication of a window; it is cheap
(three attribute reads and a clock read) and thread-safe.

Thread-safety: :meth:`Leadership.valid` from any thread; ``revoked`` and
``confirmed_at`` are set by watches on kazoo's thread too (plain attribute
writes); everything else on the event loop of the session.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ._layout import EpochRecord
from ._session import ZkSession

__all__ = ["Leadership"]

log = logging.getLogger("changebus.cluster.election")


class Leadership:
    """One term of leadership of ``partition`` with ``epoch`` (see the module docstring).

    ``valid()`` may be called from any thread; the rest on the event loop.
    """

    def __init__(
        self,
        session: ZkSession,
        partition: str,
        epoch: int,
        member_id: str,
        candidate: str,
        previous: EpochRecord | None = None,
    ) -> None:
        self.partition = partition
        self.epoch = epoch
        self.member_id = member_id
        self.candidate = candidate
        #: the epoch record this term replaced: when it is this member's own previous
        #: epoch (``previous.epoch == epoch - 1``), nobody else led in between
        self.previous = previous if previous is not None else EpochRecord(epoch - 1)
        #: monotonic send time of the newest heartbeat that confirmed the epoch
        self.confirmed_at = time.monotonic()
        #: set (for good) by a watch on kazoo's thread when the epoch moved on or the
        #: candidate went: a heartbeat answer already under way cannot renew the lease
        self.revoked = False
        #: why the leadership ended; None while it lasts
        self.lost_reason: str | None = None
        self._session = session
        self._lost = asyncio.Event()
        self._callbacks: list[Callable[[Leadership], None]] = []

    @property
    def lease_s(self) -> float:
        """How long a confirmed heartbeat keeps the lease (the session's granted timeout)."""
        return self._session.lease_s

    def valid(self) -> bool:
        """True while this process may act as the leader (a lease; thread-safe)."""
        return (
            self.lost_reason is None
            and not self.revoked
            and self._session.thread_state == "connected"
            and time.monotonic() - self.confirmed_at < self.lease_s
        )

    @property
    def lost(self) -> bool:
        """True once the leadership ended (for good)."""
        return self.lost_reason is not None

    def follows_own_term(self, epoch: int) -> bool:
        """True when this term directly follows this member's term ``epoch``.

        Then no other member led in between (a re-election after a short
        ZooKeeper suspension): the source connection of that term may carry on.
        """
        return self.previous.epoch == epoch and self.previous.member_id == self.member_id

    def on_lost(self, callback: Callable[[Leadership], None]) -> None:
        """Call ``callback(self)`` on the event loop when the leadership ends (at once if over)."""
        if self.lost_reason is not None:
            callback(self)
        else:
            self._callbacks.append(callback)

    async def wait_lost(self) -> str:
        """Wait until the leadership ends; returns the reason."""
        await self._lost.wait()
        assert self.lost_reason is not None
        return self.lost_reason

    def lose(self, reason: str) -> None:
        """End the leadership (idempotent; on the event loop)."""
        if self.lost_reason is not None:
            return
        self.lost_reason = reason
        log.warning(
            "partition %s: %s no longer leads epoch %d (%s)",
            self.partition,
            self.member_id,
            self.epoch,
            reason,
        )
        self._lost.set()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback(self)
            except Exception:
                log.exception("a leadership-lost callback failed")

    def __repr__(self) -> str:
        state = "lost: " + self.lost_reason if self.lost_reason else "held"
        return f"Leadership({self.partition!r}, epoch={self.epoch}, {state})"
