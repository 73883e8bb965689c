"""The synced watermark (``durability = "fsync"``): recovery keeps every synced window.

The syncer stores how far it made the files durable (``synced.dat``, after
the msync of the ring, the tables and ``meta.dat``, before the source is
acknowledged); recovery tells eviction overwrite at the head (damage at or
below the watermark: those windows count as evicted, the synced rest is
kept) from an unsynced tail (damage above it: trimmed, the source sends it
again), found by review:

* an OS crash during a sync of a full ring: ``meta.dat`` on disk names
  windows whose bytes were never synced, the oldest of them were overwritten
  by newer windows' bytes and the newest is torn; the synced and
  acknowledged windows between must survive (they emptied the buffer);
* W1 synced and acknowledged, W2 and W3 not synced, W2 torn and W3 written
  back: the buffer rewinds to W1 (it jumped to W3, and W2 was never read
  from the source again);
* the same crash with the synced state's oldest windows in a lap's last
  bytes, skipped by a later lap's window placed at the lap's start, and the
  synced windows from there overwritten: the buffer rewound below the
  watermark to those evicted windows (Postgres announced DATA_LOSS);
* a flipped high bit of an event position in the event table (>= 2**63)
  made every restart crash (OverflowError).

Each scenario is built with real files: windows are written, the syncer
really syncs (and stores the watermark), and the crash is simulated by
putting back an older ``meta.dat`` and zeroing ring bytes.
"""

from __future__ import annotations

import asyncio
from itertools import groupby
from pathlib import Path

import pytest
from test_recovery_damage import field_offset, flip, read_all, zero_ring

from changebus.relay import BufferConfig, EventBuffer
from changebus.relay._meta import MetaFile
from changebus.relay._syncer import GroupSyncer
from changebus.relay._tables import EVENT_DTYPE, CircularTable
from changebus.schemas import EndOfWindow, Op, encode_control, encode_event

SMALL = 64 * 1024
#: every window (``make_window``) has three events, and the buffers start after SCN 0
EVENTS = 3


def make_window(scn: int, events: int = 2, size: int = 100) -> bytes:
    parts = [
        encode_event(Op.INSERT, scn, i, scn * 1000 + i, f"k{scn}-{i}".encode(), b"v" * size)
        for i in range(events)
    ]
    parts.append(encode_control(EndOfWindow(events, f"pos-{scn}"), scn, events, scn * 1000 + 9))
    return b"".join(parts)


async def _sync(buf: EventBuffer, scn: int) -> None:
    """Run the real syncer until it synced window ``scn`` (the newest), then stop it."""
    syncer = GroupSyncer(buf)
    syncer.start()
    try:
        syncer.request()
        while syncer.synced_scn < scn:
            await asyncio.wait_for(syncer.wait_synced(syncer.synced_scn), 10)
        assert syncer.synced_scn == scn
    finally:
        await asyncio.to_thread(syncer.stop)


def _window_span(directory: Path, scn: int, tail_pos: int) -> tuple[int, int]:
    """Virtual ring positions ``[start, end)`` of window ``scn`` (the table's; the next
    window's start, or ``tail_pos`` for the newest)."""
    meta = MetaFile(directory / "meta.dat").load()
    assert meta is not None
    table = CircularTable(directory / "events.dat", EVENT_DTYPE, meta.event_slots, create=False)
    try:
        start = int(table.at((scn - 1) * EVENTS)["pos"])
        end = int(table.at(scn * EVENTS)["pos"]) if scn * EVENTS < meta.tail_event else tail_pos
    finally:
        table.close()
    return start, end


def _served(buf: EventBuffer) -> dict[int, bytes]:
    """Every window the buffer serves, by SCN: its whole bytes."""
    events = read_all(buf)
    assert all(e[2] != Op.DATA_LOSS for e in events)
    return {scn: b"".join(e[4] for e in group) for scn, group in groupby(events, lambda e: e[0])}


def _check_resumes_at(buf: EventBuffer, last: int) -> None:
    """The fetcher resumes after window ``last``: the source sends ``last + 1`` next."""
    assert buf.meta.last_scn == last
    assert buf.last_source_position == f"pos-{last}"
    buf.append_window(make_window(last + 1))
    assert buf.meta.last_scn == last + 1


