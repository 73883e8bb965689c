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

What is checksummed: ``meta.dat`` (a CRC per slot) and every event in
``ring.dat`` (header and payload CRCs). ``events.dat`` and ``index.dat``
carry no checksum of their own: they are derived from the ring, and
recovery checks them against the ring's event headers (rewriting damaged
records) and rebuilds the index, so the writer pays nothing for them.

Invariants (hold whenever the lock is free):

* live events ``[head_event, tail_event)`` and live bytes
  ``[head_pos, tail_pos)`` hold whole windows only, in strictly increasing
  SCN order, each closed by an END_OF_WINDOW event;
* ``tail_pos - head_pos <= capacity`` and ``tail_event - head_event <= event_slots``;
* ``prev_scn`` is the SCN of the newest evicted window (or the SCN the
  buffer was started at), so nothing after ``prev_scn`` is missing;
* with live windows, ``last_scn`` is the SCN of the newest one (after
  recovery dropped damaged windows, until it appended the DATA_LOSS window
  it owes: see :mod:`._recovery`).

The parts, one module each: placing and committing windows (the writer
side, :mod:`._writer`), validating them (:mod:`._validate`), the SCN index
(:mod:`._index`), eviction and reader pins (:mod:`._evict`), selecting what
a reader sends (:mod:`._reader`) and recovery on open (:mod:`._recovery`,
which checks the live events against the ring with :mod:`._ringcheck`);
its configuration is :mod:`._bufconfig`, and whether the files on disk are
recovered, reset or (another size) refused is :mod:`._bufopen`. This module holds the state they
share, its files and its lock, and the reader entry points.

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
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import numpy.typing as npt

from changebus.schemas import (
    DataLoss,
    EndOfWindow,
    PartitionFilter,
    ScnNotFoundError,
    encode_control,
    source_table,
)
from changebus.schemas.errors import BadRequestError
from changebus.schemas.files import reserve_file

from ._bufconfig import DURABILITY_MODES, BufferConfig, Durability, check_durability
from ._bufopen import open_meta, with_resized_hint
from ._evict import Pin, eviction_is_small
from ._index import cut_points
from ._meta import BufferMeta, kept_position
from ._prefault import Prefaulter
from ._reader import Selection, locate, select_events
from ._recovery import Loss, recover
from ._syncer import Span, circular_spans, msync_spans
from ._tables import EVENT_DTYPE, INDEX_DTYPE, CircularTable
from ._watermark import SyncedMark
from ._writer import TS_OFFSET as _TS_OFFSET, BufferWriter

__all__ = [
    "DURABILITY_MODES",
    "BufferConfig",
    "Durability",
    "EventBuffer",
    "Pin",
    "Selection",
    "check_durability",
]

log = logging.getLogger("changebus.relay.buffer")


#: requests inside an over-long window whose scan position is remembered (``_scanned``)
_SCANNED_MAX = 1024

#: ring bytes faulted in ahead of the writer (see :mod:`._prefault`)
_PREFAULT_AHEAD = 32 << 20
#: event table bytes faulted in ahead of the writer (32 bytes per event)
_PREFAULT_EVENTS_AHEAD = 1 << 20


