"""The SCN index: where a window with a given SCN starts, without scanning the ring.

One job: keep and search ``index.dat``, a :class:`~._tables.CircularTable`
of :data:`~._tables.INDEX_DTYPE` entries ``(scn, event)``. For each ring
block of ``block`` bytes in which a window starts, the index holds the SCN
and the first event number of the *first* window starting there.

Invariants (with the buffer's published :class:`~._meta.BufferMeta`):

* live entries are ``[index_head, index_tail)``; their SCNs and event numbers
  strictly increase, and each names the first event of a live window (the
  buffer moves ``index_head`` past evicted events, see :mod:`._evict`);
* consecutive entries lie in different blocks, so the index has at most
  ``capacity / block`` live entries (+ a few slots of slack); when it would
  overflow anyway the oldest entries are dropped, which only makes lookups
  scan a little more;
* a window with SCN ``s`` lies between the events of the last entry with a
  SCN ``<= s`` and the next entry (or the tail): a lookup is a binary search
  in the index, then a vectorised scan of that stretch of the event table.

Only the writer thread calls :func:`add_windows` (on entries beyond the
published ``index_tail``); readers call :func:`scn_range` under the
buffer's lock. The index is derived data: recovery recomputes it from the
verified event records (:func:`rebuild`) instead of trusting the file.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from changebus.schemas import FIRST_CONTROL_OP, Op

from ._meta import BufferMeta
from ._tables import INDEX_DTYPE, CircularTable

__all__ = ["add_windows", "add_windows_small", "cut_points", "rebuild", "scn_range"]

_EOW = int(Op.END_OF_WINDOW)
_FIRST_CONTROL = int(FIRST_CONTROL_OP)


def add_windows(
    index: CircularTable,
    events: CircularTable,
    block: int,
    m: BufferMeta,
    ev: npt.NDArray[Any],
    positions: npt.NDArray[np.int64],
    first_event: int,
) -> tuple[int, int]:
    """Index the windows of a group being committed; returns the new ``(index_head, index_tail)``.

    ``ev`` are the group's parsed records (:data:`~._validate.PARSED_DTYPE`),
    ``positions`` their virtual ring positions, ``first_event`` the event
    number of the first one; ``m`` is the state before the group.
    """
    index_head, index_tail = m.index_head, m.index_tail
    firsts = np.flatnonzero(ev["first"])
    blocks = positions[firsts] // block
    last_block = _last_block(index, events, block, m)
    fresh = firsts[np.flatnonzero(blocks != np.concatenate(([last_block], blocks[:-1])))]
    if fresh.size:
        entries = np.empty(fresh.size, dtype=INDEX_DTYPE)
        entries["scn"] = ev["scn"][fresh]
        entries["event"] = first_event + fresh
        index_head = max(index_head, index_tail + fresh.size - index.slots)
        index.put(index_tail, entries[-index.slots :])
        index_tail += fresh.size
    return index_head, index_tail


def add_windows_small(
    index: CircularTable,
    events: CircularTable,
    block: int,
    m: BufferMeta,
    rows: list[tuple[Any, ...]],
    tail_pos: int,
    first_event: int,
) -> tuple[int, int]:
    """:func:`add_windows` for a small group laid out from ``tail_pos`` without a lap.

    ``rows`` are the group's parsed records as tuples (``off`` first, ``scn``
    second, ``first`` last); the same entries, found with a Python loop.
    """
    index_head, index_tail = m.index_head, m.index_tail
    last_block = _last_block(index, events, block, m)
    entries: list[tuple[int, int]] = []
    for i, row in enumerate(rows):
        if row[-1]:
            b = (tail_pos + row[0]) // block
            if b != last_block:
                entries.append((row[1], first_event + i))
            last_block = b
    if entries:
        index_head = max(index_head, index_tail + len(entries) - index.slots)
        index.put(index_tail, np.array(entries[-index.slots :], dtype=INDEX_DTYPE))
        index_tail += len(entries)
    return index_head, index_tail


def _last_block(index: CircularTable, events: CircularTable, block: int, m: BufferMeta) -> int:
    """The block of the newest indexed window (-1: the index is empty)."""
    if m.index_tail <= m.index_head:
        return -1
    last_event = int(index.at(m.index_tail - 1)["event"])
    return int(events.at(last_event)["pos"]) // block


def scn_range(index: CircularTable, m: BufferMeta, scn: int) -> tuple[int, int]:
    """Events ``[lo, hi)`` that hold every live event with SCN ``scn``, if any."""
    i = index.searchsorted(m.index_head, m.index_tail, "scn", scn, "right")
    lo = int(index.at(i - 1)["event"]) if i > m.index_head else m.head_event
    lo = max(lo, m.head_event)
    hi = int(index.at(i)["event"]) if i < m.index_tail else m.tail_event
    return lo, hi


#: ranges of at most this many events are cut at exact event counts (a read of their
#: SCN column, 8 bytes an event); longer ones at the index's block granularity
EXACT_CUT_EVENTS = 1 << 18


def cut_points(
    index: CircularTable,
    events: CircularTable,
    m: BufferMeta,
    first: int,
    end: int,
    since: int,
    until: int,
    parts: int,
    sources: frozenset[int] | None = None,
) -> list[int]:
    """SCNs that cut the live windows ``(since, until]`` into ``parts`` spans of similar size.

    ``[first, end)`` are the events of that range (the caller locates them).
    Size is counted in events: the targets are evenly spaced event numbers,
    and each becomes the SCN just before the window holding it (a range of
    up to :data:`EXACT_CUT_EVENTS` events, read from the event table) or
    before the indexed window nearest to it (longer ranges: even to about a
    ring block's events, from the index alone: a binary search per target).
    A cut ``c`` splits the range into ``(since, c]`` and ``(c, until]`` on a
    window boundary, and a window is never cut. Returns the strictly increasing cuts inside
    ``(since, until)``, each part holding at least one window (fewer than
    ``parts - 1`` cuts when the range holds too few windows).

    With ``sources`` (source ids) only the data events of those sources
    count, where the range is counted exactly; the index path counts every
    event.
    """
    if parts < 2 or end - first < 2:
        return []
    targets = first + (end - first) * np.arange(1, parts, dtype=np.int64) // parts
    if end - first <= EXACT_CUT_EVENTS:
        scns = np.asarray(events.get(first, end, "scn"), dtype=np.int64)
        where = targets - first
        if sources is not None:  # the event holding each target's share of the counted ones
            counted = np.isin(events.get(first, end, "source_id"), list(sources)) & (
                events.get(first, end, "op") < _FIRST_CONTROL
            )
            running = np.cumsum(counted)
            total = int(running[-1]) if len(running) else 0
            if total < 2:
                return []
            shares = np.arange(1, parts, dtype=np.int64) * total // parts
            where = np.searchsorted(running, shares + 1, side="left")
        # a target in the first window would leave the first part empty
        exact = np.unique(scns[where] - 1)
        return [int(c) for c in exact if since < c < until and c >= scns[0]]
    if m.index_tail <= m.index_head:
        return []
    lo = index.searchsorted(m.index_head, m.index_tail, "scn", since, "right")
    hi = index.searchsorted(lo, m.index_tail, "scn", until, "right")
    # entries ``[lo, hi)`` name the indexed windows of the range: the nearer of the two
    # entries around each target (binary searches in place, never a copy of the slice:
    # an index may hold millions of entries); ties go to the earlier one
    at = index.searchsorted_many(lo, hi, "event", targets, "left")
    numbers, scns = index.data["event"], index.data["scn"]
    best_dist = np.full(len(targets), np.iinfo(np.int64).max, dtype=np.int64)
    best_scn = np.full(len(targets), -1, dtype=np.int64)
    for k in (at - 1, at):
        usable = (k >= lo) & (k < hi)
        slot = k[usable] % index.slots
        number = numbers[slot].astype(np.int64)
        # (an indexed window that starts the range would leave the first part empty)
        dist = np.where(number > first, np.abs(number - targets[usable]), best_dist[usable])
        better = dist < best_dist[usable]
        rows = np.flatnonzero(usable)[better]
        best_dist[rows] = dist[better]
        best_scn[rows] = scns[slot][better].astype(np.int64)
    picked = {int(c) - 1 for c in best_scn[best_scn >= 0].tolist()}
    return sorted(c for c in picked if since < c < until)


def rebuild(
    index: CircularTable,
    block: int,
    m: BufferMeta,
    pos: npt.NDArray[np.int64],
    op: npt.NDArray[np.uint8],
    scn: npt.NDArray[Any],
) -> tuple[int, int, bool]:
    """Recompute the index of the live events ``[m.head_event, m.head_event + len(pos))``.

    ``pos``, ``op`` and ``scn`` are the events' verified fields (whole
    windows). The entries follow the writer's rule (the first window
    starting in each block); the oldest window may have no entry in the
    file (it shared its block with an evicted window), which is as good.
    Returns ``(index_head, index_tail, rewritten)``: the file is rewritten
    only when its entries for these events differ (a damaged index); the
    entries of newer events (dropped by recovery) are cut off.
    """
    if len(pos) == 0:
        return m.index_tail, m.index_tail, m.index_head != m.index_tail
    firsts = np.concatenate(([0], np.flatnonzero(op[:-1] == _EOW) + 1))
    blocks = pos[firsts] // block
    fresh = firsts[np.concatenate(([True], blocks[1:] != blocks[:-1]))][-index.slots :]
    entries = np.empty(fresh.size, dtype=INDEX_DTYPE)
    entries["scn"] = scn[fresh]
    entries["event"] = m.head_event + fresh
    current = index.get(m.index_head, m.index_tail)
    for skip in (0, 1):  # entries of events beyond these (dropped by recovery) may follow
        k = entries.size - skip
        if k <= current.size and np.array_equal(current[:k], entries[skip:]):
            return m.index_head, m.index_head + k, False
    index.put(m.index_head, entries)
    return m.index_head, m.index_head + entries.size, True
