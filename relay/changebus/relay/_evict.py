"""Eviction and reader pins: how the writer makes room without pulling bytes from under a reader.

One job: decide which oldest windows the writer evicts to fit a new group
(:func:`plan_eviction`), and make it wait for the readers still sending
those bytes (:func:`wait_for_readers`).

Eviction invariants:

* only whole windows are evicted: the new head is the first event after an
  END_OF_WINDOW (or the tail, when everything goes);
* ``prev_scn`` becomes the SCN of the newest evicted window, ``min_scn`` the
  SCN of the oldest kept one (-1: none), ``index_head`` the first SCN index
  entry at or after the new head (:mod:`._index`).

Pins
====
A reader selects events under the buffer's lock and, in the same critical
section, *pins* the lowest byte position it will send (a :class:`Pin` in the
buffer's pin set). It then writes memoryview slices of the ring to its
socket without the lock, and releases the pin when the bytes have left the
process. Before evicting bytes at or beyond a pinned position the writer
waits (``pin_timeout_s``); after that it marks the pin as overrun and evicts
anyway. A reader whose pin was overrun must abort its response (the client
then sees a short body and retries); it never delivers bytes that may have
been overwritten.

A reader whose client stopped reading marks its pin *stalled*
(:meth:`EventBuffer.stall <._buffer.EventBuffer.stall>`): the writer does not
wait for a stalled pin at all, it overruns it at once. So one client that
stops reading never holds up appends; its response is aborted (the relay
cuts the connection after its send timeout, or as soon as the client reads
again).

A client that reads, but slowly, is judged by its pace: the reader notes
on its pin the bytes it has to send and those sent so far (``total``,
``sent``, since ``since``), and the writer does not wait for a pin whose
pace says it needs more than ``slow_reader_s`` (the partition's option,
default :data:`SLOW_ETA_S`) to finish: it overruns it
at once too. Before, a client reading just fast enough never to look
stalled (a piece per half second) held every append that reached its pin
for the whole ``pin_timeout_s``, once per lap of the ring. The writer waits
only for readers about to finish (``pin_timeout_s`` at most), and for those
whose pace is not known yet (no piece sent, or sending for less than
:data:`_PACE_MIN_S`).

Thread-safety: :func:`plan_eviction` runs in the writer thread and reads
only events the writer owns the fate of (readers never move the head);
:func:`wait_for_readers` runs with the buffer's lock held, through the pin
condition that shares it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from changebus.schemas import Op

from ._meta import BufferMeta
from ._tables import CircularTable

__all__ = ["Eviction", "Pin", "plan_eviction", "wait_for_readers"]

log = logging.getLogger("changebus.relay.buffer")

_EOW = int(Op.END_OF_WINDOW)
#: the longest run of events :func:`_find` examines at once
_FIND_CHUNK = 16384
#: the writer does not wait for a reader that needs longer than this to finish (the
#: default of ``slow_reader_s``)
SLOW_ETA_S = 0.25
#: a reader's pace is judged once it has been sending this long
_PACE_MIN_S = 0.1
#: while the writer waits, it looks at the readers' pace this often
_RECHECK_S = 0.05


@dataclass(eq=False)
class Pin:
    """A reader's claim on ring bytes from ``pos`` on (see the module docstring)."""

    pos: int
    overrun: bool = False
    #: the reader is waiting for a client that does not read: do not wait for it
    stalled: bool = False
    #: bytes the reader sends, and has sent since ``since`` (monotonic seconds; 0: not yet)
    #: -- written by the reader without the lock (single ints), read by the writer
    total: int = 0
    sent: int = 0
    since: float = 0.0

    def eta(self, now: float) -> float:
        """Seconds the reader needs for the rest at its pace so far; 0 when unknown yet.

        A reader that has been sending for :data:`_PACE_MIN_S` without its
        first piece leaving has no pace yet but is slow (infinite): a client
        that does not read (a tiny receive window) looked unknown until it
        counted as stalled, and was waited for meanwhile (found by review).
        """
        elapsed = now - self.since
        if self.since <= 0 or elapsed < _PACE_MIN_S:
            return 0.0
        if self.sent <= 0:
            return float("inf")
        return max(self.total - self.sent, 0) * elapsed / self.sent


class Eviction(NamedTuple):
    """The state fields an eviction changes, and how many windows it drops."""

    head_event: int
    head_pos: int
    prev_scn: int
    min_scn: int
    index_head: int
    windows: int


def _first_kept(
    events: CircularTable, m: BufferMeta, min_head_pos: int, min_head_event: int
) -> int | None:
    """The first event the bounds keep, before moving to a window's start (None: the
    head is past both already; two bisections)."""
    if m.head_pos >= min_head_pos and m.head_event >= min_head_event:
        return None
    cand = events.searchsorted(m.head_event, m.tail_event, "pos", max(min_head_pos, 0))
    cand = max(cand, min_head_event)
    return None if cand <= m.head_event else cand


