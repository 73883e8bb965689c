"""WindowQueue: FIFO order and the count and byte bounds between fetcher and writer."""

from __future__ import annotations

import asyncio

from changebus.fetchers import Window
from changebus.relay._windowqueue import WindowQueue


def window(scn: int, size: int) -> Window:
    return Window(scn, 0, b"x" * size, 1)


async def test_bytes_bound_the_producer_and_a_large_window_passes_alone() -> None:
    queue: WindowQueue[Window | None] = WindowQueue(max_items=100, max_bytes=1000)
    put: list[int] = []

    async def producer() -> None:
        for scn, size in enumerate([400, 400, 400, 5000, 10]):
            await queue.put(window(scn, size))
            put.append(scn)
        await queue.put(None)

    task = asyncio.create_task(producer())
    await asyncio.sleep(0.05)
    assert put == [0, 1, 2]  # 1200 bytes queued: the fourth waits
    assert queue.bytes == 1200
    got = []
    while (item := await queue.get()) is not None:
        got.append(item.scn)
        if item.scn == 3:
            assert queue.bytes == 0  # the large window was queued alone
    assert got == [0, 1, 2, 3, 4]
    await task


async def test_count_bounds_the_producer() -> None:
    queue: WindowQueue[Window] = WindowQueue(max_items=2, max_bytes=1 << 20)
    await queue.put(window(1, 1))
    await queue.put(window(2, 1))
    blocked = asyncio.create_task(queue.put(window(3, 1)))
    await asyncio.sleep(0.05)
    assert not blocked.done()
    assert queue.get_nowait().scn == 1
    await asyncio.wait_for(blocked, 1)
    assert [queue.get_nowait().scn, queue.get_nowait().scn] == [2, 3]
    assert queue.empty()
