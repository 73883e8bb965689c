"""Bootstrap pages cut on the way (a proxy ending a body at an event boundary).

The client compared a relay answer's events with its ``X-Changebus-Events``
header, but not a bootstrap page's: a snapshot page cut short was taken whole,
its position header moved past the rows cut off, and they were never delivered
(review). Now such a page is refused (retriably) and fetched again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from synthetic_boot import synthetic_boot

from changebus.client import Consumer, ConsumerConfig, Window
from changebus.schemas import Op, parse_stream
from stub_http import serve_routes

_HOP = frozenset({"content-length", "transfer-encoding", "content-encoding", "connection"})


Hook = Callable[[web.Request, int, dict[str, str], bytes], web.Response | None]


@contextlib.asynccontextmanager
async def proxy(
    upstream: str, hook: Hook, rewrite: Callable[[web.Request], str] | None = None
) -> AsyncIterator[str]:
    """Forwards GETs to ``upstream``; ``hook(request, status, headers, body)`` may answer
    instead (None: the upstream's answer); ``rewrite(request)``: the path and query
    asked of the upstream instead of the request's."""
    async with aiohttp.ClientSession() as session:

        async def forward(request: web.Request) -> web.Response:
            asked = request.path_qs if rewrite is None else rewrite(request)
            async with session.get(f"{upstream}{asked}") as resp:
                body = await resp.read()
                headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
                status = resp.status
            answer = hook(request, status, headers, body)
            if answer is not None:  # (not ``or``: a response is a mapping, empty: false)
                return answer
            return web.Response(status=status, body=body, headers=headers)

        async with serve_routes({"/{tail:.*}": forward}) as url:
            yield url


@contextlib.asynccontextmanager
async def cutting_proxy(upstream: str, cuts: list[str]) -> AsyncIterator[str]:
    """The first answer of each path in ``cuts`` loses the second half of its events (its
    headers kept)."""
    pending = list(cuts)

    def cut(request: web.Request, status: int, headers: dict[str, str], body: bytes) -> Any:
        if status == 200 and request.path in pending:
            offsets, _ = parse_stream(body)
            if offsets.size >= 2:
                pending.remove(request.path)
                return web.Response(
                    status=status, body=body[: int(offsets[offsets.size // 2])], headers=headers
                )
        return None

    async with proxy(upstream, cut) as url:
        yield url
    assert not pending, f"the proxy cut nothing of {pending}"


async def _read(relay_url: str, boot_url: str, **config: Any) -> dict[str, Any]:
    """Every key and its last values, bootstrapped from nothing (until no window comes for
    2 s: the relay's source has ended)."""
    options: dict[str, Any] = {"backoff_initial_s": 0.05, "backoff_max_s": 0.2, **config}
    cfg = ConsumerConfig(
        relays=(relay_url,),
        partition="syn",
        bootstrap_servers=(boot_url,),
        bootstrap_page_bytes=2_000,
        wait_s=0.2,
        **options,
    )
    rows: dict[str, Any] = {}
    for window in await _windows(cfg):
        for e in window.events:
            if e.after is None:
                rows.pop(repr(e.key), None)
            else:
                rows[repr(e.key)] = e.after
    return rows


async def _windows(cfg: ConsumerConfig) -> list[Window]:
    """The windows a consumer gets until none comes for 2 s (the relay's source ended)."""
    got: list[Window] = []
    async with Consumer(cfg) as consumer:
        stream = aiter(consumer)
        while True:
            try:
                got.append(await asyncio.wait_for(anext(stream), 2.0))
            except TimeoutError:
                return got


async def test_a_cut_snapshot_page_is_read_again(tmp_path: Path) -> None:
    async with synthetic_boot(tmp_path, windows=60) as (relay, boot):
        want = await asyncio.wait_for(_read(relay.url, boot.url), 60)
        assert len(want) >= 4
        cuts = ["/v1/bootstrap/snapshot"]
        async with cutting_proxy(boot.url, cuts) as proxy:
            got = await asyncio.wait_for(_read(relay.url, proxy), 60)
        assert got == want


async def test_snapshots_restarted_again_and_again_back_off(tmp_path: Path) -> None:
    """Two stores behind one address: every page after the first is the other store's
    position (and every catch-up the other's log), answered "run the snapshot again".
    The snapshot restarted at once, for as long as it lasted (review); after the first
    restart, the next ones back off."""
    refused: list[float] = []
    loop = asyncio.get_running_loop()
    until = [0.0]  # (set when the read through the proxy starts)

    def other_store(request: web.Request, status: int, headers: dict[str, str], body: bytes) -> Any:
        if loop.time() < until[0] and (
            (request.path == "/v1/bootstrap/snapshot" and "position" in request.query)
            or request.path == "/v1/bootstrap/catchup"  # (a restart's plan may be one)
        ):
            refused.append(loop.time())
            return web.json_response(
                {
                    "error": "scn_not_found",
                    "message": "the snapshot position is another store's",
                    "retriable": False,
                    "restart_snapshot": True,
                },
                status=410,
            )
        return None

    async with synthetic_boot(tmp_path, windows=60) as (relay, boot):
        want = await asyncio.wait_for(_read(relay.url, boot.url), 60)
        async with proxy(boot.url, other_store) as url:
            until[0] = loop.time() + 1.5
            got = await asyncio.wait_for(
                _read(relay.url, url, backoff_initial_s=0.1, backoff_max_s=0.4), 60
            )
        assert got == want
    assert 2 <= len(refused) <= 12, f"{len(refused)} restarts in 1.5 s"


async def test_catchup_windows_past_the_target_are_left_to_the_relays(tmp_path: Path) -> None:
    """A catch-up page holding windows past the consumer's target (a server that ignored
    it): they were queued, the consumer went on at the relays after the target, and the
    relays sent them again (review). The catch-up now ends at its target. And a catch-up
    page cut on the way at a window's end (its event count header kept) is read again."""
    import json

    async with synthetic_boot(tmp_path, windows=60) as (relay, boot):
        buffer = relay.hosts["syn"].buffer
        sel = buffer.select(-1, -1, 1 << 30)
        assert sel is not None
        data = b"".join(bytes(v) for v in sel.views)
        buffer.release(sel)
        _, hdr = parse_stream(data)
        scns = sorted({int(h["scn"]) for h in hdr})
        mid = scns[len(scns) // 2]
        with_rows = sorted({int(h["scn"]) for h in hdr if not Op(int(h["op"])).is_control})
        cut: list[str] = []

        def low_status(
            request: web.Request, status: int, headers: dict[str, str], body: bytes
        ) -> Any:
            if request.path == "/v1/bootstrap/status" and status == 200:
                doc = json.loads(body)
                doc["producer_scn"] = mid  # (the consumer's target: mid)
                return web.json_response(doc)
            if request.path == "/v1/bootstrap/catchup" and status == 200 and not cut:
                # and the first catch-up page loses its second half of windows, its
                # headers kept: its rows were lost for good (review)
                offsets, page = parse_stream(body)
                ends = [i for i in range(len(page)) if int(page["op"][i]) == Op.END_OF_WINDOW]
                if len(ends) >= 2:
                    cut.append(request.path_qs)
                    at = ends[len(ends) // 2 - 1]
                    end = int(offsets[at]) + int(page["total_length"][at])
                    return web.Response(status=200, body=body[:end], headers=headers)
            return None

        def ignore_target(request: web.Request) -> str:
            if request.path != "/v1/bootstrap/catchup":
                return request.path_qs
            query = dict(request.query)
            query["target"] = str(scns[-1])
            return request.path + "?" + "&".join(f"{k}={v}" for k, v in query.items())

        def evicted(request: web.Request, status: int, headers: dict[str, str], body: bytes) -> Any:
            # the relay as one that evicted the windows up to mid
            if request.path == "/v1/stream" and int(request.query.get("scn", "-1")) < mid:
                return web.json_response(
                    {
                        "error": "scn_not_found",
                        "message": "evicted",
                        "retriable": False,
                        "oldest_scn": mid,
                        "prev_scn": mid,
                    },
                    status=410,
                )
            return None

        async with (
            proxy(boot.url, low_status, ignore_target) as boot_url,
            proxy(relay.url, evicted) as relay_url,
        ):
            cfg = ConsumerConfig(
                relays=(relay_url,),
                partition="syn",
                start=str(scns[0] - 1),
                bootstrap_servers=(boot_url,),
                bootstrap_catchup_only=True,
                backoff_initial_s=0.05,
                backoff_max_s=0.2,
                wait_s=0.2,
            )
            got = [w.scn for w in await _windows(cfg) if w.events]
    assert got == sorted(set(got)), "windows repeated"
    assert got == with_rows, "windows lost"
    assert cut, "no catch-up page was cut"
