"""The bootstrap server under the server frame's connection limits (issue 17, item 8)."""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path

import pytest
from test_store import window

from changebus.bootstrap import BootstrapConfig, BootstrapServer, HttpConfig, StoreConfig
from changebus.schemas import Op
from changebus.schemas._server_stats import CONNECTION_STATS
from waiting import wait_until

pytestmark = pytest.mark.usefixtures("no_blocking")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_the_bootstrap_server_applies_its_http_limits(tmp_path: Path) -> None:
    cfg = BootstrapConfig(
        relays=(f"http://127.0.0.1:{closed_port()}",),
        partitions=("p",),
        data_dir=tmp_path / "boot",
        store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
        http=HttpConfig(port=0, max_connections=2, header_timeout_s=0.5),
    )
    async with BootstrapServer(cfg) as boot:
        stats = boot.server.app[CONNECTION_STATS]
        held = [await asyncio.open_connection("127.0.0.1", boot.port) for _ in range(2)]
        await wait_until(lambda: stats.open == 2, 5, "two connections open")
        reader, writer = await asyncio.open_connection("127.0.0.1", boot.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: boot\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)
        assert answer.startswith(b"HTTP/1.1 503 ") and b'"overloaded"' in answer
        # the two silent connections are closed by the header timeout
        for r, _ in held:
            assert await asyncio.wait_for(r.read(), 5) == b""
        await wait_until(lambda: stats.open == 0, 5, "the silent connections closed")
        assert stats.header_timeouts == 2
        for _, w in [*held, (reader, writer)]:
            w.close()


async def test_pages_for_clients_that_do_not_read_stay_within_the_copy_budget(
    tmp_path: Path,
) -> None:
    """Pages are built whole and live until their client has taken them. Clients asking
    for 16 MiB pages and reading nothing each held one (1,024 connections: 16 GiB; found
    by review). Pages now come out of the server's copy budget (http.max_copy_bytes):
    with the budget busy they get smaller, nobody waits, and the bytes held stay within
    the budget (plus one window per request)."""
    from changebus.bootstrap._pagesend import BUDGET

    cfg = BootstrapConfig(
        relays=(f"http://127.0.0.1:{closed_port()}",),
        partitions=("p",),
        data_dir=tmp_path / "boot",
        store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
        http=HttpConfig(port=0, max_connections=16, max_copy_bytes=1 << 20),
    )
    async with BootstrapServer(cfg) as boot:
        # 8 MB of log: windows of one 50 KB row each
        data = b"".join(
            window(100 + i, [("public.t1", Op.INSERT, i, "x" * 50_000)]) for i in range(160)
        )
        await boot.service.stores.write(lambda s: s.append("p", data, start_scn=99))
        budget = boot.server.app[BUDGET]
        path = "/v1/bootstrap/catchup?partition=p&after=99&target=259&max_bytes=16777216"
        socks = []
        for _ in range(8):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", boot.port))
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: boot\r\n\r\n".encode())
            socks.append(sock)
        try:
            sizes = []
            for sock in socks:
                sock.settimeout(10)
                head = await asyncio.to_thread(sock.recv, 4096)
                assert head.startswith(b"HTTP/1.1 200 "), head[:200]
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                sizes.append(length)
            # each page within the budget (plus its one window over it), never the 8 MB
            # asked for; at no time more than the budget held (plus a window a request)
            assert all(50_000 <= n <= (1 << 20) + 51_000 for n in sizes), sizes
            assert budget.peak <= (1 << 20) + 8 * 51_000, budget.peak
            assert budget.cut >= 1
        finally:
            for sock in socks:
                sock.close()
        await wait_until(lambda: budget.holders == 0, 30, "the grants given back")
        assert budget.held == 0


async def test_a_client_reading_a_page_a_trickle_at_a_time_is_cut_off(tmp_path: Path) -> None:
    """A client reading a few hundred bytes a second looked alive to the frame's write
    watchdog, so it kept its page and its share of the budget for hours (review). A page
    goes out in pieces that must each leave within http.write_timeout_s."""
    from changebus.bootstrap._pagesend import BUDGET

    cfg = BootstrapConfig(
        relays=(f"http://127.0.0.1:{closed_port()}",),
        partitions=("p",),
        data_dir=tmp_path / "boot",
        store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
        http=HttpConfig(port=0, write_timeout_s=2.0),
    )
    async with BootstrapServer(cfg) as boot:
        data = b"".join(
            window(100 + i, [("public.t1", Op.INSERT, i, "x" * 50_000)]) for i in range(320)
        )
        await boot.service.stores.write(lambda s: s.append("p", data, start_scn=99))
        budget = boot.server.app[BUDGET]
        path = "/v1/bootstrap/catchup?partition=p&after=99&target=419&max_bytes=16777216"
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", boot.port))
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: boot\r\n\r\n".encode())

        stop = threading.Event()

        def trickle() -> int:
            """Read 2,000 bytes every 0.1 s (the watchdog sees progress) until told to
            stop or the server closes."""
            import time

            sock.settimeout(1)
            got = 0
            while not stop.is_set():
                try:
                    chunk = sock.recv(2000)
                except (TimeoutError, OSError):
                    break
                if not chunk:
                    break
                got += len(chunk)
                time.sleep(0.1)
            return got

        reading = asyncio.create_task(asyncio.to_thread(trickle))
        try:
            await wait_until(lambda: budget.holders == 1, 10, "the page under way")
            # the page (16 MB) would take this client 15 minutes: it is cut off after
            # a piece did not leave within write_timeout_s, and its grant is given back
            # (the kernel may go on sending what it had queued: the client cannot tell)
            await wait_until(lambda: budget.holders == 0, 20, "the grant given back")
            assert not reading.done()  # (while the client still reads)
        finally:
            stop.set()
            got = await reading
            sock.close()
        assert got < 15_000_000
