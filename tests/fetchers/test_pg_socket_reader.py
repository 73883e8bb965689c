"""The postgres fetcher's socket reader (``stream_reader = "socket"``) on a real server.

Messages split across reads, keepalives answered, the server's ErrorResponse
(a terminated walsender) as a retriable error and a reconnect, and the same
relay buffer bytes as the libpq reader for the same changes.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import psycopg
import pytest
from test_pg_fetcher import replay_buffer, source, workload

from changebus.fetchers import create_fetcher
from changebus.fetchers.postgres._wire import CopyBothSocket, ServerError
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import ConfigError, lsn_to_scn
from fix_pg import caught_up, wait_until

pytestmark = pytest.mark.pg


def config(tmp: Path, dsn: str, name: str = "relay", **options: Any) -> RelayConfig:
    return RelayConfig(
        data_dir=tmp / name,
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "pg",
                1,
                capacity_bytes=16 << 20,
                fetcher=FetcherConfig(
                    "postgres",
                    {"dsn": dsn, "status_interval_s": 0.2, "heartbeat_interval_s": 0, **options},
                ),
            ),
        ),
        flush_interval_s=0,
    )


def make_table(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE acct (id int8 PRIMARY KEY, bal int8, name text)")


def big_rows(dsn: str, first: int, count: int, size: int) -> None:
    """Rows whose messages are far larger than one read (and than one TCP segment)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO acct SELECT g, g, repeat(md5(g::text), %s) "
            "FROM generate_series(%s::int8, %s::int8) AS g",
            (size // 32, first, first + count - 1),
        )


def buffer_bytes(relay: Relay) -> bytes:
    buf = relay.hosts["pg"].buffer
    sel = buf.select(-1, -1, 1 << 30)
    assert sel is not None
    data = b"".join(bytes(v) for v in sel.views)
    assert buf.release(sel)
    return data


def walsender_pid(dsn: str, slot: str = "changebus") -> int | None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
    return row[0] if row else None


async def test_messages_split_across_tiny_reads(tmp_path: Path, pg_dsn: str) -> None:
    make_table(pg_dsn)
    # 7 bytes per read: every message's header is cut, large rows take several reads
    async with Relay(
        config(tmp_path, pg_dsn, stream_reader="socket", socket_read_bytes=7)
    ) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        await asyncio.to_thread(workload, pg_dsn, 11, 40)
        await asyncio.to_thread(big_rows, pg_dsn, 1000, 20, 200_000)
        await caught_up(relay, pg_dsn)
        rows, scns = replay_buffer(relay)
        status = relay.hosts["pg"].status()
        restarts = relay.hosts["pg"].stats["fetcher_restarts"]
    assert rows == source(pg_dsn)
    assert len([r for r in rows if r >= 1000]) == 20
    assert scns == sorted(set(scns))
    assert status["fetcher"]["stream_reader"] == "socket"
    assert restarts == 0


async def test_auto_reads_the_socket_of_a_plain_connection(tmp_path: Path, pg_dsn: str) -> None:
    make_table(pg_dsn)
    async with Relay(config(tmp_path, pg_dsn)) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        await asyncio.to_thread(workload, pg_dsn, 12, 10)
        await caught_up(relay, pg_dsn)
        rows, _ = replay_buffer(relay)
        status = relay.hosts["pg"].status()
    assert rows == source(pg_dsn)
    assert status["fetcher"]["stream_reader"] == "socket"


async def test_keepalives_asking_for_a_reply_are_answered(tmp_path: Path, pg_dsn: str) -> None:
    make_table(pg_dsn)
    # the walsender asks for a reply after 0.5 s and gives up after 1 s of silence; the
    # fetcher's own status interval (30 s) would be far too late: only replies keep it alive
    dsn = pg_dsn + " options='-c wal_sender_timeout=1000'"
    cfg = config(
        tmp_path, dsn, stream_reader="socket", status_interval_s=30.0, slot_stats_interval_s=0
    )
    async with Relay(cfg) as relay:
        host = relay.hosts["pg"]
        await wait_until(lambda: host.state == "streaming")
        await wait_until(lambda: walsender_pid(pg_dsn) is not None)
        pid = walsender_pid(pg_dsn)
        await asyncio.sleep(4.0)
        keepalives = host.status()["fetcher"]["keepalives"]
        assert walsender_pid(pg_dsn) == pid  # the same walsender: never timed out
        assert host.stats["fetcher_restarts"] == 0
        await asyncio.to_thread(workload, pg_dsn, 13, 10)
        await caught_up(relay, pg_dsn)
        rows, _ = replay_buffer(relay)
    assert keepalives >= 4
    assert rows == source(pg_dsn)


async def test_terminated_walsender_is_a_retriable_error_then_reconnects(
    tmp_path: Path, pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    make_table(pg_dsn)
    caplog.set_level(logging.WARNING, logger="changebus")
    async with Relay(config(tmp_path, pg_dsn, stream_reader="socket")) as relay:
        host = relay.hosts["pg"]
        await wait_until(lambda: host.state == "streaming")
        await asyncio.to_thread(workload, pg_dsn, 14, 20)
        await caught_up(relay, pg_dsn)
        await wait_until(lambda: walsender_pid(pg_dsn) is not None)
        pid = walsender_pid(pg_dsn)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            assert conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)
        await wait_until(lambda: host.stats["fetcher_restarts"] >= 1)
        await wait_until(lambda: host.state == "streaming")
        await asyncio.to_thread(workload, pg_dsn, 15, 20)
        await caught_up(relay, pg_dsn)
        rows, scns = replay_buffer(relay)
        new_pid = walsender_pid(pg_dsn)
    assert rows == source(pg_dsn)
    assert scns == sorted(set(scns))
    assert new_pid is not None and new_pid != pid
    errors = [r.getMessage() for r in caplog.records if "fetcher error, retrying" in r.getMessage()]
    assert errors, "the terminated stream was not reported"
    assert "terminating connection due to administrator command" in errors[0]
    assert "replication stream ended: FATAL" in errors[0]


