"""The buffer's trusted append path (windows framed in-process, with event sizes).

It must leave exactly what the verifying path leaves (ring bytes, event
table, SCN index, published state), still refuse structurally wrong windows,
and windows without sizes (any other producer) must still have every CRC
checked. Also: the relay host passes a fetcher's ``event_sizes`` on, and the
ring prefaulting never changes what is stored.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from changebus.fetchers import Window
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.relay._buffer import BufferConfig, EventBuffer
from changebus.relay._prefault import Prefaulter
from changebus.schemas import (
    BadRequestError,
    Column,
    CorruptEventError,
    EndOfWindow,
    Op,
    RowEncoder,
    SchemaRegistry,
    TableSchema,
    encode_control,
    parse_stream,
)

CAP = 256 * 1024


def framed_windows(count: int, seed: int = 1) -> list[tuple[bytes, tuple[int, ...]]]:
    """Windows of RowEncoder events (random sizes), with their event sizes."""
    rnd = random.Random(seed)
    table = SchemaRegistry().register(
        TableSchema("s.t", (Column("id", "long", nullable=False), Column("v", "string")), ("id",))
    )
    enc = RowEncoder(table, source_id=3, partition=1)
    out = []
    for w in range(count):
        scn = 1000 + 7 * w
        events = [
            enc.encode(
                Op.INSERT, scn, i, scn * 10, {"id": w * 100 + i, "v": "x" * rnd.randrange(2000)}
            )
            for i in range(rnd.randrange(1, 12))
        ]
        events.append(
            encode_control(
                EndOfWindow(len(events), f"pos{scn}"), scn, len(events), scn * 10, partition=1
            )
        )
        out.append((b"".join(events), tuple(len(e) for e in events)))
    return out


def drain(buf: EventBuffer) -> list[tuple[int, int, bytes]]:
    """Every event a reader gets from the start: (scn, seq, bytes)."""
    out: list[tuple[int, int, bytes]] = []
    scn, offset = -1, -1
    while (sel := buf.select(scn, offset, 1 << 20)) is not None:
        data = b"".join(bytes(v) for v in sel.views)
        assert buf.release(sel)
        offsets, headers = parse_stream(data)
        ends = offsets + headers["total_length"]
        out += [
            (int(h["scn"]), int(h["seq"]), data[a:b])
            for h, a, b in zip(headers, offsets.tolist(), ends.tolist(), strict=True)
        ]
        scn, offset = sel.next_scn, sel.next_offset
    return out


def state(buf: EventBuffer) -> tuple[object, bytes, bytes, bytes]:
    m = buf.meta
    return (
        m,
        bytes(buf._ring),
        buf._events.get(m.head_event, m.tail_event).tobytes(),
        buf._index.get(m.index_head, m.index_tail).tobytes(),
    )


@pytest.mark.parametrize("group", [1, 3, 40])
def test_trusted_path_leaves_the_same_buffer(tmp_path: Path, group: int) -> None:
    windows = framed_windows(300)
    cfg = BufferConfig(capacity_bytes=CAP)  # wraps around several times
    verified = EventBuffer(tmp_path / "v", cfg)
    trusted = EventBuffer(tmp_path / "t", cfg)
    for i in range(0, len(windows), group):
        part = windows[i : i + group]
        verified.append_windows([d for d, _ in part])
        trusted.append_windows([d for d, _ in part], sizes=[s for _, s in part])
    assert trusted.stats["windows_evicted"] > 0  # the ring wrapped
    assert state(trusted) == state(verified)
    got = drain(trusted)
    assert got == drain(verified)
    # groups are gathered in a reused scratch buffer: what is stored is still
    # exactly the newest events sent, byte for byte
    sent = []
    for data, sizes in windows:
        pos = 0
        for size in sizes:
            sent.append(data[pos : pos + size])
            pos += size
    assert [e for _, _, e in got] == sent[-len(got) :]
    verified.close()
    trusted.close()


def test_trusted_path_still_checks_structure(tmp_path: Path) -> None:
    buf = EventBuffer(tmp_path, BufferConfig(capacity_bytes=CAP))
    (data, sizes), (data2, sizes2) = framed_windows(2)
    with pytest.raises(BadRequestError, match="add up"):
        buf.append_windows([data], sizes=[(*sizes[:-1], sizes[-1] + 1)])
    with pytest.raises(BadRequestError, match="add up"):
        buf.append_windows([data, data2], sizes=[sizes2, sizes])
    if len(sizes) > 2:  # two events given as one: the lengths no longer match the headers
        merged = (sizes[0] + sizes[1], *sizes[2:])
        with pytest.raises(CorruptEventError):
            buf.append_windows([data], sizes=[merged])
    bad = bytearray(data)
    bad[0] ^= 0xFF  # the magic
    with pytest.raises(CorruptEventError):
        buf.append_windows([bytes(bad)], sizes=[sizes])
    buf.append_windows([data2], sizes=[sizes2])
    with pytest.raises(BadRequestError, match="not above"):  # order, as on the other path
        buf.append_windows([data], sizes=[sizes])
    assert buf.meta.windows == 1
    buf.close()


def test_windows_without_sizes_are_still_verified(tmp_path: Path) -> None:
    """A flipped payload byte: refused without sizes; the group appends nothing."""
    buf = EventBuffer(tmp_path, BufferConfig(capacity_bytes=CAP))
    windows = framed_windows(3)
    for k, (data, _) in enumerate(windows):
        bad = bytearray(data)
        bad[len(bad) // 2] ^= 0x01
        with pytest.raises(CorruptEventError, match="checksum"):
            buf.append_windows([bytes(bad)])
        if k:  # after a window with sizes, in one group: the whole group is verified
            earlier, sizes = windows[k - 1]
            with pytest.raises(CorruptEventError, match="checksum"):
                buf.append_windows([earlier, bytes(bad)], sizes=[sizes, ()])
    assert buf.meta.windows == 0
    buf.close()


def test_prefaulted_ring_reopens_with_the_same_windows(tmp_path: Path) -> None:
    cfg = BufferConfig(capacity_bytes=CAP)
    buf = EventBuffer(tmp_path, cfg)
    for data, sizes in framed_windows(40):
        buf.append_windows([data], sizes=[sizes])
    before = state(buf)
    events = drain(buf)
    buf.close()
    again = EventBuffer(tmp_path, cfg)  # recovery verifies every CRC of what is live
    assert state(again) == before and drain(again) == events
    again.close()


def test_prefaulting_covers_the_ring_and_the_event_table(tmp_path: Path) -> None:
    """Every madvise call must start on a page, whatever the writer's tail: an unaligned
    start is refused with EINVAL, which used to stop prefaulting for good after the
    first few MB (the writer then took every page fault itself)."""
    size = 1 << 20
    ring = np.memmap(tmp_path / "ring", dtype=np.uint8, mode="w+", shape=(size,))
    view = ring.view(np.ndarray)
    pre = Prefaulter(view, 0, 10_000)  # ahead: a few pages, not page-aligned
    tail = 0
    while tail < size:
        tail += 3_001  # never page-aligned
        pre.advance(tail)
        deadline = time.monotonic() + 5
        while pre._done < min(tail, size) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert pre._done >= min(tail, size), (tail, pre._done)
    assert pre._thread is not None
    pre._thread.join(5)
    assert not pre._thread.is_alive() and pre._done >= size  # covered once, then done
    pre.close()
    # the buffer prefaults its event table as well
    buf = EventBuffer(tmp_path / "buf", BufferConfig(capacity_bytes=CAP))
    assert buf._prefault_events._thread is not None
    buf.close()
    del view, ring


async def test_host_hands_event_sizes_to_the_buffer(tmp_path: Path, monkeypatch) -> None:
    """The relay uses the trusted path only for windows that carry sizes."""
    seen: list[tuple[Any, list[int]]] = []
    real = EventBuffer.append_windows

    def spy(self, windows, *, before_publish=None, sizes=None):
        seen.append((sizes, [len(w) for w in windows]))
        return real(self, windows, before_publish=before_publish, sizes=sizes)

    monkeypatch.setattr(EventBuffer, "append_windows", spy)
    cfg = RelayConfig(
        data_dir=tmp_path / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "syn",
                1,
                capacity_bytes=1 << 20,
                fetcher=FetcherConfig("synthetic", {"windows_per_s": 0, "events_per_window": 3}),
            ),
        ),
        flush_interval_s=0,
    )
    async with Relay(cfg) as relay:
        for _ in range(200):
            if relay.hosts["syn"].buffer.stats["windows_appended"] >= 20:
                break
            await asyncio.sleep(0.02)
        assert relay.hosts["syn"].buffer.stats["windows_appended"] >= 20
    # the synthetic fetcher frames its events with changebus's encoders and says so:
    # every window carries its event sizes (the trusted path), adding up to its length
    assert seen
    for sizes, lengths in seen:
        assert isinstance(sizes, list) and all(sizes)
        assert list(map(sum, sizes)) == lengths
    assert Window(1, 0, b"", 0).event_sizes == ()


def test_encode_many_reports_event_sizes() -> None:
    """The sizes a fetcher gives the relay are those of the events it framed."""
    table = SchemaRegistry().register(
        TableSchema("s.t", (Column("id", "long", nullable=False), Column("v", "string")), ("id",))
    )
    enc = RowEncoder(table, source_id=3)
    sizes: list[int] = [7]
    rows = [(int(Op.INSERT), {"id": i, "v": "x" * i}, None, (), ()) for i in range(5)]
    data = enc.encode_many(rows, 5, 0, first_seq=1, sizes=sizes)
    again = enc.encode_many_encoded(
        [(int(Op.DELETE), b"\x02", None, b"\x02\x00", (), ())], 5, 0, sizes=sizes
    )
    _, headers = parse_stream(data + again)
    assert sizes == [7, *headers["total_length"].tolist()]
