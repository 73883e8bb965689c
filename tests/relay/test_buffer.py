"""Event buffer invariants: windows, eviction, wraparound, pins, restart."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from changebus.relay import _reader
from changebus.relay._buffer import BufferConfig, EventBuffer
from changebus.schemas import (
    BadRequestError,
    CheckpointError,
    CorruptEventError,
    EndOfWindow,
    EventTooLargeError,
    Op,
    PartitionFilter,
    ScnNotFoundError,
    encode_control,
    encode_event,
    key_hash,
    parse_stream,
)

CAP = 64 * 1024
#: the reader's shortcuts as shipped (tests swap them per example: Hypothesis runs many
#: examples inside one function-scoped monkeypatch, so the module attribute may be a stand-in)
_WHOLE_TAIL = _reader._whole_tail
_BYTE_BOUND = _reader._byte_bound


def make_window(scn: int, sizes: list[int], *, source_id: int = 1) -> bytes:
    events = []
    for i, size in enumerate(sizes):
        key = f"k{scn}-{i}".encode()
        events.append(
            encode_event(
                Op.INSERT,
                scn,
                i,
                scn * 1000,
                key,
                bytes([scn % 251]) * size,
                key_hash=key_hash(key),
                source_id=source_id,
            )
        )
    events.append(encode_control(EndOfWindow(len(sizes), f"pos{scn}"), scn, len(sizes), scn * 1000))
    return b"".join(events)


def drain(
    buf: EventBuffer, scn: int, offset: int, max_bytes: int, **kw
) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """Read everything after a checkpoint; returns [(scn, seq)] and the final checkpoint."""
    seen: list[tuple[int, int]] = []
    while True:
        sel = buf.select(scn, offset, max_bytes, **kw)
        if sel is None:
            return seen, (scn, offset)
        data = b"".join(bytes(v) for v in sel.views)
        assert buf.release(sel)
        assert len(data) == sel.nbytes
        _, headers = parse_stream(data)
        seen.extend((int(h["scn"]), int(h["seq"])) for h in headers)
        assert (sel.next_scn, sel.next_offset) != (scn, offset), "no progress"
        scn, offset = sel.next_scn, sel.next_offset


def selection_fields(sel: Any) -> tuple[Any, ...]:
    """Everything a selection says, and the bytes it covers (to compare two ways to select)."""
    data = b"".join(bytes(v) for v in sel.views)
    return (
        sel.spans,
        sel.events,
        sel.nbytes,
        sel.next_scn,
        sel.next_offset,
        sel.partial,
        sel.windows,
        sel.to_tail,
        sel.start_pos,
        data,
    )


@pytest.fixture
def buf(tmp_path: Path):
    b = EventBuffer(tmp_path / "buf", BufferConfig(capacity_bytes=CAP, event_slots=2048))
    b.set_start(0)
    yield b
    b.close()


windows_st = st.lists(st.lists(st.integers(0, 3000), max_size=6), min_size=1, max_size=60)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(windows_st, st.integers(200, 20000), st.data())
def test_random_windows_and_reads(tmp_path_factory, spec, max_bytes, data) -> None:
    path = tmp_path_factory.mktemp("buf")
    buf = EventBuffer(path, BufferConfig(capacity_bytes=CAP, event_slots=2048))
    buf.set_start(0)
    expected: dict[int, int] = {}
    checkpoint = (0, -1)
    seen_all: list[tuple[int, int]] = []
    try:
        for i, sizes in enumerate(spec, start=1):
            scn = i * 3
            buf.append_window(make_window(scn, sizes))
            expected[scn] = len(sizes) + 1
            if data.draw(st.booleans()):
                try:
                    seen, checkpoint = drain(buf, *checkpoint, max_bytes)
                except ScnNotFoundError as exc:
                    # fell behind: everything after prev_scn is still there
                    assert exc.details["prev_scn"] > checkpoint[0]
                    checkpoint = (exc.details["prev_scn"], -1)
                    seen_all.clear()
                    continue
                seen_all.extend(seen)
        m = buf.meta
        assert m.tail_pos - m.head_pos <= CAP
        # the live windows are exactly the newest ones, complete, in order
        seen, _ = drain(buf, -1, -1, 1 << 30)
        scns = sorted({s for s, _ in seen})
        assert scns == sorted(expected)[-len(scns) :]
        assert m.prev_scn == (
            max(s for s in expected if s < scns[0]) if scns[0] != min(expected) else 0
        )
        for s in scns:
            assert [q for t, q in seen if t == s] == list(range(expected[s]))
        # incremental reads saw each event once, in order
        assert seen_all == sorted(set(seen_all))
    finally:
        buf.close()


def test_partial_window_when_larger_than_limit(buf: EventBuffer) -> None:
    buf.append_window(make_window(5, [1000] * 10))
    buf.append_window(make_window(6, [10]))
    sel = buf.select(0, -1, 3000)
    assert sel is not None and sel.partial and sel.next_scn == 5 and sel.next_offset == 2
    buf.release(sel)
    seen, ck = drain(buf, 0, -1, 3000)
    assert seen == [(5, i) for i in range(11)] + [(6, 0), (6, 1)]
    assert ck == (6, -1)
    # resume inside window 5 from offset 7
    seen, _ = drain(buf, 5, 7, 1 << 20)
    assert seen[:4] == [(5, 7), (5, 8), (5, 9), (5, 10)]
    seen, _ = drain(buf, 5, 10, 1 << 20)  # only the end-of-window event left
    assert seen[0] == (5, 10)
    # an offset at or past the window's end (11 events) is refused, not clamped:
    # clamping would skip whatever the client had not really read
    for offset in (11, 12, 2**31 - 1):
        with pytest.raises(CheckpointError, match="past the end of window 5"):
            buf.select(5, offset, 1 << 20)


def test_filters_keep_control_events(buf: EventBuffer) -> None:
    for scn in range(1, 30):
        buf.append_window(make_window(scn, [50] * 4, source_id=scn % 3))
    everything, _ = drain(buf, 0, -1, 1 << 20)
    parts = [drain(buf, 0, -1, 700, key_filter=PartitionFilter.mod(3, b))[0] for b in range(3)]
    data_events = {e for e in everything if e[1] < 4}
    union = [e for p in parts for e in p if e[1] < 4]
    assert sorted(union) == sorted(data_events)  # exactly once across partitions
    for p in parts:
        assert {e for e in p if e[1] == 4} == {(s, 4) for s in range(1, 30)}  # every EOW
    only_src1, _ = drain(buf, 0, -1, 1 << 20, sources=frozenset({1}))
    assert {s for s, q in only_src1 if q < 4} == {s for s in range(1, 30) if s % 3 == 1}


def test_checkpoint_semantics(buf: EventBuffer) -> None:
    for scn in (10, 20, 30):
        buf.append_window(make_window(scn, [5]))
    assert buf.select(30, -1, 1000) is None  # nothing newer: long-poll
    assert buf.select(99, -1, 1000) is None  # from the future: wait too
    seen, _ = drain(buf, 15, -1, 1000)  # between windows: next one
    assert seen[0] == (20, 0)
    with pytest.raises(ScnNotFoundError, match="does not have"):
        buf.select(15, 0, 1000)  # inside a window that does not exist
    seen, _ = drain(buf, -1, -1, 1000)
    assert seen[0] == (10, 0)


def test_fell_off_is_reported_with_oldest_scn(buf: EventBuffer) -> None:
    for scn in range(1, 200):
        buf.append_window(make_window(scn, [900]))
    m = buf.meta
    assert m.prev_scn > 1
    with pytest.raises(ScnNotFoundError) as info:
        buf.select(1, -1, 1000)
    assert info.value.details == {
        "oldest_scn": m.min_scn,
        "prev_scn": m.prev_scn,
        "prev_position": f"pos{m.prev_scn}",
    }
    assert info.value.retriable
    seen, _ = drain(buf, m.prev_scn, -1, 1 << 20)  # exactly at prev_scn: no gap
    assert seen[0] == (m.min_scn, 0)


def test_bad_windows_are_refused(buf: EventBuffer) -> None:
    with pytest.raises(EventTooLargeError):
        buf.append_window(make_window(1, [CAP]))
    assert buf.stats["windows_refused"] == 1
    with pytest.raises(BadRequestError, match="END_OF_WINDOW"):
        buf.append_window(encode_event(Op.INSERT, 1, 0, 0, b"k", b""))
    buf.append_window(make_window(5, [5]))
    with pytest.raises(BadRequestError, match="not above"):
        buf.append_window(make_window(5, [5]))
    with pytest.raises(CorruptEventError):
        buf.append_window(make_window(7, [5])[:-1])
    assert buf.meta.last_scn == 5


def test_restart_keeps_windows(tmp_path: Path) -> None:
    cfg = BufferConfig(capacity_bytes=CAP)
    b = EventBuffer(tmp_path, cfg)
    b.set_start(0)
    for scn in range(1, 100):
        b.append_window(make_window(scn, [300, 20]))
    before = b.meta
    before_events, _ = drain(b, -1, -1, 1 << 20)
    b.close()
    b2 = EventBuffer(tmp_path, cfg)
    assert b2.meta == before
    assert b2.last_source_position == "pos99"
    assert drain(b2, -1, -1, 1 << 20)[0] == before_events
    b2.append_window(make_window(100, [1]))
    b2.close()


def test_the_buffer_says_whether_windows_before_prev_scn_were_evicted(tmp_path: Path) -> None:
    """``prev_scn`` is either where the buffer started or the newest evicted window: a
    reader of start times (Spark's startingTimestamp) must know which (review). The
    mark survives a restart; a buffer of the older meta format counts as evicted."""
    import struct
    import zlib

    from changebus.relay._meta import _STRUCT_1, MetaFile

    cfg = BufferConfig(capacity_bytes=CAP)
    b = EventBuffer(tmp_path / "a", cfg)
    b.set_start(0)
    for scn in range(1, 20):
        b.append_window(make_window(scn, [300]))
    assert (b.meta.prev_scn, b.meta.evicted) == (0, 0)
    assert (b.meta.prev_ts, b.meta.first_ts) == (0, 1000)
    for scn in range(20, 200):
        b.append_window(make_window(scn, [900]))
    m = b.meta
    assert m.prev_scn > 1 and m.evicted == 1
    # the evicted window's commit time, and the oldest kept one's (it stayed at the
    # first window's before: /v1/status showed it as oldest_timestamp_ns)
    assert (m.prev_ts, m.first_ts) == (m.prev_scn * 1000, m.min_scn * 1000)
    b.close()
    b = EventBuffer(tmp_path / "a", cfg)
    assert b.meta.evicted == 1
    b.close()
    fresh = EventBuffer(tmp_path / "b", cfg)
    fresh.set_start(5)
    fresh.append_window(make_window(6, [10]))
    assert fresh.meta.evicted == 0
    fresh.restart_after(50)  # (a follower whose upstream evicted what follows it)
    assert (fresh.meta.prev_scn, fresh.meta.evicted) == (50, 1)
    fresh.close()
    # a format-1 meta file (no such mark): prev_scn >= 0 counts as evicted
    path = tmp_path / "old.dat"
    body = _STRUCT_1.pack(0x4D425243, 1, 7, CAP, 10, 10, 0, 0, 0, 0, 41, 41, -1, 0, 0, 0, 0, 0, 0)
    body = body[:-8] + struct.pack("<Q", zlib.crc32(body[:-8]))
    path.write_bytes(body.ljust(512, b"\0"))
    old = MetaFile(path).load()
    assert old is not None and (old.prev_scn, old.evicted, old.capacity) == (41, 1, CAP)


def test_the_position_after_prev_scn_is_kept(tmp_path: Path) -> None:
    """An empty buffer complete after ``prev_scn`` knows where its source resumes.

    A cluster follower restarted at its upstream's ``prev_scn`` and elected
    before its first window started its Postgres fetcher from wherever the
    slot was, unchecked (review): the end of window ``prev_scn`` was not kept.
    Evictions keep it now, followers get it from the upstream, and it
    survives a restart; an older meta file has none ("")."""
    import struct
    import zlib

    from changebus.relay._meta import _STRUCT_2, POSITION_BYTES, MetaFile

    cfg = BufferConfig(capacity_bytes=CAP)
    b = EventBuffer(tmp_path / "a", cfg)
    b.set_start(0, position="start")
    assert b.last_source_position == "start"
    b.append_window(make_window(1, [300]))
    assert b.last_source_position == "pos1" and b.meta.prev_pos == "start"
    for scn in range(2, 200):
        b.append_window(make_window(scn, [900]))
    m = b.meta
    assert m.prev_scn > 1 and m.prev_pos == f"pos{m.prev_scn}"  # the evicted window's
    assert b.last_source_position == "pos199"
    assert b.meta.prev_ts > 0
    b.restart_after(250, "upstream-pos")  # (a follower whose upstream moved on)
    assert (b.meta.prev_scn, b.meta.prev_pos) == (250, "upstream-pos")
    assert b.meta.prev_ts == 0  # (the eviction's time was of its own last window: not known)
    assert b.last_source_position == "upstream-pos"
    b.close()
    b = EventBuffer(tmp_path / "a", cfg)  # kept across a restart
    assert (b.meta.prev_scn, b.last_source_position) == (250, "upstream-pos")
    b.restart_after(260)  # an upstream that did not say: not known
    assert b.last_source_position == ""
    b.close()
    # a position too long for the meta file is not kept (not known), never cut short
    c = EventBuffer(tmp_path / "c", cfg)
    c.set_start(7, position="x" * (POSITION_BYTES + 1))
    assert c.last_source_position == ""  # (the same before a restart as after it)
    c.close()
    c = EventBuffer(tmp_path / "c", cfg)
    assert (c.meta.prev_scn, c.last_source_position) == (7, "")
    c.close()
    # a format-2 meta file (before prev_pos) reads as not known
    path = tmp_path / "old.dat"
    fields = (0x4D425243, 2, 7, CAP, 10, 10, 0, 0, 0, 0, 41, 41, -1, 0, 0, 0, 0, 0, 1, 5, 0)
    body = _STRUCT_2.pack(*fields)[:-8]
    path.write_bytes((body + struct.pack("<Q", zlib.crc32(body))).ljust(512, b"\0"))
    old = MetaFile(path).load()
    assert old is not None and (old.prev_scn, old.prev_ts, old.prev_pos) == (41, 5, "")


def test_a_meta_file_of_256_byte_slots_is_upgraded_in_place(tmp_path: Path) -> None:
    """Format 3 kept at most 88 bytes of ``prev_pos``: a MariaDB position naming a
    host-named binlog after a failover (``base``), or an open XA transaction, passed
    that and was lost at a restart with an empty buffer. Format 4 keeps 352; a file
    of the old slots is rewritten in the new format when opened, its state kept."""
    import struct
    import zlib

    from changebus.relay._meta import _STRUCT_3, POSITION_BYTES, MetaFile

    long_pos = (
        "gtid=0-1-1234567;file=mariadb-primary-0-bin.000042;pos=123456789;server=1;"
        "base=8589934592000;xa=0-1-1234560@mariadb-primary-0-bin.000042:123450000"
    )
    assert 88 < len(long_pos) <= POSITION_BYTES
    cfg = BufferConfig(capacity_bytes=CAP)
    b = EventBuffer(tmp_path / "a", cfg)
    b.set_start(7, position=long_pos)
    b.close()
    b = EventBuffer(tmp_path / "a", cfg)
    assert (b.meta.prev_scn, b.last_source_position) == (7, long_pos)
    b.close()
    assert (tmp_path / "a" / "meta.dat").stat().st_size == 1024
    # a format-3 file (two 256-byte slots, the newer in slot 1): upgraded, state kept
    path = tmp_path / "old.dat"
    fields = (0x4D425243, 3, 9, CAP, 10, 10, 0, 0, 0, 0, 41, 41, -1, 0, 0, 0, 0, 0, 1, 5)
    body = _STRUCT_3.pack(*fields, b"gtid=0-1-5;file=b.000001;pos=4", 0)[:-8]
    slot = (body + struct.pack("<Q", zlib.crc32(body))).ljust(256, b"\0")
    path.write_bytes(bytes(256) + slot)
    meta = MetaFile(path)
    old = meta.load()
    assert old is not None
    assert (old.prev_scn, old.prev_ts, old.prev_pos) == (41, 5, "gtid=0-1-5;file=b.000001;pos=4")
    assert path.stat().st_size == 1024 and not meta.created
    meta.publish(old)  # the next sequence number goes on from the old file's
    meta.close()
    again = MetaFile(path)
    assert again.load() == old and again._seq == 10
    again.close()
    # an old-size file with no intact slot stays as it was: the buffer starts afresh
    broken = tmp_path / "broken.dat"
    broken.write_bytes(bytes(512))
    assert MetaFile(broken).created


@pytest.mark.parametrize("mode", ["page_cache", "fsync"])
def test_oldest_windows_overwritten_before_their_eviction_was_published(
    tmp_path: Path, mode: str
) -> None:
    """The writer evicts the oldest windows in memory, overwrites their bytes with the
    new window's, then publishes the new head. A machine that went down in between
    (the ring's pages on disk, the meta file's not: a sync or the kernel's writeback)
    left a published head whose first windows hold newer bytes; recovery refused the
    very first event and dropped the whole buffer, synced and acknowledged windows
    too (review). Those windows now count as evicted; the rest is kept."""
    cfg = BufferConfig(capacity_bytes=CAP)
    b = EventBuffer(tmp_path, cfg)
    b.set_start(0)
    for scn in range(1, 200):
        b.append_window(make_window(scn, [900]))
    before = b.meta
    assert before.prev_scn > 0  # wrapped: the ring is full
    published = (tmp_path / "meta.dat").read_bytes()
    b.append_window(make_window(200, [2500]))  # evicts and overwrites the oldest windows
    assert b.meta.min_scn > before.min_scn
    b.close()
    (tmp_path / "meta.dat").write_bytes(published)  # the new head never reached the disk
    again = EventBuffer(tmp_path, BufferConfig(capacity_bytes=CAP, durability=mode))  # type: ignore[arg-type]
    m = again.meta
    assert before.min_scn < m.min_scn <= 200 and m.last_scn == before.last_scn == 199
    assert m.prev_scn == m.min_scn - 1 and m.evicted == 1
    assert again.stats["recovery_events_dropped"] > 0
    seen, _ = drain(again, m.prev_scn, -1, 1 << 20)
    assert sorted({scn for scn, _ in seen}) == list(range(m.min_scn, 200))
    again.close()


def test_recovery_discards_damaged_events(tmp_path: Path) -> None:
    cfg = BufferConfig(capacity_bytes=CAP)
    b = EventBuffer(tmp_path, cfg)
    b.set_start(0)
    for scn in range(1, 10):
        b.append_window(make_window(scn, [100]))
    b.close()
    ring = tmp_path / "ring.dat"
    raw = bytearray(ring.read_bytes())
    raw[100] ^= 0xFF
    ring.write_bytes(bytes(raw))
    b2 = EventBuffer(tmp_path, cfg)
    # nothing damaged is served: the damaged oldest window counts as evicted, so
    # consumers before it are told to bootstrap, and the intact ones are served
    assert (b2.meta.min_scn, b2.meta.prev_scn) == (2, 1)
    with pytest.raises(ScnNotFoundError):
        b2.select(0, -1, 1000)
    seen, _ = drain(b2, 1, -1, 1 << 20)
    assert sorted({scn for scn, _ in seen}) == list(range(2, 10))
    b2.close()


def test_concurrent_writer_and_readers_never_see_torn_data(tmp_path: Path) -> None:
    b = EventBuffer(tmp_path, BufferConfig(capacity_bytes=CAP, pin_timeout_s=0.05))
    b.set_start(0)
    stop = threading.Event()
    errors: list[BaseException] = []
    counts = {"reads": 0, "overrun": 0, "fell_off": 0}

    def writer() -> None:
        try:
            # at least 3,000 windows, and on until the readers read some whole (on a loaded
            # machine the writer could overrun every read of its 3,000: a flake in CI)
            scn = 0
            while scn < 3000 or (counts["reads"] < 3 and scn < 200_000):
                scn += 1
                b.append_window(
                    make_window(scn, [random.randint(0, 1500) for _ in range(random.randint(0, 4))])
                )
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)
        finally:
            stop.set()

    def reader() -> None:
        ck = (0, -1)
        while not stop.is_set():
            try:
                sel = b.select(*ck, 4000)
            except ScnNotFoundError as exc:
                counts["fell_off"] += 1
                ck = (exc.details["prev_scn"], -1)
                continue
            if sel is None:
                continue
            data = b"".join(bytes(v) for v in sel.views)
            if not b.release(sel):
                counts["overrun"] += 1
                continue  # the bytes may be torn: they must be thrown away
            try:
                _, headers = parse_stream(data)
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(exc)
                return
            scns = headers["scn"].tolist()
            if scns != sorted(scns) or (scns[0] <= ck[0] and ck[1] < 0):
                errors.append(AssertionError(f"out of order {scns[:3]} after {ck}"))
                return
            counts["reads"] += 1
            ck = (sel.next_scn, sel.next_offset)

    threads = [threading.Thread(target=writer)] + [
        threading.Thread(target=reader) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    b.close()
    assert not errors, errors
    assert counts["reads"] >= 3, counts


def test_selection_says_whether_it_reached_the_tail(buf: EventBuffer) -> None:
    """A selection cut by the byte limit is settled; one that reached the tail is not."""
    for scn in range(1, 6):
        buf.append_window(make_window(scn, [500]))
    whole = buf.select(0, -1, 1 << 20)
    assert whole is not None and whole.to_tail and whole.windows == 5
    first = whole.start_pos
    buf.release(whole)
    cut = buf.select(0, -1, 1300)  # two windows (638 bytes each) fit, the third does not
    assert cut is not None and not cut.to_tail and cut.windows == 2
    assert cut.start_pos == first == buf.meta.head_pos
    data = b"".join(bytes(v) for v in cut.views)
    buf.release(cut)
    buf.append_window(make_window(6, [500]))  # a new tail: the same question, the same answer
    again = buf.select(0, -1, 1300)
    assert again is not None and not again.to_tail and again.start_pos == first
    assert b"".join(bytes(v) for v in again.views) == data
    buf.release(again)
    later = buf.select(2, -1, 1300)
    assert later is not None and later.start_pos > first
    buf.release(later)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(windows_st, st.integers(200, 40000))
def test_the_whole_tail_shortcut_answers_as_the_scan_does(
    tmp_path_factory, monkeypatch, spec, max_bytes
) -> None:
    """An unfiltered read from a window boundary takes a shortcut; it must equal the scan."""
    path = tmp_path_factory.mktemp("buf")
    buf = EventBuffer(path, BufferConfig(capacity_bytes=CAP, event_slots=2048))
    buf.set_start(0)
    shortcut = _WHOLE_TAIL
    taken = 0

    def counted(*args):
        nonlocal taken
        got = shortcut(*args)
        taken += got is not None
        return got

    try:
        for i, sizes in enumerate(spec, start=1):
            buf.append_window(make_window(i * 3, sizes))
            m = buf.meta
            # every checkpoint at a live window boundary, and "from the oldest"
            for scn in [-1, m.prev_scn] + [j * 3 for j in range(max(1, i - 6), i)]:
                if scn >= 0 and scn < m.prev_scn:
                    continue
                monkeypatch.setattr(_reader, "_whole_tail", counted)
                fast = buf.select(scn, -1, max_bytes)
                monkeypatch.setattr(_reader, "_whole_tail", lambda *a: None)
                slow = buf.select(scn, -1, max_bytes)
                assert (fast is None) == (slow is None)
                if fast is not None and slow is not None:
                    assert selection_fields(fast) == selection_fields(slow)
                    buf.release(fast)
                    buf.release(slow)
    finally:
        buf.close()


def test_a_read_at_the_tail_takes_the_whole_tail_shortcut(buf: EventBuffer, monkeypatch) -> None:
    taken: list[Any] = []
    shortcut = _WHOLE_TAIL

    def counted(*args: Any) -> Any:
        taken.append(shortcut(*args))
        return taken[-1]

    monkeypatch.setattr(_reader, "_whole_tail", counted)
    buf.append_window(make_window(3, [100, 200]))
    buf.append_window(make_window(4, [50]))
    sel = buf.select(3, -1, 1 << 20)
    assert sel is not None and taken and taken[-1] is not None
    assert (sel.events, sel.windows, sel.next_scn, sel.next_offset) == (2, 1, 4, -1)
    _, headers = parse_stream(b"".join(bytes(v) for v in sel.views))
    assert [(int(h["scn"]), int(h["seq"])) for h in headers] == [(4, 0), (4, 1)]
    buf.release(sel)
    # a filtered read, or one that does not fit, scans
    taken.clear()
    sel = buf.select(0, -1, 300)
    assert sel is not None and taken == [None] and sel.partial
    buf.release(sel)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.lists(st.integers(0, 3000), max_size=8), min_size=1, max_size=80), st.data())
def test_small_commits_write_what_the_bulk_commit_writes(
    tmp_path_factory, monkeypatch, spec, data
) -> None:
    """A small group's commit (Python lists) leaves the same files as the numpy commit."""
    from changebus.relay import _writer

    dirs = [tmp_path_factory.mktemp("small"), tmp_path_factory.mktemp("bulk")]
    bufs = [EventBuffer(d, BufferConfig(capacity_bytes=CAP, event_slots=256)) for d in dirs]
    for b in bufs:
        b.set_start(0)
    try:
        i = 0
        while i < len(spec):
            k = data.draw(st.integers(1, 3))  # groups of one to three windows
            group = [make_window((i + j + 1) * 2, sizes) for j, sizes in enumerate(spec[i : i + k])]
            i += k
            for b, small in zip(bufs, (64, 0), strict=True):
                monkeypatch.setattr(_writer, "_SMALL_EVENTS", small)
                b.append_windows(group)
            assert bufs[0].meta == bufs[1].meta
        for b in bufs:
            b.flush()
        for name in ("ring.dat", "events.dat", "index.dat", "meta.dat"):
            assert (dirs[0] / name).read_bytes() == (dirs[1] / name).read_bytes(), name
    finally:
        for b in bufs:
            b.close()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(windows_st, st.integers(200, 40000), st.data())
def test_the_byte_bound_on_a_scan_changes_no_selection(
    tmp_path_factory, monkeypatch, spec, max_bytes, data
) -> None:
    """An unfiltered scan looks only at the events within ``max_bytes`` of positions.

    Positions bound the bytes before an event from above (a wrap leaves a
    gap), so the bound may cut too early; the scan must then notice and look
    further. Every selection, from window boundaries and from inside
    windows, equals the scan without the bound, field for field and byte
    for byte.
    """
    path = tmp_path_factory.mktemp("buf")
    buf = EventBuffer(path, BufferConfig(capacity_bytes=CAP, event_slots=2048))
    buf.set_start(0)
    bound = _BYTE_BOUND
    monkeypatch.setattr(_reader, "_whole_tail", lambda *a: None)  # (always the scan)

    try:
        for i, sizes in enumerate(spec, start=1):
            buf.append_window(make_window(i * 3, sizes))
            m = buf.meta
            for scn in [-1, m.prev_scn] + [j * 3 for j in range(max(1, i - 6), i + 1)]:
                if scn >= 0 and scn < m.prev_scn:
                    continue
                offset = -1
                if scn > 0 and data.draw(st.booleans()):  # inside the window, when it is kept
                    offset = data.draw(st.integers(0, len(spec[scn // 3 - 1])))
                answers: list[Any] = []
                for use in (bound, lambda events, e, stop, budget: stop):
                    monkeypatch.setattr(_reader, "_byte_bound", use)
                    try:
                        answers.append(buf.select(scn, offset, max_bytes))
                    except ScnNotFoundError:
                        answers.append("too old")
                fast, slow = answers
                assert (fast is None) == (slow is None)
                if isinstance(fast, str) or isinstance(slow, str):
                    assert fast == slow
                elif fast is not None and slow is not None:
                    assert selection_fields(fast) == selection_fields(slow)
                    buf.release(fast)
                    buf.release(slow)
    finally:
        buf.close()


def test_a_byte_bound_cut_short_by_a_wrap_gap_is_looked_past(buf: EventBuffer, monkeypatch) -> None:
    """A wrap's gap inside a window can make the bound cut events that fit: they are sent."""

    def end_of(i: int) -> int:
        rec = buf._events.at(i)
        return int(rec["pos"]) + int(rec["length"])

    scn = 1
    while CAP - buf.meta.tail_pos > 5000:
        buf.append_window(make_window(scn, [400]))
        scn += 1
    buf.append_window(make_window(scn, [max(0, CAP - buf.meta.tail_pos - 2500)]))
    scn += 1
    # two small events fit before the ring's end, the big third one goes to its start
    first = buf.meta.tail_event
    buf.append_window(make_window(scn, [300, 300, 3000, 0, 0, 0, 0]))
    last = buf.meta.tail_event - 1  # its END_OF_WINDOW
    big = int(buf._events.at(first + 2)["pos"])
    assert big % CAP == 0  # it went to the ring's start: a gap before it
    gap = big - end_of(first + 1)
    assert 500 < gap < 3000
    # a budget of exactly the window's bytes: by positions (with the gap) the bound
    # ends inside the window, by lengths the window fits
    start = int(buf._events.at(first)["pos"])
    total = end_of(last) - start - gap
    cuts: list[int] = []
    bound = _BYTE_BOUND

    def recorded(events: Any, e: int, stop: int, left: int) -> int:
        cuts.append(bound(events, e, stop, left))
        return cuts[-1]

    monkeypatch.setattr(_reader, "_byte_bound", recorded)
    monkeypatch.setattr(_reader, "_whole_tail", lambda *a: None)
    sel = buf.select(scn - 1, -1, total)
    assert sel is not None
    assert cuts and cuts[0] <= last  # the bound stopped short of the window's end ...
    assert (sel.next_scn, sel.next_offset, sel.nbytes) == (scn, -1, total)  # ... it was sent
    _, headers = parse_stream(b"".join(bytes(v) for v in sel.views))
    assert [int(h["scn"]) for h in headers] == [scn] * 8
    buf.release(sel)


def test_a_position_too_long_to_keep_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Positions over POSITION_BYTES are kept as not known: an operator is told, once
    (evictions come often), rather than finding resumes from the SCN alone (review)."""
    import logging

    from changebus.relay import _meta

    monkeypatch.setattr(_meta, "_too_long_logged", False)
    b = EventBuffer(tmp_path / "a", BufferConfig(capacity_bytes=CAP))
    with caplog.at_level(logging.WARNING, logger="changebus.relay.buffer"):
        b.set_start(7, position="y" * (_meta.POSITION_BYTES + 10))
        b.set_start(8, position="z" * (_meta.POSITION_BYTES + 20))
        b.set_start(9, position="short")
    b.close()
    logged = [r.getMessage() for r in caplog.records if "longer than" in r.getMessage()]
    assert logged == [
        f"a source position of {_meta.POSITION_BYTES + 10} bytes is longer than the "
        f"{_meta.POSITION_BYTES} the buffer's meta file keeps: the position before the oldest "
        "window is not known (a fetcher starting on an empty buffer resumes from the SCN "
        "alone, and chained relays get no position with a fall-off)"
    ]


def test_a_position_inside_a_window_the_buffer_never_had_is_a_410(tmp_path: Path) -> None:
    """A checkpoint inside a window between ``prev_scn`` and the oldest one, or newer than
    the newest, was answered from the next window on (or with nothing): a reader of
    ``checkpoint=`` tokens took its half-read window as complete (review). Such a place
    gets a 410 (the client reads that window again whole); complete positions as before."""
    b = EventBuffer(tmp_path, BufferConfig(capacity_bytes=CAP))
    b.set_start(10)
    with pytest.raises(ScnNotFoundError, match="inside window 12"):
        drain(b, 12, 1, 1 << 20)  # (an empty buffer)
    for scn in (20, 30):
        b.append_window(make_window(scn, [50, 50]))
    for scn, offset in ((15, 1), (25, 1), (35, 1)):
        with pytest.raises(ScnNotFoundError, match=f"inside window {scn}"):
            drain(b, scn, offset, 1 << 20)
    assert [s for s, _ in drain(b, 15, -1, 1 << 20)[0]][:1] == [20]  # complete: from 20
    assert drain(b, 20, 1, 1 << 20)[0][0] == (20, 1)  # inside a window it has: from there
    assert drain(b, 35, -1, 1 << 20)[0] == []  # complete and newer: nothing yet


def _allocated(path: Path) -> int:
    return path.stat().st_blocks * 512


def test_the_buffer_files_have_their_disk_space_reserved(tmp_path: Path) -> None:
    """Written through a mapping, a sparse file allocates blocks at page faults: costly for
    the writer, and SIGBUS at some write when the disk is full. The files are reserved whole
    at open, and a sparse ring an older version left is reserved at reopen, its windows kept."""
    cap = 4 << 20
    cfg = BufferConfig(capacity_bytes=cap, event_slots=4096)
    b = EventBuffer(tmp_path, cfg)
    b.set_start(0)
    for name, size in (("ring.dat", cap), ("events.dat", 4096 * 32)):
        assert _allocated(tmp_path / name) >= size, name
    assert _allocated(tmp_path / "index.dat") >= (tmp_path / "index.dat").stat().st_size
    for scn in range(1, 20):
        b.append_window(make_window(scn, [300, 20]))
    before, _ = drain(b, -1, -1, 1 << 20)
    b.close()
    # an older version's ring: the same bytes in a sparse file
    ring = tmp_path / "ring.dat"
    data = ring.read_bytes()
    ring.unlink()
    with ring.open("wb") as f:
        f.truncate(cap)
        f.seek(0)
        f.write(data[: 1 << 16])
        assert data[1 << 16 :].count(0) == cap - (1 << 16)  # only the start was written
    assert _allocated(ring) < cap // 2
    b2 = EventBuffer(tmp_path, cfg)
    try:
        assert _allocated(ring) >= cap
        assert drain(b2, -1, -1, 1 << 20)[0] == before
    finally:
        b2.close()


def test_a_file_system_that_cannot_reserve_leaves_the_file_sparse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from changebus.schemas import files
    from changebus.schemas.files import reserve_file

    path = tmp_path / "f.dat"
    path.write_bytes(b"x")

    def refuse(fd: int, size: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(files, "_allocate", refuse)
    assert reserve_file(path, 1 << 20) is False

    def full(fd: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files, "_allocate", full)
    with pytest.raises(OSError) as err:
        reserve_file(path, 1 << 20)
    assert err.value.errno == errno.ENOSPC
    assert str(path) in str(err.value) and "1048576 bytes" in str(err.value)
    assert path.read_bytes() == b"x"
