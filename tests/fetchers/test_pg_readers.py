"""The postgres fetcher's two stream readers behind one protocol, on a real server.

Both readers hand the stream loop the same pgoutput messages as
``(buffer, start, end)`` batches, and a status update sent through either
moves the slot. The libpq reader (which hands on a batch of what libpq
holds) loses nothing when the walsender is terminated mid-stream.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time
from pathlib import Path

import psycopg
import pytest
from test_pg_fetcher import replay_buffer, source, workload
from test_pg_socket_reader import config, make_table, walsender_pid

from changebus.fetchers.postgres._config import PostgresConfig
from changebus.fetchers.postgres._readers import CopyDataReader, start_reader
from changebus.relay import Relay
from changebus.schemas import lsn_to_scn
from fix_pg import caught_up, wait_until

pytestmark = pytest.mark.pg

_END = "readers-test-end"


def read_until_marker(
    dsn: str, slot: str, kind: str, *, confirm: bool = False
) -> tuple[list[bytes], int]:
    """The pgoutput messages of ``slot`` up to the end marker, read by reader ``kind``,
    and the LSN of the marker's XLogData (confirmed through the reader with ``confirm``)."""
    repl = psycopg.connect(dsn, autocommit=True, replication="database")
    try:
        cfg = PostgresConfig(dsn=dsn, slot=slot, stream_reader=kind)
        command = (
            f"START_REPLICATION SLOT {slot} LOGICAL 0/0 (proto_version '1', "
            "publication_names 'changebus', binary 'true', messages 'true')"
        )
        reader: CopyDataReader = start_reader(kind, repl, cfg, command)
        messages: list[bytes] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            batch = reader.read()
            if not batch:
                reader.wait(0.2)
                continue
            for buf, start, end in batch:
                assert buf[start] in (0x77, 0x6B)  # XLogData or keepalive, nothing else
                if buf[start] != 0x77:
                    continue
                message = bytes(buf[start + 25 : end] if end >= 0 else buf[start + 25 :])
                messages.append(message)
                if message[:1] == b"M" and _END.encode() in message:
                    lsn = struct.unpack_from(">Q", buf, start + 1)[0]
                    if confirm:
                        status = struct.pack(">cQQQQB", b"r", lsn, lsn, lsn, 0, 0)
                        reader.send_copy_data(status)
                        with psycopg.connect(dsn, autocommit=True) as conn:
                            wait_confirmed(conn, slot, lsn)
                    return messages, lsn
        raise AssertionError(f"{kind}: no end marker within 60 s")
    finally:
        repl.close()


def wait_confirmed(conn: psycopg.Connection[tuple[str]], slot: str, lsn: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        row = conn.execute(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        ).fetchone()
        if row is not None and lsn_to_scn(row[0]) >= lsn:
            return
        time.sleep(0.05)
    raise AssertionError(f"slot {slot} was not confirmed up to {lsn}")


def test_both_readers_hand_on_the_same_messages(pg_dsn: str) -> None:
    make_table(pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE PUBLICATION changebus FOR ALL TABLES")
        for slot in ("by_libpq", "by_socket"):
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    workload(pg_dsn, 21, 80)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO acct SELECT g, g, repeat('x', 3000) FROM generate_series(5000, 5400) g"
        )
        conn.execute("SELECT pg_logical_emit_message(true, %s, '')", (_END,))
    by_libpq, lsn = read_until_marker(pg_dsn, "by_libpq", "libpq", confirm=True)
    by_socket, lsn_socket = read_until_marker(pg_dsn, "by_socket", "socket", confirm=True)
    assert len(by_libpq) > 500  # every row of the big transaction, one message each
    assert by_socket == by_libpq
    assert lsn_socket == lsn


async def test_libpq_reader_loses_nothing_when_the_walsender_is_terminated(
    tmp_path: Path, pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    make_table(pg_dsn)
    caplog.set_level(logging.WARNING, logger="changebus")
    async with Relay(config(tmp_path, pg_dsn, stream_reader="libpq")) as relay:
        host = relay.hosts["pg"]
        await wait_until(lambda: host.state == "streaming")
        await asyncio.to_thread(workload, pg_dsn, 22, 20)
        await caught_up(relay, pg_dsn)
        await wait_until(lambda: walsender_pid(pg_dsn) is not None)
        pid = walsender_pid(pg_dsn)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            assert conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)
        await wait_until(lambda: host.stats["fetcher_restarts"] >= 1)
        await wait_until(lambda: host.state == "streaming")
        await asyncio.to_thread(workload, pg_dsn, 23, 20)
        await caught_up(relay, pg_dsn)
        rows, scns = replay_buffer(relay)
        status = host.status()["fetcher"]
    assert rows == source(pg_dsn)
    assert scns == sorted(set(scns))
    assert status["stream_reader"] == "libpq"
    errors = [r.getMessage() for r in caplog.records if "fetcher error, retrying" in r.getMessage()]
    assert errors, "the terminated stream was not reported"


@pytest.mark.parametrize("kind", ["libpq", "socket"])
def test_readers_wait_on_descriptors_past_1023(pg_dsn: str, kind: str) -> None:
    """A relay serving many consumers has descriptors past ``select``'s 1023."""
    make_table(pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE PUBLICATION changebus FOR ALL TABLES")
        conn.execute("SELECT pg_create_logical_replication_slot('high_fd', 'pgoutput')")
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        assert max(held) > 1023
        workload(pg_dsn, 24, 5)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_logical_emit_message(true, %s, '')", (_END,))
        messages, _ = read_until_marker(pg_dsn, "high_fd", kind, confirm=True)
    finally:
        for fd in held:
            os.close(fd)
    assert len(messages) > 5