class EventBuffer(BufferWriter):
    """A circular buffer of whole windows for one physical partition.

    The append side (writer thread) is :class:`~._writer.BufferWriter`; the
    reader side is below, built on :mod:`._reader`.
    """

    def __init__(
        self,
        directory: Path,
        config: BufferConfig,
        *,
        name: str = "default",
        partition_id: int = 0,
        on_publish: Callable[[], None] | None = None,
        replayable: bool = False,
        resize: bool = False,
    ) -> None:
        """``resize``: files of a buffer of other sizes are moved aside and the buffer
        starts empty (else a :class:`~changebus.schemas.ConfigError`: :mod:`._bufopen`)."""
        self.directory = directory
        self.config = config
        self.name = name
        self.partition_id = partition_id
        self.on_publish = on_publish
        #: windows recovery drops are sent again by the source (``durability = "fsync"``:
        #: it was acknowledged for synced ones only) or by the upstream relay of a chained
        #: one: no DATA_LOSS window for them (:mod:`._recovery`)
        self.replayable = replayable or config.durability == "fsync"
        self.capacity = config.capacity_bytes
        self.block = config.block
        index_slots = math.ceil(self.capacity / self.block) + 4
        try:
            with with_resized_hint(directory):  # (a full disk: names old files moved aside)
                self._open(config, index_slots, resize)
        except BaseException:
            self._release(failed=True)  # (a full disk, a failed recovery: nothing left open)
            raise

    def _open(self, config: BufferConfig, index_slots: int, resize: bool) -> None:
        """The constructor's part that opens files, maps them and recovers."""
        directory, name = self.directory, self.name
        self._metafile, previous = open_meta(
            directory, (self.capacity, config.slots, index_slots), name, resize=resize
        )
        compatible = previous is not None
        create = not compatible
        self._ring_map = np.memmap(
            directory / "ring.dat",
            dtype=np.uint8,
            mode="w+" if create else "r+",
            shape=(self.capacity,),
        )
        # blocks reserved: the prefaulter's first pass costs a tenth, a full disk stops the start
        reserve_file(directory / "ring.dat", self.capacity)
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
        #: (start event, key filter, sources) of a request inside a window longer than
        #: a scan may read -> the event its last scan stopped at (nothing kept before it);
        #: so the next selection of any such request goes on from there (LRU, bounded)
        #: (a filter by its text: the object of a ``mod`` filter holds its 64 KiB table,
        #: which 1,024 entries pinned per partition outside every budget; review)
        self._scanned: OrderedDict[tuple[int, str, frozenset[int] | None], int] = OrderedDict()
        self.stats = {
            "windows_appended": 0,
            "events_appended": 0,
            "bytes_appended": 0,
            "windows_evicted": 0,
            "windows_refused": 0,
            "pins_overrun": 0,
            # what recovery found at open (see ._recovery)
            "recovery_records_rewritten": 0,
            "recovery_index_rebuilt": 0,
            "recovery_events_dropped": 0,
            # DATA_LOSS windows recovery appended (windows a crash lost)
            "recovery_data_loss": 0,
        }
        #: how far the syncer made the files durable (``durability = "fsync"`` only; a
        #: stale one of a replaced buffer or of another mode is removed: :mod:`._watermark`)
        self.watermark: SyncedMark | None = None
        if config.durability != "fsync" or not compatible:
            (directory / "synced.dat").unlink(missing_ok=True)
        if config.durability == "fsync":
            self.watermark = SyncedMark(directory / "synced.dat")
        loss: Loss | None = None
        if compatible and previous is not None:
            self._meta, loss = recover(
                previous,
                self._events,
                self._index,
                self.block,
                self._ring_view,
                self._metafile,
                name,
                self.stats,
                replayable=self.replayable,
                watermark=self.watermark,
            )
        else:
            self._meta = BufferMeta(self.capacity, config.slots, index_slots)
            self._metafile.publish(self._meta)
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
        if loss is not None:
            self._record_loss(loss)

    def _record_loss(self, loss: Loss) -> None:
        """Append the DATA_LOSS window recovery owes (see :mod:`._recovery`).

        The published state still claims ``last_scn == loss.to_scn``; room
        is made first, so no state without that claim is ever published,
        then the window commits at ``loss.to_scn`` through the normal path.
        """
        part = self.partition_id
        ts = loss.timestamp_ns
        data = encode_control(
            DataLoss(loss.from_scn, loss.to_scn, loss.reason), loss.to_scn, 0, ts, partition=part
        ) + encode_control(EndOfWindow(0, loss.source_position), loss.to_scn, 1, ts, partition=part)
        m = self._meta
        phys = m.tail_pos % self.capacity
        skip = self.capacity - phys if phys + len(data) > self.capacity else 0
        self._make_room(
            m.tail_pos + skip + len(data) - self.capacity, m.tail_event + 2 - m.event_slots
        )
        self._meta = replace(self._meta, last_scn=loss.from_scn - 1)  # not published
        on_publish, self.on_publish = self.on_publish, None
        try:
            self.append_window(data)
        finally:
            self.on_publish = on_publish
        self.stats["recovery_data_loss"] += 1

    # ------------------------------------------------------------------
    # state

    @property
    def meta(self) -> BufferMeta:
        """The last published state (a consistent, immutable snapshot)."""
        return self._meta

    def set_start(self, scn: int, *, evicted: bool = False, position: str = "") -> None:
        """Declare an empty buffer complete after ``scn`` (sets ``prev_scn``).

        Used when a fetcher starts at a known source position with nothing
        buffered yet: consumers at ``scn`` or later have missed nothing.
        ``evicted``: windows before ``scn`` existed and are gone (else the
        buffer's ``evicted`` mark stays as it was). ``position``: the source
        position at the end of the window at ``scn`` when it is known (a
        follower learns it from its upstream): the fetcher resumes from it,
        and a Postgres slot confirmed beyond it is a DATA_LOSS, not a silent
        jump.
        """
        with self._lock:
            m = self._meta
            if m.tail_event != m.head_event:
                raise ValueError("set_start needs an empty buffer")
            self._meta = replace(
                m,
                prev_scn=scn,
                last_scn=max(m.last_scn, scn),
                evicted=1 if evicted else m.evicted,
                prev_ts=0,  # (not known: an eviction's was of another window)
                prev_pos=kept_position(position),
            )
            self._metafile.publish(self._meta)

    def restart_after(self, scn: int, position: str = "") -> None:
        """Evict every window and declare the buffer complete after ``scn`` (writer thread).

        For a follower whose upstream evicted what follows its newest window: its
        buffer starts again where the upstream's is complete (``position``: the
        upstream's, see :meth:`set_start`). Readers of the evicted windows are
        waited for as by any eviction; a consumer positioned before ``scn`` is
        then older than the buffer keeps (410).
        """
        m = self._meta
        if scn < m.last_scn:
            raise ValueError(f"restart_after({scn}) is before the newest window {m.last_scn}")
        self._make_room(m.tail_pos, m.tail_event)
        self.set_start(scn, evicted=True, position=position)

    @property
    def last_source_position(self) -> str:
        """The source position after the newest window the buffer is complete to ("" if none).

        The newest window's END_OF_WINDOW; for an empty buffer, the position
        of the window at ``prev_scn`` when it is known (``prev_pos``: kept by
        an eviction, given to :meth:`set_start`); else "" and the fetcher
        resumes from the SCN alone.
        """
        m = self._meta
        if m.tail_event == m.head_event:
            return m.prev_pos if m.prev_scn == m.last_scn else ""
        return self._position_at(m.tail_event - 1)

    # ------------------------------------------------------------------
    # reader side (see :mod:`._reader`)

    def locate(self, window_scn: int, window_offset: int) -> tuple[int, int]:
        """Where to start sending after checkpoint ``(window_scn, window_offset)``.

        Returns ``(start_event, window_first_event)``; raises
        :class:`~changebus.schemas.ScnNotFoundError` when events after the
        checkpoint may have been evicted (see :func:`._reader.locate`). Under the
        buffer's lock, as :meth:`select`: the writer cannot evict (and then reuse the
        event slots of) the windows it reads meanwhile.
        """
        with self._lock:
            return locate(
                self._events, self._index, self._meta, self.name, window_scn, window_offset
            )

    def timestamp_after(self, scn: int) -> int | None:
        """Source commit time (ns) of the first window after SCN ``scn`` (scrape time only).

        None when no window follows ``scn``; the oldest window's time when
        windows after ``scn`` were evicted (the consumer lags at least that
        much). A binary search in the SCN index and one header read, under
        the buffer's lock: for ``/metrics``, never per event.
        """
        with self._lock:
            m = self._meta
            start = self._after(m, scn)
            if start >= m.tail_event:
                return None
            at = int(self._events.at(start)["pos"]) % self.capacity + _TS_OFFSET
            return int(self._ring[at : at + 8].view("<i8")[0])

    def split_points(
        self, since: int, until: int, parts: int, sources: frozenset[int] | None = None
    ) -> list[int]:
        """SCNs cutting the kept windows ``(since, until]`` into ``parts`` similar spans.

        For readers that split a range between workers (the Spark source):
        see :func:`._index.cut_points` (``sources``: count only those
        sources' data events). The part of the range the buffer no
        longer keeps (or does not hold yet) is not counted. Under the lock:
        two binary searches, then a read of the range's SCN column (up to
        :data:`._index.EXACT_CUT_EVENTS` events, 2 MiB) or a slice of the
        index (longer ranges); never a scan of the ring.
        """
        with self._lock:
            m = self._meta
            first = self._after(m, since)
            end = self._after(m, until)
            return cut_points(
                self._index, self._events, m, first, end, since, until, parts, sources
            )

    def _after(self, m: BufferMeta, scn: int) -> int:
        """The first kept event after window ``scn`` (the oldest when ``scn`` was evicted)."""
        try:
            return locate(self._events, self._index, m, self.name, scn, -1)[0]
        except ScnNotFoundError:
            return m.head_event

    def select(
        self,
        window_scn: int,
        window_offset: int,
        max_bytes: int,
        *,
        key_filter: PartitionFilter | None = None,
        sources: frozenset[int] | None = None,
        skip_to: int = -1,
    ) -> Selection | None:
        """Choose the events to send after a checkpoint, and pin them.

        Returns None when nothing newer than the checkpoint exists (the
        caller long-polls). Whole windows only, unless the first window alone
        exceeds ``max_bytes``: then as many of its events as fit (at least
        one), and ``partial`` is set. Control events are always selected.
        A selection with ``resume_at`` set has nothing to send yet: the
        caller lets the event loop run and selects again, and the scan goes
        on where it stopped (:attr:`Selection.resume_at`, passed back as
        ``skip_to``: the buffer's own record of scans is bounded, and more long
        scans at once than it holds evicted each other's, found by review).
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
            scanned = self._scanned
            # (the filter's text only when a long window was scanned: a mod filter's is
            # built from its bucket table)
            where = _scan_key(start, key_filter, sources) if scanned else None
            skip = scanned.get(where, -1) if where is not None else -1
            if skip >= 0 and where is not None:
                scanned.move_to_end(where)  # (kept after the scan ends: the same requests
                # of other consumers go on from there too, and a window never changes)
            skip = max(skip, skip_to)
            result, low = select_events(
                self._events,
                self.capacity,
                m,
                start,
                window_first,
                max_bytes,
                key_filter,
                src_table,
                skip,
            )
            if result.resume_at >= 0:
                scanned[where or _scan_key(start, key_filter, sources)] = result.resume_at
                if len(scanned) > _SCANNED_MAX:
                    scanned.popitem(last=False)
            pin = Pin(low)
            self._pins.add(pin)
        result.pin = pin
        rv = self._ring_view
        result.views = [rv[a:b] for a, b in result.spans]
        return result

    def room_is_cheap(self, size: int, events: int, max_events: int) -> bool:
        """Whether making room for ``size`` bytes and ``events`` events evicts at most
        ``max_events`` events without a scan (bounds taken high: a wrap's skip is less
        than ``size``)."""
        m = self._meta
        return eviction_is_small(
            self._events,
            m,
            m.tail_pos + 2 * size - self.capacity,
            m.tail_event + events - self.config.slots,
            max_events,
        )

    @property
    def pinned(self) -> bool:
        """Whether a reader holds a pin now (an eviction might have to wait for it)."""
        return bool(self._pins)

    def stall(self, pin: Pin, stalled: bool = True) -> None:
        """Say whether the reader holding ``pin`` waits for a client that does not read.

        The writer overruns a stalled pin at once instead of waiting for it
        (see :mod:`._evict`); a reader that makes progress again clears it.
        """
        with self._pins_changed:
            pin.stalled = stalled
            if stalled:
                self._pins_changed.notify_all()

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

    def sync_spans(self, since: BufferMeta | None, upto: BufferMeta) -> list[Span]:
        """What to msync, in order, so that the published state ``upto`` is on disk.

        ``since`` is the state of the previous sync (None: the whole files).
        Ring bytes, event records and index entries added after ``since`` up
        to ``upto`` (page-aligned, see :func:`._syncer.circular_spans`), then
        ``meta.dat``. Called by the syncer thread: reads only the mappings'
        addresses, which do not change until :meth:`close`.
        """
        ring = int(self._ring.ctypes.data)
        ev_addr, ev_size = self._events.mapping()
        ix_addr, ix_size = self._index.mapping()
        meta_addr, meta_size = self._metafile.mapping()
        if since is None:
            ranges = [
                ("ring.dat", ring, [(0, self.capacity)]),
                ("events.dat", ev_addr, [(0, ev_size)]),
                ("index.dat", ix_addr, [(0, ix_size)]),
            ]
        else:
            ev_item, ix_item = EVENT_DTYPE.itemsize, INDEX_DTYPE.itemsize
            ranges = [
                ("ring.dat", ring, circular_spans(since.tail_pos, upto.tail_pos, self.capacity)),
                (
                    "events.dat",
                    ev_addr,
                    circular_spans(since.tail_event * ev_item, upto.tail_event * ev_item, ev_size),
                ),
                (
                    "index.dat",
                    ix_addr,
                    circular_spans(since.index_tail * ix_item, upto.index_tail * ix_item, ix_size),
                ),
            ]
        spans = [(name, addr + a, b - a) for name, addr, parts in ranges for a, b in parts]
        spans.append(("meta.dat", meta_addr, meta_size))
        return spans

    def flush(self) -> None:
        """msync everything (clean shutdown, periodic durability).

        Through libc's ``msync``, which lets go of the GIL while the kernel
        writes (:func:`._syncer.msync_spans`); ``mmap.flush`` is the fallback
        on other platforms.
        """
        if msync_spans(self.sync_spans(None, self._meta)):
            return
        self._ring_map.flush()
        self._events.flush()
        self._index.flush()
        self._metafile.flush()

    def close(self) -> None:
        self._prefault.close()
        self._prefault_events.close()
        del self._event_bytes  # a view of the event table's mapping, closed below
        self.flush()
        self._release()

    def _release(self, *, failed: bool = False) -> None:
        """Stop the prefaulters, unmap and close every file opened so far; also for a
        constructor that failed half way (``failed``: closed at once, not by the collector,
        review), when the ring's mapping is left to the collector if a view of it is
        still referenced (by the failure's traceback)."""
        opened = self.__dict__
        for prefaulter in ("_prefault", "_prefault_events"):
            if prefaulter in opened:
                opened[prefaulter].close()
        opened.pop("_event_bytes", None)
        if "_ring_view" in opened:
            try:
                self._ring_view.release()
            except BufferError:
                if not failed:
                    raise
                opened.pop("_ring_map", None)  # (its mapping: the collector's)
        opened.pop("_ring", None)
        ring_map = opened.pop("_ring_map", None)
        mm = getattr(ring_map, "_mmap", None)
        del ring_map
        if mm is not None:
            mm.close()
        for table in ("_events", "_index", "_metafile"):
            if table in opened:
                opened[table].close()
        watermark = opened.get("watermark")
        if watermark is not None:
            watermark.close()


def _scan_key(
    start: int, key_filter: PartitionFilter | None, sources: frozenset[int] | None
) -> tuple[int, str, frozenset[int] | None]:
    """A request's key in :attr:`EventBuffer._scanned`: the filter by its text."""
    return start, "" if key_filter is None else str(key_filter), sources
