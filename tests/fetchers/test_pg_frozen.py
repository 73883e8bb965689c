"""A Postgres that stops answering: the fetcher cuts the connection and reconnects.

The relay reads Postgres through the chaos harness's TCP fault proxy
(``bench/_chaos_proxy.py``). ``half_open`` leaves every connection open and
forwards nothing, as a frozen server (SIGSTOP, a stalled disk) or a broken
network path would: TCP keepalives see nothing wrong and libpq has no query
timeout. Before ``io_timeout_s`` existed the stream thread waited for ever
(in a heartbeat query or on the silent stream) and the partition never came
back; now the silence is noticed within ``io_timeout_s``, the fetcher
reconnects once the path heals, and every transaction arrives once. Found
by the chaos harness (``bench/chaos.py``): a half-open path from the leading
relay to Postgres stalled the ``pg`` partition for good.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

import psycopg
import pytest
from test_pg_fetcher import replay_buffer, source, workload
from test_pg_fetcher_ops import config

from _chaos_proxy import FaultProxy
from changebus.fetchers.postgres import message_scn
from changebus.relay import Relay
from fix_pg import PgServer
from waiting import wait_until

pytestmark = pytest.mark.pg


def _marker(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_logical_emit_message(false, 'sync', 'x')::text").fetchone()
    assert row is not None
    return message_scn(row[0])


async def _caught_up(relay: Relay, dsn: str) -> None:
    target = await asyncio.to_thread(_marker, dsn)
    await wait_until(lambda: relay.hosts["pg"].buffer.meta.last_scn >= target, seconds=30)


@pytest.mark.parametrize("idle", [False, True], ids=["busy", "idle"])
async def test_a_server_that_stops_answering_is_cut_off_and_read_again(
    tmp_path: Path, pg_server: PgServer, pg_dsn: str, idle: bool
) -> None:
    """``idle``: no writes during the freeze (only keepalive requests can notice it)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE acct (id int8 PRIMARY KEY, bal int8, name text)")
    proxy = FaultProxy("pg", "127.0.0.1", pg_server.port)
    await proxy.start()
    dbname = pg_dsn.rsplit("dbname=", 1)[1].split()[0]
    via_proxy = f"host=127.0.0.1 port={proxy.port} user=postgres dbname={dbname}"
    try:
        async with Relay(config(tmp_path, via_proxy, io_timeout_s=2.0)) as relay:
            host = relay.hosts["pg"]
            # the slot exists once the fetcher streams: changes before it are not in the stream
            await wait_until(lambda: host.state == "streaming")
            await asyncio.to_thread(workload, pg_dsn, 1, 40)
            await _caught_up(relay, pg_dsn)
            restarts = host.stats["fetcher_restarts"]

            proxy.half_open()
            frozen = time.monotonic()
            writer = (
                None if idle else asyncio.create_task(asyncio.to_thread(workload, pg_dsn, 2, 40))
            )
            await wait_until(lambda: host.stats["fetcher_restarts"] > restarts, seconds=15)
            noticed = time.monotonic() - frozen
            assert "did not answer" in host.last_error
            assert noticed < 2.0 + 4.0  # io_timeout_s plus a status interval and retries' slack

            proxy.heal()  # new connections pass; the stuck ones stay stuck
            if writer is not None:
                await writer
            await asyncio.to_thread(workload, pg_dsn, 3, 20)
            await _caught_up(relay, pg_dsn)
            assert host.state == "streaming"
            rows, scns = replay_buffer(relay)
    finally:
        await proxy.close()
    assert scns == sorted(set(scns)), "a window was appended twice"
    assert rows == await asyncio.to_thread(source, pg_dsn)


