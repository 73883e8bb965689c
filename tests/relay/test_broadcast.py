"""Follow streams at the tail are served by the partition's broadcast (``_broadcast``).

Many followers of a live partition each get every window once, in order,
byte for byte as the buffer holds it; followers with different filters get
their own pushes; a follower that stops reading is cut off while the others go on;
budgets and idle waits still end responses with their terminating chunk.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.relay._broadcast import PUSH_BYTES
from changebus.relay._http import BROADCASTS, COPIES
from changebus.schemas import Op, PartitionFilter, parse_stream

pytestmark = pytest.mark.usefixtures("no_blocking")


def _config(tmp_path: Path, rate: float, *, source: Any = (), **http: Any) -> RelayConfig:
    options = {"windows_per_s": rate, "events_per_window": 3, "row_bytes": 100, "tables": 2}
    options.update(source)
    return RelayConfig(
        data_dir=tmp_path / "relay",
        http=HttpConfig(port=0, max_wait_s=30, **http),
        partitions=(
            PartitionConfig(
                "syn", 1, capacity_bytes=16 << 20, fetcher=FetcherConfig("synthetic", options)
            ),
        ),
        flush_interval_s=0,
    )


async def _follow(
    http: aiohttp.ClientSession, relay: Relay, scn: int, until_scn: int, **extra: Any
) -> tuple[bytes, int]:
    """Read one follow response until a window at or past ``until_scn``; (body, chunks)."""
    params: dict[str, Any] = {"partition": "syn", "scn": scn, "follow": 1, "wait": 20, **extra}
    body = b""
    chunks = 0
    async with http.get(f"{relay.url}/v1/stream", params=params) as resp:
        assert resp.status == 200
        async for data, end_of_chunk in resp.content.iter_chunks():
            body += data
            chunks += end_of_chunk
            if end_of_chunk and body:
                _, hdr = parse_stream(body)
                if (
                    len(hdr)
                    and int(hdr["scn"][-1]) >= until_scn
                    and hdr["op"][-1] == Op.END_OF_WINDOW
                ):
                    break
    return body, chunks


async def _live_tail(relay: Relay) -> int:
    """The partition's newest SCN once the source is running (a few windows in)."""
    buffer = relay.hosts["syn"].buffer
    while buffer.meta.windows < 5:
        await asyncio.sleep(0.01)
    return buffer.meta.last_scn


def _buffer_bytes(relay: Relay, after_scn: int, until_scn: int) -> bytes:
    """The buffer's own bytes of the windows after ``after_scn`` up to ``until_scn``."""
    buffer = relay.hosts["syn"].buffer
    sel = buffer.select(after_scn, -1, 1 << 30)
    assert sel is not None
    data = b"".join(bytes(v) for v in sel.views)
    buffer.release(sel)
    offsets, hdr = parse_stream(data)
    last = max(i for i in range(len(hdr)) if int(hdr["scn"][i]) <= until_scn)
    return data[: int(offsets[last]) + int(hdr["total_length"][last])]


async def test_many_followers_get_every_window_once_in_order_byte_for_byte(tmp_path: Path) -> None:
    async with Relay(_config(tmp_path, 300)) as relay, aiohttp.ClientSession() as http:
        start = await _live_tail(relay)
        until = start + 300  # about a second of windows
        parked: list[int] = []

        async def watch_parked() -> None:
            while True:
                broadcast = relay.server.app[BROADCASTS].get("syn")
                parked.append(len(broadcast) if broadcast is not None else 0)
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch_parked())
        try:
            results = await asyncio.gather(*(_follow(http, relay, start, until) for _ in range(40)))
        finally:
            watcher.cancel()
        expected = _buffer_bytes(relay, start, until)
    assert max(parked) >= 20, "the followers were not parked at the tail"
    for body, chunks in results:
        assert body[: len(expected)] == expected  # every window once, in order, whole
        assert chunks >= 2  # pushed as windows came, not in one piece


async def test_a_lone_follower_catching_up_gets_pushes_larger_than_a_herd_does(
    tmp_path: Path,
) -> None:
    """Behind the tail, pushes grow with the copy budget's share: fewer, cheaper pushes."""
    backlog = {"windows_per_s": 0, "row_bytes": 2000, "max_windows": 3000}
    async with (
        Relay(_config(tmp_path, 0, source=backlog)) as relay,
        aiohttp.ClientSession() as http,
    ):
        host = relay.hosts["syn"]
        while host.state != "finished":
            await asyncio.sleep(0.05)
        last = host.buffer.meta.last_scn
        body, chunks = await _follow(http, relay, -1, last, max_bytes=1 << 20)
        expected = _buffer_bytes(relay, -1, last)
        copies = relay.server.app[COPIES]
        deadline = time.monotonic() + 5
        while copies.parked and time.monotonic() < deadline:  # (the response ends after us)
            await asyncio.sleep(0.01)
        assert copies.parked == 0  # the relay-wide count the push cap divides by
    assert body == expected
    assert len(expected) > 8 << 20
    assert len(body) / chunks > 4 * PUSH_BYTES, (len(body), chunks)


