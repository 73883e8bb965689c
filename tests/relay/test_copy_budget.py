"""The relay-wide copy budget (``http.max_copy_bytes``): slow followers cannot grow the relay.

A follow push is a copy the relay holds until its client takes it; a
thousand lagging followers once held 1.5-1.8 GiB (bench/relay_fanout.py).
Here many followers that read nothing ask for large pushes: the bytes held
stay within the budget, their pushes are cut to what it allows, and a
healthy follower still reads everything meanwhile (nobody waits for budget).
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings, strategies as st
from test_hardening import _raw_request, fill, ring_config
from test_metrics import scrape, value  # type: ignore[import-not-found]

from changebus.relay import HttpConfig, Relay
from changebus.relay._broadcast import PUSH_BYTES
from changebus.schemas import ConfigError
from changebus.schemas.server import MIN_FLOOR, CopyBudget

pytestmark = pytest.mark.usefixtures("no_blocking")


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 40),
    st.integers(0, 1 << 22),
    st.lists(st.tuples(st.booleans(), st.integers(1, 1 << 21), st.integers(0, 1 << 21))),
)
def test_every_request_finds_its_floor_and_the_sum_stays_in_the_limit(
    slots: int, extra: int, steps: list[tuple[bool, int, int]]
) -> None:
    budget = CopyBudget(slots * MIN_FLOOR + extra, slots)
    held: list[int] = []
    for take, want, used in steps:
        if take and len(held) < slots:
            got = budget.grant(want)
            assert min(want, budget.floor) <= got <= want
            held.append(budget.resize(got, min(got, used)))  # a copy is at most its grant
        elif held:
            budget.release(held.pop(0))
        assert budget.held == sum(held) <= budget.reserved <= budget.limit
        assert budget.limit - budget.reserved >= budget.floor * (slots - len(held))
    for charged in held:
        budget.release(charged)
    assert budget.held == budget.reserved == budget.holders == 0


def test_a_budget_too_small_for_the_connections_is_refused() -> None:
    with pytest.raises(ConfigError, match="max_copy_bytes"):
        HttpConfig(max_copy_bytes=1 << 20, max_connections=1024)
    assert HttpConfig(max_copy_bytes=4 << 20, max_connections=1024).max_copy_bytes == 4 << 20


def _metric(text: str, name: str) -> float:
    found: float | None = value(text, name)
    assert found is not None, f"no {name} in /metrics"
    return found


async def test_stalled_followers_stay_within_the_budget_and_others_go_on(tmp_path: Path) -> None:
    limit = 2 << 20
    cfg = ring_config(
        tmp_path, 48 << 20, max_copy_bytes=limit, max_connections=32, send_timeout_s=4
    )
    stalled: list[socket.socket] = []
    async with Relay(cfg) as relay, aiohttp.ClientSession() as http:
        await fill(relay, 1, 24 << 20)
        m = relay.hosts["ring"].buffer.meta
        total = m.tail_pos - m.head_pos  # nothing evicted: everything from the start
        path = "/v1/stream?partition=ring&scn=-1&follow=1&max_bytes=4194304&wait=30"
        try:
            for _ in range(20):  # 20 x 4 MiB pushes asked for; none of them read
                stalled.append(await asyncio.to_thread(_raw_request, relay.port, path))
            await asyncio.sleep(1.0)
            text = await scrape(relay.url)
            held = _metric(text, "changebus_relay_copy_bytes")
            # they share the broadcast's pushes (at most PUSH_BYTES): each holds what its
            # transport could not send, charged while its task waits for the drain
            assert 0 < held <= min(limit, 20 * PUSH_BYTES)
            # a follower that reads gets every byte while the others stall
            got = 0
            t0 = time.monotonic()
            params: dict[str, Any] = {"partition": "ring", "scn": -1, "follow": 1, "wait": 0.3}
            params["max_bytes"] = 4 << 20
            async with http.get(f"{relay.url}/v1/stream", params=params) as resp:
                assert resp.status == 200
                async for chunk in resp.content.iter_any():
                    got += len(chunk)
            assert got == total, (got, total)
            assert time.monotonic() - t0 < 20
            text = await scrape(relay.url)
            assert _metric(text, "changebus_relay_copy_peak_bytes") <= limit
        finally:
            for sock in stalled:
                sock.close()
        # the stalled followers are cut off (or gone): their grants come back
        deadline = time.monotonic() + 15
        while True:
            held = _metric(await scrape(relay.url), "changebus_relay_copy_bytes")
            if held == 0:
                break
            assert time.monotonic() < deadline, f"{held} bytes of copies still held"
            await asyncio.sleep(0.2)


# ---- ndjson: JSON many times the binary events --------------------------------------

#: 60 smallint columns with 60-character names: ~200 B of binary events per row, ~5 KB of JSON
_WIDE = [f"c{i:02d}_" + "x" * 56 for i in range(60)]


@pytest.mark.pg
async def test_an_ndjson_answer_many_times_its_events_stays_within_the_budget(
    tmp_path: Path, pg_dsn: str
) -> None:
    """A wide table's JSON is ~25x its binary events: the answer goes out in pieces."""
    import json

    import psycopg

    from changebus.relay import FetcherConfig, PartitionConfig, RelayConfig
    from fix_pg import caught_up, wait_until

    rows = 3000
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        cols = ", ".join(f"{c} int2 NOT NULL" for c in _WIDE)
        conn.execute(f"CREATE TABLE wide (id int4 PRIMARY KEY, {cols})")
    limit = 1 << 20
    cfg = RelayConfig(
        data_dir=tmp_path / "relay",
        http=HttpConfig(port=0, max_copy_bytes=limit, max_connections=8),
        partitions=(PartitionConfig("pg", 1, fetcher=FetcherConfig("postgres", {"dsn": pg_dsn})),),
    )
    async with Relay(cfg) as relay, aiohttp.ClientSession() as http:
        host = relay.hosts["pg"]
        await wait_until(lambda: host.state == "streaming")

        def write() -> None:
            with psycopg.connect(pg_dsn) as conn, conn.cursor() as cur:
                marks = ", ".join(["%s"] * (len(_WIDE) + 1))
                cur.executemany(
                    f"INSERT INTO wide VALUES ({marks})",
                    [(i, *((i + c) % 30000 for c in range(len(_WIDE)))) for i in range(rows)],
                )

        await asyncio.to_thread(write)
        await caught_up(relay, pg_dsn)
        params: dict[str, Any] = {"partition": "pg", "scn": -1, "format": "ndjson"}
        params["max_bytes"] = 4 << 20
        async with http.get(f"{relay.url}/v1/stream", params=params) as resp:
            assert resp.status == 200
            body = await resp.read()
            events = int(resp.headers["X-Changebus-Events"])
        text = await scrape(relay.url)
    # held at once: the binary selection and one piece, never the whole JSON
    assert _metric(text, "changebus_relay_copy_peak_bytes") <= limit
    lines = [json.loads(x) for x in body.decode().splitlines()]
    inserts = [x for x in lines if x["op"] == "insert"]
    assert len(lines) == events and len(inserts) > 500  # a large selection, every event sent
    assert len(body) > 3 * limit  # the JSON is far larger than the whole budget
    for x in inserts:  # the values of every row, as written
        i = x["after"]["id"]
        assert [x["after"][c] for c in _WIDE] == [(i + c) % 30000 for c in range(len(_WIDE))]