async def test_a_query_the_server_never_answers_is_cut_at_its_deadline(
    pg_server: PgServer,
) -> None:
    """The watchdog behind every catalog query: a query on a frozen path fails, retriably."""
    from changebus.fetchers.postgres._watchdog import Watchdog
    from changebus.schemas import SourceError

    proxy = FaultProxy("pg", "127.0.0.1", pg_server.port)
    await proxy.start()
    dog = Watchdog(1.0, "test")
    loop = asyncio.get_running_loop()

    def frozen_query() -> tuple[str, float]:
        conn = psycopg.connect(
            f"host=127.0.0.1 port={proxy.port} user=postgres dbname=postgres", autocommit=True
        )
        with dog.guard(conn) as guarded:
            assert guarded.execute("SELECT 1").fetchone() == (1,)
            loop.call_soon_threadsafe(proxy.half_open)  # the proxy lives on the loop
            time.sleep(0.2)
            started = time.monotonic()
            try:
                guarded.execute("SELECT 2")
            except SourceError as exc:
                return exc.message, time.monotonic() - started
            return "answered", 0.0

    try:
        message, took = await asyncio.wait_for(asyncio.to_thread(frozen_query), 20)
    finally:
        dog.close()
        await proxy.close()
    assert "did not answer a query within 1 s" in message
    assert 0.9 <= took < 3.0


async def test_a_long_query_the_server_works_on_is_not_cut_unless_it_freezes(
    pg_server: PgServer,
) -> None:
    """A query with a probe (the SQL mode's peek) lasts as long as the server works on it.

    Cut at the deadline, a peek decoding a big transaction was run again and
    cut again, for ever. With the probe, the watchdog asks the server (on a
    connection of its own) whether the backend is still active, and cuts only
    when the answer does not come: a path frozen mid-query is still cut.
    """
    from changebus.fetchers.postgres._watchdog import Watchdog
    from changebus.schemas import SourceError

    proxy = FaultProxy("pg", "127.0.0.1", pg_server.port)
    await proxy.start()
    dog = Watchdog(0.5, "test")
    loop = asyncio.get_running_loop()
    dsn = f"host=127.0.0.1 port={proxy.port} user=postgres dbname=postgres"

    def long_queries() -> tuple[float, str, float]:
        conn = psycopg.connect(dsn, autocommit=True)
        pid = conn.info.backend_pid

        def active() -> bool:
            with psycopg.connect(dsn, autocommit=True, connect_timeout=2) as probe:
                row = probe.execute(
                    "SELECT state FROM pg_stat_activity WHERE pid = %s", (pid,)
                ).fetchone()
            return row is not None and row[0] == "active"

        with dog.guard(conn) as guarded:
            started = time.monotonic()
            assert guarded.execute("SELECT pg_sleep(2), 1", probe=active).fetchone() == ("", 1)
            slow = time.monotonic() - started
            loop.call_soon_threadsafe(lambda: loop.call_later(1.0, proxy.half_open))
            started = time.monotonic()
            try:
                guarded.execute("SELECT pg_sleep(30)", probe=active)
            except SourceError as exc:
                return slow, exc.message, time.monotonic() - started
            return slow, "answered", 0.0

    try:
        slow, message, took = await asyncio.wait_for(asyncio.to_thread(long_queries), 40)
    finally:
        dog.close()
        await proxy.close()
    assert slow >= 2.0 and dog.extended >= 3  # four deadlines passed, the server was at work
    assert "did not answer a query" in message
    assert 1.0 < took < 6.0  # frozen after 1 s; the probe's answer waited one timeout


