"""Recovery of a buffer's files after a restart or a crash.

One job: decide what a reopened buffer may serve, trusting only what
carries its own checksum. The last published state (:meth:`~._meta.MetaFile.load`,
CRC-protected) names the live events and bytes; the ring's event headers
and payloads (CRC-protected) are the truth about them; the side tables
are derived data and are checked or rebuilt from the ring:

* the **event table**: every live record is compared with the ring
  (:func:`~._ringcheck.check_ring`): a wrong position is found again by
  the writer's placement rule, and a wrong SCN, length, op, key hash or
  source is rewritten from the event's header, so a damaged key hash can
  never send an event to the wrong mod-filter consumer;
* the **SCN index** is recomputed from the verified records
  (:func:`~._index.rebuild`) and rewritten when it differs, so a damaged
  entry can never make a reader skip windows.

Damage in the ring itself (a torn page after the machine went down, a
flipped bit) is never served; what is kept around it:

* when every event from some window start after the damage verifies up to
  the published tail, the windows from that start on are kept and those
  before it count as evicted (:func:`_later_head`). That is what a machine
  that went down between an eviction's overwrite and its published head
  leaves (damage in the oldest windows), and the better choice for damage
  in a middle window too: consumers behind the new head catch up from the
  bootstrap server, which holds what the relay had served it, while every
  consumer past the damage goes on; keeping the windows before the damage
  instead would stop those with a DATA_LOSS for windows that are intact.
  With ``durability = "fsync"`` and a synced watermark (:mod:`._watermark`)
  only damage at or below it is handled so, and the windows from the new
  head on need to verify up to the watermark only (not to the tail): the
  windows it covers were synced and acknowledged, and the source no longer
  holds them; damage above it is an unsynced tail, trimmed as below, never
  jumped over (the source still holds it); when no synced window verifies
  from any start, the oldest included, or the damage that reaches the
  newest synced one begins at a lap's start after intact oldest windows (a
  later lap's window that did not fit before the ring's end went there and
  skipped their bytes: evicted too), the buffer starts empty after the
  watermark's SCN; damage after intact oldest windows that reaches the
  newest synced one from elsewhere is not an eviction's: trimmed, as below;
* otherwise (the newest window is damaged too) every complete window
  before the first damaged event is kept, and that window and everything
  after it are dropped: the buffer owes a DATA_LOSS window for ``(last kept
  SCN + 1 .. last published SCN)`` at the last published SCN
  (:class:`Loss`, appended by the buffer through its normal write path), so
  a consumer past the kept windows is told, as for other losses in the
  relay; the fetcher resumes after the last published SCN as before;
* when nothing else is kept (damage in the oldest window and later), the
  buffer starts empty after the last published SCN (``prev_scn =
  last_scn``), so older consumers are sent to the bootstrap server
  (``scn_not_found``).

The state published by recovery keeps ``last_scn`` (the source was read
that far): a buffer whose newest window is older than ``last_scn`` owes the
marker, and a crash before it is written is found again at the next start.
So does an *empty* buffer with ``last_scn > prev_scn``: the room the marker
needed evicted every kept window (one window filling the ring, or the event
slots) and was published before it; nothing else leaves that state (an
eviction of everything sets ``prev_scn`` to the newest SCN), and serving it
as complete after ``prev_scn`` skipped the dropped windows silently.

With ``durability = "fsync"`` (``replayable``) the source was acknowledged
only up to windows that were synced to disk (:mod:`._syncer`), so damage
that reaches the newest window is what an OS crash left unsynced, and the
source still holds it: the dropped windows are *not* recorded as data loss. The
published state goes back to the last kept window (``last_scn`` = its SCN)
and the fetcher resumes from that window's source position, so the source
sends them again (same SCNs, same changes). When nothing is kept, the buffer
starts empty after ``prev_scn`` (the newest evicted window) for the same
reason. Damage within synced windows that also reaches the newest one (a
bit flip on disk there) is then caught by the source's own check where it
has one (Postgres: a slot confirmed beyond the relay's last window is
announced as DATA_LOSS). Without a watermark (files of an older version, or
before the first sync) damage is handled as without fsync, then rewound.

Runs once, in the buffer's constructor, before any reader or writer exists.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from changebus.schemas import HEADER_SIZE, CorruptEventError, Op, end_of_window_position

from ._index import rebuild
from ._meta import BufferMeta, MetaFile
from ._ringcheck import RingCheck, check_ring, damage_at_lap_start, verified_event
from ._tables import EVENT_DTYPE, CircularTable
from ._watermark import Synced, SyncedMark

__all__ = ["Loss", "recover"]

log = logging.getLogger("changebus.relay.buffer")

_EOW = int(Op.END_OF_WINDOW)
#: event table fields and the header fields they copy
_FIELDS = (
    ("scn", "scn"),
    ("key_hash", "key_hash"),
    ("length", "total_length"),
    ("op", "op"),
    ("source_id", "source_id"),
)


@dataclass(frozen=True)
class Loss:
    """Windows ``from_scn..to_scn`` were dropped by recovery: the buffer owes a DATA_LOSS window.

    ``source_position`` is the END_OF_WINDOW position of the last dropped
    window when it could still be verified ("" otherwise), so the fetcher
    resumes exactly where it stopped.
    """

    from_scn: int
    to_scn: int
    timestamp_ns: int
    source_position: str
    reason: str


def recover(
    meta: BufferMeta,
    events: CircularTable,
    index: CircularTable,
    block: int,
    ring: memoryview,
    metafile: MetaFile,
    name: str,
    stats: dict[str, int],
    *,
    replayable: bool = False,
    watermark: SyncedMark | None = None,
) -> tuple[BufferMeta, Loss | None]:
    """Verify what the last published state says is live; repair side tables; trim damage.

    Returns the state to serve (published when it changed) and the
    DATA_LOSS window the buffer owes, if any (never with ``replayable``:
    the source replays what was dropped, see the module docstring). Counts what it did in
    ``stats`` (the buffer's): ``recovery_records_rewritten``,
    ``recovery_index_rebuilt`` (0 or 1) and ``recovery_events_dropped``.
    ``watermark``: the synced watermark (``durability = "fsync"``); it is lowered
    to the recovered state when that ends before it (it never names bytes that
    recovery gave up, which new windows overwrite).
    """
    state, loss = _recover(
        meta, events, index, block, ring, metafile, name, stats, replayable, watermark
    )
    synced = watermark.load() if watermark is not None else None
    if watermark is not None and synced is not None and state.tail_event < synced.tail_event:
        watermark.store(Synced(state.tail_event, state.tail_pos, state.last_scn))
    return state, loss


def _recover(
    meta: BufferMeta,
    events: CircularTable,
    index: CircularTable,
    block: int,
    ring: memoryview,
    metafile: MetaFile,
    name: str,
    stats: dict[str, int],
    replayable: bool,
    watermark: SyncedMark | None,
) -> tuple[BufferMeta, Loss | None]:
    n = meta.tail_event - meta.head_event
    if n <= 0:
        if meta.last_scn > meta.prev_scn:  # (never left so but by the room for a marker)
            log.warning(
                "buffer %s: windows %d..%d were dropped by an interrupted recovery that"
                " evicted every kept window; recorded as data loss now",
                name,
                meta.prev_scn + 1,
                meta.last_scn,
            )
            lost = _interrupted(meta.prev_scn)
            return meta, Loss(meta.prev_scn + 1, meta.last_scn, meta.last_ts, "", lost)
        return meta, None
    records = events.get(meta.head_event, meta.tail_event)  # compared before anything is rewritten
    check = check_ring(ring, meta.head_pos, meta.tail_pos, meta.min_scn, meta.last_scn, records)
    eows = np.flatnonzero(check.headers["op"] == _EOW)
    keep = int(eows[-1]) + 1 if eows.size else 0
    loaded = meta
    synced = _synced_events(meta, watermark, name)
    if keep < n and (synced is None or keep < synced):
        # (also with fsync: damage before windows that verify is not an unsynced tail,
        # which the source would send again, but an eviction's bytes, such as a group
        # placed at the next lap's start over a window after intact ones, or a flipped
        # bit: the windows after it were synced and acknowledged, and rewinding to
        # before it dropped them for good; found by review. With a watermark only
        # damage at or below it is, and the windows from the new head on must verify
        # up to it; damage above it alone is trimmed below, never jumped over)
        later = _later_head(ring, meta, records, name, n if synced is None else synced)
        if later is not None:
            meta, check = later
            n = meta.tail_event - meta.head_event
            records = records[-n:]
            eows = np.flatnonzero(check.headers["op"] == _EOW)
            keep = int(eows[-1]) + 1 if eows.size else 0
        elif (
            synced is not None
            and watermark is not None
            and (keep == 0 or damage_at_lap_start(records, check, len(ring)))
        ):
            return _synced_gone(ring, meta, records, synced, watermark, metafile, name, stats)
        # (else, with a watermark: damage in synced windows after intact ones at the head,
        # up to the newest synced one, and not from a lap's start, is no eviction's:
        # trimmed below, and the source's own check says whether it still holds what
        # follows, as without a watermark. From a lap's start it is: a window that did
        # not fit before the ring's end went there, and its lap skipped the intact ones,
        # evicted too; rewound, they were announced as DATA_LOSS by Postgres: review)
    stats["recovery_records_rewritten"] = _repair_events(
        events, meta.head_event, records[:keep], check, name
    )
    index_head, index_tail, reindexed = rebuild(
        index,
        block,
        meta,
        check.pos[:keep],
        check.headers["op"][:keep],
        check.headers["scn"][:keep],
    )
    stats["recovery_index_rebuilt"] = int(reindexed)
    stats["recovery_events_dropped"] = loaded.tail_event - loaded.head_event - keep
    if reindexed:
        log.warning("buffer %s: the SCN index did not match the events; rebuilt it", name)
    if keep == n:
        fixed = replace(meta, index_head=index_head, index_tail=index_tail)
        if fixed != loaded:
            metafile.publish(fixed)
        last = int(check.headers["scn"][-1])
        if last < meta.last_scn:  # a marker owed by an earlier recovery that did not finish
            log.warning(
                "buffer %s: windows %d..%d were dropped by an interrupted recovery;"
                " recorded as data loss now",
                name,
                last + 1,
                meta.last_scn,
            )
            return fixed, Loss(last + 1, meta.last_scn, meta.last_ts, "", _interrupted(last))
        log.info("buffer %s: recovered %d events, SCN %d..%d", name, n, meta.min_scn, meta.last_scn)
        return fixed, None
    lost_events = n - keep
    at = int(records["pos"][min(check.good, n - 1)])
    why = f"{check.problem or 'damaged event'} at ring position {at}"
    if replayable:
        return _rewind(meta, check, keep, eows.size, index_head, index_tail, metafile, name, why)
    if keep == 0:
        log.warning(
            "buffer %s: %s in the oldest window: all %d events dropped, recorded as data loss;"
            " starting empty after SCN %d (older consumers catch up from the bootstrap server)",
            name,
            why,
            n,
            meta.last_scn,
        )
        fresh = _emptied(meta, meta.last_scn, lost=True)
        metafile.publish(fresh)
        return fresh, None
    h = check.headers
    last_kept = int(h["scn"][keep - 1])
    trimmed = replace(
        meta,
        tail_event=meta.head_event + keep,
        tail_pos=int(check.pos[keep - 1]) + int(h["total_length"][keep - 1]),
        last_ts=int(h["timestamp_ns"][keep - 1]),
        index_head=index_head,
        index_tail=index_tail,
        windows=int(eows.size),
    )  # last_scn stays: the source was read that far, and the marker below says what is lost
    metafile.publish(trimmed)
    reason = f"buffer {name!r} was damaged on disk ({why}); the relay dropped these windows"
    log.warning(
        "buffer %s: %s: kept %d windows up to SCN %d, dropped %d events;"
        " recorded as data loss %d..%d",
        name,
        why,
        eows.size,
        last_kept,
        lost_events,
        last_kept + 1,
        meta.last_scn,
    )
    position = _last_position(ring, meta, records[-1])
    return trimmed, Loss(last_kept + 1, meta.last_scn, meta.last_ts, position, reason)


def _synced_events(meta: BufferMeta, watermark: SyncedMark | None, name: str) -> int | None:
    """How many live events (from the head) the synced watermark covers; None: no watermark.

    A watermark beyond the published state (a ``meta.dat`` older than it: never
    left so by the syncer, which syncs ``meta.dat`` first) is not used.
    """
    synced = watermark.load() if watermark is not None else None
    if synced is None:
        return None
    if (
        synced.tail_event > meta.tail_event
        or synced.tail_pos > meta.tail_pos
        or synced.last_scn > meta.last_scn
    ):
        log.warning(
            "buffer %s: its synced watermark (SCN %d) is beyond its published state"
            " (SCN %d): not used",
            name,
            synced.last_scn,
            meta.last_scn,
        )
        return None
    return max(0, min(synced.tail_event - meta.head_event, meta.tail_event - meta.head_event))


def _synced_gone(
    ring: memoryview,
    meta: BufferMeta,
    records: npt.NDArray[Any],
    synced: int,
    watermark: SyncedMark,
    metafile: MetaFile,
    name: str,
    stats: dict[str, int],
) -> tuple[BufferMeta, None]:
    """No window at or below the watermark verifies from a later start, and not even the
    oldest does, or those that do lie in a lap's last bytes before damage from its start
    (skipped by a later lap's window placed there): an eviction's newer bytes over the
    rest (a lap written during one sync), and all count as evicted; the unsynced rest is
    dropped (the source sends it again): empty after the watermark.
    """
    mark = watermark.load()
    assert mark is not None
    n = len(records)
    at = int(records["pos"][synced - 1])
    position = _eow_position(ring, at, mark.last_scn, mark.tail_pos)
    fresh = replace(_emptied(meta, mark.last_scn, lost=True), prev_pos=position)
    metafile.publish(fresh)
    stats["recovery_events_dropped"] = n
    log.warning(
        "buffer %s: no synced window can be kept (overwritten by newer bytes before the"
        " head that evicted them was published, or damaged): all %d events dropped, those up to"
        " the synced watermark (SCN %d) counted as evicted; starting empty after it"
        " (the source sends the rest again)",
        name,
        n,
        mark.last_scn,
    )
    return fresh, None


def _later_head(
    ring: memoryview, meta: BufferMeta, records: npt.NDArray[Any], name: str, need: int
) -> tuple[BufferMeta, RingCheck] | None:
    """The state with every window up to the last damaged one evicted, or None.

    The writer evicts windows in memory before it overwrites their bytes
    with new ones, and publishes the new head after the bytes: a machine
    that went down in between (the ring's pages written back, by a sync or
    by the kernel, the meta file's not) leaves a published head whose
    first windows hold newer bytes. Everything after them is intact, synced
    and acknowledged; dropping the whole buffer for them lost it (found by
    review). So the first window start (the event table's, a hint) from
    which every event verifies up to the published tail becomes the head,
    and the windows before it count as evicted: ``prev_scn`` is the SCN of
    the newest of them when its END_OF_WINDOW verifies (:func:`_window_before`),
    else just below the new oldest window, never below what was really
    evicted, so no consumer is served across a gap. Damage also in a middle
    window moves the head past it (the intact windows before it count as
    evicted). Damage in the newest window: None. A binary search over the
    window starts (verification from one start implies it from every later
    one), each step one check.

    Events ``[0, need)`` must verify from the new head on: all of them (``need
    = len(records)``) without a synced watermark; with one, those it covers,
    and the caller trims the unsynced windows after them at their first damage.
    A start whose event table position is outside the published live bytes (a
    flipped bit) does not verify.
    """
    starts = np.flatnonzero(records["op"][: max(need - 1, 0)] == _EOW) + 1
    if starts.size == 0:
        return None

    def verified(i: int) -> RingCheck | None:
        rest = records[i:]
        at = int(rest["pos"][0])  # (the event table's: a hint)
        if not meta.head_pos <= at < meta.tail_pos:
            return None
        check = check_ring(ring, at, meta.tail_pos, int(rest["scn"][0]), meta.last_scn, rest)
        return check if check.good >= need - i else None

    if verified(int(starts[-1])) is None:
        return None
    lo, hi = 0, starts.size - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if verified(int(starts[mid])) is None:
            lo = mid + 1
        else:
            hi = mid
    first = int(starts[lo])
    check = verified(first)
    assert check is not None
    h = check.headers
    head_pos, min_scn = int(check.pos[0]), int(h["scn"][0])
    before = _window_before(ring, meta, int(records["pos"][first - 1]), head_pos, min_scn)
    prev_scn, prev_ts, prev_pos = before or (min_scn - 1, 0, "")
    moved = replace(
        meta,
        head_event=meta.head_event + first,
        head_pos=head_pos,
        min_scn=min_scn,
        prev_scn=max(prev_scn, meta.prev_scn),
        first_ts=int(h["timestamp_ns"][0]),
        windows=int(np.count_nonzero(h["op"] == _EOW)),
        evicted=1,
        prev_ts=prev_ts,
        prev_pos=prev_pos,
    )
    log.warning(
        "buffer %s: its %d oldest events (SCN %d..) do not verify (damaged, or overwritten"
        " by newer bytes before the head that evicted them was published): counted as"
        " evicted; the %d events from SCN %d on are intact",
        name,
        first,
        meta.min_scn,
        check.good,
        moved.min_scn,
    )
    return moved, check


def _window_before(
    ring: memoryview, meta: BufferMeta, pos: int, head_pos: int, min_scn: int
) -> tuple[int, int, str] | None:
    """``(SCN, commit time, source position)`` of the window just before a new head, or None.

    A new head's ``prev_scn`` must be at least the SCN of the newest window
    it evicts (a consumer at a lower checkpoint would be served across the
    gap); just below the new oldest window is always that, but sends the
    consumers that had read the evicted windows to the bootstrap server for
    nothing. The exact SCN is taken only from an END_OF_WINDOW (``pos``, the
    event table's hint) that verifies (both CRCs), ends right at the new head
    and belongs to the published live range (``meta.min_scn <= SCN <
    min_scn``): bytes of an earlier lap hold older SCNs (a stale page could
    otherwise make ``prev_scn`` too low), bytes written after the published
    tail newer ones.
    """
    h = verified_event(ring, pos)
    if h is None or int(h["op"]) != _EOW or pos + int(h["total_length"]) != head_pos:
        return None
    scn = int(h["scn"])
    if not meta.min_scn <= scn < min_scn:
        return None
    start = pos % len(ring)
    try:
        position = end_of_window_position(
            ring[start + HEADER_SIZE : start + int(h["total_length"])]
        )
    except CorruptEventError:
        position = ""
    return scn, int(h["timestamp_ns"]), position


def _rewind(
    meta: BufferMeta,
    check: RingCheck,
    keep: int,
    windows: int,
    index_head: int,
    index_tail: int,
    metafile: MetaFile,
    name: str,
    why: str,
) -> tuple[BufferMeta, None]:
    """Trim to the kept windows and go back to the last of them (``durability = "fsync"``).

    Nothing is owed: the source was acknowledged for synced windows only
    and sends the dropped ones again after the last kept window's position.
    """
    n = meta.tail_event - meta.head_event
    if keep == 0:
        rewound = _emptied(meta, meta.prev_scn)
        last_kept = meta.prev_scn
    else:
        h = check.headers
        last_kept = int(h["scn"][keep - 1])
        rewound = replace(
            meta,
            tail_event=meta.head_event + keep,
            tail_pos=int(check.pos[keep - 1]) + int(h["total_length"][keep - 1]),
            last_scn=last_kept,
            last_ts=int(h["timestamp_ns"][keep - 1]),
            index_head=index_head,
            index_tail=index_tail,
            windows=windows,
        )
    metafile.publish(rewound)
    log.warning(
        "buffer %s: %s: kept %d windows up to SCN %d, dropped %d events (SCN %d..%d);"
        " durability is fsync, so the source was not told they were held: it sends them again",
        name,
        why,
        windows,
        last_kept,
        n - keep,
        last_kept + 1,
        meta.last_scn,
    )
    return rewound, None


def _emptied(meta: BufferMeta, after_scn: int, *, lost: bool = False) -> BufferMeta:
    """``meta`` with no live event, complete after ``after_scn`` (its prev and last SCN);
    ``lost``: the windows dropped are gone for good (not sent again by the source).
    The position after ``after_scn`` is kept when it is the one already known
    (``prev_scn``), else not known."""
    return BufferMeta(
        meta.capacity,
        meta.event_slots,
        meta.index_slots,
        head_event=meta.tail_event,
        tail_event=meta.tail_event,
        head_pos=meta.tail_pos,
        tail_pos=meta.tail_pos,
        prev_scn=after_scn,
        last_scn=after_scn,
        index_head=meta.index_tail,
        index_tail=meta.index_tail,
        evicted=1 if lost else meta.evicted,
        prev_ts=meta.prev_ts if after_scn == meta.prev_scn else 0,
        prev_pos=meta.prev_pos if after_scn == meta.prev_scn else "",
    )


def _interrupted(last: int) -> str:
    return (
        f"windows after SCN {last} were dropped by a recovery of a damaged buffer"
        " that was interrupted before it recorded them"
    )


def _repair_events(
    events: CircularTable,
    head_event: int,
    records: npt.NDArray[Any],
    check: RingCheck,
    name: str,
) -> int:
    """Rewrite the event table records that disagree with the (verified) ring; how many."""
    keep = len(records)
    h = check.headers[:keep]
    pos = check.pos[:keep]
    wrong = pos != records["pos"].astype(np.int64)
    for field, header_field in _FIELDS:
        wrong |= h[header_field] != records[field]
    rows = np.flatnonzero(wrong)
    if rows.size == 0:
        return 0
    truth = np.zeros(rows.size, dtype=EVENT_DTYPE)
    truth["pos"] = pos[rows]
    for field, header_field in _FIELDS:
        truth[field] = h[header_field][rows]
    for j, row in enumerate(rows.tolist()):
        events.put(head_event + row, truth[j : j + 1])
    log.warning(
        "buffer %s: %d event table records did not match the ring; rewrote them from the"
        " event headers",
        name,
        rows.size,
    )
    return int(rows.size)


def _last_position(ring: memoryview, meta: BufferMeta, rec: Any) -> str:
    """The source position in the newest window's END_OF_WINDOW, if it is intact ("" if not)."""
    return _eow_position(ring, int(rec["pos"]), meta.last_scn, meta.tail_pos)


def _eow_position(ring: memoryview, pos: int, scn: int, end: int) -> str:
    """The source position in the END_OF_WINDOW at ``pos`` of the window at ``scn``
    ending at ``end``, if it is intact ("" if not)."""
    h = verified_event(ring, pos)
    if h is None or int(h["op"]) != _EOW or int(h["scn"]) != scn:
        return ""
    if pos + int(h["total_length"]) != end:
        return ""
    start = pos % len(ring)
    try:
        return end_of_window_position(ring[start + HEADER_SIZE : start + int(h["total_length"])])
    except CorruptEventError:
        return ""
