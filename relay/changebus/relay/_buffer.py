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
* ``index.dat`` -- the SCN index: for each ring block of ``block_bytes`` in
  which a window starts, the SCN and first event number of the first such
  window. A lookup is a binary search over the index plus a vectorised scan
  of the event table between two index entries.
* ``meta.dat`` -- the published state (:class:`._meta.BufferMeta`).

Invariants (hold whenever the lock is free):

* live events ``[head_event, tail_event)`` and live bytes
  ``[head_pos, tail_pos)`` hold whole windows only, in strictly increasing
  SCN order, each closed by an END_OF_WINDOW event;
* ``tail_pos - head_pos <= capacity`` and ``tail_event - head_event <= event_slots``;
* ``prev_scn`` is the SCN of the newest evicted window (or the SCN the
  buffer was started at), so nothing after ``prev_scn`` is missing.

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
  *pins* the lowest byte position it will send. It then writes memoryview
  slices of the ring to its socket without the lock, and releases the pin
  when the bytes have left the process. Before evicting bytes at or beyond a
  pinned position the writer waits (``pin_timeout_s``); after that it marks
  the pin as overrun and evicts anyway. A reader whose pin was overrun must
  abort its response (the client then sees a short body and retries); it
  never delivers bytes that may have been overwritten.
"""

from __future__ import annotations

import itertools
import logging
import math
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from changebus.schemas import (
    HEADER_SIZE,
    MAGIC,
    CorruptEventError,
    EventTooLargeError,
    Op,
    PartitionFilter,
    ScnNotFoundError,
    check_headers,
    crc32,
    decode_control,
    event_mask,
    headers_at,
    parse_stream,
    source_table,
    verify_payloads,
)
from changebus.schemas.errors import BadRequestError, ConfigError

from ._meta import BufferMeta, MetaFile
from ._prefault import Prefaulter
from ._tables import EVENT_DTYPE, INDEX_DTYPE, CircularTable

__all__ = ["BufferConfig", "EventBuffer", "Pin", "Selection"]

_Hook = Callable[[bytes | memoryview, npt.NDArray[np.int64], npt.NDArray[Any]], None]
#: groups up to this size are validated event by event, larger ones in bulk
_SCALAR_PARSE_BYTES = 32 * 1024
_FULL_HEADER = struct.Struct("<HBBIQqQQIIIHHHHI")
_OPS = frozenset(int(op) for op in Op)
_VALID_OP = np.zeros(256, dtype=bool)
_VALID_OP[sorted(_OPS)] = True
_PARSED_DTYPE = np.dtype(
    [
        ("off", "<i8"),
        ("scn", "<i8"),
        ("key_hash", "<u8"),
        ("length", "<i8"),
        ("op", "u1"),
        ("source_id", "<u2"),
        ("ts", "<i8"),
        ("first", "?"),
    ]
)

log = logging.getLogger("changebus.relay.buffer")

_EOW = int(Op.END_OF_WINDOW)
_SCAN_CHUNK = 16384
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


@dataclass(eq=False)
class Pin:
    """A reader's claim on ring bytes from ``pos`` on (see the module docstring)."""

    pos: int
    overrun: bool = False