async def test_a_streamed_query_is_cut_only_while_it_waits_for_the_server(
    pg_server: PgServer,
) -> None:
    """``Guarded.stream`` (the SQL mode's peek): time the caller spends holding a
    row is not the server's (a relay applying back-pressure must not get the
    peek cut), but a path that freezes mid-stream is still cut at the deadline."""
    from changebus.fetchers.postgres._watchdog import Watchdog
    from changebus.schemas import SourceError

    proxy = FaultProxy("pg", "127.0.0.1", pg_server.port)
    await proxy.start()
    dog = Watchdog(0.5, "test")
    loop = asyncio.get_running_loop()
    dsn = f"host=127.0.0.1 port={proxy.port} user=postgres dbname=postgres"
    query = "SELECT g, repeat('x', 1000) FROM generate_series(1, %s) g"

    def slow_reader() -> tuple[int, str, int, float]:
        conn = psycopg.connect(dsn, autocommit=True)
        with dog.guard(conn) as guarded:
            seen = 0
            for row in guarded.stream(query, (300,), size=100):
                seen += 1
                if row[0] in (1, 150):
                    time.sleep(1.2)  # more than two deadlines, holding a row
            loop.call_soon_threadsafe(lambda: loop.call_later(0.5, proxy.half_open))
            got, started = 0, 0.0
            try:
                for _ in guarded.stream(query, (500_000,), size=100):
                    got += 1
                    started = time.monotonic()
            except SourceError as exc:
                return seen, exc.message, got, time.monotonic() - started
            return seen, "answered", got, 0.0

    try:
        seen, message, got, took = await asyncio.wait_for(asyncio.to_thread(slow_reader), 40)
    finally:
        dog.close()
        await proxy.close()
    assert seen == 300 and dog.fired.startswith("Postgres did not answer a query")
    assert "did not answer a query within 0.5 s" in message
    assert 0 < got < 500_000
    assert 0.4 < took < 2.0  # from the last row received to the cut


def test_io_timeout_is_checked() -> None:
    from changebus.fetchers.postgres import PostgresConfig
    from changebus.schemas import ConfigError
    from changebus.schemas.config import load_config_dict

    assert load_config_dict(PostgresConfig, {"dsn": "x"}, "f").io_timeout_s == 15.0
    with pytest.raises(ConfigError, match="io_timeout_s"):
        load_config_dict(PostgresConfig, {"dsn": "x", "io_timeout_s": -1}, "f")


def test_a_probe_answer_extends_only_the_call_it_was_asked_about() -> None:
    """The call ended while its probe ran: "still active" must not arm it again.

    Re-armed, the deadline of a call no longer running passed while the
    connection sat idle (or ran its next call), and the watchdog cut a
    healthy connection.
    """
    from changebus.fetchers.postgres._watchdog import Watchdog

    ours, theirs = socket.socketpair()
    dog = Watchdog(0.3, "test")
    asked = threading.Event()
    ended = threading.Event()

    def probe() -> bool:
        asked.set()
        ended.wait(5)  # the call ends while the probe runs
        return True

    try:
        dog.arm(1, ours.fileno(), "a query", probe=probe)
        assert asked.wait(5)
        dog.disarm(1)  # the call returned
        ended.set()
        time.sleep(1.5)  # several deadlines: nothing of that call may fire now
        assert dog.fired == "" and dog.extended == 1
        theirs.sendall(b"x")
        assert ours.recv(1) == b"x"  # the socket was not shut down
    finally:
        dog.close()
        ours.close()
        theirs.close()


def test_a_probe_saying_no_after_its_call_ended_cuts_nothing() -> None:
    """The call returned while its probe ran; the probe then found the backend idle
    (the call is over): the watchdog must not cut the connection for it."""
    from changebus.fetchers.postgres._watchdog import Watchdog

    ours, theirs = socket.socketpair()
    dog = Watchdog(0.3, "test")
    asked = threading.Event()
    ended = threading.Event()

    def probe() -> bool:
        asked.set()
        ended.wait(5)
        return False  # "idle": the call is over

    try:
        dog.arm(1, ours.fileno(), "a query", probe=probe)
        assert asked.wait(5)
        dog.disarm(1)
        ended.set()
        time.sleep(1.0)
        assert dog.fired == ""
        theirs.sendall(b"x")
        assert ours.recv(1) == b"x"
    finally:
        dog.close()
        ours.close()
        theirs.close()


