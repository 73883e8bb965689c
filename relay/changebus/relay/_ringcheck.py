"""Checking a reopened buffer's live events against the ring, in bulk.

One job: given the event positions the event table claims for the live
events ``[head_event, tail_event)``, find out how many of them, from the
oldest on, are really in the ring, and where exactly. The ring's own event
headers are the truth; the event table is only a hint (its ``pos`` column
says where to look), so damage in the table is repaired, not trusted.

An event ``i`` is *verified* when all of this holds (every check in numpy
over all events at once, unless said otherwise):

* its header is well formed (magic, version, op, ``total_length ==
  64 + key_length + payload_length``) and it lies inside the ring file;
* its position follows from its predecessor's by the writer's placement
  rule: right after the previous event (the first one at the published
  ``head_pos``), or at the next lap's start when it does not fit before the
  end of the ring; the last one ends at the published ``tail_pos``;
* the window rules: seq numbers ``0, 1, 2, ...`` restart after each
  END_OF_WINDOW, the events of a window share its SCN and window SCNs
  increase from the published ``min_scn`` on, never above the published
  ``last_scn`` (so stale events of an earlier lap, left by a page the
  machine did not write before it went down, and newer ones of a later lap,
  written over evicted windows before the head that evicted them was
  published, are refused even though their CRCs match);
* its header CRC matches, and then its payload CRC (both checked with a
  few large CRC calls, see :mod:`._crcbatch`; the payloads last, and only
  those of the events that passed everything else).

When event ``i`` fails a check, the table's position may be the damaged
part (a flipped bit, or a whole page of ``events.dat`` the machine did not
write back): the ring is followed from the last verified event, event by
event, by the placement rule and the window rules, as long as the table
disagrees with it (:func:`_walk`); then the checks run again, from event
``i`` on (at most :data:`_MAX_WALKS` times). When not even event ``i`` can
be found that way, it is damaged in the ring and the verified prefix ends
before it; so it does when the path followed never meets the table again
nor ends at the published tail, however many walks of :data:`_MAX_WALK`
events it took (it may have skipped events).

Pure functions over a read-only view of the ring; run once at recovery.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from changebus.schemas import HEADER_DTYPE, HEADER_SIZE, MAGIC, VERSION, Op, crc32

from ._crcbatch import first_bad_header, first_bad_payload

__all__ = ["RingCheck", "check_ring", "damage_at_lap_start", "verified_event"]

_EOW: Final = int(Op.END_OF_WINDOW)
_VALID_OP = np.zeros(256, dtype=bool)
_VALID_OP[[int(op) for op in Op]] = True
#: stretches of wrong event positions one recovery follows in the ring (each costs a
#: check of all events), before it calls the rest damaged; and events one walk follows
#: (a Python step each) before the checks run again (a longer stretch goes on)
_MAX_WALKS: Final = 16
_MAX_WALK: Final = 1 << 16
#: events the first slice of a check covers (each next slice twice as many): the checks
#: stop at the slice holding the first failure, so a check after a walk costs about
#: the events it walked, not all events (a long stretch took one check of all per walk)
_CHECK_SLICE: Final = 1 << 16
#: offset of the header CRC in a header (it covers the bytes before it)
_HCRC_AT: Final = 60


@dataclass(frozen=True)
class RingCheck:
    """What :func:`check_ring` found.

    Events ``[0, good)`` (numbered from the head event) are verified;
    ``pos`` and ``headers`` hold their true virtual positions and headers.
    ``repaired`` counts positions taken from the ring because the event
    table's were wrong. ``problem`` says why event ``good`` was refused
    (empty when every event is verified).
    """

    pos: npt.NDArray[np.int64]
    headers: npt.NDArray[Any]
    good: int
    repaired: int
    problem: str


def check_ring(
    ring: memoryview,
    head_pos: int,
    tail_pos: int,
    min_scn: int,
    last_scn: int,
    records: npt.NDArray[Any],
) -> RingCheck:
    """Verify the live events (``records``: their event table rows) against the ring.

    ``head_pos``, ``tail_pos``, ``min_scn`` (the oldest window's SCN) and
    ``last_scn`` (no live window is newer) come from the published state.
    """
    capacity = len(ring)
    raw = np.frombuffer(ring, dtype=np.uint8)
    pos = records["pos"].astype(np.int64)
    headers = _gather(raw, pos, capacity)
    published = (head_pos, tail_pos, min_scn, last_scn)
    repaired = walks = start = 0
    # what the capped walks of the stretch being followed replaced, and the state before
    # it: a stretch that ends neither at the table nor at the tail is undone whole (only
    # its last walk was: a path that skipped a torn window at the ring's end for the
    # next lap's first one was kept, and the skipped window served as never there; review)
    segments: list[tuple[int, npt.NDArray[np.int64], Any]] = []
    stretch = (0, "", 0)
    while True:
        bad, problem = _first_bad(raw, capacity, published, pos, headers, start)
        if bad == len(pos) or walks >= _MAX_WALKS:
            break
        if not segments:
            stretch = (bad, problem, repaired)
        saved = (bad, pos[bad : bad + _MAX_WALK].copy(), headers[bad : bad + _MAX_WALK].copy())
        moved, capped = _walk(raw, capacity, published, pos, headers, bad)
        start = bad  # (the events before it are verified and the walk left them)
        if moved == 0:
            for at, was_pos, was_headers in (saved, *reversed(segments)):
                pos[at : at + len(was_pos)] = was_pos
                headers[at : at + len(was_headers)] = was_headers
            if segments:
                bad, problem, repaired = stretch
            break
        repaired += moved
        if capped:  # (a stretch longer than a walk goes on: same stretch)
            segments.append(saved)
        else:
            segments.clear()
            walks += 1
    payload_bad = first_bad_payload(ring, pos[:bad] % capacity, headers[:bad])
    if payload_bad < bad:
        bad, problem = payload_bad, "payload checksum mismatch"
    return RingCheck(pos[:bad], headers[:bad], bad, repaired, problem)


def damage_at_lap_start(records: npt.NDArray[Any], check: RingCheck, capacity: int) -> bool:
    """Whether the first damaged event (``check.good``, after at least one verified
    event) lies at a lap's start, right after verified events in the last bytes of
    the lap before: where a later lap's window that did not fit before the ring's end
    began, its bytes written over the events there while those it skipped stay intact.
    Its position is the event table's (a hint) unless the verified events end at the
    ring's end (then the placement rule puts it at the lap's start).
    """
    good = check.good
    end = int(check.pos[good - 1]) + int(check.headers["total_length"][good - 1])
    lap = -(-end // capacity) * capacity
    return end == lap or int(records["pos"][good]) == lap


def _gather(raw: npt.NDArray[np.uint8], pos: npt.NDArray[np.int64], capacity: int) -> Any:
    """The headers at ``pos`` (a copy); positions too close to the end read offset 0."""
    phys = pos % capacity
    safe = np.where(phys <= capacity - HEADER_SIZE, phys, 0)
    rows = np.lib.stride_tricks.as_strided(
        raw, shape=(capacity - HEADER_SIZE + 1, HEADER_SIZE), strides=(1, 1), writeable=False
    )
    return rows[safe].view(HEADER_DTYPE).reshape(-1)


def _first_bad(
    raw: npt.NDArray[np.uint8],
    capacity: int,
    published: tuple[int, int, int, int],
    pos: npt.NDArray[np.int64],
    headers: npt.NDArray[Any],
    start: int = 0,
) -> tuple[int, str]:
    """The first event from ``start`` on (those before it verified) failing a structural,
    placement, window or header CRC check; ``len(pos)``: none.

    ``published`` is ``(head_pos, tail_pos, min_scn, last_scn)`` of the published state.
    Checks slices of growing size and stops at the first one holding a failure.
    """
    n = len(pos)
    lo, size = start, _CHECK_SLICE
    while lo < n:
        hi = min(n, lo + size)
        bad, problem = _first_bad_in(raw, capacity, published, pos, headers, lo, hi)
        if bad < hi:
            return bad, problem
        lo, size = hi, size * 2
    return n, ""


def _first_bad_in(
    raw: npt.NDArray[np.uint8],
    capacity: int,
    published: tuple[int, int, int, int],
    pos: npt.NDArray[np.int64],
    headers: npt.NDArray[Any],
    lo: int,
    hi: int,
) -> tuple[int, str]:
    """:func:`_first_bad` over events ``[lo, hi)`` (``hi``: none fails); event ``lo - 1``,
    verified, is their context."""
    head_pos, tail_pos, min_scn, last_scn = published
    at = lo - 1 if lo > 0 else 0  # the slice checked, with its context event first
    p, h = pos[at:hi], headers[at:hi]
    n = len(p)
    phys = p % capacity
    total = h["total_length"].astype(np.int64)
    malformed = (
        (phys > capacity - HEADER_SIZE)
        | (h["magic"] != MAGIC)
        | (h["version"] != VERSION)
        | ~_VALID_OP[h["op"]]
        | (
            total
            != HEADER_SIZE + h["key_length"].astype(np.int64) + h["payload_length"].astype(np.int64)
        )
        | (phys + total > capacity)
    )
    # placement: right after the previous event, or at the next lap when it does not fit
    expected = np.empty(n, dtype=np.int64)
    expected[0] = head_pos
    np.add(p[:-1], total[:-1], out=expected[1:])
    room = capacity - expected % capacity
    expected = np.where(total > room, expected + room, expected)
    misplaced = p != expected
    if hi == len(pos):
        misplaced[-1] |= int(p[-1]) + int(total[-1]) != tail_pos
    # the window rules: seq numbers 0, 1, 2, ... restarting after each END_OF_WINDOW
    op = h["op"]
    scn = h["scn"].astype(np.int64)
    seq = h["seq"].astype(np.int64)
    opens = np.empty(n, dtype=bool)
    opens[0] = True
    np.equal(op[:-1], _EOW, out=opens[1:])
    want_seq = np.zeros(n, dtype=np.int64)
    want_seq[1:] = np.where(opens[1:], 0, seq[:-1] + 1)
    out_of_window = seq != want_seq
    same = np.empty(n, dtype=bool)
    same[0] = True
    np.equal(scn[1:], scn[:-1], out=same[1:])
    rising = np.empty(n, dtype=bool)
    rising[0] = int(scn[0]) == min_scn
    np.greater(scn[1:], scn[:-1], out=rising[1:])
    out_of_window |= np.where(opens, ~rising, ~same)
    out_of_window |= scn > last_scn  # (a later lap's bytes: review)
    checks = (
        (malformed, "malformed event header"),
        (misplaced, "event not where the event table and the ring say"),
        (out_of_window, "event breaks the window rules"),
    )
    skip = lo - at  # (the context event is verified)
    bad, problem = n, ""
    for mask, why in checks:
        hits = np.flatnonzero(mask[skip:bad]) + skip
        if hits.size:
            bad, problem = int(hits[0]), why
    crc_bad = skip + first_bad_header(h[skip:bad])
    if crc_bad < bad:
        bad, problem = crc_bad, "header checksum mismatch"
    return at + bad, problem


def _header_at(raw: npt.NDArray[np.uint8], capacity: int, pos: int) -> Any | None:
    """The header at virtual ``pos`` if it is well formed, checksummed and fits the ring."""
    phys = pos % capacity
    if phys > capacity - HEADER_SIZE:
        return None
    h = raw[phys : phys + HEADER_SIZE].copy().view(HEADER_DTYPE)[0]
    total = int(h["total_length"])
    if (
        int(h["magic"]) != MAGIC
        or int(h["version"]) != VERSION
        or not _VALID_OP[int(h["op"])]
        or total != HEADER_SIZE + int(h["key_length"]) + int(h["payload_length"])
        or phys + total > capacity
        or crc32(raw[phys : phys + _HCRC_AT]) != int(h["header_crc"])
    ):
        return None
    return h


def verified_event(ring: memoryview, pos: int) -> Any | None:
    """The header of the event at virtual ``pos`` if the event is intact (both CRCs), else None."""
    capacity = len(ring)
    h = _header_at(np.frombuffer(ring, dtype=np.uint8), capacity, pos)
    if h is None:
        return None
    phys = pos % capacity
    if crc32(ring[phys + HEADER_SIZE : phys + int(h["total_length"])]) != int(h["payload_crc"]):
        return None
    return h


def _walk(
    raw: npt.NDArray[np.uint8],
    capacity: int,
    published: tuple[int, int, int, int],
    pos: npt.NDArray[np.int64],
    headers: npt.NDArray[Any],
    i: int,
) -> tuple[int, bool]:
    """Follow the ring from event ``i`` while the event table's positions are wrong.

    Event ``i`` is the first one the checks refused; all before it are
    verified. Each step takes the position the placement rule gives after
    the previous event (right after it, or the next lap's start when the
    event there does not fit) whose header is intact and continues the
    window rules; it stops where the table is right again. A path that
    never meets the table again before the published tail is refused (it
    could skip events). Fixes ``pos`` and ``headers`` in place; returns how
    many positions it took from the ring (0: none, event ``i`` counts as
    damaged in the ring, and the caller undoes what it changed) and whether
    it stopped at :data:`_MAX_WALK` steps: then the caller checks again and
    goes on from there, and keeps the whole path only if it finally meets
    the table or the tail (more wrong records in a row than one walk, 2 MiB
    of ``events.dat`` the machine did not write back, undid the whole path
    before, and intact windows after it were dropped: review).
    """
    head_pos, tail_pos, min_scn, last_scn = published
    n = len(pos)
    j = i
    while j < n and j - i < _MAX_WALK:
        prev = headers[j - 1] if j > 0 else None
        expected = head_pos if prev is None else int(pos[j - 1]) + int(prev["total_length"])
        room = capacity - expected % capacity
        found = None
        for cand in (expected, expected + room):
            h = _header_at(raw, capacity, cand)
            if h is None or (cand == expected) != (int(h["total_length"]) <= room):
                continue
            end = cand + int(h["total_length"])
            if end > tail_pos or (j == n - 1 and end != tail_pos):
                continue
            if _continues(prev, h, min_scn, last_scn):
                found = cand, h
                break
        if found is not None and found[0] == int(pos[j]) and j > i:
            return j - i, False  # the table is right again
        if found is None or found[0] == int(pos[j]):
            break
        pos[j], headers[j] = found
        j += 1
    if j == n:
        return j - i, False  # followed to the published tail
    if j - i >= _MAX_WALK:
        return j - i, True  # kept: the checks run again and the walk goes on after it
    # damaged in the ring at event i, or a path that never meets the table again (it
    # would skip events: e.g. a window at the next lap's start): undone by the caller
    return 0, False


def _continues(prev: Any | None, h: Any, min_scn: int, last_scn: int) -> bool:
    """Whether header ``h`` may follow header ``prev`` (None: it opens the buffer)."""
    seq, scn = int(h["seq"]), int(h["scn"])
    if scn > last_scn:
        return False
    if prev is None:
        return seq == 0 and scn == min_scn
    if int(prev["op"]) == _EOW:
        return seq == 0 and scn > int(prev["scn"])
    return seq == int(prev["seq"]) + 1 and scn == int(prev["scn"])
