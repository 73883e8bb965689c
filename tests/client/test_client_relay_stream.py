"""The public low-level reader (RelayStream) against real relays: failover, sinks, positions."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import aiohttp
import pytest

from changebus.client import (
    FellOffRelayError,
    RawWindow,
    RelayStream,
    RelayUnavailableError,
    StreamConfig,
)
from changebus.relay import Relay
from changebus.schemas import BadRequestError, TransportError, UnknownSourceError

MakeRelay = Callable[..., AbstractAsyncContextManager[Relay]]
FAST: dict[str, Any] = {"wait_s": 0.3, "backoff_initial_s": 0.01, "backoff_max_s": 0.05}
LAST = 1299  # the synthetic source's windows are SCNs 1000..1299


class Done(Exception):
    """Ends a test's stream (not a ChangebusError: never retried)."""


def stream_config(*relays: str, **kw: Any) -> StreamConfig:
    return StreamConfig(relays=relays, **{"partition": "syn", **FAST, **kw})


async def run_until_last(stream: RelayStream, sink: Callable[[RawWindow, str], Any]) -> None:
    with contextlib.suppress(Done):
        async with asyncio.timeout(30):
            await stream.run(sink)


@pytest.mark.parametrize(("follow", "stop_after"), [(True, 0), (False, 0), (False, 50)])
async def test_failover_across_two_relays_when_one_stops(
    make_relay: MakeRelay, follow: bool, stop_after: int
) -> None:
    """The first relay is stopped before the stream starts, or after ``stop_after`` windows."""
    accepted: list[int] = []
    relays_used: list[str] = []
    async with make_relay() as second, contextlib.AsyncExitStack() as stack:
        first = await stack.enter_async_context(make_relay())
        if not stop_after:
            await stack.aclose()
        cfg = stream_config(first.url, second.url, follow=follow, max_bytes=2000)
        async with aiohttp.ClientSession() as session:
            stream = RelayStream(cfg, session)

            async def sink(raw: RawWindow, relay: str) -> None:
                accepted.append(raw.scn)
                relays_used.append(relay)
                if len(accepted) == stop_after:
                    await stack.aclose()  # the first relay stops mid-stream
                if raw.scn == LAST:
                    raise Done

            await run_until_last(stream, sink)
    assert accepted == list(range(1000, 1300))
    assert relays_used[0] == (first.url if stop_after else second.url)
    assert relays_used[-1] == second.url
    assert stream.failovers >= 1 and stream.relay == second.url and stream.position == LAST - 1


@pytest.mark.parametrize("follow", [True, False])
async def test_retriable_sink_error_reads_the_same_window_again_once(
    make_relay: MakeRelay, follow: bool
) -> None:
    seen: list[int] = []
    async with make_relay() as relay, aiohttp.ClientSession() as session:
        stream = RelayStream(stream_config(relay.url, follow=follow, max_bytes=500), session)

        async def sink(raw: RawWindow, relay: str) -> None:
            seen.append(raw.scn)
            if raw.scn == 1010 and seen.count(1010) == 1:
                assert stream.position == 1009
                raise TransportError("the schema fetch failed")  # retriable
            if raw.scn == LAST:
                raise Done

        await run_until_last(stream, sink)
    assert seen.count(1010) == 2
    assert [s for i, s in enumerate(seen) if s != 1010 or i != seen.index(1010)] == list(
        range(1000, 1300)
    )
    assert seen[seen.index(1010) + 1] == 1010  # read again at once, nothing before it


async def test_non_retriable_sink_errors_end_the_stream(make_relay: MakeRelay) -> None:
    async with make_relay() as relay, aiohttp.ClientSession() as session:
        for error in (ValueError("application bug"), UnknownSourceError("no such table")):
            stream = RelayStream(stream_config(relay.url), session)
            calls: list[int] = []

            async def sink(
                raw: RawWindow, relay: str, error: Exception = error, calls: list[int] = calls
            ) -> None:
                calls.append(raw.scn)
                if raw.scn == 1005:
                    raise error

            with pytest.raises(type(error)) as info:
                async with asyncio.timeout(10):
                    await stream.run(sink)
            assert info.value is error
            assert calls == list(range(1000, 1006))
            assert stream.position == 1004 and stream.failovers == 0


@pytest.mark.parametrize(("follow", "max_bytes"), [(True, 1 << 20), (False, 300)])
async def test_position_never_skips_a_window(
    make_relay: MakeRelay, follow: bool, max_bytes: int
) -> None:
    rng = random.Random(7)
    accepted: list[int] = []
    failures = 0
    async with make_relay() as relay, aiohttp.ClientSession() as session:
        cfg = stream_config(relay.url, follow=follow, max_bytes=max_bytes)
        stream = RelayStream(cfg, session, position=1099)

        async def sink(raw: RawWindow, relay: str) -> None:
            nonlocal failures
            # every window handed over is the one right after the position
            assert raw.scn == stream.position + 1
            if rng.random() < 0.2:
                failures += 1
                raise TransportError("flaky sink")
            accepted.append(raw.scn)
            if raw.scn == LAST:
                raise Done

        await run_until_last(stream, sink)
    assert failures > 10
    assert accepted == list(range(1100, 1300))


async def test_a_relays_400_is_not_retried(make_relay: MakeRelay) -> None:
    async with make_relay() as first, make_relay() as second, aiohttp.ClientSession() as session:
        # a wait beyond what any relay accepts (a day; waits above the relay's
        # max_wait_s but within that are shortened): a bad request, the same on every relay
        stream = RelayStream(stream_config(first.url, second.url, wait_s=200_000.0), session)

        async def sink(raw: RawWindow, relay: str) -> None:
            raise AssertionError("no window expected")

        with pytest.raises(BadRequestError) as info:
            async with asyncio.timeout(10):
                await stream.run(sink)
    assert not info.value.retriable and "wait" in info.value.message
    assert stream.requests == 1 and stream.failovers == 0


async def test_dead_relays_give_up_after_max_attempts_and_410_everywhere(
    make_relay: MakeRelay,
) -> None:
    async with aiohttp.ClientSession() as session:
        dead = "http://127.0.0.1:9"
        stream = RelayStream(stream_config(dead, dead + "/", max_attempts=4), session)

        async def sink(raw: RawWindow, relay: str) -> None:
            raise AssertionError("no window expected")

        with pytest.raises(RelayUnavailableError, match="4 attempts"):
            await stream.run(sink)
        assert stream.requests == 4
        async with make_relay(max_windows=400, row_bytes=2000, capacity_bytes=128 << 10) as a:
            min_scn = a.hosts["syn"].buffer.meta.min_scn
            stream = RelayStream(stream_config(a.url, a.url), session, position=1000)
            with pytest.raises(FellOffRelayError) as info:
                await stream.run(sink)
    assert (info.value.requested_scn, info.value.oldest_scn) == (1000, min_scn)
    assert stream.position == 1000


def test_stream_config_is_validated() -> None:
    from changebus.schemas import ConfigError

    with pytest.raises(ConfigError):
        StreamConfig(relays=())
    with pytest.raises(ConfigError):
        StreamConfig(relays=("ftp://x",))
    assert StreamConfig(relays="http://h:1/").relays == ("http://h:1",)  # type: ignore[arg-type]