def test_a_cut_never_reaches_a_socket_that_took_the_descriptor_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The watchdog decided to cut a call, let its lock go, then shut down the call's
    descriptor by number: if the call had ended meanwhile and its connection closed,
    the number could belong to another socket by then (the relay's HTTP sockets share
    the process), which it shut down instead (review). It takes a duplicate while the
    call still runs, under its lock."""
    from changebus.fetchers.postgres import _watchdog
    from changebus.fetchers.postgres._watchdog import Watchdog

    ours, theirs = socket.socketpair()
    number = ours.fileno()
    pairs: list[tuple[socket.socket, socket.socket]] = []

    def between(*_args: object) -> None:  # after the decision to cut, before the cut
        ours.close()  # the call ended, its connection closed ...
        pairs.append(socket.socketpair())  # ... and another socket got its number

    monkeypatch.setattr(_watchdog.log, "warning", between)
    dog = Watchdog(0.2, "test")
    try:
        dog.arm(1, number, "a query")
        deadline = time.monotonic() + 5
        while not dog.fired and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)
        assert dog.fired and pairs
        a, b = pairs[0]
        assert number in (a.fileno(), b.fileno())
        a.sendall(b"x")
        b.sendall(b"y")
        assert b.recv(1) == b"x" and a.recv(1) == b"y"  # both ends still work
    finally:
        dog.close()
        theirs.close()
        for a, b in pairs:
            a.close()
            b.close()


def test_received_within_reads_the_sockets_last_data() -> None:
    """A backend writing its answer (ClientWrite) makes progress while bytes arrive."""
    from changebus.fetchers.postgres._watchdog import received_within

    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    try:
        peer.sendall(b"x")
        assert client.recv(1) == b"x"
        assert received_within(client.fileno(), 1.0)
        time.sleep(1.2)
        assert not received_within(client.fileno(), 1.0)  # silent for longer than that
        unix, other = socket.socketpair()
        assert received_within(unix.fileno(), 1.0)  # not TCP: no path to die
        unix.close()
        other.close()
    finally:
        for s in (peer, client, server):
            s.close()


def _bulk_insert(dsn: str, rows: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO bulk SELECT g, repeat('x', 40) FROM generate_series(1, %s) g", (rows,)
        )


@pytest.mark.parametrize("mode", ["stream", "sql"])
async def test_a_big_transaction_outside_the_publication_is_waited_for(
    tmp_path: Path, pg_dsn: str, mode: str
) -> None:
    """The walsender replays a big transaction of a table outside the publication
    without a word, and answers no keepalive request meanwhile. The fetcher took that
    for a frozen server, cut the connection after ``io_timeout_s``, and the next
    stream replayed the same transaction again: cut again, for ever (review). It asks
    the catalog connection first now: a walsender that is busy is waited for. The SQL
    mode's peek was waited for already; its slot advance, which decodes the same
    transaction again, was cut the same way."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE acct (id int8 PRIMARY KEY, bal int8, name text)")
        conn.execute("CREATE TABLE bulk (id int8 PRIMARY KEY, v text)")
    # (stream: a timeout well under the replay of the big transaction, which takes about
    # a second on a fast machine: the quiet spell must outlast it for the check to run)
    quick = {"io_timeout_s": 0.4, "status_interval_s": 0.1} if mode == "stream" else {}
    cfg = config(
        tmp_path, pg_dsn, **{"io_timeout_s": 1.0, **quick}, tables=["public.acct"], mode=mode
    )
    async with Relay(cfg) as relay:
        host = relay.hosts["pg"]
        await wait_until(lambda: host.state == "streaming")
        await asyncio.to_thread(workload, pg_dsn, 1, 10)
        await _caught_up(relay, pg_dsn)
        restarts = host.stats["fetcher_restarts"]
        await asyncio.to_thread(_bulk_insert, pg_dsn, 2_000_000)
        await asyncio.to_thread(workload, pg_dsn, 2, 10)
        await _caught_up(relay, pg_dsn)
        fetcher = host.status()["fetcher"]
        assert host.stats["fetcher_restarts"] == restarts, host.last_error
        if mode == "stream":
            assert fetcher["quiet_decoding"] >= 1  # (it was quiet longer than io_timeout_s)
        rows, scns = replay_buffer(relay)
    assert scns == sorted(set(scns))
    assert rows == await asyncio.to_thread(source, pg_dsn)
