"""A daemon-wide budget of response copies: bytes held for clients that read slowly.

The relay's follow-mode pushes and ``format=ndjson`` answers are copies
taken out of the ring (the ring may be overwritten under a slow reader, a
copy cannot); the bootstrap server's snapshot and catch-up pages are built
whole from its store. Each such copy lives until its client has taken it; a
client that stalls keeps it for up to the send timeout. Without a bound, a
thousand lagging followers asking for 1 MiB pushes held over a GiB (a
thousand bootstrap clients asking for 16 MiB pages, 16 GiB). This budget
bounds the sum, and it does so without ever making a request wait:

* the daemon serves at most ``slots`` (``http.max_connections``) requests at
  once, each holding at most one grant;
* every request may always have ``floor`` bytes (at most 64 KiB, less when
  ``limit / slots`` is smaller): a grant beyond the floor comes only out of
  the bytes no other possible request's floor needs.

Data structure: ``held`` bytes in ``holders`` grants, and ``reserved``, the
same grants each counted as at least ``floor`` (a request holding less
still keeps its slot's floor). Invariant (between calls): ``limit -
reserved >= floor * (slots - holders)``, so a new request finds at least
its floor free, and ``held <= reserved <= limit``. A copy larger than
its grant (a single event bigger than the grant: the buffer selects at
least one) is charged in full by :meth:`resize`; that overshoot is bounded
by one event per request and is what the ``floor`` fallback in
:meth:`grant` covers.

Thread-safety: event loop only (the HTTP handlers); no locking.
"""

from __future__ import annotations

from changebus.schemas import ConfigError

__all__ = ["MIN_FLOOR", "CopyBudget", "check_copy_budget", "copy_floor"]

#: a grant never needs more than this to make progress (a push of 64 KiB fills a socket buffer)
_MAX_FLOOR = 64 * 1024
#: below this a daemon would answer in crumbs: the configuration is refused
MIN_FLOOR = 4 * 1024


def copy_floor(limit: int, slots: int) -> int:
    """The bytes every one of ``slots`` requests may always have out of ``limit``."""
    return min(_MAX_FLOOR, limit // max(1, slots))


def check_copy_budget(limit: int, slots: int) -> None:
    """Refuse ``http.max_copy_bytes`` = ``limit`` that leaves one of ``slots``
    (``http.max_connections``) requests less than :data:`MIN_FLOOR`."""
    if copy_floor(limit, slots) < MIN_FLOOR:
        raise ConfigError(
            f"http.max_copy_bytes ({limit}) must give each of http.max_connections ({slots})"
            f" at least {MIN_FLOOR} bytes: raise it to {MIN_FLOOR * slots} or lower"
            " max_connections"
        )


class CopyBudget:
    """Bytes of response copies held at once (module docstring)."""

    def __init__(self, limit: int, slots: int) -> None:
        floor = copy_floor(limit, slots)
        if floor < MIN_FLOOR:  # HttpConfig refuses such a configuration already
            raise ConfigError(f"a copy budget of {limit} bytes is too small for {slots} slots")
        self.limit = limit
        self.slots = slots
        self.floor = floor
        self.held = 0
        self.reserved = 0
        self.holders = 0
        #: grants that got less than asked for (the budget was busy)
        self.cut = 0
        #: the most bytes held at once since start
        self.peak = 0
        #: follow streams parked in any partition's tail broadcast (kept by
        #: :class:`~._broadcast.TailBroadcast`, which sizes its pushes by it)
        self.parked = 0

    def spare(self) -> int:
        """What a new grant could get now: the free bytes no other request's floor needs."""
        others = max(0, self.slots - self.holders - 1)
        return self.limit - self.reserved - self.floor * others

    def grant(self, want: int) -> int:
        """Take up to ``want`` bytes (at least ``min(want, floor)``); give them back with :meth:`release`."""
        got = min(want, self.spare())
        if got < min(want, self.floor):  # only after overshoots by single large events
            got = min(want, self.floor)
        if got < want:
            self.cut += 1
        self.held += got
        self.reserved += max(got, self.floor)
        self.holders += 1
        self.peak = max(self.peak, self.held)
        return got

    def resize(self, granted: int, used: int) -> int:
        """Charge a grant its real size ``used`` (the copy made under it); returns ``used``."""
        self.held += used - granted
        self.reserved += max(used, self.floor) - max(granted, self.floor)
        self.peak = max(self.peak, self.held)
        return used

    def release(self, charged: int) -> None:
        """Give back a grant (its size as last charged)."""
        self.held -= charged
        self.reserved -= max(charged, self.floor)
        self.holders -= 1
