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
