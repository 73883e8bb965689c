"""The reader side of the buffer: from a consumer's checkpoint to ring spans to send.

One job: given a published :class:`~._meta.BufferMeta` and the event table,
find where a checkpoint resumes (:func:`locate`) and choose the events that
follow it (:func:`select_events`). Nothing here touches the ring bytes or
writes anything: selection works on the event table alone, vectorised, so a
request costs numpy calls per chunk of events, never Python work per event.

Rules of a selection: whole windows only, unless the first window alone
exceeds the byte limit (then as many of its events as fit, at least one,
and the checkpoint points inside the window); events a consumer does not
subscribe to are skipped but still passed by the checkpoint; control events
are always selected (:func:`~changebus.schemas.event_mask`).

Thread-safety: both functions run under the buffer's lock, on the state it
published; the caller pins the lowest selected position in the same critical
section (see :mod:`._evict`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from changebus.schemas import (
    HEADER_SIZE,
    CheckpointError,
    Op,
    PartitionFilter,
    ScnNotFoundError,
    event_mask,
)

from ._evict import Pin
from ._index import scn_range
from ._meta import BufferMeta
from ._tables import CircularTable

__all__ = ["SCAN_CHUNK", "Selection", "locate", "select_events"]

_EOW = int(Op.END_OF_WINDOW)
#: events examined per step of a selection (doubled for a longer window)
SCAN_CHUNK = 16384
#: the smallest first scan step (a small ``max_bytes`` starts with fewer events)
_FIRST_CHUNK = 256
#: events one selection scans at most (a filter that keeps little would otherwise walk
#: the whole buffer on the event loop, under the lock): it then ends at the last whole
#: window scanned, the client asks again from there
MAX_SCAN_EVENTS = 1 << 18


@dataclass
class Selection:
    """What a reader should send: ring byte spans, and where it got to.

    ``spans`` are physical ``(start, stop)`` offsets into the ring, each a
    run of back-to-back selected events. ``next_scn``/``next_offset`` form the
    checkpoint after these events: ``next_offset`` is -1 when the last window
    was sent whole, else the number of that window's events already passed
    (sent or filtered out). ``partial`` says a window was cut by the byte
    limit. ``pin`` must be released with :meth:`EventBuffer.release`.

    ``resume_at`` (>= 0): nothing to send yet, but the scan stopped inside
    the checkpoint's window, which is longer than a scan may read
    (:data:`MAX_SCAN_EVENTS`) and holds nothing the request keeps up to this
    event index: select again soon, and the scan goes on from there (the
    :class:`~._buffer.EventBuffer` remembers it for the same request).

    ``to_tail``: the scan reached the buffer's tail (a later request with the
    same checkpoint may get more). Otherwise the selection stopped at the
    byte limit and its bytes are settled: the same request gives the same
    answer for as long as the buffer holds ``start_pos`` (the virtual byte
    position of the first event after the checkpoint).
    """

    spans: list[tuple[int, int]]
    events: int
    nbytes: int
    next_scn: int
    next_offset: int
    partial: bool
    windows: int
    to_tail: bool = True
    start_pos: int = -1
    resume_at: int = -1
    pin: Pin | None = None
    views: list[memoryview] = field(default_factory=list)


def locate(
    events: CircularTable,
    index: CircularTable,
    m: BufferMeta,
    name: str,
    window_scn: int,
    window_offset: int,
) -> tuple[int, int]:
    """Where to start sending after checkpoint ``(window_scn, window_offset)``.

    Returns ``(start_event, window_first_event)``: the first event to
    send, and the first event of the window it belongs to (they differ
    only when resuming inside a window). ``window_scn`` -1 means "from
    the oldest event kept". ``start_event == tail_event`` means nothing
    newer exists yet. Raises :class:`ScnNotFoundError` when events after
    the checkpoint may have been evicted: the consumer must catch up
    from the bootstrap server; :class:`CheckpointError` for an offset at
    or past the end of its window, which no relay hands out.
    """
    if window_scn < 0:
        return m.head_event, m.head_event
    complete = window_offset < 0
    if m.tail_event == m.head_event:
        if m.prev_scn < 0 or window_scn > m.prev_scn or (window_scn == m.prev_scn and complete):
            if not complete and window_scn > m.prev_scn:
                raise _inside_missing(name, window_scn, m)
            return m.tail_event, m.tail_event
        raise _too_old(name, window_scn, m)
    if window_scn < m.min_scn:
        if m.prev_scn >= 0 and (window_scn > m.prev_scn or (window_scn == m.prev_scn and complete)):
            if not complete:  # (inside a window between prev_scn and the oldest: never held)
                raise _inside_missing(name, window_scn, m)
            return m.head_event, m.head_event
        raise _too_old(name, window_scn, m)
    if window_scn > m.last_scn or (window_scn == m.last_scn and complete):
        if not complete and window_scn > m.last_scn:
            # inside a window newer than any here (another relay's, or one a restart
            # lost): its first part was taken as a whole window before (review)
            raise _inside_missing(name, window_scn, m)
        return m.tail_event, m.tail_event
    # binary search in the SCN index, then a short scan of the event table
    # (bisected in place: the range is a whole transaction when the window is big, and
    # numpy.searchsorted copies the strided SCN field first)
    lo, hi = scn_range(index, m, window_scn)
    first_at = events.searchsorted(lo, hi, "scn", window_scn, "left")
    after = events.searchsorted(first_at, hi, "scn", window_scn, "right")
    if complete:
        return after, after
    if first_at == after:
        raise _inside_missing(name, window_scn, m)
    if window_offset >= after - first_at:
        # a relay never hands out such an offset (a window read to its end
        # checkpoints as complete): refuse it rather than skip what follows
        raise CheckpointError(
            f"checkpoint offset {window_offset} is past the end of window {window_scn}, "
            f"which has {after - first_at} events"
        )
    return first_at + window_offset, first_at


def _inside_missing(name: str, window_scn: int, m: BufferMeta) -> ScnNotFoundError:
    """A checkpoint inside a window this buffer does not have (a 410: the client reads
    that window again whole, from its last complete one)."""
    return ScnNotFoundError(
        f"checkpoint is inside window {window_scn}, which buffer {name!r} does not "
        "have; resume from the last complete window (prev_scn)",
        oldest_scn=m.min_scn,
        prev_scn=m.prev_scn,
        prev_position=m.prev_pos,
    )


def _too_old(name: str, scn: int, m: BufferMeta) -> ScnNotFoundError:
    return ScnNotFoundError(
        f"SCN {scn} is older than buffer {name!r} keeps (oldest window {m.min_scn}, "
        f"complete after {m.prev_scn}); catch up from the bootstrap server",
        oldest_scn=m.min_scn,
        prev_scn=m.prev_scn,
        # (where the source resumes after prev_scn: a follower restarted there keeps it)
        prev_position=m.prev_pos,
    )


def select_events(
    events: CircularTable,
    capacity: int,
    m: BufferMeta,
    start: int,
    window_first: int,
    max_bytes: int,
    key_filter: PartitionFilter | None,
    src_table: npt.NDArray[np.bool_] | None,
    skip_to: int = -1,
) -> tuple[Selection, int]:
    """The events to send from event ``start`` (of the window starting at ``window_first``).

    ``skip_to`` (> ``start``): an earlier selection of the same request
    scanned up to this event of the same window and found nothing to keep
    (:attr:`Selection.resume_at`); the scan goes on from there.

    Returns the selection (without pin or views) and the lowest virtual byte
    position it covers (``tail_pos`` when it is empty): what to pin.
    """
    if key_filter is None and src_table is None and start == window_first:
        tail = _whole_tail(events, capacity, m, start, max_bytes)
        if tail is not None:
            return tail
    pos_parts: list[npt.NDArray[np.uint64]] = []
    len_parts: list[npt.NDArray[np.uint32]] = []
    used = windows = 0
    next_scn, next_offset, partial = -1, -1, False
    e = start
    start_pos = -1
    if skip_to > start:
        start_pos = int(events.get(start, start + 1)["pos"][0])
        e = skip_to
    origin = e  # (where this scan began: it reads at most MAX_SCAN_EVENTS from here)
    resume_at = -1
    # no more events fit in max_bytes than it holds headers: a small request scans little
    chunk = min(SCAN_CHUNK, max(_FIRST_CHUNK, max_bytes // HEADER_SIZE + 1))
    unfiltered = key_filter is None and src_table is None
    while e < m.tail_event and used < max_bytes and e - origin < MAX_SCAN_EVENTS:
        stop = min(e + chunk, m.tail_event)
        bounded = False
        if unfiltered:
            cut = _byte_bound(events, e, stop, max_bytes - used)
            bounded, stop = cut < stop, cut
        rec: npt.NDArray[Any] = events.get(e, stop)
        if start_pos < 0:
            start_pos = int(rec["pos"][0])
        ops = rec["op"]
        eows = np.flatnonzero(ops == _EOW)
        keep = event_mask(rec, key_filter, src_table)
        cum = np.cumsum(np.where(keep, rec["length"], 0).astype(np.int64))
        budget = max_bytes - used
        full = int(cum[-1]) > budget  # nothing after this chunk fits
        if bounded and not full:
            unfiltered = False  # (a wrap's gap made the byte bound too tight: scan without it)
            continue
        if eows.size == 0 and stop < m.tail_event and not full:
            if stop - origin < MAX_SCAN_EVENTS:
                chunk *= 2  # a window longer than the chunk that may still fit: look further
                continue
            if windows:
                break  # (the whole windows before it go now)
            # one window longer than a scan may read (a big transaction a filter keeps
            # little of): what it keeps so far goes as a part, or the next scan goes on
            # from here; the event loop and the writer do not wait for the whole window
            e, next_scn = stop, int(rec["scn"][0])
            if keep.any():
                pos_parts.append(rec["pos"][keep])
                len_parts.append(rec["length"][keep])
                used += int(cum[-1])
                next_offset, partial = e - window_first, True
            else:
                resume_at, next_scn = e, -1
            break
        fits = eows[cum[eows] <= budget]
        if fits.size:
            last = int(fits[-1])
            pos_parts.append(rec["pos"][: last + 1][keep[: last + 1]])
            len_parts.append(rec["length"][: last + 1][keep[: last + 1]])
            used += int(cum[last])
            windows += int(fits.size)
            next_scn, next_offset = int(rec["scn"][last]), -1
            e += last + 1
            if fits.size < eows.size or full:
                break  # the next complete window does not fit
            chunk = max(chunk, min(2 * chunk, SCAN_CHUNK))  # (a filter skipping most events)
            continue
        if windows:
            break
        # the first window alone exceeds the limit: send a part of it, with at least one
        # event the request keeps (the events before it may all be filtered out: an
        # answer with none made a consumer ask for the same part again, for ever)
        over = np.flatnonzero(cum > budget)
        cut = max(int(over[0]) if over.size else len(ops), 1)
        if over.size and not keep[:cut].any():
            cut = int(over[0]) + 1
        pos_parts.append(rec["pos"][:cut][keep[:cut]])
        len_parts.append(rec["length"][:cut][keep[:cut]])
        used += int(cum[cut - 1])
        e += cut
        next_scn = int(rec["scn"][0])
        if int(ops[cut - 1]) == _EOW:
            next_offset, windows = -1, 1
        else:
            next_offset, partial = e - window_first, True
        break
    pos = np.concatenate(pos_parts).astype(np.int64) if pos_parts else np.zeros(0, np.int64)
    lens = np.concatenate(len_parts).astype(np.int64) if len_parts else np.zeros(0, np.int64)
    selection = Selection(
        spans=_runs(pos, lens, capacity),
        events=int(pos.size),
        nbytes=int(lens.sum()),
        next_scn=next_scn,
        next_offset=next_offset,
        partial=partial,
        windows=windows,
        to_tail=e >= m.tail_event,
        start_pos=start_pos,
        resume_at=resume_at,
    )
    return selection, int(pos[0]) if pos.size else m.tail_pos


def _byte_bound(events: CircularTable, e: int, stop: int, budget: int) -> int:
    """``stop``, or less: one past the first event of ``[e, stop)`` starting ``budget`` bytes on.

    Event positions only grow, by at least each event's length (a wrap adds
    a gap), so the events after that one cannot be among ``budget`` bytes
    of unfiltered events: a scan of large events (a backlog of 2.5 KB rows
    read 64 KiB at a time) then looks at some 26 events, not a thousand.
    The event that crosses the bound is kept, so a window cut by it shows
    that it does not fit. Positions are only an upper bound on the bytes
    before an event: where a wrap's gap makes the bound cut events that
    would fit, the caller sees it (the lengths do not exceed the budget) and
    scans without the bound.
    """
    first = int(events.at(e)["pos"])
    crossing = events.searchsorted(e, stop, "pos", first + budget, side="left")
    return min(crossing + 1, stop)


def _whole_tail(
    events: CircularTable, capacity: int, m: BufferMeta, start: int, max_bytes: int
) -> tuple[Selection, int] | None:
    """The unfiltered selection of everything from window start ``start`` to the tail.

    The common case of a consumer keeping up (a follow push, a long-poll
    woken by a commit): no filter, a checkpoint at a window boundary, and
    all the newer bytes fit in ``max_bytes``. The published state holds
    whole windows, and events are written back to back except where one
    would straddle the ring's end, so without a wrap the answer is one byte
    run from the start event to ``tail_pos``: a handful of numpy calls
    instead of the scan's few dozen (which cost ~0.3 ms of a commit's
    latency). None: not that case (the caller scans).
    """
    start_pos = int(events.at(start)["pos"])
    end = m.tail_pos
    if end - start_pos > max_bytes or start_pos // capacity != (end - 1) // capacity:
        return None
    ops = events.get(start, m.tail_event, "op")
    a = start_pos % capacity
    selection = Selection(
        spans=[(a, a + end - start_pos)],
        events=m.tail_event - start,
        nbytes=end - start_pos,
        next_scn=m.last_scn,
        next_offset=-1,
        partial=False,
        windows=int(np.count_nonzero(ops == _EOW)),
        to_tail=True,
        start_pos=start_pos,
    )
    return selection, start_pos


def _runs(
    pos: npt.NDArray[np.int64], lens: npt.NDArray[np.int64], capacity: int
) -> list[tuple[int, int]]:
    """Physical spans of back-to-back events (split at gaps and at the ring end)."""
    if pos.size == 0:
        return []
    ends = pos + lens
    brk = (pos[1:] != ends[:-1]) | (pos[1:] // capacity != pos[:-1] // capacity)
    starts_idx = np.concatenate(([0], np.flatnonzero(brk) + 1))
    stops_idx = np.concatenate((starts_idx[1:] - 1, [pos.size - 1]))
    s = pos[starts_idx] % capacity
    t = s + (ends[stops_idx] - pos[starts_idx])
    return list(zip(s.tolist(), t.tolist(), strict=True))
