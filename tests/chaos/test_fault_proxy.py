"""The chaos harness's TCP fault proxy against real servers on loopback (an aiohttp app and a
raw asyncio echo server): every mode does what it says, and pass-through is fast."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import psycopg
import pytest
from aiohttp import web

from _chaos_proxy import FaultProxy
from fix_pg import PgServer
from waiting import wait_until

BIG = os.urandom(1 << 20)


@dataclass
class Echo:
    """A raw TCP echo server; ``open`` counts its live connections."""

    port: int = 0
    open: int = 0
    server: asyncio.Server | None = None
    writers: list[asyncio.StreamWriter] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        self.writers.append(writer)
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            self.open -= 1
            writer.close()


@pytest.fixture
async def echo() -> AsyncIterator[Echo]:
    e = Echo()
    e.server = await asyncio.start_server(e.handle, "127.0.0.1", 0)
    e.port = e.server.sockets[0].getsockname()[1]
    yield e
    e.server.close()
    for w in e.writers:
        w.close()
    await e.server.wait_closed()


@pytest.fixture
async def http_port() -> AsyncIterator[int]:
    async def big(request: web.Request) -> web.Response:
        size = int(request.query.get("size", len(BIG)))
        return web.Response(body=BIG[:size])

    async def echo_body(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    app = web.Application()
    app.router.add_get("/big", big)
    app.router.add_post("/echo", echo_body)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    assert site._server is not None
    port: int = site._server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    yield port
    await runner.cleanup()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def proxy_to(port: int) -> FaultProxy:
    p = FaultProxy("test", "127.0.0.1", port)
    await p.start()
    return p


@pytest.fixture
async def proxies() -> AsyncIterator[list[FaultProxy]]:
    made: list[FaultProxy] = []
    yield made
    for p in made:
        await p.close()


async def connect(p: FaultProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(*p.address())


async def roundtrip(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes, wait_s: float = 5
) -> bytes:
    writer.write(data)
    await writer.drain()
    return await asyncio.wait_for(reader.readexactly(len(data)), wait_s)


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


async def test_pass_through_http_and_counters(
    http_port: int, session: aiohttp.ClientSession, proxies: list[FaultProxy]
) -> None:
    p = await proxy_to(http_port)
    proxies.append(p)
    host, port = p.address()
    assert host == "127.0.0.1" and port == p.port != http_port
    async with session.get(f"http://{host}:{port}/big") as r:
        assert await r.read() == BIG
    async with session.post(f"http://{host}:{port}/echo", data=b"hello" * 1000) as r:
        assert await r.read() == b"hello" * 1000
    assert p.stats["connections"] >= 1
    assert p.stats["bytes_down"] > len(BIG) + 5000
    assert p.stats["bytes_up"] > 5000
    assert p.stats["resets"] == p.stats["stuck"] == p.stats["truncated"] == 0


async def test_pass_through_is_fast(
    http_port: int, session: aiohttp.ClientSession, proxies: list[FaultProxy]
) -> None:
    # client, server and proxy share this one loop (and a busy 2-core machine): ~150 MB/s
    # when quiet; a relay's stream needs tens of MB/s
    p = await proxy_to(http_port)
    proxies.append(p)
    total = 0
    t0 = time.monotonic()
    for _ in range(32):
        async with session.get(f"http://127.0.0.1:{p.port}/big") as r:
            total += len(await r.read())
    rate = total / (time.monotonic() - t0)
    assert total == 32 * len(BIG)
    assert rate > 10e6, f"{rate / 1e6:.1f} MB/s through the proxy"


async def test_drop_resets_open_connections_and_new_ones_pass(
    echo: Echo, proxies: list[FaultProxy]
) -> None:
    p = await proxy_to(echo.port)
    proxies.append(p)
    reader, writer = await connect(p)
    assert await roundtrip(reader, writer, b"ping") == b"ping"
    p.drop()
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(10), 5)
    await close(writer)
    assert p.stats["resets"] == 1
    await wait_until(lambda: echo.open == 0, 5, "the target side reset too")
    reader, writer = await connect(p)
    assert await roundtrip(reader, writer, b"again") == b"again"
    await close(writer)


async def test_refuse_resets_new_and_open_connections_until_healed(
    echo: Echo, http_port: int, session: aiohttp.ClientSession, proxies: list[FaultProxy]
) -> None:
    p = await proxy_to(echo.port)
    proxies.append(p)
    reader, writer = await connect(p)
    assert await roundtrip(reader, writer, b"ping") == b"ping"
    p.refuse()
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(10), 5)
    await close(writer)
    reader, writer = await connect(p)  # the handshake completes, then the RST
    writer.write(b"x")
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(10), 5)
    await close(writer)
    assert p.stats["resets"] >= 2
    hp = await proxy_to(http_port)
    proxies.append(hp)
    hp.refuse()
    with pytest.raises(aiohttp.ClientConnectionError):
        async with session.get(f"http://127.0.0.1:{hp.port}/big?size=10") as r:
            await r.read()
    hp.heal()
    async with session.get(f"http://127.0.0.1:{hp.port}/big?size=10") as r:
        assert await r.read() == BIG[:10]


async def test_delay_holds_each_direction_keeps_order_and_not_throughput(
    echo: Echo, proxies: list[FaultProxy]
) -> None:
    p = await proxy_to(echo.port)
    proxies.append(p)
    reader, writer = await connect(p)
    assert await roundtrip(reader, writer, b"warm") == b"warm"
    p.delay(0.3)
    t0 = time.monotonic()
    assert await roundtrip(reader, writer, b"slow") == b"slow"
    rtt = time.monotonic() - t0
    assert 0.6 <= rtt < 3.0, rtt  # held 0.3 s on the way up and 0.3 s on the way down
    # order kept across many small chunks sent while earlier ones are still held
    parts = [f"<{i}>".encode() for i in range(50)]
    for part in parts:
        writer.write(part)
        await writer.drain()
        await asyncio.sleep(0.005)
    expected = b"".join(parts)
    assert await asyncio.wait_for(reader.readexactly(len(expected)), 10) == expected
    # a pipeline: 8 MiB go through in far less than 8 MiB / (256 KiB per 0.3 s)
    blob = os.urandom(8 << 20)
    t0 = time.monotonic()
    writer.write(blob)
    got = await asyncio.wait_for(reader.readexactly(len(blob)), 30)
    assert got == blob
    assert time.monotonic() - t0 < 6.0
    p.heal()
    t0 = time.monotonic()
    assert await roundtrip(reader, writer, b"fast") == b"fast"
    assert time.monotonic() - t0 < 0.3
    await close(writer)


async def test_throttle_limits_the_rate_both_ways(
    echo: Echo, http_port: int, session: aiohttp.ClientSession, proxies: list[FaultProxy]
) -> None:
    rate = 256 * 1024
    hp = await proxy_to(http_port)
    proxies.append(hp)
    hp.throttle(rate)
    size = 640 * 1024
    t0 = time.monotonic()
    async with session.get(f"http://127.0.0.1:{hp.port}/big?size={size}") as r:
        assert await r.read() == BIG[:size]
    measured = size / (time.monotonic() - t0)
    assert 0.6 * rate < measured < 1.25 * rate, measured
    # upward: the echo server answers as it receives, so the way up bounds the time too
    p = await proxy_to(echo.port)
    proxies.append(p)
    p.throttle(rate)
    reader, writer = await connect(p)
    t0 = time.monotonic()
    blob = BIG[: 512 * 1024]
    writer.write(blob)
    assert await asyncio.wait_for(reader.readexactly(len(blob)), 10) == blob
    elapsed = time.monotonic() - t0
    assert 1.5 < elapsed < 4.0, elapsed
    p.heal()
    t0 = time.monotonic()
    writer.write(blob)
    assert await asyncio.wait_for(reader.readexactly(len(blob)), 10) == blob
    assert time.monotonic() - t0 < 1.0
    await close(writer)


async def test_half_open_never_answers_and_stays_stuck_after_heal(
    echo: Echo, http_port: int, session: aiohttp.ClientSession, proxies: list[FaultProxy]
) -> None:
    p = await proxy_to(echo.port)
    proxies.append(p)
    reader, writer = await connect(p)
    assert await roundtrip(reader, writer, b"ping") == b"ping"
    p.half_open()
    with pytest.raises(TimeoutError):
        await roundtrip(reader, writer, b"lost", wait_s=0.5)
    assert echo.open == 1  # the target's socket stays open too
    p.heal()
    with pytest.raises(TimeoutError):
        await roundtrip(reader, writer, b"still", wait_s=0.5)
    # new connections pass after heal
    r2, w2 = await connect(p)
    assert await roundtrip(r2, w2, b"new") == b"new"
    await close(w2)
    assert p.stats["stuck"] == 1
    # the client gives up: the proxy closes the target side too
    await close(writer)
    await wait_until(lambda: echo.open == 0, 5, "the stuck target side closed")
    # an HTTP request through a half-open proxy times out on the client side
    hp = await proxy_to(http_port)
    proxies.append(hp)
    hp.half_open()
    with pytest.raises(TimeoutError):
        async with session.get(
            f"http://127.0.0.1:{hp.port}/big?size=10", timeout=aiohttp.ClientTimeout(total=1)
        ) as r:
            await r.read()
    assert hp.stats["stuck"] >= 1
    assert hp.stats["bytes_down"] == 0


async def test_truncate_cuts_the_server_stream(
    echo: Echo, http_port: int, session: aiohttp.ClientSession, proxies: list[FaultProxy]
) -> None:
    hp = await proxy_to(http_port)
    proxies.append(hp)
    hp.truncate(5000)
    with pytest.raises(aiohttp.ClientPayloadError):
        async with session.get(f"http://127.0.0.1:{hp.port}/big") as r:
            await r.read()
    assert hp.stats["truncated"] >= 1
    assert hp.stats["bytes_down"] <= 5000 * hp.stats["connections"]
    hp.heal()
    async with session.get(f"http://127.0.0.1:{hp.port}/big") as r:
        assert await r.read() == BIG
    # an open stream: exactly the budget arrives, then EOF
    p = await proxy_to(echo.port)
    proxies.append(p)
    reader, writer = await connect(p)
    assert await roundtrip(reader, writer, b"0123456789") == b"0123456789"
    p.truncate(25)
    writer.write(b"a" * 100)
    got = await asyncio.wait_for(reader.read(), 5)
    assert got == b"a" * 25
    await close(writer)
    await wait_until(lambda: echo.open == 0, 5, "the target side closed")


async def test_close_stops_listening_and_closes_connections(
    echo: Echo, proxies: list[FaultProxy]
) -> None:
    p = await proxy_to(echo.port)
    reader, writer = await connect(p)
    assert await roundtrip(reader, writer, b"ping") == b"ping"
    await p.close()
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(10), 5)
    await close(writer)
    with pytest.raises(OSError):
        await connect(p)
    await p.close()  # idempotent


async def test_unreachable_target_resets_the_client(proxies: list[FaultProxy]) -> None:
    p = FaultProxy("dead", "127.0.0.1", 1)  # nothing listens on port 1
    await p.start()
    proxies.append(p)
    reader, writer = await connect(p)
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(10), 5)
    await close(writer)


@pytest.mark.pg
async def test_a_postgres_session_through_the_proxy(
    pg_server: PgServer, proxies: list[FaultProxy]
) -> None:
    p = await proxy_to(pg_server.port)
    proxies.append(p)
    dsn = f"host=127.0.0.1 port={p.port} user=postgres dbname=postgres connect_timeout=5"
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute("SELECT 41 + 1")
        assert await cur.fetchone() == (42,)
        p.drop()
        with pytest.raises(psycopg.OperationalError):
            await conn.execute("SELECT 1")
    p.refuse()
    with pytest.raises(psycopg.OperationalError):
        await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    p.half_open()
    with pytest.raises(psycopg.OperationalError):  # connect_timeout=1 gives up
        await psycopg.AsyncConnection.connect(dsn.replace("=5", "=1"), autocommit=True)
    p.heal()
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute("SELECT repeat('x', 100000)")
        row = await cur.fetchone()
        assert row is not None and len(row[0]) == 100000
    assert p.stats["resets"] >= 2 and p.stats["stuck"] >= 1
