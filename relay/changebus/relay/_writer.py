"""The buffer's writer side: validate, make room, place, copy, index, publish.

One job: append groups of whole windows to an :class:`~._buffer.EventBuffer`
(whose writer side this class is: :class:`BufferWriter` is mixed into it).
Only one thread appends (the relay's writer thread); readers run
concurrently, so the order of a commit is what keeps them safe:

1. validate the whole group before anything is touched (:mod:`._validate`);
   then check its order against the buffer's newest window;
2. place it: positions are virtual (bytes ever written) and an event never
   straddles the end of ``ring.dat`` -- the first event that would is moved
   to the next lap's start, and the skipped bytes belong to no event;
3. make room: evict whole oldest windows, waiting for readers that pinned
   them, and publish the new head *under the lock* (:mod:`._evict`);
4. copy the bytes and write the event table records and SCN index entries
   (:mod:`._index`) -- all beyond the published tail, where no reader looks;
5. run the ``before_publish`` hook, then publish the new tail under the lock
   (and in ``meta.dat``): readers see the whole group at once or not at all.

:meth:`BufferWriter.append_windows` splits a batch into groups of at most
half the ring (one window alone may be larger, up to ``max_window_bytes``);
each group commits alone. A group of several windows is first gathered in a
reused scratch buffer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from changebus.schemas import (
    HEADER_DTYPE,
    HEADER_SIZE,
    CorruptEventError,
    EventTooLargeError,
    end_of_window_position,
)
from changebus.schemas.errors import BadRequestError

from ._evict import Pin, plan_eviction, wait_for_readers
from ._index import add_windows, add_windows_small
from ._meta import BufferMeta, MetaFile, kept_position
from ._prefault import Prefaulter
from ._tables import EVENT_DTYPE, CircularTable
from ._validate import validate

if TYPE_CHECKING:
    from ._bufconfig import BufferConfig

__all__ = ["BufferWriter", "Hook"]

#: ``before_publish(data, ev)``: the group's bytes and its validated event table
#: (``PARSED_DTYPE``: offsets into ``data``, SCNs, ops, lengths, source ids)
Hook = Callable[[bytes | memoryview, npt.NDArray[Any]], None]

#: the largest group gathered in the writer's reused scratch buffer (see _gather)
_SCRATCH_MAX = 32 << 20

#: where an event header holds its source commit time (ns)
TS_OFFSET: Final = 16
assert HEADER_DTYPE.fields is not None
assert HEADER_DTYPE.fields["timestamp_ns"][1] == TS_OFFSET
#: groups of at most this many events commit with Python lists (see _commit_small)
_SMALL_EVENTS = 64


@dataclass(frozen=True, slots=True)
class _Group:
    """A placed group, as the commit publishes it (virtual positions, event numbers)."""

    windows: int
    events: int
    size: int
    first_pos: int
    tail_pos: int
    first_scn: int
    last_scn: int
    first_ts: int
    last_ts: int
    first_event: int


class BufferWriter:
    """The append side of :class:`~._buffer.EventBuffer` (writer thread only)."""

    # the buffer's state this side uses, set up by EventBuffer.__init__
    config: BufferConfig
    name: str
    capacity: int
    block: int
    on_publish: Callable[[], None] | None
    stats: dict[str, int]
    _meta: BufferMeta
    _metafile: MetaFile
    _ring: npt.NDArray[np.uint8]
    _ring_view: memoryview
    _events: CircularTable
    _index: CircularTable
    _lock: threading.Lock
    _pins_changed: threading.Condition
    _pins: set[Pin]
    #: the writer's gather buffer for groups of windows
    _scratch: bytearray
    _prefault: Prefaulter
    _prefault_events: Prefaulter

    def append_window(self, window: bytes | memoryview) -> int:
        """Append one whole window; see :meth:`append_windows`. Returns its SCN."""
        return self.append_windows([window])

    def append_windows(
        self,
        windows: Sequence[bytes | memoryview],
        *,
        before_publish: Hook | None = None,
        sizes: Sequence[Sequence[int]] | None = None,
    ) -> int:
        """Append whole windows (each: events back to back, ending with END_OF_WINDOW).

        All windows are validated before anything touches the buffer, then
        appended and published together (one group commit: the writer thread
        hands over everything that queued up while it was busy). Returns the
        last SCN. Raises :class:`EventTooLargeError` when a window exceeds the
        configured limit, :class:`CorruptEventError` / :class:`BadRequestError`
        when one is malformed or out of order; then nothing is appended.
        ``before_publish(data, ev)`` runs after the bytes are in
        place and before readers can see them (the relay registers new table
        schemas there).

        ``sizes`` (one sequence of event sizes per window, or an empty one
        for a window without) marks windows that changebus's own encoders
        framed in this process (:attr:`changebus.fetchers.Window.event_sizes`):
        the trusted path. Their events are located from the sizes instead of
        a scan and their CRCs, computed once by the encoder, are not computed
        again; every structural check (magic, version, op, lengths, window
        ends, SCNs, seq numbers, order, the sizes themselves) still applies.
        A group with any window without sizes is verified in full, CRCs
        included (see :mod:`._validate`).
        """
        limit = self.config.window_limit
        for w in windows:
            if len(w) > limit:
                self.stats["windows_refused"] += 1
                raise EventTooLargeError(
                    f"window of {len(w)} bytes exceeds buffer {self.name!r} limit of {limit} bytes",
                    size=len(w),
                    limit=limit,
                )
        if sizes is not None and len(sizes) != len(windows):
            raise ValueError("sizes must have one entry per window")
        # split so that one group never exceeds the ring (each part appends alone)
        group: list[bytes | memoryview] = []
        group_sizes: list[Sequence[int]] = []
        size = 0
        last = -1
        for i, w in enumerate(windows):
            if group and size + len(w) > self.capacity // 2:
                last = self._append_group(group, group_sizes, before_publish)
                group, group_sizes, size = [], [], 0
            group.append(w)
            group_sizes.append(sizes[i] if sizes is not None else ())
            size += len(w)
        if group:
            last = self._append_group(group, group_sizes, before_publish)
        return last

    def _append_group(
        self,
        windows: Sequence[bytes | memoryview],
        sizes: Sequence[Sequence[int]],
        before_publish: Hook | None,
    ) -> int:
        data = windows[0] if len(windows) == 1 else self._gather(windows)
        try:
            ev, _offsets, _headers = validate(windows, data, sizes, self.config.slots)
            if len(ev) > self.config.slots and len(windows) > 1:
                # more events than the event table holds (groups are cut by bytes): in
                # halves. Whole, it overran the table after evicting every window, and
                # the ingest failed on it for good (found by review)
                half = len(windows) // 2
                self._append_group(windows[:half], sizes[:half], before_publish)
                return self._append_group(windows[half:], sizes[half:], before_publish)
            # placed where it straddles the ring's end, a window's events from the one that
            # does not fit on go to the next lap's start, skipping less than that event's
            # length (never the first event's: the whole window moves then): a tail that
            # overwrote the window's own first events was served corrupt and lost at a
            # restart (found by review). Only a window alone in its group comes near (a
            # group of several is at most half the ring), and whatever its placement, one
            # that could is refused: the same windows on every relay.
            big = 2 * len(data) > self.capacity and len(ev) > 1
            longest = int(ev["length"][1:].max()) if big else 0
            if len(data) + longest > self.capacity:
                raise EventTooLargeError(
                    f"window of {len(data)} bytes with an event of {longest} bytes after its"
                    f" first does not fit buffer {self.name!r} of {self.capacity} bytes"
                    " wherever it lands (the ring must hold it and that event's length)",
                    size=len(data),
                    limit=self.capacity - longest,
                )
        except EventTooLargeError:
            self.stats["windows_refused"] += 1
            raise
        return self._commit(windows, data, ev, before_publish)

    def _gather(self, windows: Sequence[bytes | memoryview]) -> bytes | memoryview:
        """The windows back to back, in the writer's reused scratch buffer.

        A fresh ``b"".join`` of a group (megabytes) is newly mapped memory
        every time, and its page faults cost more than the copy. The scratch
        buffer is reused (grown, never above ``_SCRATCH_MAX``; larger groups
        are joined). The view is only used until the group is committed.
        """
        size = sum(len(w) for w in windows)
        if size > _SCRATCH_MAX:
            return b"".join(windows)
        if len(self._scratch) < size:
            self._scratch = bytearray(min(max(size, 2 * len(self._scratch)), _SCRATCH_MAX))
        view = memoryview(self._scratch)
        pos = 0
        for w in windows:
            end = pos + len(w)
            view[pos:end] = w
            pos = end
        return view[:size]

    def _check_order(self, first_scn: int) -> None:
        m = self._meta
        if m.windows > 0 and first_scn <= m.last_scn:
            raise BadRequestError(f"window SCN {first_scn} is not above the last SCN {m.last_scn}")
        if first_scn < m.prev_scn:
            raise BadRequestError(f"window SCN {first_scn} is below the buffer start {m.prev_scn}")

    def _commit(
        self,
        windows: Sequence[bytes | memoryview],
        data: bytes | memoryview,
        ev: npt.NDArray[Any],
        before_publish: Hook | None,
    ) -> int:
        """Place, copy, index and publish validated windows (writer thread)."""
        n = len(ev)
        size = len(data)
        if n <= _SMALL_EVENTS and self._meta.tail_pos % self.capacity + size <= self.capacity:
            return self._commit_small(windows, data, ev, before_publish)
        first_scn = int(ev["scn"][0])
        last_scn = int(ev["scn"][-1])
        self._check_order(first_scn)
        m = self._meta
        # placement: events never straddle the end of the ring
        positions = ev["off"] + m.tail_pos
        phys = m.tail_pos % self.capacity
        k = n
        if phys + size > self.capacity:
            room = self.capacity - phys
            k = int(np.searchsorted(ev["off"] + ev["length"], room, side="right"))
            positions[k:] += room - int(ev["off"][k])
        new_tail_pos = int(positions[-1]) + int(ev["length"][-1])

        self._make_room(new_tail_pos - self.capacity, m.tail_event + n - self.config.slots)
        m = self._meta

        # copy bytes (beyond tail: invisible to readers)
        src = np.frombuffer(data, dtype=np.uint8)
        cut = int(ev["off"][k]) if k < n else size
        self._ring[phys : phys + cut] = src[:cut]
        if cut < size:
            self._ring[0 : size - cut] = src[cut:]

        records = np.zeros(n, dtype=EVENT_DTYPE)
        records["pos"] = positions
        for name in ("scn", "key_hash", "length", "op", "source_id"):
            records[name] = ev[name]
        first_event = m.tail_event
        self._events.put(first_event, records)

        # SCN index: the first window starting in each new block
        index_head, index_tail = add_windows(
            self._index, self._events, self.block, m, ev, positions, first_event
        )

        group = _Group(
            len(windows),
            n,
            size,
            int(positions[0]),
            new_tail_pos,
            first_scn,
            last_scn,
            int(ev["ts"][0]),
            int(ev["ts"][-1]),
            first_event,
        )
        self._publish(group, index_head, index_tail, data, ev, before_publish)
        return last_scn

    def _commit_small(
        self,
        windows: Sequence[bytes | memoryview],
        data: bytes | memoryview,
        ev: npt.NDArray[Any],
        before_publish: Hook | None,
    ) -> int:
        """:meth:`_commit` for a small group that ends before the ring does.

        The same records, index entries and published state, computed over
        Python lists: a commit's few dozen numpy calls on arrays of a dozen
        events cost microseconds each (several times that on a machine idle
        between commits), which made a small window's append most of the
        relay's share of its latency. ``tests/relay/test_buffer.py`` checks
        both paths write the same files.
        """
        rows: list[tuple[int, ...]] = ev.tolist()  # (off, scn, key_hash, length, op, ...)
        n = len(rows)
        size = len(data)
        first_scn: int = rows[0][1]
        last_scn: int = rows[-1][1]
        self._check_order(first_scn)
        tail_pos = self._meta.tail_pos
        new_tail_pos = tail_pos + size  # back to back, and no lap: nothing skipped
        self._make_room(new_tail_pos - self.capacity, self._meta.tail_event + n - self.config.slots)
        m = self._meta

        phys = tail_pos % self.capacity
        self._ring_view[phys : phys + size] = data
        records = np.array(
            [(tail_pos + r[0], r[1], r[2], r[3], r[4], 0, r[5]) for r in rows], dtype=EVENT_DTYPE
        )
        first_event = m.tail_event
        self._events.put(first_event, records)

        index_head, index_tail = add_windows_small(
            self._index, self._events, self.block, m, rows, tail_pos, first_event
        )
        group = _Group(
            len(windows),
            n,
            size,
            tail_pos,
            new_tail_pos,
            first_scn,
            last_scn,
            rows[0][6],
            rows[-1][6],
            first_event,
        )
        self._publish(group, index_head, index_tail, data, ev, before_publish)
        return last_scn

    def _publish(
        self,
        group: _Group,
        index_head: int,
        index_tail: int,
        data: bytes | memoryview,
        ev: npt.NDArray[Any],
        before_publish: Hook | None,
    ) -> None:
        """The last step of both commits: run the hook, publish the new tail, tell readers."""
        if before_publish is not None:
            before_publish(data, ev)
        with self._lock:
            m = self._meta
            empty_before = m.tail_event == m.head_event
            new = BufferMeta(
                m.capacity,
                m.event_slots,
                m.index_slots,
                head_event=m.head_event,
                tail_event=m.tail_event + group.events,
                head_pos=group.first_pos if empty_before else m.head_pos,
                tail_pos=group.tail_pos,
                prev_scn=m.prev_scn,
                last_scn=group.last_scn,
                min_scn=group.first_scn if empty_before else m.min_scn,
                index_head=index_head,
                index_tail=index_tail,
                first_ts=group.first_ts if empty_before else m.first_ts,
                last_ts=group.last_ts,
                windows=m.windows + group.windows,
                evicted=m.evicted,
                prev_ts=m.prev_ts,
                prev_pos=m.prev_pos,
            )
            # the file first: the fsync syncer reads ``meta`` without the lock, and a sync
            # of the files must never cover a window the meta file does not name yet (the
            # source was acknowledged past what recovery finds after an OS crash: review)
            self._metafile.publish(new)
            self._meta = new
        self._prefault.advance(group.tail_pos)
        self._prefault_events.advance((group.first_event + group.events) * EVENT_DTYPE.itemsize)
        self.stats["windows_appended"] += group.windows
        self.stats["events_appended"] += group.events
        self.stats["bytes_appended"] += group.size
        if self.on_publish is not None:
            self.on_publish()

    def _timestamp_at(self, pos: int) -> int:
        """The commit time in the header of the event at virtual position ``pos``."""
        at = pos % self.capacity + TS_OFFSET
        return int(self._ring[at : at + 8].view("<i8")[0])

    def _position_at(self, event: int) -> str:
        """The source position of the END_OF_WINDOW numbered ``event`` ("" if unreadable).

        The event must still be in the ring (live, or evicted and not yet
        overwritten). About 2 µs: every eviction reads one.
        """
        rec = self._events.at(event)
        start = int(rec["pos"]) % self.capacity
        try:
            return end_of_window_position(
                self._ring_view[start + HEADER_SIZE : start + int(rec["length"])]
            )
        except CorruptEventError:
            return ""

    def _make_room(self, min_head_pos: int, min_head_event: int) -> None:
        """Evict whole oldest windows until the head is past both bounds."""
        plan = plan_eviction(self._events, self._index, self._meta, min_head_pos, min_head_event)
        if plan is None:
            return
        # (the evicted bytes are still in the ring: nothing overwrote them yet)
        prev_pos = kept_position(self._position_at(plan.head_event - 1))
        with self._pins_changed:
            self.stats["pins_overrun"] += wait_for_readers(
                self._pins,
                self._pins_changed,
                plan.head_pos,
                self.config.pin_timeout_s,
                self.name,
                self.config.slow_reader_s,
            )
            m = self._meta
            self._meta = replace(
                m,
                head_event=plan.head_event,
                head_pos=plan.head_pos,
                prev_scn=plan.prev_scn,
                min_scn=plan.min_scn,
                index_head=plan.index_head,
                windows=m.windows - plan.windows,
                evicted=1,
                prev_ts=self._timestamp_at(int(self._events.at(plan.head_event - 1)["pos"])),
                prev_pos=prev_pos,
                first_ts=(
                    self._timestamp_at(plan.head_pos) if plan.head_event < m.tail_event else 0
                ),
            )
            self._metafile.publish(self._meta)
        self.stats["windows_evicted"] += plan.windows
