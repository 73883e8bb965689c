"""ThreadFeed: order, bound, coalesced wake-ups and errors, with a real producer thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from changebus.fetchers._threadfeed import ThreadFeed


async def test_items_arrive_in_order_and_the_error_after_them() -> None:
    def produce(emit: Callable[[int], None], stopping: threading.Event) -> None:
        for i in range(20_000):
            emit(i)
        raise ValueError("source broke")

    feed = ThreadFeed(produce, maxsize=64)
    got: list[int] = []

    async def consume() -> None:
        async for item in feed.items():
            got.append(item)
            if item % 5000 == 0:
                await asyncio.sleep(0.01)  # let items pile up behind one wake-up

    with pytest.raises(ValueError, match="source broke"):
        await consume()
    assert got == list(range(20_000))
    await feed.close()


async def test_the_bound_holds_the_producer_back() -> None:
    produced: list[int] = []

    def produce(emit: Callable[[int], None], stopping: threading.Event) -> None:
        for i in range(100):
            emit(i)
            produced.append(i)

    feed = ThreadFeed(produce, maxsize=8)
    await asyncio.sleep(0.3)  # nothing consumed: the producer waits for a slot
    assert len(produced) == 8
    got = [item async for item in feed.items()]
    assert got == list(range(100))
    await feed.close()


async def test_close_stops_a_blocked_producer() -> None:
    def produce(emit: Callable[[int], None], stopping: threading.Event) -> None:
        i = 0
        while True:
            emit(i)
            i += 1

    feed = ThreadFeed(produce, maxsize=4)
    await asyncio.sleep(0.1)
    await feed.close()
    assert not feed._thread.is_alive()


async def test_held_items_arrive_on_flush_on_age_and_before_the_producer_waits() -> None:
    flushed = threading.Event()
    go_on = threading.Event()
    feed_box: list[ThreadFeed[int]] = []

    def produce(emit: Callable[[int], None], stopping: threading.Event) -> None:
        emit(0)  # held: fewer than hold_items, younger than hold_s
        go_on.wait(5)
        feed_box[0].flush()
        flushed.set()
        for i in range(1, 200):  # more than maxsize: held items must reach the consumer
            emit(i)

    feed = ThreadFeed(produce, maxsize=16, hold_items=1000, hold_s=60.0)
    feed_box.append(feed)
    items = feed.items()
    first = asyncio.ensure_future(items.__anext__())
    await asyncio.sleep(0.2)
    assert not first.done()  # held back
    go_on.set()
    assert await asyncio.wait_for(first, 5) == 0
    assert flushed.wait(5)  # set by the producer just after its flush (a race otherwise)
    rest = [item async for item in items]
    assert rest == list(range(1, 200))
    await feed.close()


async def test_the_byte_bound_holds_the_producer_back_but_lets_a_large_item_pass() -> None:
    produced: list[bytes] = []

    def produce(emit: Callable[[bytes], None], stopping: threading.Event) -> None:
        for i in range(10):
            item = bytes([i]) * (5000 if i == 6 else 300)  # item 6 alone is over the bound
            emit(item)
            produced.append(item)

    feed = ThreadFeed(produce, maxsize=1000, weigh=len, max_bytes=1000)
    await asyncio.sleep(0.3)  # nothing consumed: 3 items of 300 bytes fit, the 4th waits
    assert len(produced) == 3
    got = [item async for item in feed.items()]
    assert got == produced
    assert [len(item) for item in got].count(5000) == 1
    assert feed._bytes == 0
    await feed.close()


async def test_close_stops_a_producer_waiting_for_bytes() -> None:
    def produce(emit: Callable[[bytes], None], stopping: threading.Event) -> None:
        while True:
            emit(b"x" * 600)

    feed = ThreadFeed(produce, maxsize=1000, weigh=len, max_bytes=1000)
    await asyncio.sleep(0.1)
    await feed.close()
    assert not feed._thread.is_alive()


async def test_the_queue_protocol_returns_the_error_after_the_items_and_gives_slots_back() -> None:
    """get / get_nowait / empty (the relay's ingest reads a feed so, batching what is queued)."""
    release = threading.Event()

    def produce(emit: Callable[[int], None], stopping: threading.Event) -> None:
        for i in range(6):
            emit(i)
        release.wait(5)
        raise ValueError("source broke")

    feed = ThreadFeed(produce, maxsize=6)
    assert await feed.get() == 0
    await asyncio.sleep(0.05)  # the other five were handed over meanwhile
    assert not feed.empty()
    batch = [await feed.get()]
    while not feed.empty():
        batch.append(feed.get_nowait())
    assert batch == [1, 2, 3, 4, 5]
    assert feed.empty()
    with pytest.raises(IndexError):
        feed.get_nowait()
    release.set()
    error = await feed.get()  # returned, not raised: a batch before it is kept
    assert isinstance(error, ValueError) and str(error) == "source broke"
    await feed.close()


async def test_an_injected_error_comes_after_what_is_queued_and_stops_the_items() -> None:
    def produce(emit: Callable[[int], None], stopping: threading.Event) -> None:
        for i in range(3):
            emit(i)
        stopping.wait(5)

    feed = ThreadFeed(produce, maxsize=8)
    await asyncio.sleep(0.05)
    feed.inject(RuntimeError("fenced"))
    got: list[int] = []

    async def consume() -> None:
        async for item in feed.items():
            got.append(item)

    with pytest.raises(RuntimeError, match="fenced"):
        await consume()
    assert got == [0, 1, 2]
    await feed.close()


async def test_the_end_of_the_stream_is_none() -> None:
    def produce(emit: Callable[[int], None], stopping: threading.Event) -> None:
        emit(7)

    feed = ThreadFeed(produce, maxsize=2)
    assert await feed.get() == 7
    assert await feed.get() is None
    await feed.close()


@pytest.mark.parametrize("bound", ["slots", "bytes"])
async def test_a_producer_waiting_for_room_calls_on_wait(bound: str) -> None:
    """The Postgres stream thread blocked handing a window to a busy relay sent no
    status update, and the walsender ended the connection after wal_sender_timeout
    (review): the feed calls ``on_wait`` (in the producer's thread) while it waits."""
    calls: list[str] = []

    def produce(emit: Callable[[bytes], None], stopping: threading.Event) -> None:
        for _ in range(3):
            emit(b"x" * 600)

    if bound == "slots":
        feed = ThreadFeed(produce, maxsize=1)
    else:
        feed = ThreadFeed(produce, maxsize=1000, weigh=len, max_bytes=1000)
    feed.on_wait = lambda: calls.append(threading.current_thread().name)
    await asyncio.sleep(0.9)  # nothing consumed: the producer waits, about 4 times
    assert len(calls) >= 2 and set(calls) == {feed._thread.name}
    got = [item async for item in feed.items()]
    assert len(got) == 3
    await feed.close()