def plan_eviction(
    events: CircularTable,
    index: CircularTable,
    m: BufferMeta,
    min_head_pos: int,
    min_head_event: int,
) -> Eviction | None:
    """Whole oldest windows to evict so the head is past both bounds (None: none)."""
    cand = _first_kept(events, m, min_head_pos, min_head_event)
    if cand is None:
        return None
    if cand < m.tail_event and int(events.at(cand - 1)["op"]) != _EOW:
        cand = _find(events, m.tail_event, cand, lambda r: r["op"] == _EOW) + 1
    new_head = min(cand, m.tail_event)
    prev_scn = int(events.at(new_head - 1)["scn"])
    if new_head < m.tail_event:
        first_rec = events.at(new_head)
        head_pos, min_scn = int(first_rec["pos"]), int(first_rec["scn"])
    else:
        head_pos, min_scn = m.tail_pos, -1
    return Eviction(
        head_event=new_head,
        head_pos=head_pos,
        prev_scn=prev_scn,
        min_scn=min_scn,
        index_head=index.searchsorted(m.index_head, m.index_tail, "event", new_head),
        windows=int(np.count_nonzero(events.get(m.head_event, new_head, "op") == _EOW)),
    )


def eviction_is_small(
    events: CircularTable,
    m: BufferMeta,
    min_head_pos: int,
    min_head_event: int,
    max_events: int,
) -> bool:
    """Whether :func:`plan_eviction` for these bounds (or lower ones) evicts at most
    ``max_events`` events: two bisections and a look at most ``max_events`` ahead. For an
    append on the event loop: evicting the first part of a window of millions of events
    scanned to its end there (review)."""
    cand = _first_kept(events, m, min_head_pos, min_head_event)
    if cand is None:
        return True
    if cand >= m.tail_event:
        return cand - m.head_event <= max_events
    # the window's end that plan_eviction finds: within max_events of the head
    ahead = events.get(cand - 1, min(m.tail_event, m.head_event + max_events), "op")
    return bool(np.any(ahead == _EOW))


def _find(
    events: CircularTable,
    tail: int,
    start: int,
    pred: Callable[[npt.NDArray[Any]], npt.NDArray[np.bool_]],
) -> int:
    """First event number in ``[start, tail)`` whose record satisfies ``pred`` (or tail)."""
    e = start
    chunk = 64
    while e < tail:
        stop = min(e + chunk, tail)
        hits = np.flatnonzero(pred(events.get(e, stop)))
        if hits.size:
            return e + int(hits[0])
        e = stop
        chunk = min(chunk * 4, _FIND_CHUNK)
    return tail


def wait_for_readers(
    pins: set[Pin],
    changed: threading.Condition,
    head_pos: int,
    timeout: float,
    name: str,
    slow_s: float = SLOW_ETA_S,
) -> int:
    """Wait until no pin lies below ``head_pos``, at most ``timeout`` seconds.

    The caller holds ``changed`` (the buffer's lock). Stalled pins below
    ``head_pos``, and those whose pace says they need more than
    ``slow_s`` to finish, are overrun at once, without waiting; the
    others are waited for, and those still below ``head_pos`` after
    ``timeout`` are marked overrun. Returns how many pins were overrun.

    Only readers that were there when the wait began are waited for: one that
    pinned bytes below ``head_pos`` meanwhile (the lock is free while the
    writer waits) is overrun at once. Else a client sending a request every
    fraction of a second kept every eviction, so every append, waiting the
    whole ``timeout`` (found by review).
    """
    deadline = time.monotonic() + timeout
    overrun = 0
    before = {p for p in pins if p.pos < head_pos and not p.overrun}
    while True:
        waiting = 0
        now = time.monotonic()
        for p in pins:
            if p.pos < head_pos and not p.overrun:
                eta = p.eta(now)
                if p.stalled or eta > slow_s or p not in before:
                    p.overrun = True
                    overrun += 1
                    if p.stalled:
                        log.info("buffer %s: overran a reader whose client stopped reading", name)
                    elif p not in before:
                        log.debug("buffer %s: overran a reader that began during an eviction", name)
                    else:
                        log.info(
                            "buffer %s: overran a reader that needed %.1f s more (%d of %d "
                            "bytes sent)",
                            name,
                            eta,
                            p.sent,
                            p.total,
                        )
                else:
                    waiting += 1
        if not waiting:
            break
        left = deadline - now
        if left <= 0:
            for p in pins:
                if p.pos < head_pos and not p.overrun:
                    p.overrun = True
                    overrun += 1
            log.warning("buffer %s: overran a reader slower than %.1f s", name, timeout)
            break
        changed.wait(min(left, _RECHECK_S))  # (paces change while the writer waits)
    return overrun
