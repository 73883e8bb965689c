"""The response cache: small stream responses shared by identical requests, bounded by bytes.

Many consumers long-polling at a partition's newest SCN ask the same
question whenever a window commits; the first one's answer (an immutable
copy taken out of the ring, :class:`CachedResponse`) serves the others.
Consumers that fell behind together (a burst, a slow wake-up, many of them
on a busy machine) ask the same questions too, at whatever tail the buffer
has then: an answer that stopped at the byte limit before the tail is
*settled* (:attr:`CachedResponse.to_tail` false) and serves them across
tails, so a herd catching up selects and copies each step once.

Data structure: one :class:`ResponseCache` per partition, two ordered dicts
from request key to response in least-recently-used order (the answers that
reached the tail :attr:`ResponseCache.tail`, and the settled ones), plus the
sum of the bodies' sizes. Invariants:

* every tail entry was computed at the buffer tail :attr:`ResponseCache.tail`
  (the tail is part of such a request's key: an entry for an older tail can
  never be asked for again, so moving on to a newer tail drops them);
* a settled entry is returned only while the buffer still holds its first
  byte (``start_pos >= head_pos`` of the caller's buffer bounds): the same
  request would select exactly those bytes again, and a request for evicted
  windows still gets its 410 from the buffer;
* ``nbytes`` (the sum of the entries' costs: body, key texts and a fixed
  :data:`ENTRY_OVERHEAD` for the objects around them) never exceeds
  ``max_bytes``: a new entry evicts settled entries first, least recently used
  first, then tail entries. (Bodies alone were counted once: empty answers
  for ever new keys -- a padded filter text, another ``max_bytes`` -- cost
  nothing, and a client grew the cache without bound; found by review);
* a body larger than ``max_entry_bytes`` is never cached (large responses
  are rarely identical, and one would push out many small shared ones).

So the cache holds at most about ``max_bytes`` whatever clients ask
(follow-mode pushes included).

Thread-safety: event loop only (the HTTP handlers); no locking.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

__all__ = ["ENTRY_OVERHEAD", "CachedResponse", "ResponseCache"]

#: bytes charged per entry besides its body and key texts: the dict slot, the key tuple,
#: the response object and the bytes object's header, rounded up
ENTRY_OVERHEAD = 512


def _cost(key: tuple[Any, ...], response: CachedResponse) -> int:
    """What an entry is charged: its body, the texts of its key, :data:`ENTRY_OVERHEAD`."""
    texts = sum(len(part) for part in key if isinstance(part, str | bytes))
    sets = sum(8 * len(part) for part in key if isinstance(part, frozenset))
    return len(response.body) + texts + sets + ENTRY_OVERHEAD


@dataclass(frozen=True, slots=True)
class CachedResponse:
    """A stream response copied out of the ring (immutable, shareable)."""

    body: bytes
    next_scn: int
    next_offset: int
    events: int
    windows: int
    partial: bool
    #: the selection reached the buffer tail (false: settled, see the module docstring)
    to_tail: bool = True
    #: virtual byte position of the first event after the request's checkpoint
    start_pos: int = -1


class ResponseCache:
    """Copies of responses for one partition at its current tail (module docstring)."""

    def __init__(self, max_bytes: int, max_entry_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.max_entry_bytes = min(max_entry_bytes, max_bytes)
        #: the buffer tail (event number) the tail entries were computed at
        self.tail = -1
        self.nbytes = 0
        self._entries: OrderedDict[tuple[Any, ...], CachedResponse] = OrderedDict()
        self._settled: OrderedDict[tuple[Any, ...], CachedResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries) + len(self._settled)

    def get(self, tail: int, key: tuple[Any, ...], head_pos: int = 0) -> CachedResponse | None:
        """The response for ``key`` at buffer tail ``tail`` (None: none).

        ``head_pos``: the buffer's oldest byte; settled entries starting
        before it are dropped (their windows were evicted).
        """
        if tail == self.tail:
            found = self._entries.get(key)
            if found is not None:
                if 0 <= found.start_pos < head_pos:
                    # evicted at an unchanged tail: a follower's buffer restarted after
                    # its upstream's loss (its consumers get their 410 now; review)
                    del self._entries[key]
                    self.nbytes -= _cost(key, found)
                    return None
                self._entries.move_to_end(key)
                return found
        found = self._settled.get(key)
        if found is None:
            return None
        if found.start_pos < head_pos:
            del self._settled[key]
            self.nbytes -= _cost(key, found)
            return None
        self._settled.move_to_end(key)
        return found

    def put(self, tail: int, key: tuple[Any, ...], response: CachedResponse) -> None:
        """Keep ``response`` for ``key`` at ``tail`` if it is small enough (LRU eviction)."""
        if len(response.body) > self.max_entry_bytes or self.max_bytes <= 0:
            return
        size = _cost(key, response)
        if size > self.max_bytes:
            return
        settled = not response.to_tail and response.start_pos >= 0
        if not settled:
            if tail < self.tail:
                return
            if tail > self.tail:
                self._drop(self._entries)
                self.tail = tail
        table = self._settled if settled else self._entries
        old = table.pop(key, None)
        if old is not None:
            self.nbytes -= _cost(key, old)
        for victims in (self._settled, self._entries):
            while victims and self.nbytes + size > self.max_bytes:
                gone, evicted = victims.popitem(last=False)
                self.nbytes -= _cost(gone, evicted)
        table[key] = response
        self.nbytes += size

    def _drop(self, table: OrderedDict[tuple[Any, ...], CachedResponse]) -> None:
        self.nbytes -= sum(_cost(k, r) for k, r in table.items())
        table.clear()

    def clear(self) -> None:
        self._entries.clear()
        self._settled.clear()
        self.nbytes = 0