async def test_both_readers_fill_identical_buffers(tmp_path: Path, pg_dsn: str) -> None:
    make_table(pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE PUBLICATION changebus FOR ALL TABLES")
        for slot in ("via_libpq", "via_socket", "via_socket_tiny"):
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    await asyncio.to_thread(workload, pg_dsn, 16, 60)
    await asyncio.to_thread(big_rows, pg_dsn, 1000, 30, 50_000)
    await asyncio.to_thread(workload, pg_dsn, 17, 60)
    # one end marker for all three, transactional: its window carries the commit's time (a
    # non-transactional message's carries the time it was received)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        marker = conn.execute("SELECT pg_logical_emit_message(true, 'end', 'x')::text").fetchone()
    assert marker is not None
    target = lsn_to_scn(marker[0])
    runs: dict[str, dict[str, Any]] = {
        "via_libpq": {"stream_reader": "libpq"},
        "via_socket": {"stream_reader": "socket"},
        "via_socket_tiny": {"stream_reader": "socket", "socket_read_bytes": 13},
    }
    contents: dict[str, bytes] = {}
    for slot, options in runs.items():
        cfg = config(tmp_path, pg_dsn, name=slot, slot=slot, **options)
        async with Relay(cfg) as relay:
            buf = relay.hosts["pg"].buffer
            await wait_until(lambda: buf.meta.last_scn >= target)  # noqa: B023 - awaited here
            contents[slot] = buffer_bytes(relay)
            rows, _ = replay_buffer(relay)
            assert (
                relay.hosts["pg"].status()["fetcher"]["stream_reader"] == options["stream_reader"]
            )
        assert rows == source(pg_dsn)
    assert len(contents["via_libpq"]) > 1_500_000
    assert contents["via_socket"] == contents["via_libpq"]
    assert contents["via_socket_tiny"] == contents["via_libpq"]


def test_start_replication_error_response_is_parsed(pg_dsn: str) -> None:
    conn = psycopg.connect(pg_dsn, autocommit=True, replication="database")
    try:
        wire = CopyBothSocket(conn.pgconn.socket)
        with pytest.raises(ServerError) as caught:
            wire.start("START_REPLICATION SLOT no_such_slot LOGICAL 0/0")
    finally:
        conn.close()
    assert caught.value.sqlstate == "42704"  # undefined_object
    assert caught.value.message == 'replication slot "no_such_slot" does not exist'
    assert caught.value.text.startswith("ERROR:  replication slot")


def test_stream_reader_option_is_checked() -> None:
    with pytest.raises(ConfigError, match="stream_reader"):
        create_fetcher("postgres", "pg", 1, {"dsn": "x", "stream_reader": "fast"})
    with pytest.raises(ConfigError, match="socket_read_bytes"):
        create_fetcher("postgres", "pg", 1, {"dsn": "x", "socket_read_bytes": 0})
    fetcher = create_fetcher("postgres", "pg", 1, {"dsn": "x"})
    assert fetcher.config.stream_reader == "auto"  # type: ignore[attr-defined]


def test_a_message_longer_than_many_reads_is_joined_once() -> None:
    """A CopyData message of 6 MiB arriving in 64 KiB pieces (with a small one after it):
    its pieces are collected and joined once it is whole (each read used to append to
    everything read so far: 21 s for a 256 MiB value), and both come out intact."""
    import socket
    import struct
    import threading
    import time

    big = bytes(range(256)) * (6 * 4096)
    small = b"after"
    wire = b"".join(b"d" + struct.pack(">i", len(p) + 4) + p for p in (big, small))
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    reader = CopyBothSocket(ours.fileno(), recv_bytes=64 << 10)

    def send() -> None:
        # one piece at a time, the next once the reader has read this one: a busy machine
        # could otherwise let the socket fill up between two reads (fewer, bigger pieces)
        theirs.settimeout(10)
        deadline = time.monotonic() + 30
        try:
            for at in range(0, len(wire), 64 << 10):
                piece = wire[at : at + (64 << 10)]
                theirs.sendall(piece)
                while reader.bytes_read < at + len(piece) and time.monotonic() < deadline:
                    time.sleep(0.0002)
        except OSError:
            pass  # (the test failed and closed its end)

    sender = threading.Thread(target=send)
    sender.start()
    got: list[bytes] = []
    collected = 0
    try:
        while len(got) < 2:
            spans = reader.read()
            if not spans:
                collected = max(collected, len(reader._pieces))
                assert reader._buf == b"" or not reader._pieces  # (never both: no re-copy)
                reader.wait(5.0)
            got += [bytes(chunk[a:b]) for chunk, a, b in spans]
    finally:
        ours.close()
        sender.join()
        theirs.close()
    assert got == [big, small]
    assert collected > 50  # (it did arrive in pieces: 97 of 64 KiB)
