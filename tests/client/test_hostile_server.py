"""A broken or hostile server cannot make the client hold more than ``max_window_bytes``.

A real aiohttp server on loopback answers the client's stream requests with
what no relay sends: a body declared or streamed past the bound, an event
declaring gigabytes, a window that never closes. Each ends the stream with a
non-retriable :class:`ProtocolError` naming ``max_window_bytes``, and the
client holds no more than the bound meanwhile.
"""

from __future__ import annotations

import asyncio
import struct
import time
from contextlib import AbstractAsyncContextManager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from changebus.client._stream import RelayStream, StreamConfig
from changebus.schemas import ChangebusError, Heartbeat, ProtocolError, encode_control
from stub_http import Handler, serve_routes

LIMIT = 1 << 20
FAST: dict[str, Any] = {"wait_s": 0.3, "backoff_initial_s": 0.01, "backoff_max_s": 0.05}


def open_event(seq: int) -> bytes:
    """A valid HEARTBEAT event of window 5 (no END_OF_WINDOW ever follows)."""
    return encode_control(Heartbeat("x" * 1000), 5, seq, time.time_ns(), partition=0)


def serve(handler: Handler) -> AbstractAsyncContextManager[str]:
    server: AbstractAsyncContextManager[str] = serve_routes({"/v1/stream": handler})
    return server


async def endless_window(request: web.Request) -> web.StreamResponse:
    """Events of one window, for ever (until the client goes)."""
    resp = web.StreamResponse(headers={"X-Changebus-Next-Scn": "5", "X-Changebus-Next-Offset": "0"})
    await resp.prepare(request)
    seq = 0
    while True:
        await resp.write(b"".join(open_event(seq + i) for i in range(64)))
        seq += 64


async def declared_huge(request: web.Request) -> web.StreamResponse:
    """A long-poll answer declaring 3 GiB."""
    resp = web.StreamResponse(headers={"X-Changebus-Next-Scn": "5", "X-Changebus-Next-Offset": "0"})
    resp.content_length = 3 << 30
    await resp.prepare(request)
    while True:  # until the client goes
        await resp.write(open_event(0))
        await asyncio.sleep(0.05)


async def huge_event(request: web.Request) -> web.StreamResponse:
    """A follow answer whose first event declares 3 GiB, then bytes for ever."""
    resp = web.StreamResponse()
    await resp.prepare(request)
    event = bytearray(open_event(0))
    struct.pack_into("<I", event, 4, 3 << 30)
    await resp.write(bytes(event))
    while True:
        await resp.write(b"\0" * 65536)


@pytest.mark.parametrize(
    ("handler", "follow", "said"),
    [
        (endless_window, True, "window 5 is larger"),  # follow: the window never closes
        (endless_window, False, "an answer is larger"),  # long-poll: the body never ends
        (declared_huge, False, f"an answer of {3 << 30} bytes"),
        (huge_event, True, f"an event of {3 << 30} bytes"),
    ],
    ids=["follow-window", "long-poll-body", "declared-length", "event-length"],
)
async def test_the_stream_stops_at_max_window_bytes(
    handler: Handler, follow: bool, said: str
) -> None:
    async with serve(handler) as url:
        cfg = StreamConfig(
            relays=(url,), partition="p", follow=follow, max_window_bytes=LIMIT, **FAST
        )
        async with aiohttp.ClientSession() as http:
            stream = RelayStream(cfg, http)
            seen: list[Any] = []

            async def sink(window: Any, relay: str) -> None:
                seen.append(window)

            with pytest.raises(ProtocolError) as caught:
                await asyncio.wait_for(stream.run(sink), 20)
            held = stream._assembler._pending_bytes
    assert said in caught.value.message and "max_window_bytes" in caught.value.message
    assert not caught.value.retriable
    assert seen == [] and held <= LIMIT


async def endless_error(request: web.Request) -> web.StreamResponse:
    """A 500 whose body never ends (its JSON would say what went wrong)."""
    resp = web.StreamResponse(status=500, headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    while True:
        await resp.write(b" " * 65536)


async def test_an_endless_error_answer_is_read_only_so_far() -> None:
    """An error answer's JSON was read whole: a hostile one grew memory without end."""
    async with serve(endless_error) as url:
        cfg = StreamConfig(relays=(url,), partition="p", follow=False, max_attempts=1, **FAST)
        async with aiohttp.ClientSession() as http:
            stream = RelayStream(cfg, http)

            async def sink(window: Any, relay: str) -> None:
                raise AssertionError("no window")

            # (unbounded, the read of the answer never ended: a timeout, not this error)
            with pytest.raises(ChangebusError):
                await asyncio.wait_for(stream.run(sink), 20)


def test_max_window_bytes_must_be_positive() -> None:
    from changebus.client import ConsumerConfig
    from changebus.schemas import ConfigError

    assert ConsumerConfig(relays=("http://a:1",)).max_window_bytes == 512 << 20
    with pytest.raises(ConfigError, match="max_window_bytes"):
        ConsumerConfig(relays=("http://a:1",), max_window_bytes=0)
    with pytest.raises(ConfigError, match="must not pass max_window_bytes"):
        ConsumerConfig(relays=("http://a:1",), max_bytes=4 << 20, max_window_bytes=2 << 20)