async def test_ndjson_long_polls_woken_together_share_the_budget(tmp_path: Path) -> None:
    """ndjson long-polls sized their answers by the budget before they waited: woken by
    one big commit, each copied that much, and together they held several times the
    budget (review). Each is sized when it selects now, seeing the grants before it."""
    from test_hardening import big_window

    limit = 1 << 20
    cfg = ring_config(tmp_path, 16 << 20, max_copy_bytes=limit, max_connections=4)
    async with Relay(cfg) as relay:
        buffer = relay.hosts["ring"].buffer
        await asyncio.to_thread(buffer.append_window, big_window(1))
        path = "/v1/stream?partition=ring&scn=1&wait=10&format=ndjson&max_bytes=4194304"
        socks = [_raw_request(relay.port, path) for _ in range(3)]
        try:
            await asyncio.sleep(0.3)  # (all three wait)
            group = [big_window(scn) for scn in range(2, 40)]  # 2.4 MB in one commit
            await asyncio.to_thread(buffer.append_windows, group)
            events = []
            for sock in socks:
                head = await asyncio.to_thread(_head, sock)
                assert head.startswith(b"HTTP/1.1 200"), head[:100]
                line = [
                    x for x in head.split(b"\r\n") if x.lower().startswith(b"x-changebus-events")
                ]
                events.append(int(line[0].split(b":")[1]))
        finally:
            for sock in socks:
                sock.close()
    # each event is ~16 KB: what the three selected together stays near the budget
    # (at most one event over it each), not three times what one could have alone
    assert sum(events) * 16_000 <= limit + 3 * 16_100, events
    assert min(events) >= 1


def _head(sock: socket.socket) -> bytes:
    """The response head (status and headers) of a raw request, not its body."""
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\r\n\r\n", 1)[0]
