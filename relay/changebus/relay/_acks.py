"""Acknowledging a partition's source: through the fence, never backwards, after the sync.

One job: tell the fetcher how far the relay holds the source's changes (the
fetcher then lets the source forget them: a Postgres slot's
``confirmed_flush_lsn``). :class:`SourceAcks` is mixed into
:class:`~._host.PartitionHost` (whose state it uses):

* with ``durability = "page_cache"`` the ingest acknowledges each group
  right after appending it (:meth:`SourceAcks._acknowledge`);
* with ``durability = "fsync"`` the acknowledger task
  (:meth:`SourceAcks._ack_synced`, one per fetcher run) acknowledges up to
  the syncer's ``synced_scn`` after each grouped sync (:mod:`._syncer`), so
  acknowledgements trail the appends asynchronously and never pass what is
  on disk;
* a leader of a relay cluster asks its :class:`IngestFence` first: the
  source is acknowledged up to ``min(scn, fence.ack_scn(scn))``, and not at
  all when the fence refuses (:class:`Fenced` stops the ingest);
  :meth:`SourceAcks.acknowledge_held` releases what the fence held back once
  the followers caught up.

Acknowledgements to one fetcher never go backwards. Everything here runs on
the event loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from changebus.fetchers import Fetcher, WindowFeed

if TYPE_CHECKING:
    from ._buffer import EventBuffer
    from ._syncer import GroupSyncer

__all__ = ["Fenced", "IngestFence", "SourceAcks"]


class IngestFence(Protocol):
    """What a leading partition checks before it appends or acknowledges (:mod:`._host`)."""

    def admit(self) -> bool:
        """True while the group may be appended (writer thread: must be thread-safe)."""
        ...

    def ack_scn(self, scn: int) -> int | None:
        """How far the source may be acknowledged for a group ending at ``scn``.

        At most ``scn``; below 0: nothing yet; None: not at all (fenced).
        Event loop.
        """
        ...

    def refused(self, reason: str) -> None:
        """The ingest stopped because a check failed (event loop)."""
        ...


class Fenced(Exception):
    """A fence check failed: the ingest stops (never leaves the relay's ingest)."""


class SourceAcks:
    """The acknowledging side of :class:`~._host.PartitionHost` (module docstring)."""

    # the host's state this side uses, set up by PartitionHost.__init__
    buffer: EventBuffer
    fetcher: Fetcher | None
    fence: IngestFence | None
    state: str
    syncer: GroupSyncer | None
    #: the newest SCN acknowledged to ``_acked_by``
    _acked_by: Fetcher | None
    _acked_scn: int

    @property
    def durable_scn(self) -> int:
        """The newest SCN the source may be told the relay holds (before the fence).

        ``durability = "fsync"``: the syncer's ``synced_scn``; else the
        buffer's newest SCN.
        """
        if self.syncer is not None:
            return self.syncer.synced_scn
        return self.buffer.meta.last_scn

    async def _acknowledge(self, fetcher: Fetcher, scn: int) -> None:
        """Acknowledge ``scn`` as far as the fence allows; raises :class:`Fenced` if refused.

        The lease is checked here, when the position is handed to the fetcher,
        not when the fetcher's own thread later sends it to the source (the
        Postgres fetcher sends its standby status on its own schedule). That is
        safe only because the position is at most the followers' hold at the
        time of the check (``fence.ack_scn``), and a follower's held SCN never
        goes backwards: whoever leads next still holds everything after it. A
        change that lets the acknowledged position pass the hold must move the
        lease check next to the send.
        """
        fence = self.fence
        if fence is not None:
            limit = fence.ack_scn(scn)
            if limit is None:
                raise Fenced("the leadership lease is not valid: source not acknowledged")
            if limit < 0:
                return
            scn = limit
        if fetcher is self._acked_by and scn < self._acked_scn:
            return  # never backwards
        self._acked_by, self._acked_scn = fetcher, scn
        await fetcher.acknowledge(scn)

    async def _ack_synced(self, fetcher: Fetcher, queue: WindowFeed) -> None:
        """Acknowledge what the syncer made durable, after each sync (``durability = "fsync"``).

        Up to ``synced_scn`` at each wake-up (several syncs meanwhile: one
        ack). A fence refusal goes to the ingest loop through ``queue``,
        which stops it like a refused group.
        """
        assert self.syncer is not None
        scn = -1
        try:
            while True:
                scn = await self.syncer.wait_synced(scn)
                await self._acknowledge(fetcher, scn)
        except Fenced as exc:
            queue.inject(exc)

    async def acknowledge_held(self) -> None:
        """Acknowledge what the fence now allows of the buffer (a leader's periodic catch-up).

        The fence may have held an acknowledgement back (followers behind);
        this releases it once they caught up, with the same check (and,
        with ``durability = "fsync"``, no further than what is synced).
        """
        fetcher, fence = self.fetcher, self.fence
        if fetcher is None or fence is None or self.state != "streaming":
            return
        last = self.durable_scn
        limit = fence.ack_scn(last) if last >= 0 else -1
        if limit is not None and limit >= 0:
            await fetcher.acknowledge(limit)
