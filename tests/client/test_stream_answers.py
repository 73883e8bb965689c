"""The consumer's long-poll reads against answers that once made it loop, skip or lose.

Found by review, each with a relay (scripted or synthetic) and, where an
answer must be bent, an aiohttp proxy in front of it:

* a window holding an event of another source, then one of ours larger than
  ``max_bytes``: the relay answered a part with no event, and the consumer
  asked for the same part again, for ever (no error, no backoff);
* a part of a window cut by a proxy at an event boundary: the consumer kept
  the events it got and went on at the relay's next offset, the rest lost;
* ``start="latest"``: the first window's continuation failed once, and the
  consumer asked "from latest" again, which starts after that window.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from aiohttp import web

from changebus.client import Consumer, ConsumerConfig
from changebus.schemas import Column, Op, TableSchema, scan_offsets
from stub_http import serve_routes

A = TableSchema("app.a", (Column("id", "long", nullable=False), Column("v", "string")), ("id",), 1)
B = TableSchema("app.b", (Column("id", "long", nullable=False), Column("v", "string")), ("id",), 1)
FAST: dict[str, Any] = {
    "wait_s": 0.3,
    "backoff_initial_s": 0.01,
    "backoff_max_s": 0.05,
    "follow": False,
}


async def _read(
    cfg: ConsumerConfig, until: int, seconds: float = 10
) -> list[tuple[int, list[Any]]]:
    got: list[tuple[int, list[Any]]] = []
    async with Consumer(cfg) as c:
        async with asyncio.timeout(seconds):
            async for w in c:
                got.append((w.scn, [e.key["id"] for e in w.events]))
                if w.scn >= until:
                    break
    return got


async def test_a_big_event_after_filtered_ones_is_read(
    scripted_relay: Any, window_type: Any
) -> None:
    big = "x" * 3000
    script = [
        window_type(
            10, rows=[(A, 1, Op.INSERT, {"id": 1, "v": "a"}, None)], announce=[(1, A), (2, B)]
        ),
        window_type(
            20,
            rows=[
                (A, 1, Op.INSERT, {"id": 2, "v": "a"}, None),
                (B, 2, Op.INSERT, {"id": 3, "v": big}, None),
            ],
        ),
        window_type(30, rows=[(B, 2, Op.INSERT, {"id": 4, "v": "b"}, None)]),
    ]
    async with scripted_relay(script) as relay:
        cfg = ConsumerConfig(
            relays=(relay.url,), partition="syn", sources=("app.b",), max_bytes=1000, **FAST
        )
        got = await _read(cfg, 30)
    assert got == [(10, []), (20, [3]), (30, [4])]


@asynccontextmanager
async def _proxy(upstream: str, bend: Any, delay_s: float = 0.0) -> AsyncIterator[str]:
    """An HTTP proxy to ``upstream``; ``bend(request, status, headers, body)`` may return
    a response of its own (None: pass the relay's on, changebus headers and body);
    ``delay_s``: how long each request waits before it is passed on."""
    async with aiohttp.ClientSession() as http:

        async def handle(request: web.Request) -> web.StreamResponse:
            await asyncio.sleep(delay_s)
            async with http.get(upstream + request.path_qs) as r:
                body = await r.read()
                headers = {k: v for k, v in r.headers.items() if k.startswith("X-Changebus")}
                status = r.status
            bent = bend(request, status, headers, body)
            if bent is not None:
                return bent  # type: ignore[no-any-return]
            return web.Response(
                status=status, body=body if status != 204 else None, headers=headers
            )

        async with serve_routes({"/{path:.*}": handle}) as url:
            yield url


async def test_a_part_of_a_window_cut_on_the_way_is_refused_and_read_again(
    scripted_relay: Any, window_type: Any
) -> None:
    rows = [(A, 1, Op.INSERT, {"id": i, "v": "x" * 200}, None) for i in range(40)]
    script = [
        window_type(10, rows=rows, announce=[(1, A)]),
        window_type(20, rows=[(A, 1, Op.INSERT, {"id": 999, "v": "z"}, None)]),
    ]
    cut: list[int] = []

    def halve(request: web.Request, status: int, headers: dict[str, str], body: bytes) -> Any:
        if headers.get("X-Changebus-Partial") != "1" or cut:
            return None
        offsets = scan_offsets(body).tolist()
        cut.append(len(offsets))
        return web.Response(status=status, body=body[: offsets[len(offsets) // 2]], headers=headers)

    async with scripted_relay(script) as relay, _proxy(relay.url, halve) as url:
        cfg = ConsumerConfig(relays=(url,), partition="syn", max_bytes=3000, **FAST)
        got = await _read(cfg, 20)
    assert cut, "the proxy cut no answer"
    assert got == [(10, list(range(40))), (20, [999])]


async def test_latest_keeps_its_first_window_when_its_continuation_fails(make_relay: Any) -> None:
    failed: list[int] = []

    def fail_once(request: web.Request, status: int, headers: dict[str, str], body: bytes) -> Any:
        if request.query.get("offset", "-1") != "-1" and not failed:
            failed.append(int(request.query["scn"]))
            return web.json_response(
                {"error": "overloaded", "message": "busy", "retriable": True}, status=503
            )
        return None

    async with make_relay(
        wait=False, windows_per_s=4, max_windows=400, events_per_window=4, row_bytes=1500
    ) as relay:
        host = relay.hosts["syn"]
        while host.buffer.meta.windows < 2:
            await asyncio.sleep(0.05)
        async with _proxy(relay.url, fail_once) as url:
            cfg = ConsumerConfig(
                relays=(url,), partition="syn", max_bytes=3000, start="latest", **FAST
            )
            got: list[int] = []
            async with Consumer(cfg) as c, asyncio.timeout(15):
                async for w in c:
                    got.append(w.scn)
                    if len(got) == 3:
                        break
    assert failed and got[0] == failed[0]  # the window whose continuation failed
    assert got == sorted(got) and len(set(got)) == 3


async def test_a_410_inside_a_window_reads_it_again_whole(
    scripted_relay: Any, window_type: Any
) -> None:
    """A relay that restarted (``durability = "fsync"`` after an OS crash) and lost the
    window being read answers its continuation with 410: the consumer took that for
    falling off the relay, and with one relay and no bootstrap server stopped (found by
    review). It now reads the window again from the last whole one."""
    rows = [(A, 1, Op.INSERT, {"id": i, "v": "x" * 200}, None) for i in range(40)]
    script = [
        window_type(10, rows=rows, announce=[(1, A)]),
        window_type(20, rows=[(A, 1, Op.INSERT, {"id": 999, "v": "z"}, None)]),
    ]
    refused: list[str] = []

    def gone_once(request: web.Request, status: int, headers: dict[str, str], body: bytes) -> Any:
        if request.query.get("offset", "-1") != "-1" and not refused:
            refused.append(request.query["scn"])
            return web.json_response(
                {
                    "error": "scn_not_found",
                    "message": "not in this relay's buffer",
                    "retriable": False,
                    "oldest_scn": 20,
                    "prev_scn": 10,
                },
                status=410,
            )
        return None

    async with scripted_relay(script) as relay, _proxy(relay.url, gone_once) as url:
        cfg = ConsumerConfig(relays=(url,), partition="syn", max_bytes=3000, **FAST)
        got = await _read(cfg, 20)
    assert refused, "no continuation was refused"
    assert got == [(10, list(range(40))), (20, [999])]


async def test_a_continuation_past_the_window_now_at_its_scn_reads_it_again_whole(
    scripted_relay: Any, window_type: Any
) -> None:
    """A relay that restarted after an OS crash replaced the window being read with the
    DATA_LOSS window it owed at that SCN (two events): a continuation past them is a 400
    ``bad_checkpoint``, which ended the consumer's stream for good (review). It reads
    the window at that SCN again whole, as after a 410."""
    rows = [(A, 1, Op.INSERT, {"id": i, "v": "x" * 200}, None) for i in range(40)]
    script = [
        window_type(10, rows=rows, announce=[(1, A)]),
        window_type(20, rows=[(A, 1, Op.INSERT, {"id": 999, "v": "z"}, None)]),
    ]
    refused: list[str] = []

    def past_once(request: web.Request, status: int, headers: dict[str, str], body: bytes) -> Any:
        if request.query.get("offset", "-1") != "-1" and not refused:
            refused.append(request.query["scn"])
            return web.json_response(
                {
                    "error": "bad_checkpoint",
                    "message": "offset 12 is past window 10's 2 events",
                    "retriable": False,
                },
                status=400,
            )
        return None

    async with scripted_relay(script) as relay, _proxy(relay.url, past_once) as url:
        cfg = ConsumerConfig(relays=(url,), partition="syn", max_bytes=3000, **FAST)
        got = await _read(cfg, 20)
    assert refused, "no continuation was refused"
    assert got == [(10, list(range(40))), (20, [999])]


async def test_continuations_refused_again_and_again_back_off(
    scripted_relay: Any, window_type: Any
) -> None:
    """A window longer than ``max_bytes`` whose continuations a relay keeps refusing (two
    relays behind one address, one lacking the window): each refusal read the window's
    first part again at once with the backoff reset, thousands of requests a second, for
    as long as it lasted (review). A second refusal of the same window is a failure now:
    the backoff applies, and the window is read once the relay holds it."""
    rows = [(A, 1, Op.INSERT, {"id": i, "v": "x" * 200}, None) for i in range(40)]
    script = [
        window_type(10, rows=rows, announce=[(1, A)]),
        window_type(20, rows=[(A, 1, Op.INSERT, {"id": 999, "v": "z"}, None)]),
    ]
    refused: list[float] = []
    loop = asyncio.get_running_loop()
    until = loop.time() + 1.5

    def refuse(request: web.Request, status: int, headers: dict[str, str], body: bytes) -> Any:
        if request.query.get("offset", "-1") != "-1" and loop.time() < until:
            refused.append(loop.time())
            return web.json_response(
                {"error": "bad_checkpoint", "message": "not that window", "retriable": False},
                status=400,
            )
        return None

    async with scripted_relay(script) as relay, _proxy(relay.url, refuse) as url:
        cfg = ConsumerConfig(
            relays=(url,),
            partition="syn",
            max_bytes=3000,
            **{**FAST, "backoff_initial_s": 0.1, "backoff_max_s": 0.4},
        )
        got = await _read(cfg, 20)
    assert got == [(10, list(range(40))), (20, [999])]
    assert 2 <= len(refused) <= 12, f"{len(refused)} refused continuations in 1.5 s"


async def test_a_relay_dropped_while_its_request_waits_for_headers_hands_nothing_on(
    make_relay: Any,
) -> None:
    """``set_relays`` closed the response being read, but a request still connecting or
    waiting for its headers had none yet: its answer was read until it ended on its own,
    windows and all, from a relay no longer listed (review)."""
    from changebus.client._stream import RelayStream, StreamConfig

    async with make_relay(wait=False, windows_per_s=50, max_windows=2000) as relay:
        host = relay.hosts["syn"]
        while host.buffer.meta.windows < 2:
            await asyncio.sleep(0.05)
        async with (
            aiohttp.ClientSession() as http,
            _proxy(relay.url, lambda *_: None, delay_s=1.0) as dropped,  # (headers come late)
        ):
            cfg = StreamConfig(
                relays=(dropped,),
                partition="syn",
                follow=False,
                wait_s=0.3,
                **{k: v for k, v in FAST.items() if k.startswith("backoff")},
            )
            stream = RelayStream(cfg, http)
            handed: list[tuple[str, int]] = []
            changed = asyncio.Event()

            async def sink(window: Any, url: str) -> None:
                handed.append((url, window.scn))
                if changed.is_set() and len([u for u, _ in handed if u == relay.url]) >= 3:
                    raise asyncio.CancelledError

            task = asyncio.create_task(stream.run(sink))
            await asyncio.sleep(0.3)  # (the request waits for its headers)
            stream.set_relays((relay.url,))
            changed.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, 20)
    assert not [s for u, s in handed if u == dropped], "windows from the dropped relay"
    assert [u for u, _ in handed] and all(u == relay.url for u, _ in handed)