async def test_followers_with_different_filters_get_their_own_events(tmp_path: Path) -> None:
    async with Relay(_config(tmp_path, 300)) as relay, aiohttp.ClientSession() as http:
        start = await _live_tail(relay)
        until = start + 200
        filters = ["mod:2:0", "mod:2:1", None]
        results = await asyncio.gather(
            *(
                _follow(http, relay, start, until, **({"filter": f} if f else {}))
                for f in filters
                for _ in range(5)
            )
        )
        whole = _buffer_bytes(relay, start, until)
    _, all_hdr = parse_stream(whole)
    data_ops = {int(Op.INSERT), int(Op.UPDATE), int(Op.DELETE)}
    for i, (body, _) in enumerate(results):
        text = filters[i // 5]
        _, hdr = parse_stream(body)
        hdr = hdr[hdr["scn"] <= until]
        got = [(int(h["scn"]), int(h["key_hash"])) for h in hdr if int(h["op"]) in data_ops]
        flt = PartitionFilter.parse(text) if text else None
        want = [
            (int(h["scn"]), int(h["key_hash"]))
            for h in all_hdr
            if int(h["op"]) in data_ops and (flt is None or flt.matches(int(h["key_hash"])))
        ]
        assert got == want, f"filter {text}"


def _stalled_follower(port: int, scn: int) -> socket.socket:
    """A follow request whose client never reads (a tiny receive buffer)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    path = f"/v1/stream?partition=syn&scn={scn}&follow=1&wait=30"
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return sock


async def test_a_stalled_follower_is_cut_off_and_the_others_go_on(tmp_path: Path) -> None:
    cfg = _config(tmp_path, 2000, send_timeout_s=1)
    async with Relay(cfg) as relay, aiohttp.ClientSession() as http:
        start = await _live_tail(relay)
        stalled = await asyncio.to_thread(_stalled_follower, relay.port, start)
        try:
            until = start + 8000  # about four seconds of windows: past the send timeout
            t0 = time.monotonic()
            body, _ = await _follow(http, relay, start, until)
            assert time.monotonic() - t0 < 30
            expected = _buffer_bytes(relay, start, until)
            async with http.get(f"{relay.url}/metrics") as resp:
                text = await resp.text()
        finally:
            stalled.close()
    assert body[: len(expected)] == expected
    line = 'changebus_relay_responses_aborted_total{partition="syn"}'
    assert line in text and float(text.split(line, 1)[1].split()[0]) == 1.0


async def test_budget_and_idle_end_parked_responses_whole(tmp_path: Path) -> None:
    async with Relay(_config(tmp_path, 300)) as relay, aiohttp.ClientSession() as http:
        start = await _live_tail(relay)
        params: dict[str, Any] = {
            "partition": "syn",
            "scn": start,
            "follow": 1,
            "wait": 20,
            "follow_bytes": 20_000,
        }
        t0 = time.monotonic()
        async with http.get(f"{relay.url}/v1/stream", params=params) as resp:
            body = await resp.read()  # raises if the body does not end with its last chunk
        assert 20_000 <= len(body) < 20_000 + (64 << 10)
        assert time.monotonic() - t0 < 10
        _, hdr = parse_stream(body)  # whole windows only
        assert hdr["op"][-1] == Op.END_OF_WINDOW
    # a partition with no traffic: the parked stream ends after its wait
    idle_cfg = _config(tmp_path / "idle", 300)
    part = PartitionConfig("syn", 1, capacity_bytes=1 << 20)
    idle_cfg = RelayConfig(
        data_dir=idle_cfg.data_dir, http=idle_cfg.http, partitions=(part,), flush_interval_s=0
    )
    async with Relay(idle_cfg) as relay, aiohttp.ClientSession() as http:
        t0 = time.monotonic()
        params = {"partition": "syn", "scn": -1, "follow": 1, "wait": 0.5}
        async with http.get(f"{relay.url}/v1/stream", params=params) as resp:
            assert resp.status == 200
            assert await resp.read() == b""
        took = time.monotonic() - t0
    assert 0.5 <= took < 3


async def test_a_follow_response_ends_its_connection(tmp_path: Path) -> None:
    """A follow response locks the socket's send buffer small and its write limit at 0;
    the connection closes with the response, so a keep-alive reuse cannot pull the next
    (large) answers through them (review)."""
    created: list[object] = []
    trace = aiohttp.TraceConfig()

    async def on_create(*_args: object) -> None:
        created.append(1)

    trace.on_connection_create_end.append(on_create)
    connector = aiohttp.TCPConnector(limit=1)
    async with (
        Relay(_config(tmp_path, 300)) as relay,
        aiohttp.ClientSession(connector=connector, trace_configs=[trace]) as http,
    ):
        start = await _live_tail(relay)
        params: dict[str, Any] = {
            "partition": "syn",
            "scn": start,
            "follow": 1,
            "wait": 20,
            "follow_bytes": 5_000,
        }
        async with http.get(f"{relay.url}/v1/stream", params=params) as resp:
            assert resp.headers.get("Connection", "").lower() == "close"
            assert len(await resp.read()) >= 5_000
        pull: dict[str, Any] = {"partition": "syn", "scn": start, "max_bytes": 100_000}
        async with http.get(f"{relay.url}/v1/stream", params=pull) as resp:
            assert resp.status == 200
            assert resp.headers.get("Connection", "").lower() != "close"
            await resp.read()
        async with http.get(f"{relay.url}/v1/stream", params=pull) as resp:
            assert resp.status == 200
            await resp.read()
    assert len(created) == 2  # the follow's connection was not reused; the pulls' was
