"""The response cache: small stream responses shared by identical requests, bounded by bytes.

Many consumers long-polling at a partition's newest SCN ask the same
question whenever a window commits; the first one's answer (an immutable
copy taken out of the ring, :class:`CachedResponse`) serves the others.

Data structure: one :class:`ResponseCache` per partition, an ordered dict
from request key to response in least-recently-used order, plus the sum of
the bodies' sizes. Invariants:

* every entry was computed at the buffer tail :attr:`ResponseCache.tail`
  (the tail is part of a request's key: an entry for an older tail can never
  be asked for again, so moving on to a newer tail empties the cache);
* ``nbytes`` (the sum of the entries' body sizes) never exceeds
  ``max_bytes``: a new entry evicts the least recently used ones first;
* a body larger than ``max_entry_bytes`` is never cached (large responses
  are rarely identical, and one would push out many small shared ones).

So the cache holds at most ``max_bytes`` of bodies whatever clients ask
(follow-mode pushes included), and nothing at all once its tail is stale.

Thread-safety: event loop only (the HTTP handlers); no locking.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

__all__ = ["CachedResponse", "ResponseCache"]


@dataclass(frozen=True, slots=True)
class CachedResponse:
    """A stream response copied out of the ring (immutable, shareable)."""

    body: bytes
    next_scn: int
    next_offset: int
    events: int
    windows: int
    partial: bool


class ResponseCache:
    """Copies of responses for one partition at its current tail (module docstring)."""

    def __init__(self, max_bytes: int, max_entry_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.max_entry_bytes = min(max_entry_bytes, max_bytes)
        #: the buffer tail (event number) the entries were computed at
        self.tail = -1
        self.nbytes = 0
        self._entries: OrderedDict[tuple[Any, ...], CachedResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, tail: int, key: tuple[Any, ...]) -> CachedResponse | None:
        """The response cached for ``key`` at buffer tail ``tail`` (None: none)."""
        if tail != self.tail:
            return None
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
        return found

    def put(self, tail: int, key: tuple[Any, ...], response: CachedResponse) -> None:
        """Keep ``response`` for ``key`` at ``tail`` if it is small enough (LRU eviction)."""
        size = len(response.body)
        if size > self.max_entry_bytes or tail < self.tail or self.max_bytes <= 0:
            return
        if tail > self.tail:
            self.clear()
            self.tail = tail
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= len(old.body)
        while self._entries and self.nbytes + size > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= len(evicted.body)
        self._entries[key] = response
        self.nbytes += size

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0
