"""Small groups are appended on the event loop when the writer thread is idle.

Only groups framed by changebus's encoders (event sizes known), without
SCHEMA_CHANGE events, and while no reader holds a pin; everything else goes
to the writer thread. Either way the buffer holds every window, whole and in
order.
"""

from __future__ import annotations

import threading
from pathlib import Path

from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import Op, parse_stream
from waiting import wait_until


def relay_config(tmp: Path) -> RelayConfig:
    return RelayConfig(
        data_dir=tmp / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "syn",
                1,
                capacity_bytes=1 << 20,
                fetcher=FetcherConfig(
                    "synthetic", {"windows_per_s": 200, "tables": 2, "events_per_window": 3}
                ),
            ),
        ),
        flush_interval_s=0,
    )


async def test_small_groups_are_appended_on_the_loop_unless_a_reader_holds_a_pin(
    tmp_path: Path,
) -> None:
    async with Relay(relay_config(tmp_path)) as relay:
        host = relay.hosts["syn"]
        where: list[tuple[bool, bool, int]] = []  # (on the loop, pinned, last SCN)
        append = host._append

        def recording(batch):
            on_loop = threading.current_thread() is threading.main_thread()
            where.append((on_loop, host.buffer.pinned, batch[-1].scn))
            return append(batch)

        host._append = recording  # type: ignore[method-assign]
        await wait_until(lambda: sum(w[0] for w in where) >= 20, 30, "appends on the loop")
        # a reader holding a pin: every group goes to the writer thread meanwhile
        selection = host.buffer.select(-1, -1, 1 << 20)
        assert selection is not None
        held = len(where)
        await wait_until(lambda: len(where) >= held + 10, 30, "appends while pinned")
        assert host.buffer.release(selection)
        pinned = [w for w in where[held:] if w[1]]
        assert pinned and not any(on_loop for on_loop, _, _ in pinned)
        await wait_until(lambda: where[-1][0], 30, "appends on the loop again")
        # the first window (the tables' SCHEMA_CHANGE events) went to the writer thread
        m = host.buffer.meta
        sel = host.buffer.select(-1, -1, 1 << 30)
        assert sel is not None
        data = b"".join(bytes(v) for v in sel.views)
        host.buffer.release(sel)
        _, headers = parse_stream(data)
        first_scn = int(headers["scn"][0])
        firsts = [w for w in where if w[2] == first_scn]
        assert all(not on_loop for on_loop, _, _ in firsts)
    # every window whole and in order, nothing twice
    scns = headers["scn"].tolist()
    ends = [i for i, op in enumerate(headers["op"].tolist()) if op == Op.END_OF_WINDOW]
    assert len(ends) == m.windows
    window_scns = [scns[i] for i in ends]
    assert window_scns == sorted(set(window_scns))
    start = 0
    for end in ends:
        assert headers["seq"][start : end + 1].tolist() == list(range(end + 1 - start))
        assert set(scns[start : end + 1]) == {scns[end]}
        start = end + 1


def _window(scn: int, n: int, size: int) -> bytes:
    from changebus.schemas import EndOfWindow, encode_control, encode_event, key_hash

    events = [
        encode_event(
            Op.INSERT,
            scn,
            i,
            scn,
            f"k{i}".encode(),
            b"x" * size,
            key_hash=key_hash(b"k"),
            source_id=1,
        )
        for i in range(n)
    ]
    return b"".join(events) + encode_control(EndOfWindow(n, "p"), scn, n, scn)


def test_a_group_whose_room_evicts_part_of_a_huge_window_goes_to_the_writer_thread(
    tmp_path: Path,
) -> None:
    """An inline group that evicts the first part of the oldest window, one of many events,
    made the eviction find that window's end by scanning its events on the event loop
    (38 ms for 8 million; review). Such a group goes to the writer thread; one whose room
    is a few whole small windows is still appended inline."""
    from changebus.fetchers import Window
    from changebus.relay._buffer import BufferConfig, EventBuffer
    from changebus.relay._writerthread import WriterThread, fits_inline

    data = _window(10_000, 2, 100)
    _, h = parse_stream(data)
    sizes = tuple(int(x) for x in h["total_length"])
    small = Window(10_000, 1, data, len(sizes), event_sizes=sizes)
    writer = WriterThread("t")
    try:
        # its event table full: the group's room is the oldest window's first events
        huge = EventBuffer(
            tmp_path / "huge", BufferConfig(capacity_bytes=8 << 20, event_slots=40_002)
        )
        huge.set_start(0)
        huge.append_window(_window(1, 40_000, 20))
        assert not fits_inline(writer, huge, [small])
        many = EventBuffer(
            tmp_path / "many", BufferConfig(capacity_bytes=8 << 20, event_slots=40_002)
        )
        many.set_start(0)
        for scn in range(1, 2001):
            many.append_window(_window(scn, 19, 20))  # 40,000 events, 20 a window
        assert fits_inline(writer, many, [small])
        huge.close()
        many.close()
    finally:
        writer._executor.shutdown()
