"""The relay's HTTP API through a real aiohttp server and client."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from blockbuster import BlockBuster

from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import (
    Checkpoint,
    EndOfWindow,
    Op,
    encode_control,
    encode_event,
    headers_at,
    key_hash,
    parse_stream,
    scan_offsets,
)

# the relay runs in the test's event loop: none of its code may block that loop
pytestmark = pytest.mark.usefixtures("no_blocking")


def relay_config(tmp_path: Path, **fetcher: Any) -> RelayConfig:
    options = {
        "windows_per_s": 0,
        "max_windows": 300,
        "events_per_window": 3,
        "row_bytes": 100,
        "tables": 2,
    }
    options.update(fetcher)
    return RelayConfig(
        data_dir=tmp_path / "relay",
        http=HttpConfig(port=0, max_wait_s=10),
        partitions=(
            PartitionConfig(
                "syn", 1, capacity_bytes=1 << 20, fetcher=FetcherConfig("synthetic", options)
            ),
            PartitionConfig("idle", 2, capacity_bytes=1 << 20),
        ),
        flush_interval_s=0,
    )


async def wait_windows(relay: Relay, n: int, partition: str = "syn", seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while relay.hosts[partition].buffer.meta.windows < n and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert relay.hosts[partition].buffer.meta.windows >= n


@pytest.fixture
async def relay(tmp_path: Path) -> AsyncIterator[Relay]:
    async with Relay(relay_config(tmp_path)) as r:
        yield r


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def read_all(
    http: aiohttp.ClientSession, relay: Relay, **params: Any
) -> tuple[list[tuple[int, int, int]], str]:
    """Follow the stream until it is drained; returns [(scn, seq, op)] and the last token."""
    events: list[tuple[int, int, int]] = []
    token = Checkpoint({}).to_token()
    while True:
        query = {"partition": "syn", "checkpoint": token, **params}
        async with http.get(f"{relay.url}/v1/stream", params=query) as resp:
            assert resp.status in (200, 204), await resp.text()
            body = await resp.read()
            token = resp.headers["X-Changebus-Checkpoint"]
            if resp.status == 204:
                return events, token
            _, headers = parse_stream(body)
            assert int(resp.headers["X-Changebus-Events"]) == len(headers)
            events.extend((int(h["scn"]), int(h["seq"]), int(h["op"])) for h in headers)


async def test_stream_delivers_every_window_in_order(
    relay: Relay, http: aiohttp.ClientSession
) -> None:
    await wait_windows(relay, 300)
    events, token = await read_all(http, relay, max_bytes=4096)
    eows = [scn for scn, _, op in events if op == Op.END_OF_WINDOW]
    assert len(eows) == 300
    assert eows == sorted(set(eows))
    assert [e[:2] for e in events] == sorted(e[:2] for e in events)
    assert Checkpoint.parse(token).get("syn").window_scn == eows[-1]
    # from the final token there is nothing new: 204 at once, same position
    async with http.get(
        f"{relay.url}/v1/stream", params={"partition": "syn", "checkpoint": token}
    ) as resp:
        assert resp.status == 204
        assert Checkpoint.parse(resp.headers["X-Changebus-Checkpoint"]) == Checkpoint.parse(token)


async def test_partition_filters_split_the_stream_exactly_once(
    relay: Relay, http: aiohttp.ClientSession
) -> None:
    await wait_windows(relay, 300)
    whole, _ = await read_all(http, relay)
    parts = [await read_all(http, relay, filter=f"mod:3:{b}") for b in range(3)]
    data = sorted(e for e in whole if e[2] < 16)
    assert sorted(e for p, _ in parts for e in p if e[2] < 16) == data
    for p, _ in parts:
        assert {e for e in p if e[2] == Op.END_OF_WINDOW} == {
            e for e in whole if e[2] == Op.END_OF_WINDOW
        }


async def test_long_poll_wakes_on_commit(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with Relay(relay_config(tmp_path, windows_per_s=20, max_windows=0)) as relay:
        await wait_windows(relay, 1)
        last = relay.hosts["syn"].buffer.meta.last_scn
        t0 = time.monotonic()
        async with http.get(
            f"{relay.url}/v1/stream", params={"partition": "syn", "scn": last, "wait": 5}
        ) as resp:
            assert resp.status == 200
            body = await resp.read()
        waited = time.monotonic() - t0
        _, headers = parse_stream(body)
        assert int(headers["scn"][0]) > last
        assert waited < 1.0  # one window arrives every 50 ms


async def test_wait_expires_with_204(relay: Relay, http: aiohttp.ClientSession) -> None:
    t0 = time.monotonic()
    async with http.get(
        f"{relay.url}/v1/stream", params={"partition": "idle", "from": "latest", "wait": 0.3}
    ) as resp:
        assert resp.status == 204
        assert resp.headers["X-Changebus-Next-Scn"] == "-1"
    assert 0.25 < time.monotonic() - t0 < 3


async def test_too_old_checkpoint_gets_410_with_oldest_scn(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    cfg = relay_config(tmp_path, max_windows=400, row_bytes=2000)
    cfg = RelayConfig(
        data_dir=cfg.data_dir,
        http=cfg.http,
        partitions=(
            PartitionConfig("syn", 1, capacity_bytes=128 << 10, fetcher=cfg.partitions[0].fetcher),
        ),
        flush_interval_s=0,
    )
    async with Relay(cfg) as relay:
        await wait_windows(relay, 1)
        while relay.hosts["syn"].buffer.stats["windows_appended"] < 400:
            await asyncio.sleep(0.02)
        m = relay.hosts["syn"].buffer.meta
        async with http.get(
            f"{relay.url}/v1/stream", params={"partition": "syn", "scn": 1000}
        ) as resp:
            assert resp.status == 410
            body = await resp.json()
        assert body["error"] == "scn_not_found"
        assert body["oldest_scn"] == m.min_scn and body["prev_scn"] == m.prev_scn
        assert body["retriable"] is True


@pytest.mark.parametrize(
    ("params", "status", "needle"),
    [
        ({"partition": "nope"}, 404, "no partition"),
        ({"partition": "syn", "scn": "abc"}, 400, "integer"),
        ({"partition": "syn", "scn": "-7"}, 400, "within"),
        ({"partition": "syn", "max_bytes": "0"}, 400, "within"),
        ({"partition": "syn", "wait": "1e9"}, 400, "within"),
        ({"partition": "syn", "filter": "mod:0:1"}, 400, "filter"),
        ({"partition": "syn", "format": "xml"}, 400, "format"),
        ({"partition": "syn", "from": "yesterday"}, 400, "earliest"),
        ({"partition": "syn", "checkpoint": "{{{"}, 400, "checkpoint"),
        ({"partition": "syn", "sources": "no.such"}, 404, "no source"),
        # (naming none meant "messages only": a 200 moving past every data event)
        ({"partition": "syn", "sources": ""}, 400, "names no source"),
        ({"partition": "syn", "sources": " , ,"}, 400, "names no source"),
        ({"partition": "syn", "bogus": "1"}, 400, "unknown parameter"),
        ({"scn": "5"}, 400, "name the partition"),
    ],
)
async def test_bad_requests_get_clear_json_errors(
    relay: Relay, http: aiohttp.ClientSession, params: dict[str, str], status: int, needle: str
) -> None:
    await wait_windows(relay, 1)
    async with http.get(f"{relay.url}/v1/stream", params=params) as resp:
        assert resp.status == status
        body = await resp.json()
    assert needle in body["message"].lower()
    assert set(body) >= {"error", "message", "retriable"}
    async with http.get(f"{relay.url}/healthz") as resp:
        assert resp.status == 200


async def test_garbage_paths_and_methods(relay: Relay, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{relay.url}/v1/nothing") as resp:
        assert resp.status == 404
    async with http.post(f"{relay.url}/v1/stream", data=b"x" * 1000) as resp:
        assert resp.status == 405
    async with http.get(f"{relay.url}/v1/stream?partition=syn&scn=%ff%fe") as resp:
        assert resp.status == 400
    async with http.get(f"{relay.url}/healthz") as resp:
        assert resp.status == 200


async def test_ndjson_is_readable(relay: Relay, http: aiohttp.ClientSession) -> None:
    await wait_windows(relay, 5)
    async with http.get(
        f"{relay.url}/v1/stream", params={"partition": "syn", "format": "ndjson", "max_bytes": 2000}
    ) as resp:
        assert resp.status == 200
        lines = [json.loads(line) for line in (await resp.text()).splitlines()]
    ops = {line["op"] for line in lines}
    assert "end_of_window" in ops and "schema_change" in ops
    rows = [line for line in lines if line["op"] in ("insert", "update")]
    assert rows and all(
        r["source"].startswith("synthetic.t") and r["after"]["id"] == r["key"]["id"] for r in rows
    )


async def test_sources_schemas_status_metrics(relay: Relay, http: aiohttp.ClientSession) -> None:
    await wait_windows(relay, 300)
    async with http.get(f"{relay.url}/v1/sources") as resp:
        parts = {p["partition"]: p for p in (await resp.json())["partitions"]}
    assert {s["name"] for s in parts["syn"]["sources"]} == {"synthetic.t0", "synthetic.t1"}
    assert parts["idle"]["sources"] == []
    async with http.get(f"{relay.url}/v1/schemas/synthetic.t0") as resp:
        schema = await resp.json()
    assert schema["partitions"][0]["versions"][0]["version"] == 1
    async with http.get(f"{relay.url}/v1/schemas/missing.table") as resp:
        assert resp.status == 404
    await read_all(http, relay, client="tester")
    params: dict[str, Any] = {
        "partition": "syn",
        "scn": -1,
        "max_bytes": 4096,
        "client": "slowpoke",
    }
    async with http.get(f"{relay.url}/v1/stream", params=params) as resp:
        first = len(await resp.read())
    # a filter that skips most of what its answer covers, up to the tail: caught up
    kept: dict[str, Any] = {
        "partition": "syn",
        "scn": -1,
        "max_bytes": 1 << 24,
        "client": "filtered",
    }
    async with http.get(f"{relay.url}/v1/stream", params={**kept, "filter": "mod:8:0"}) as resp:
        assert resp.status == 200
        await resp.read()
    async with http.get(f"{relay.url}/v1/status") as resp:
        status = {p["name"]: p for p in (await resp.json())["partitions"]}
    syn = status["syn"]
    assert syn["windows"] == 300 and syn["max_scn"] > syn["min_scn"] > 0
    assert syn["state"] in ("streaming", "finished")
    seen = {c["client"]: c for c in syn["consumers"]}
    # behind: what the buffer holds after the consumer's answer (it was the buffer's
    # size for every consumer: review)
    assert seen["tester"]["behind_bytes"] == 0
    assert seen["slowpoke"]["behind_bytes"] == syn["bytes_used"] - first > 0
    assert seen["filtered"]["behind_bytes"] == 0
    async with http.get(f"{relay.url}/metrics") as resp:
        text = await resp.text()
    assert 'changebus_relay_buffer_windows{partition="syn"} 300.0' in text
    assert "changebus_relay_http_requests_total" in text
    async with http.get(f"{relay.url}/readyz") as resp:
        assert resp.status == 200


async def test_restart_resumes_without_duplicates(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    cfg = relay_config(tmp_path, max_windows=100)
    async with Relay(cfg) as relay:
        await wait_windows(relay, 100)
        _, token = await read_all(http, relay)
    async with Relay(cfg) as relay:
        await wait_windows(relay, 200)
        more, _ = await _resume(http, relay, token)
        everything, _ = await read_all(http, relay)
    scns = [scn for scn, _, op in everything if op == Op.END_OF_WINDOW]
    assert scns == list(range(scns[0], scns[0] + 200))  # no gap, no duplicate across the restart
    assert [scn for scn, _, op in more if op == Op.END_OF_WINDOW] == scns[100:]


async def _resume(
    http: aiohttp.ClientSession, relay: Relay, token: str
) -> tuple[list[tuple[int, int, int]], str]:
    events: list[tuple[int, int, int]] = []
    while True:
        async with http.get(
            f"{relay.url}/v1/stream", params={"partition": "syn", "checkpoint": token}
        ) as resp:
            body = await resp.read()
            token = resp.headers["X-Changebus-Checkpoint"]
            if resp.status == 204:
                return events, token
            _, headers = parse_stream(body)
            events.extend((int(h["scn"]), int(h["seq"]), int(h["op"])) for h in headers)


async def test_follow_streams_backlog_then_ends(relay: Relay, http: aiohttp.ClientSession) -> None:
    await wait_windows(relay, 300)
    params: dict[str, Any] = {
        "partition": "syn",
        "scn": -1,
        "follow": 1,
        "wait": 0.3,
        "max_bytes": 3000,
    }
    t0 = time.monotonic()
    async with http.get(f"{relay.url}/v1/stream", params=params) as resp:
        assert resp.status == 200
        assert resp.headers["X-Changebus-Follow"] == "1"
        body = await resp.read()
    assert time.monotonic() - t0 >= 0.3  # held open until idle for `wait`
    _, headers = parse_stream(body)
    eows = [int(h["scn"]) for h in headers if h["op"] == Op.END_OF_WINDOW]
    assert len(eows) == 300
    assert eows == sorted(set(eows))


async def test_follow_pushes_live_windows(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with Relay(relay_config(tmp_path, windows_per_s=50, max_windows=0)) as relay:
        await wait_windows(relay, 1)
        start = relay.hosts["syn"].buffer.meta.last_scn
        params: dict[str, Any] = {
            "partition": "syn",
            "scn": start,
            "follow": 1,
            "wait": 5,
            "follow_bytes": 1_000_000,
        }
        got: list[int] = []
        buf = b""
        t0 = time.monotonic()
        async with http.get(f"{relay.url}/v1/stream", params=params) as resp:
            async for chunk in resp.content.iter_any():
                buf += chunk
                offsets = scan_offsets(buf)
                if len(offsets):
                    end = int(offsets[-1]) + int(headers_at(buf, offsets[-1:])["total_length"][0])
                    _, hdr = parse_stream(buf[:end])
                    got.extend(int(h["scn"]) for h in hdr if h["op"] == Op.END_OF_WINDOW)
                    buf = buf[end:]
                if len(got) >= 10:
                    break
        assert got == list(range(start + 1, start + 1 + len(got)))
        assert time.monotonic() - t0 < 3  # pushed as they commit (50/s), not at the end


async def test_follow_with_too_old_checkpoint_gets_410(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    async with Relay(relay_config(tmp_path, max_windows=50)) as relay:
        await wait_windows(relay, 50)
        params: dict[str, Any] = {"partition": "syn", "scn": 5, "follow": 1, "wait": 1}
        async with http.get(f"{relay.url}/v1/stream", params=params) as resp:
            assert resp.status == 410
            assert (await resp.json())["error"] == "scn_not_found"
        async with http.get(
            f"{relay.url}/v1/stream", params={**params, "format": "ndjson"}
        ) as resp:
            assert resp.status == 400


HUGE = "9" * 5000


@pytest.mark.parametrize(
    "params",
    [
        {"scn": HUGE},
        {"scn": "-" + HUGE},
        {"offset": HUGE},
        {"max_bytes": HUGE},
        {"wait": HUGE},
        {"wait": HUGE + ".5"},
        {"filter": f"mod:{HUGE}:1"},
        {"filter": f"mod:3:{HUGE}"},
        {"follow": "1", "follow_bytes": HUGE},
        {"checkpoint": '{"version": 1, "partitions": {"syn": {"window_scn": ' + HUGE + "}}}"},
    ],
)
async def test_huge_numbers_are_bad_requests_never_retried(
    relay: Relay, http: aiohttp.ClientSession, params: dict[str, str]
) -> None:
    async with http.get(f"{relay.url}/v1/stream", params={"partition": "syn", **params}) as resp:
        assert resp.status == 400
        body = await resp.json()
    assert body["retriable"] is False
    assert body["error"] in ("bad_request", "bad_checkpoint")
    assert len(body["message"]) < 300  # the number is not echoed back


def small_window(scn: int, payload_bytes: int) -> bytes:
    key = f"k{scn}".encode()
    return encode_event(
        Op.INSERT, scn, 0, scn, key, b"x" * payload_bytes, key_hash=key_hash(key), source_id=1
    ) + encode_control(EndOfWindow(1, ""), scn, 1, scn)


@pytest.mark.parametrize("fmt", ["binary", "ndjson"])
async def test_overrun_is_409_overwritten_on_every_copy_path(
    tmp_path: Path, http: aiohttp.ClientSession, no_blocking: BlockBuster, fmt: str
) -> None:
    """A response whose pinned bytes the writer overran is 409 ``overwritten`` (retriable).

    The overrun is made to happen at the one moment it can on these paths:
    between the selection (which pins the bytes) and the copy (which checks
    the pin) -- the test, acting as the partition's writer, appends past the
    whole ring right after the relay's own selection.
    """
    cfg = RelayConfig(
        data_dir=tmp_path / "relay",
        http=HttpConfig(port=0),
        partitions=(PartitionConfig("ring", 1, capacity_bytes=64 << 10, pin_timeout_s=0.001),),
        flush_interval_s=0,
    )
    # the test's writer waits (pin_timeout_s) for the pin on the loop thread: it
    # stands in for the relay's writer thread, the relay itself does not wait
    no_blocking.functions["threading.Lock.acquire"].can_block_in(
        "tests/relay/test_http.py", "overrunning_select"
    )
    async with Relay(cfg) as relay:
        buffer = relay.hosts["ring"].buffer
        for scn in range(1, 6):
            buffer.append_window(small_window(scn, 2000))
        real_select = buffer.select
        next_scn = [6]

        def overrunning_select(*args: Any, **kw: Any) -> Any:
            selection = real_select(*args, **kw)
            for _ in range(40):  # 80 KB through a 64 KiB ring: past the pin
                buffer.append_window(small_window(next_scn[0], 2000))
                next_scn[0] += 1
            return selection

        buffer.select = overrunning_select  # type: ignore[method-assign]
        overruns = buffer.stats["pins_overrun"]
        async with http.get(
            f"{relay.url}/v1/stream", params={"partition": "ring", "scn": -1, "format": fmt}
        ) as resp:
            assert resp.status == 409
            body = await resp.json()
        assert body["error"] == "overwritten" and body["retriable"] is True
        assert buffer.stats["pins_overrun"] == overruns + 1
        # nothing torn was cached: the same position now reads the windows written since
        buffer.select = real_select  # type: ignore[method-assign]
        async with http.get(
            f"{relay.url}/v1/stream", params={"partition": "ring", "scn": -1}
        ) as resp:
            assert resp.status == 200
            _, headers = parse_stream(await resp.read())
        assert int(headers["scn"][0]) > 5
