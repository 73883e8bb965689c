"""Windows the ring cannot place whole, and a batch whose later group is refused.

1. A window alone near the ring's size, placed where it straddles the ring's
   end: its events from the one that does not fit on go to the next lap's
   start, skipping up to one event's bytes, and its tail overwrote its own
   first events. Readers got corrupt bytes, a restart lost the window (found
   by review). Such a window is now a DATA_LOSS window at its SCN, the
   buffer stays whole, and the windows around it are served.
2. A batch cut into groups (at most half the ring each) whose second group
   has more events than the event table: the fallback appended every window
   of the batch one by one, the first group's again, which failed the SCN
   order and the partition for good (review). It appends what is not in yet.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_buffer import make_window

from changebus.fetchers import Window
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import Op, parse_stream
from waiting import wait_until

pytestmark = pytest.mark.usefixtures("no_blocking")

CAP = 64 << 10


def relay_config(tmp_path: Path, **partition: object) -> RelayConfig:
    # one window of the source (SCN 1000), then the test's own from SCN 2001 on
    fetcher = FetcherConfig("synthetic", {"max_windows": 1, "windows_per_s": 0})
    return RelayConfig(
        data_dir=tmp_path,
        http=HttpConfig(port=0),
        partitions=(PartitionConfig("syn", 1, fetcher=fetcher, **partition),),  # type: ignore[arg-type]
        flush_interval_s=0,
    )


def window(scn: int, sizes: list[int]) -> Window:
    scn += 2000
    data = make_window(scn, sizes)
    return Window(scn, scn * 1000, data, len(sizes) + 1)


def ops_by_scn(relay: Relay) -> dict[int, list[int]]:
    """Every event the partition serves from its start: ops by SCN (every CRC checked)."""
    buf = relay.hosts["syn"].buffer
    scn, offset = 1000, 0  # (after the source's window)
    out: dict[int, list[int]] = {}
    while (sel := buf.select(scn, offset, 1 << 20)) is not None:
        data = b"".join(bytes(v) for v in sel.views)
        assert buf.release(sel)
        _, headers = parse_stream(data)
        for s, op in zip(headers["scn"].tolist(), headers["op"].tolist(), strict=True):
            out.setdefault(s - 2000, []).append(op)
        scn, offset = sel.next_scn, sel.next_offset
    return out


async def test_a_window_the_ring_cannot_place_whole_is_a_data_loss_window(
    tmp_path: Path,
) -> None:
    async with Relay(relay_config(tmp_path, capacity_bytes=CAP)) as relay:
        host = relay.hosts["syn"]
        await wait_until(lambda: host.state == "finished")
        big = window(2, [967] * 63)  # 65,520 bytes: under the ring, not with the skip
        assert len(big.data) <= CAP
        # the window before it ends where ``big``'s 21st event straddles the ring's end by
        # all but one byte: the old placement skipped that much and overlapped itself
        offsets, headers = parse_stream(big.data)
        k = 20
        room = int(offsets[k]) + int(headers["total_length"][k]) - 1
        t0 = host.buffer.meta.tail_pos % CAP
        filler = CAP - room - t0
        payload = filler - len(make_window(2001, [0]))
        first = window(1, [payload])
        assert len(first.data) == filler and len(big.data) + room - int(offsets[k]) > CAP
        for batch in ([first], [big], [window(3, [100])]):
            assert await host._writer.run(lambda b=batch: host._append(b))
            m = host.buffer.meta
            assert m.tail_pos - m.head_pos <= CAP  # (66,558 after ``big`` before the fix)
        assert host.losses["window_too_large"] == 1
        got = ops_by_scn(relay)
        assert got[2] == [int(Op.DATA_LOSS), int(Op.END_OF_WINDOW)]
        assert got[3][-1] == int(Op.END_OF_WINDOW) and len(got[3]) == 2
    async with Relay(relay_config(tmp_path, capacity_bytes=CAP)) as relay:  # a restart
        assert ops_by_scn(relay)[3] == [int(Op.INSERT), int(Op.END_OF_WINDOW)]


async def test_a_batch_whose_later_group_is_refused_keeps_the_earlier_groups(
    tmp_path: Path,
) -> None:
    async with Relay(relay_config(tmp_path, capacity_bytes=CAP, event_slots=20)) as relay:
        host = relay.hosts["syn"]
        await wait_until(lambda: host.state == "finished")
        # two windows of ~20 KB: one group each (a group is at most half the ring); the
        # second has more events than the event table's 20 slots
        first, crowded = window(1, [20000]), window(2, [700] * 25)
        assert await host._writer.run(lambda: host._append([first, crowded, window(3, [10])]))
        assert host.state != "failed"
        assert host.losses["window_too_many_events"] == 1
        got = ops_by_scn(relay)
        assert got[1] == [int(Op.INSERT), int(Op.END_OF_WINDOW)]
        assert got[2] == [int(Op.DATA_LOSS), int(Op.END_OF_WINDOW)]
        assert got[3] == [int(Op.INSERT), int(Op.END_OF_WINDOW)]


async def test_a_lease_that_lapses_before_a_group_is_published_stops_it(
    tmp_path: Path,
) -> None:
    """The fence admitted a group before any work: a leader paused after that (its lease
    lapsed, a new leader elected) published the group when it woke, and followers whose
    routing table still named it took it (review). The lease is asked again just before
    the group is published; refused there, nothing of it is published."""

    class Lapsing:
        """Valid for the first ``valid`` questions."""

        def __init__(self, valid: int) -> None:
            self.valid, self.asked = valid, 0

        def admit(self) -> bool:
            self.asked += 1
            return self.asked <= self.valid

        def ack_scn(self, scn: int) -> int | None:
            return None

        def refused(self, reason: str) -> None:
            pass

    async with Relay(relay_config(tmp_path, capacity_bytes=CAP)) as relay:
        host = relay.hosts["syn"]
        await wait_until(lambda: host.state == "finished")
        before, served = host.buffer.meta, ops_by_scn(relay)
        lapsing = Lapsing(1)
        host.fence = lapsing
        assert not await host._writer.run(lambda: host._append([window(1, [10]), window(2, [10])]))
        assert lapsing.asked == 2  # at the start, then just before publishing
        after = host.buffer.meta
        assert (after.last_scn, after.windows) == (before.last_scn, before.windows)
        assert ops_by_scn(relay) == served
        host.fence = Lapsing(10)  # a valid lease: appended as ever
        assert await host._writer.run(lambda: host._append([window(1, [10])]))
        assert ops_by_scn(relay) == {**served, 1: [int(Op.INSERT), int(Op.END_OF_WINDOW)]}