@pytest.mark.parametrize("torn", [301, 310])
async def test_a_crash_during_a_sync_of_a_full_ring_keeps_the_synced_windows(
    tmp_path: Path, torn: int
) -> None:
    """Windows 1..300 synced and acknowledged; 301..310 published, and ``meta.dat`` naming
    them written back; 311..320 overwrote the oldest live windows' bytes on disk and the
    unsynced window ``torn`` is torn. Every window at or below 300 that was not
    overwritten is served with its exact bytes, nothing from ``torn`` on is claimed,
    and the fetcher resumes right after the last kept window (no false DATA_LOSS)."""
    cfg = BufferConfig(capacity_bytes=SMALL, event_slots=4096, durability="fsync")
    buf = EventBuffer(tmp_path, cfg)
    buf.set_start(0)
    for scn in range(1, 301):
        buf.append_window(make_window(scn))
    await _sync(buf, 300)
    for scn in range(301, 311):
        buf.append_window(make_window(scn))
    on_disk = buf.meta
    buf.flush()
    meta_bytes = (tmp_path / "meta.dat").read_bytes()
    for scn in range(311, 321):
        buf.append_window(make_window(scn))
    overwritten_below = buf.meta.min_scn  # windows before it hold newer bytes now
    buf.close()
    assert on_disk.min_scn < overwritten_below <= 300  # (the ring is full: it wrapped)
    (tmp_path / "meta.dat").write_bytes(meta_bytes)
    start, end = _window_span(tmp_path, torn, on_disk.tail_pos)
    zero_ring(tmp_path / "ring.dat", SMALL, start, end)

    again = EventBuffer(tmp_path, cfg)
    try:
        m = again.meta
        served = _served(again)
        assert list(served) == list(range(m.min_scn, m.last_scn + 1))
        assert m.min_scn <= overwritten_below
        assert m.prev_scn == m.min_scn - 1  # (no consumer is served across a gap)
        for scn, data in served.items():
            assert data == make_window(scn), scn
        assert set(range(overwritten_below, 301)) <= set(served)  # every synced window
        assert m.last_scn == torn - 1  # nothing torn claimed, the intact unsynced kept
        assert again.stats["recovery_data_loss"] == 0
        _check_resumes_at(again, torn - 1)
    finally:
        again.close()


async def test_damage_above_the_watermark_rewinds_instead_of_skipping(tmp_path: Path) -> None:
    """W1 (windows 1..10) synced and acknowledged; W2 (11) and W3 (12) not synced: the
    kernel wrote back ``meta.dat`` and W3, but one of W2's pages is missing. The buffer
    rewinds to W1 (the source still holds W2), it does not jump to W3."""
    cfg = BufferConfig(capacity_bytes=SMALL, event_slots=4096, durability="fsync")
    buf = EventBuffer(tmp_path, cfg)
    buf.set_start(0)
    for scn in range(1, 11):
        buf.append_window(make_window(scn))
    await _sync(buf, 10)
    buf.append_window(make_window(11))
    buf.append_window(make_window(12))
    tail = buf.meta.tail_pos
    buf.close()
    start, end = _window_span(tmp_path, 11, tail)
    zero_ring(tmp_path / "ring.dat", SMALL, start + 64, end - 64)  # a page of W2 only

    again = EventBuffer(tmp_path, cfg)
    try:
        m = again.meta
        assert (m.prev_scn, m.min_scn, m.evicted) == (0, 1, 0)  # nothing counted as evicted
        served = _served(again)
        assert served == {scn: make_window(scn) for scn in range(1, 11)}
        assert again.stats["recovery_data_loss"] == 0
        _check_resumes_at(again, 10)  # W2 and W3 are read from the source again
    finally:
        again.close()


async def test_no_synced_window_left_starts_empty_after_the_watermark(tmp_path: Path) -> None:
    """No synced window verifies from any start, the oldest included (a whole lap written
    over them during one sync), and the unsynced rest torn: the buffer starts empty after
    the watermark (the synced windows count as evicted), not before it."""
    cfg = BufferConfig(capacity_bytes=SMALL, event_slots=4096, durability="fsync")
    buf = EventBuffer(tmp_path, cfg)
    buf.set_start(0)
    for scn in range(1, 11):
        buf.append_window(make_window(scn))
    await _sync(buf, 10)
    buf.append_window(make_window(11))
    tail = buf.meta.tail_pos
    buf.close()
    for scn in (1, 10, 11):  # the first event of the oldest, the newest synced, the unsynced
        start, _ = _window_span(tmp_path, scn, tail)
        zero_ring(tmp_path / "ring.dat", SMALL, start, start + 64)

    again = EventBuffer(tmp_path, cfg)
    try:
        m = again.meta
        assert (m.tail_event - m.head_event, m.prev_scn, m.evicted) == (0, 10, 1)
        _check_resumes_at(again, 10)  # (the END_OF_WINDOW of 10 is intact: its position)
    finally:
        again.close()


async def test_synced_damage_after_intact_oldest_windows_is_trimmed(tmp_path: Path) -> None:
    """Damage from a synced window (not the oldest) to the tail is no eviction's: the
    buffer goes back to the last intact window, as without a watermark (the source's own
    check says whether it still holds the rest; the Postgres OS crash test zeroes the
    windows the slot did not confirm yet, synced ones among them)."""
    cfg = BufferConfig(capacity_bytes=SMALL, event_slots=4096, durability="fsync")
    buf = EventBuffer(tmp_path, cfg)
    buf.set_start(0)
    for scn in range(1, 11):
        buf.append_window(make_window(scn))
    await _sync(buf, 10)
    buf.append_window(make_window(11))
    tail = buf.meta.tail_pos
    buf.close()
    start, _ = _window_span(tmp_path, 6, tail)
    zero_ring(tmp_path / "ring.dat", SMALL, start, tail)

    again = EventBuffer(tmp_path, cfg)
    try:
        assert _served(again) == {scn: make_window(scn) for scn in range(1, 6)}
        _check_resumes_at(again, 5)
    finally:
        again.close()