@dataclass
class Selection:
    """What a reader should send: ring byte spans, and where it got to.

    ``spans`` are physical ``(start, stop)`` offsets into the ring, each a
    run of back-to-back selected events. ``next_scn``/``next_offset`` form the
    checkpoint after these events: ``next_offset`` is -1 when the last window
    was sent whole, else the number of that window's events already passed
    (sent or filtered out). ``partial`` says a window was cut by the byte
    limit. ``pin`` must be released with :meth:`EventBuffer.release`.
    """

    spans: list[tuple[int, int]]
    events: int
    nbytes: int
    next_scn: int
    next_offset: int
    partial: bool
    windows: int
    pin: Pin | None = None
    views: list[memoryview] = field(default_factory=list)


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
        self._start_position = ""
        if compatible and previous is not None:
            self._meta = self._recover(previous)
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
            self._meta = _replace(m, prev_scn=scn, last_scn=max(m.last_scn, scn))
            self._metafile.publish(self._meta)

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
        included.
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
        headers: npt.NDArray[Any] | None
        trusted = all(sizes)
        if len(data) <= _SCALAR_PARSE_BYTES:  # numpy's per-call cost would dominate
            ev, offsets, headers = self._parse_small(windows, data, check_crc=not trusted)
            if trusted:
                _check_sizes(windows, sizes, ev["length"].tolist())
        elif trusted:
            ev, offsets, headers = self._parse_trusted(windows, sizes, data)
        else:
            ev, offsets, headers = self._parse_large(windows, data)
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

    def _parse_small(
        self,
        windows: Sequence[bytes | memoryview],
        data: bytes | memoryview,
        *,
        check_crc: bool = True,
    ) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64], npt.NDArray[Any] | None]:
        """Validate a small group event by event (no per-call numpy overhead).

        ``check_crc`` False (trusted windows) skips the two CRCs per event.
        """
        mv = memoryview(data)
        size = len(mv)
        bounds = list(itertools.accumulate(len(w) for w in windows))
        rows: list[tuple[int, int, int, int, int, int, int, int]] = []
        unpack = _FULL_HEADER.unpack_from
        pos = wi = seq_next = 0
        win_scn = last = -1
        while pos < size:
            if pos + HEADER_SIZE > size:
                raise CorruptEventError(f"{size - pos} stray bytes after the last event")
            (
                magic,
                version,
                op,
                total,
                scn,
                ts,
                khash,
                _sid,
                plen,
                pcrc,
                seq,
                source,
                _part,
                _ver,
                klen,
                hcrc,
            ) = unpack(mv, pos)
            if magic != MAGIC or version != 1 or op not in _OPS:
                raise CorruptEventError(f"malformed event header at offset {pos}")
            end = pos + total
            if total != HEADER_SIZE + klen + plen or end > size:
                raise CorruptEventError(f"inconsistent event lengths at offset {pos}")
            if check_crc:
                if crc32(mv[pos : pos + 60]) != hcrc:
                    raise CorruptEventError(f"header checksum mismatch at offset {pos}")
                if crc32(mv[pos + HEADER_SIZE : end]) != pcrc:
                    raise CorruptEventError(f"payload checksum mismatch at offset {pos}")
            if seq_next == 0:
                if scn <= last:
                    raise BadRequestError("window SCNs must increase")
                win_scn = scn
            elif scn != win_scn:
                raise BadRequestError("all events of a window must carry the window's SCN")
            if seq != seq_next:
                raise BadRequestError("event seq numbers of a window must be 0, 1, 2, ...")
            boundary = wi < len(bounds) and end == bounds[wi]
            if (op == _EOW) != boundary:
                raise BadRequestError("each window must end with exactly one END_OF_WINDOW event")
            rows.append((pos, scn, khash, total, op, source, ts, seq_next == 0))
            if op == _EOW:
                wi += 1
                seq_next = 0
                last = scn
            else:
                seq_next += 1
            pos = end
        if not rows or wi != len(windows):
            raise BadRequestError("each window must end with exactly one END_OF_WINDOW event")
        if max(len(rows), 0) > self.config.slots:
            self.stats["windows_refused"] += 1
            raise EventTooLargeError(
                f"a window has more events than the event table ({self.config.slots})"
            )
        ev = np.array(rows, dtype=_PARSED_DTYPE)
        return ev, ev["off"], None

    def _parse_large(
        self, windows: Sequence[bytes | memoryview], data: bytes | memoryview
    ) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64], npt.NDArray[Any]]:
        """Validate a large group with bulk numpy checks."""
        offsets, headers = parse_stream(data)
        return self._check_windows(windows, offsets, headers)

    def _parse_trusted(
        self,
        windows: Sequence[bytes | memoryview],
        sizes: Sequence[Sequence[int]],
        data: bytes | memoryview,
    ) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64], npt.NDArray[Any]]:
        """Locate and check the events of trusted windows (no scan, no CRCs)."""
        lens = np.fromiter(itertools.chain.from_iterable(sizes), dtype=np.int64)
        ends = np.cumsum(lens)
        window_ends = ends[np.cumsum([len(s) for s in sizes]) - 1]
        if (window_ends != np.cumsum([len(w) for w in windows])).any():
            raise BadRequestError("event sizes do not add up to their windows")
        offsets = ends - lens
        headers = headers_at(data, offsets)
        if (
            (headers["magic"] != MAGIC)
            | (headers["version"] != 1)
            | ~_VALID_OP[headers["op"]]
            | (headers["total_length"] != lens)
            | (
                headers["key_length"].astype(np.int64)
                + headers["payload_length"].astype(np.int64)
                + HEADER_SIZE
                != lens
            )
        ).any():
            raise CorruptEventError("malformed event header in a trusted window")
        return self._check_windows(windows, offsets, headers)

    def _check_windows(
        self,
        windows: Sequence[bytes | memoryview],
        offsets: npt.NDArray[np.int64],
        headers: npt.NDArray[Any],
    ) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64], npt.NDArray[Any]]:
        """Window structure of located, well-formed events, in numpy."""
        n = len(offsets)
        ops = headers["op"]
        scns = headers["scn"].astype(np.int64)
        eows = np.flatnonzero(ops == _EOW)
        if n == 0 or eows.size != len(windows) or eows[-1] != n - 1:
            raise BadRequestError("each window must end with exactly one END_OF_WINDOW event")
        ends = offsets[eows] + headers["total_length"][eows].astype(np.int64)
        if (ends != np.cumsum([len(w) for w in windows])).any():
            raise BadRequestError("END_OF_WINDOW may only close a window")
        starts = np.concatenate(([0], eows[:-1] + 1))
        sizes = np.diff(np.concatenate((starts, [n])))
        window_of = np.repeat(np.arange(len(windows)), sizes)
        if (scns != scns[eows][window_of]).any():
            raise BadRequestError("all events of a window must carry the window's SCN")
        if (headers["seq"].astype(np.int64) != np.arange(n) - starts[window_of]).any():
            raise BadRequestError("event seq numbers of a window must be 0, 1, 2, ...")
        if (np.diff(scns[eows]) <= 0).any():
            raise BadRequestError("window SCNs must increase")
        if int(sizes.max()) > self.config.slots:
            self.stats["windows_refused"] += 1
            raise EventTooLargeError(
                f"a window has more events than the event table ({self.config.slots})"
            )
        ev = np.empty(n, dtype=_PARSED_DTYPE)
        ev["off"] = offsets
        ev["scn"] = scns
        ev["key_hash"] = headers["key_hash"]
        ev["length"] = headers["total_length"]
        ev["op"] = ops
        ev["source_id"] = headers["source_id"]
        ev["ts"] = headers["timestamp_ns"]
        ev["first"] = False
        ev["first"][starts] = True
        return ev, offsets, headers

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
        index_head, index_tail = m.index_head, m.index_tail
        firsts = np.flatnonzero(ev["first"])
        blocks = positions[firsts] // self.block
        if index_tail > index_head:
            last_event = int(self._index.at(index_tail - 1)["event"])
            last_block = int(self._events.at(last_event)["pos"]) // self.block
        else:
            last_block = -1
        fresh = firsts[np.flatnonzero(blocks != np.concatenate(([last_block], blocks[:-1])))]
        if fresh.size:
            entries = np.empty(fresh.size, dtype=INDEX_DTYPE)
            entries["scn"] = ev["scn"][fresh]
            entries["event"] = first_event + fresh
            index_head = max(index_head, index_tail + fresh.size - self._index.slots)
            self._index.put(index_tail, entries[-self._index.slots :])
            index_tail += fresh.size

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

    @property
    def last_source_position(self) -> str:
        """The source position in the newest window's END_OF_WINDOW ("" if none)."""
        m = self._meta
        if m.tail_event == m.head_event:
            return self._start_position
        rec = self._events.at(m.tail_event - 1)
        start = int(rec["pos"]) % self.capacity
        payload = bytes(self._ring_view[start + HEADER_SIZE : start + int(rec["length"])])
        try:
            eow = decode_control(Op.END_OF_WINDOW, payload)
        except CorruptEventError:
            return ""
        return str(getattr(eow, "source_position", ""))

    def _find(self, start: int, pred: Callable[[npt.NDArray[Any]], npt.NDArray[np.bool_]]) -> int:
        """First event number >= ``start`` whose record satisfies ``pred`` (or tail)."""
        tail = self._meta.tail_event
        e = start
        chunk = 64
        while e < tail:
            stop = min(e + chunk, tail)
            hits = np.flatnonzero(pred(self._events.get(e, stop)))
            if hits.size:
                return e + int(hits[0])
            e = stop
            chunk = min(chunk * 4, _SCAN_CHUNK)
        return tail

    def _make_room(self, min_head_pos: int, min_head_event: int) -> None:
        """Evict whole oldest windows until the head is past both bounds."""
        m = self._meta
        if m.head_pos >= min_head_pos and m.head_event >= min_head_event:
            return
        cand = self._events.searchsorted(m.head_event, m.tail_event, "pos", max(min_head_pos, 0))
        cand = max(cand, min_head_event)
        if cand <= m.head_event:
            return
        if cand < m.tail_event and int(self._events.at(cand - 1)["op"]) != _EOW:
            cand = self._find(cand, lambda r: r["op"] == _EOW) + 1
        new_head = min(cand, m.tail_event)
        prev_scn = int(self._events.at(new_head - 1)["scn"])
        if new_head < m.tail_event:
            first_rec = self._events.at(new_head)
            head_pos, min_scn = int(first_rec["pos"]), int(first_rec["scn"])
        else:
            head_pos, min_scn = m.tail_pos, -1
        index_head = self._index.searchsorted(m.index_head, m.index_tail, "event", new_head)
        evicted = int(np.count_nonzero(self._events.get(m.head_event, new_head, "op") == _EOW))
        with self._pins_changed:
            deadline = time.monotonic() + self.config.pin_timeout_s
            while any(p.pos < head_pos and not p.overrun for p in self._pins):
                left = deadline - time.monotonic()
                if left <= 0:
                    for p in self._pins:
                        if p.pos < head_pos and not p.overrun:
                            p.overrun = True
                            self.stats["pins_overrun"] += 1
                    log.warning(
                        "buffer %s: overran a reader slower than %.1f s",
                        self.name,
                        self.config.pin_timeout_s,
                    )
                    break
                self._pins_changed.wait(left)
            m = self._meta
            self._meta = _replace(
                m,
                head_event=new_head,
                head_pos=head_pos,
                prev_scn=prev_scn,
                min_scn=min_scn,
                index_head=index_head,
                windows=m.windows - evicted,
            )
            self._metafile.publish(self._meta)
        self.stats["windows_evicted"] += evicted

    # ------------------------------------------------------------------
    # reader side

    def locate(self, window_scn: int, window_offset: int) -> tuple[int, int]:
        """Where to start sending after checkpoint ``(window_scn, window_offset)``.

        Returns ``(start_event, window_first_event)``: the first event to
        send, and the first event of the window it belongs to (they differ
        only when resuming inside a window). ``window_scn`` -1 means "from
        the oldest event kept". ``start_event == tail_event`` means nothing
        newer exists yet. Raises :class:`ScnNotFoundError` when events after
        the checkpoint may have been evicted: the consumer must catch up
        from the bootstrap server.
        """
        m = self._meta
        if window_scn < 0:
            return m.head_event, m.head_event
        complete = window_offset < 0
        if m.tail_event == m.head_event:
            if m.prev_scn < 0 or window_scn > m.prev_scn or (window_scn == m.prev_scn and complete):
                return m.tail_event, m.tail_event
            raise self._too_old(window_scn, m)
        if window_scn < m.min_scn:
            if m.prev_scn >= 0 and (
                window_scn > m.prev_scn or (window_scn == m.prev_scn and complete)
            ):
                return m.head_event, m.head_event
            raise self._too_old(window_scn, m)
        if window_scn > m.last_scn or (window_scn == m.last_scn and complete):
            return m.tail_event, m.tail_event
        # binary search in the SCN index, then a short scan of the event table
        i = self._index.searchsorted(m.index_head, m.index_tail, "scn", window_scn, "right")
        lo = int(self._index.at(i - 1)["event"]) if i > m.index_head else m.head_event
        lo = max(lo, m.head_event)
        hi = int(self._index.at(i)["event"]) if i < m.index_tail else m.tail_event
        scns = self._events.get(lo, hi, "scn")
        first_at = lo + int(np.searchsorted(scns, window_scn, side="left"))
        after = lo + int(np.searchsorted(scns, window_scn, side="right"))
        if complete:
            return after, after
        if first_at == after:
            raise ScnNotFoundError(
                f"checkpoint is inside window {window_scn}, which buffer {self.name!r} does not "
                "have; resume from the last complete window (prev_scn)",
                oldest_scn=m.min_scn,
                prev_scn=m.prev_scn,
            )
        return min(first_at + window_offset, after), first_at

    def _too_old(self, scn: int, m: BufferMeta) -> ScnNotFoundError:
        return ScnNotFoundError(
            f"SCN {scn} is older than buffer {self.name!r} keeps (oldest window {m.min_scn}, "
            f"complete after {m.prev_scn}); catch up from the bootstrap server",
            oldest_scn=m.min_scn,
            prev_scn=m.prev_scn,
        )

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
            start, window_first = self.locate(window_scn, window_offset)
            if start >= m.tail_event:
                return None
            result, low = self._select_locked(
                m, start, window_first, max_bytes, key_filter, src_table
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

    def _select_locked(
        self,
        m: BufferMeta,
        start: int,
        window_first: int,
        max_bytes: int,
        key_filter: PartitionFilter | None,
        src_table: npt.NDArray[np.bool_] | None,
    ) -> tuple[Selection, int]:
        pos_parts: list[npt.NDArray[np.uint64]] = []
        len_parts: list[npt.NDArray[np.uint32]] = []
        used = windows = 0
        next_scn, next_offset, partial = -1, -1, False
        e = start
        chunk = _SCAN_CHUNK
        while e < m.tail_event and used < max_bytes:
            stop = min(e + chunk, m.tail_event)
            rec = self._events.get(e, stop)
            ops = rec["op"]
            eows = np.flatnonzero(ops == _EOW)
            if eows.size == 0 and stop < m.tail_event:
                chunk *= 2  # a window longer than the chunk: look further
                continue
            keep = event_mask(rec, key_filter, src_table)
            cum = np.cumsum(np.where(keep, rec["length"], 0).astype(np.int64))
            budget = max_bytes - used
            fits = eows[cum[eows] <= budget]
            if fits.size:
                last = int(fits[-1])
                pos_parts.append(rec["pos"][: last + 1][keep[: last + 1]])
                len_parts.append(rec["length"][: last + 1][keep[: last + 1]])
                used += int(cum[last])
                windows += int(fits.size)
                next_scn, next_offset = int(rec["scn"][last]), -1
                e += last + 1
                if fits.size < eows.size:
                    break  # the next complete window does not fit
                continue
            if windows:
                break
            # the first window alone exceeds the limit: send a part of it
            over = np.flatnonzero(cum > budget)
            cut = max(int(over[0]) if over.size else len(ops), 1)
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
            spans=_runs(pos, lens, self.capacity),
            events=int(pos.size),
            nbytes=int(lens.sum()),
            next_scn=next_scn,
            next_offset=next_offset,
            partial=partial,
            windows=windows,
        )
        return selection, int(pos[0]) if pos.size else m.tail_pos

    # ------------------------------------------------------------------
    # lifecycle

    def _recover(self, meta: BufferMeta) -> BufferMeta:
        """Validate what the last published state says is live; trim damage."""
        n = meta.tail_event - meta.head_event
        if n <= 0:
            return meta
        rec = self._events.get(meta.head_event, meta.tail_event)
        phys = (rec["pos"] % np.uint64(self.capacity)).astype(np.int64)
        ring = self._ring_view
        try:
            headers = headers_at(ring, phys)
            check_headers(ring, phys, headers)
            verify_payloads(ring, phys, headers)
            if not (
                (headers["scn"] == rec["scn"]).all()
                and (headers["total_length"] == rec["length"]).all()
                and (headers["op"] == rec["op"]).all()
            ):
                raise CorruptEventError("event table does not match the ring")
        except CorruptEventError as exc:
            log.warning(
                "buffer %s: damaged after a crash (%s); starting empty after SCN %d",
                self.name,
                exc,
                meta.last_scn,
            )
            fresh = BufferMeta(
                meta.capacity,
                meta.event_slots,
                meta.index_slots,
                head_event=meta.tail_event,
                tail_event=meta.tail_event,
                head_pos=meta.tail_pos,
                tail_pos=meta.tail_pos,
                prev_scn=meta.last_scn,
                last_scn=meta.last_scn,
                index_head=meta.index_tail,
                index_tail=meta.index_tail,
            )
            self._metafile.publish(fresh)
            return fresh
        log.info(
            "buffer %s: recovered %d events, SCN %d..%d", self.name, n, meta.min_scn, meta.last_scn
        )
        return meta

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


def _check_sizes(
    windows: Sequence[bytes | memoryview], sizes: Sequence[Sequence[int]], found: list[int]
) -> None:
    """The event sizes a trusted group came with against those its headers say."""
    if any(sum(s) != len(w) for w, s in zip(windows, sizes, strict=True)):
        raise BadRequestError("event sizes do not add up to their windows")
    if list(itertools.chain.from_iterable(sizes)) != found:
        raise CorruptEventError("event sizes do not match the event headers")


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


def _replace(meta: BufferMeta, **changes: int) -> BufferMeta:
    from dataclasses import replace

    return replace(meta, **changes)
