"""The relay's event buffer: a space-bounded circular log of whole windows.

Data structures (all memory-mapped files in the buffer's directory, so the
process's own memory stays small whatever the capacity, and a restarted
relay finds everything again):

* ``ring.dat`` -- ``capacity`` bytes of events, back to back. Byte positions
  are *virtual* (bytes ever written); a position's offset in the file is
  ``pos % capacity``. An event never straddles the end of the file: when the
  next event does not fit before the end, the writer continues at the next
  lap's start (the skipped bytes belong to no event).
* ``events.dat`` -- the event table (see :mod:`._tables`): position, SCN,
  key hash, length, op and source of every live event, by event number.
* ``index.dat`` -- the SCN index (see :mod:`._index`): for each ring block of
  ``block_bytes`` in which a window starts, the SCN and first event number
  of the first such window. A lookup is a binary search over the index plus
  a vectorised scan of the event table between two index entries.
* ``meta.dat`` -- the published state (:class:`._meta.BufferMeta`).

Invariants (hold whenever the lock is free):

* live events ``[head_event, tail_event)`` and live bytes
  ``[head_pos, tail_pos)`` hold whole windows only, in strictly increasing
  SCN order, each closed by an END_OF_WINDOW event;
* ``tail_pos - head_pos <= capacity`` and ``tail_event - head_event <= event_slots``;
* ``prev_scn`` is the SCN of the newest evicted window (or the SCN the
  buffer was started at), so nothing after ``prev_scn`` is missing.

The parts, one module each: validating appended windows
(:mod:`._validate`), the SCN index (:mod:`._index`), eviction and reader
pins (:mod:`._evict`), selecting what a reader sends (:mod:`._reader`) and
recovery on open (:mod:`._recovery`). This module places and commits
windows and ties the parts together under one lock.

Concurrency
===========
There is one writer (a dedicated thread, fed by a fetcher through a bounded
queue) and many readers (the HTTP handlers on the event loop). One
``threading.Lock`` guards the published state; nobody holds it for I/O:

* The writer first makes room: it moves ``head`` past whole windows *under
  the lock*, then copies the new window into space no reader can reach (it
  lies beyond ``tail``), writes the event table and index entries, and only
  then publishes the new ``tail`` under the lock. Readers therefore never
  see part of a window.
* A reader selects events under the lock and, in the same critical section,
  *pins* the lowest byte position it will send; the writer does not evict
  pinned bytes until the pin is released or times out (then the reader
  must abort its response): see :mod:`._evict`.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from changebus.schemas import (
    HEADER_SIZE,
    CorruptEventError,
    EventTooLargeError,
    Op,
    PartitionFilter,
    decode_control,
    headers_at,
    source_table,
)
from changebus.schemas.errors import BadRequestError, ConfigError

from ._evict import Pin, plan_eviction, wait_for_readers
from ._index import add_windows
from ._meta import BufferMeta, MetaFile
from ._prefault import Prefaulter
from ._reader import Selection, locate, select_events
from ._recovery import recover
from ._tables import EVENT_DTYPE, INDEX_DTYPE, CircularTable
from ._validate import validate

__all__ = ["BufferConfig", "EventBuffer", "Pin", "Selection"]

_Hook = Callable[[bytes | memoryview, npt.NDArray[np.int64], npt.NDArray[Any]], None]

log = logging.getLogger("changebus.relay.buffer")

#: the largest group gathered in the writer's reused scratch buffer (see _gather)
_SCRATCH_MAX = 32 << 20
#: ring bytes faulted in ahead of the writer (see :mod:`._prefault`)
_PREFAULT_AHEAD = 32 << 20
#: event table bytes faulted in ahead of the writer (32 bytes per event)
_PREFAULT_EVENTS_AHEAD = 1 << 20


@dataclass(frozen=True)
class BufferConfig:
    """Sizes of one buffer. Bytes for sizes, seconds for durations."""

    capacity_bytes: int = 64 << 20
    #: event table slots; 0 = capacity_bytes // 128 (average event >= 128 B)
    event_slots: int = 0
    #: bytes per SCN index block; 0 = chosen so the index has ~capacity/4 KiB entries
    block_bytes: int = 0
    #: largest window accepted (0 = the capacity)
    max_window_bytes: int = 0
    #: how long the writer waits for a slow reader before overrunning its pin
    pin_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if self.capacity_bytes < 64 * 1024:
            raise ConfigError(f"buffer capacity_bytes must be >= 64 KiB, got {self.capacity_bytes}")
        if self.event_slots < 0 or self.block_bytes < 0 or self.max_window_bytes < 0:
            raise ConfigError("buffer sizes must not be negative")
        if self.max_window_bytes > self.capacity_bytes:
            raise ConfigError("max_window_bytes cannot exceed capacity_bytes")
        if self.pin_timeout_s <= 0:
            raise ConfigError("pin_timeout_s must be positive")

    @property
    def slots(self) -> int:
        return self.event_slots or max(1024, self.capacity_bytes // 128)

    @property
    def block(self) -> int:
        return self.block_bytes or max(
            256, self.capacity_bytes // max(1, self.capacity_bytes // 4096)
        )

    @property
    def window_limit(self) -> int:
        return self.max_window_bytes or self.capacity_bytes


class EventBuffer:
    """A circular buffer of whole windows for one physical partition."""

    def __init__(
        self,
        directory: Path,
        config: BufferConfig,
        *,
        name: str = "default",
        partition_id: int = 0,
        on_publish: Callable[[], None] | None = None,
    ) -> None:
        self.directory = directory
        self.config = config
        self.name = name
        self.partition_id = partition_id
        self.on_publish = on_publish
        self.capacity = config.capacity_bytes
        self.block = config.block
        index_slots = math.ceil(self.capacity / self.block) + 4
        directory.mkdir(parents=True, exist_ok=True)
        self._metafile = MetaFile(directory / "meta.dat")
        previous = None if self._metafile.created else self._metafile.load()
        compatible = (
            previous is not None
            and previous.capacity == self.capacity
            and previous.event_slots == config.slots
            and previous.index_slots == index_slots
            and (directory / "ring.dat").exists()
            and (directory / "ring.dat").stat().st_size == self.capacity
        )
        if previous is not None and not compatible:
            log.warning("buffer %s: sizes changed or files missing; starting empty", name)
        create = not compatible
        self._ring_map = np.memmap(
            directory / "ring.dat",
            dtype=np.uint8,
            mode="w+" if create else "r+",
            shape=(self.capacity,),
        )
        self._ring: npt.NDArray[np.uint8] = self._ring_map.view(np.ndarray)
        self._ring_view = memoryview(self._ring)  # type: ignore[arg-type]
        self._events = CircularTable(
            directory / "events.dat", EVENT_DTYPE, config.slots, create=create
        )
        self._index = CircularTable(
            directory / "index.dat", INDEX_DTYPE, index_slots, create=create
        )
        self._lock = threading.Lock()
        self._pins_changed = threading.Condition(self._lock)
        self._pins: set[Pin] = set()
        self.stats = {
            "windows_appended": 0,
            "events_appended": 0,
            "bytes_appended": 0,
            "windows_evicted": 0,
            "windows_refused": 0,
            "pins_overrun": 0,
        }
        if compatible and previous is not None:
            self._meta = recover(previous, self._events, self._ring_view, self._metafile, name)
        else:
            self._meta = BufferMeta(self.capacity, config.slots, index_slots)
            self._metafile.publish(self._meta)
        #: the writer's gather buffer for groups of windows (writer thread only)
        self._scratch = bytearray()
        self._prefault = Prefaulter(self._ring, self._meta.tail_pos, _PREFAULT_AHEAD)
        # the event table's pages too: a first write to one is a page fault that
        # reads ahead (zero-fills) a large folio of the file, in the writer thread
        self._event_bytes: npt.NDArray[np.uint8] = self._events.data.view(np.uint8)
        self._prefault_events = Prefaulter(
            self._event_bytes,
            self._meta.tail_event * EVENT_DTYPE.itemsize,
            _PREFAULT_EVENTS_AHEAD,
        )

    # ------------------------------------------------------------------
    # state

    @property
    def meta(self) -> BufferMeta:
        """The last published state (a consistent, immutable snapshot)."""
        return self._meta

    def set_start(self, scn: int) -> None:
        """Declare an empty buffer complete after ``scn`` (sets ``prev_scn``).

        Used when a fetcher starts at a known source position with nothing
        buffered yet: consumers at ``scn`` or later have missed nothing.
        """
        with self._lock:
            m = self._meta
            if m.tail_event != m.head_event:
                raise ValueError("set_start needs an empty buffer")
            self._meta = replace(m, prev_scn=scn, last_scn=max(m.last_scn, scn))
            self._metafile.publish(self._meta)

    @property
    def last_source_position(self) -> str:
        """The source position in the newest window's END_OF_WINDOW ("" if none).

        An empty buffer (new, started with :meth:`set_start`, or emptied by
        recovery) has no position: the fetcher resumes from the SCN alone.
        """
        m = self._meta
        if m.tail_event == m.head_event:
            return ""
        rec = self._events.at(m.tail_event - 1)
        start = int(rec["pos"]) % self.capacity
        payload = bytes(self._ring_view[start + HEADER_SIZE : start + int(rec["length"])])
        try:
            eow = decode_control(Op.END_OF_WINDOW, payload)
        except CorruptEventError:
            return ""
        return str(getattr(eow, "source_position", ""))

    # ------------------------------------------------------------------
    # writer side (one thread)

    def append_window(self, window: bytes | memoryview) -> int:
        """Append one whole window; see :meth:`append_windows`. Returns its SCN."""
        return self.append_windows([window])

    def append_windows(
        self,
        windows: Sequence[bytes | memoryview],
        *,
        before_publish: _Hook | None = None,
        sizes: Sequence[Sequence[int]] | None = None,
    ) -> int:
        """Append whole windows (each: events back to back, ending with END_OF_WINDOW).

        All windows are validated before anything touches the buffer, then
        appended and published together (one group commit: the writer thread
        hands over everything that queued up while it was busy). Returns the
        last SCN. Raises :class:`EventTooLargeError` when a window exceeds the
        configured limit, :class:`CorruptEventError` / :class:`BadRequestError`
        when one is malformed or out of order; then nothing is appended.
        ``before_publish(data, offsets, headers)`` runs after the bytes are in
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
        before_publish: _Hook | None,
    ) -> int:
        data = windows[0] if len(windows) == 1 else self._gather(windows)
        try:
            ev, offsets, headers = validate(windows, data, sizes, self.config.slots)
        except EventTooLargeError:
            self.stats["windows_refused"] += 1
            raise
        return self._commit(windows, data, ev, offsets, headers, before_publish)

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
        offsets: npt.NDArray[np.int64],
        headers: npt.NDArray[Any] | None,
        before_publish: _Hook | None,
    ) -> int:
        """Place, copy, index and publish validated windows (writer thread)."""
        n = len(ev)
        size = len(data)
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

        if before_publish is not None:
            if headers is None:
                headers = headers_at(data, offsets)
            before_publish(data, offsets, headers)
        with self._lock:
            m = self._meta
            empty_before = m.tail_event == m.head_event
            self._meta = BufferMeta(
                m.capacity,
                m.event_slots,
                m.index_slots,
                head_event=m.head_event,
                tail_event=m.tail_event + n,
                head_pos=int(positions[0]) if empty_before else m.head_pos,
                tail_pos=new_tail_pos,
                prev_scn=m.prev_scn,
                last_scn=last_scn,
                min_scn=first_scn if empty_before else m.min_scn,
                index_head=index_head,
                index_tail=index_tail,
                first_ts=int(ev["ts"][0]) if empty_before else m.first_ts,
                last_ts=int(ev["ts"][-1]),
                windows=m.windows + len(windows),
            )
            self._metafile.publish(self._meta)
        self._prefault.advance(new_tail_pos)
        self._prefault_events.advance((first_event + n) * EVENT_DTYPE.itemsize)
        self.stats["windows_appended"] += len(windows)
        self.stats["events_appended"] += n
        self.stats["bytes_appended"] += size
        if self.on_publish is not None:
            self.on_publish()
        return last_scn

    def _make_room(self, min_head_pos: int, min_head_event: int) -> None:
        """Evict whole oldest windows until the head is past both bounds."""
        plan = plan_eviction(self._events, self._index, self._meta, min_head_pos, min_head_event)
        if plan is None:
            return
        with self._pins_changed:
            self.stats["pins_overrun"] += wait_for_readers(
                self._pins, self._pins_changed, plan.head_pos, self.config.pin_timeout_s, self.name
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
            )
            self._metafile.publish(self._meta)
        self.stats["windows_evicted"] += plan.windows

    # ------------------------------------------------------------------
    # reader side (see :mod:`._reader`)

    def locate(self, window_scn: int, window_offset: int) -> tuple[int, int]:
        """Where to start sending after checkpoint ``(window_scn, window_offset)``.

        Returns ``(start_event, window_first_event)``; raises
        :class:`~changebus.schemas.ScnNotFoundError` when events after the
        checkpoint may have been evicted (see :func:`._reader.locate`).
        """
        return locate(self._events, self._index, self._meta, self.name, window_scn, window_offset)

    def select(
        self,
        window_scn: int,
        window_offset: int,
        max_bytes: int,
        *,
        key_filter: PartitionFilter | None = None,
        sources: frozenset[int] | None = None,
    ) -> Selection | None:
        """Choose the events to send after a checkpoint, and pin them.

        Returns None when nothing newer than the checkpoint exists (the
        caller long-polls). Whole windows only, unless the first window alone
        exceeds ``max_bytes``: then as many of its events as fit (at least
        one), and ``partial`` is set. Control events are always selected.
        The caller must :meth:`release` the selection after sending it.
        """
        if max_bytes <= 0:
            raise BadRequestError("max_bytes must be positive")
        src_table = None if sources is None else source_table(sources)
        with self._lock:
            m = self._meta
            start, window_first = locate(
                self._events, self._index, m, self.name, window_scn, window_offset
            )
            if start >= m.tail_event:
                return None
            result, low = select_events(
                self._events,
                self.capacity,
                m,
                start,
                window_first,
                max_bytes,
                key_filter,
                src_table,
            )
            pin = Pin(low)
            self._pins.add(pin)
        result.pin = pin
        rv = self._ring_view
        result.views = [rv[a:b] for a, b in result.spans]
        return result

    def release(self, selection: Selection) -> bool:
        """Release a selection's pin; False when the writer overran it meanwhile."""
        pin = selection.pin
        if pin is None:
            return True
        with self._pins_changed:
            self._pins.discard(pin)
            self._pins_changed.notify_all()
        selection.pin = None
        selection.views = []
        return not pin.overrun

    # ------------------------------------------------------------------
    # lifecycle

    def flush(self) -> None:
        """msync everything (clean shutdown, periodic durability)."""
        self._ring_map.flush()
        self._events.flush()
        self._index.flush()
        self._metafile.flush()

    def close(self) -> None:
        self._prefault.close()
        self._prefault_events.close()
        del self._event_bytes  # a view of the event table's mapping, closed below
        self.flush()
        self._ring_view.release()
        del self._ring
        mm = getattr(self._ring_map, "_mmap", None)
        del self._ring_map
        if mm is not None:
            mm.close()
        self._events.close()
        self._index.close()
        self._metafile.close()
