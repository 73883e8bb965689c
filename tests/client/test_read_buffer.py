"""A follow stream is read in pieces as large as the consumer's ``max_bytes`` (at most 4 MiB).

aiohttp's default read buffer (64 KiB) handed a consumer that was behind its
pushes in 64 KiB pieces, each split, checked and assembled on its own
(``bench/relay_catchup.py``: a third more CPU per row than long-polls).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest

from changebus.client import Consumer, ConsumerConfig, _assembler
from changebus.client._http import read_bufsize
from changebus.relay import Relay

MakeRelay = Callable[..., AbstractAsyncContextManager[Relay]]


def test_the_read_buffer_is_max_bytes_within_bounds() -> None:
    assert read_bufsize(1 << 20) == 1 << 20
    assert read_bufsize(64 << 20) == 4 << 20
    assert read_bufsize(4096) == 4096


async def test_a_consumer_behind_takes_what_arrived_in_large_pieces(
    make_relay: MakeRelay, monkeypatch: pytest.MonkeyPatch
) -> None:
    pieces: list[int] = []
    split = _assembler.EventSplitter.split

    def recorded(self: Any, chunk: bytes) -> Any:
        pieces.append(len(chunk))
        return split(self, chunk)

    monkeypatch.setattr(_assembler.EventSplitter, "split", recorded)
    backlog = {"max_windows": 1500, "events_per_window": 4, "row_bytes": 2000}
    async with make_relay(capacity_bytes=32 << 20, **backlog) as relay:
        cfg = ConsumerConfig(
            relays=(relay.url,), partition="syn", start="earliest", wait_s=0.3, queue_windows=20
        )
        seen = 0
        async with Consumer(cfg) as consumer:
            async for _window in consumer:
                seen += 1
                if seen % 20 == 0:
                    await asyncio.sleep(0.02)  # a slow application: the stream waits for it
                if seen == 1500:
                    break
    assert seen == 1500
    # (aiohttp's default buffer stopped reading at some 768 KiB here)
    assert max(pieces) > 1 << 20, sorted(pieces)[-5:]