@pytest.mark.parametrize("at_lap_start", [False, True])
async def test_a_lap_written_during_a_sync_over_windows_after_a_skipped_lap_end(
    tmp_path: Path, at_lap_start: bool
) -> None:
    """The synced state's oldest windows lie in a lap's last bytes, the rest from the
    next lap's start to the watermark; then (unsynced, ``meta.dat`` on disk not written
    back) a window too large for the room left before the ring's end goes to the next
    lap's start, skipping those oldest windows' bytes (evicted, intact), and newer windows
    overwrite everything from the lap's start through the newest synced window. The
    synced windows count as evicted: the buffer starts empty after the watermark (it
    rewound to the last intact window below it, and a Postgres slot confirmed past that
    was announced as DATA_LOSS; found by review). ``at_lap_start``: the synced window
    at the lap's start begins there (its first event did not fit either), so the newer
    window written over it begins where it did."""
    cfg = BufferConfig(capacity_bytes=SMALL, event_slots=4096, durability="fsync")
    buf = EventBuffer(tmp_path, cfg)
    buf.set_start(0)
    scn = 0
    while True:
        scn += 1
        m = buf.meta
        moved = at_lap_start and m.tail_pos < SMALL and SMALL - m.tail_pos < 1300
        buf.append_window(make_window(scn, size=1230 if moved else 100))
        at_lap_start &= not moved
        m = buf.meta
        if m.tail_pos > SMALL and SMALL - m.tail_pos % SMALL <= 2000:
            break
    await _sync(buf, scn)
    on_disk = buf.meta
    meta_bytes = (tmp_path / "meta.dat").read_bytes()
    lap = on_disk.tail_pos - on_disk.tail_pos % SMALL
    assert on_disk.head_pos < lap - len(make_window(1))  # whole oldest windows before it
    newest, _ = _window_span(tmp_path, scn, on_disk.tail_pos)
    big = make_window(scn + 1, size=2400)  # its first event does not fit before the end
    buf.append_window(big)
    assert buf.meta.tail_pos == lap + SMALL + len(big)  # placed at the next lap's start
    while buf.meta.tail_pos % SMALL <= newest % SMALL:  # over the newest synced window
        buf.append_window(make_window(buf.meta.last_scn + 1, events=1, size=37))
    assert buf.meta.tail_pos % SMALL <= on_disk.head_pos % SMALL  # the oldest kept intact
    buf.close()
    (tmp_path / "meta.dat").write_bytes(meta_bytes)

    again = EventBuffer(tmp_path, cfg)
    try:
        m = again.meta
        assert (m.tail_event - m.head_event, m.evicted) == (0, 1)
        assert m.prev_scn == m.last_scn == on_disk.last_scn  # not below the watermark
        assert read_all(again) == []
        assert again.stats["recovery_data_loss"] == 0
        _check_resumes_at(again, on_disk.last_scn)  # (its END_OF_WINDOW is intact)
    finally:
        again.close()


def test_a_flipped_high_bit_of_an_event_position_does_not_stop_the_restart(
    tmp_path: Path,
) -> None:
    """A window start's position in the event table >= 2**63 (a flipped bit) is not
    verified; it raised OverflowError at every restart (review)."""
    cfg = BufferConfig(capacity_bytes=1 << 20)
    buf = EventBuffer(tmp_path, cfg)
    buf.set_start(0)
    for scn in range(1, 101):
        buf.append_window(make_window(scn))
    m = buf.meta
    tail = m.tail_pos
    buf.close()
    start, end = _window_span(tmp_path, 71, tail)
    zero_ring(tmp_path / "ring.dat", 1 << 20, start, end)  # damage in a middle window
    victim = 99 * EVENTS  # the newest window's first event
    off = (victim % m.event_slots) * EVENT_DTYPE.itemsize + field_offset(EVENT_DTYPE, "pos")
    flip(tmp_path / "events.dat", off + 7, 7)

    again = EventBuffer(tmp_path, cfg)
    try:
        events = read_all(again)
        kept = {
            scn: b"".join(e[4] for e in g)
            for scn, g in groupby(events, lambda e: e[0])
            if scn < 100
        }
        assert kept == {scn: make_window(scn) for scn in range(1, 71)}
        assert again.meta.last_scn == 100
        assert [e[0] for e in events if e[2] == Op.DATA_LOSS] == [100]  # 71..100 owed
    finally:
        again.close()
