"""Durable acknowledgement (issue 19) through a simulated OS crash on a real Postgres:
kill -9 the relay, then zero every ring byte the source was not told is durable (from
the first event whose SCN is above the slot's ``confirmed_flush_lsn``). With ``fsync`` a
consumer ends with every row and sees no DATA_LOSS; with ``page_cache`` destroying
windows the source *did* confirm yields a DATA_LOSS event, never a silent gap.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from test_recovery_damage import ENV, _free_port, _get, get_json, zero_ring

from changebus.fetchers.postgres import message_scn
from changebus.relay._meta import MetaFile
from changebus.relay._tables import EVENT_DTYPE, CircularTable
from changebus.schemas import (
    DataLoss,
    Op,
    decode_control,
    event_at,
    lsn_to_scn,
    parse_stream,
    verify_event,
)

# ---- a simulated OS crash on a real Postgres -----------------------------------


def _start(cfg: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "changebus.schemas", "relay", "--config", str(cfg)],
            env=ENV,
            stdout=out,
            stderr=out,
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        with contextlib.suppress(OSError):
            if _get(port, "/readyz")[0] == 200:
                return proc
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("relay did not become ready")


class Follower(threading.Thread):
    """A consumer following the relay over HTTP from ``scn``; keeps every event it is sent.

    It survives the relay going away (it retries) and records the
    ``(scn, op, key)`` of each event and the DATA_LOSS windows.
    """

    def __init__(self, port: int, scn: int = -1) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.scn = scn
        self.events: list[tuple[int, int, bytes]] = []
        self.losses: list[DataLoss] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                status, headers, body = _get(
                    self.port, f"/v1/stream?partition=pg&scn={self.scn}&max_bytes=4000000&wait=1"
                )
            except OSError:
                time.sleep(0.1)
                continue
            if status == 204:
                continue
            assert status == 200, body
            offsets, _ = parse_stream(body)
            for off in offsets.tolist():
                h = verify_event(body, off)
                key, payload = event_at(body, off, h)
                self.events.append((h.scn, h.op, bytes(key)))
                if h.op == Op.DATA_LOSS:
                    loss = decode_control(Op.DATA_LOSS, bytes(payload))
                    assert isinstance(loss, DataLoss)
                    self.losses.append(loss)
            self.scn = int(headers["X-Changebus-Next-Scn"])

    def stop(self) -> None:
        self.stopping.set()
        self.join(10)

    def inserted(self) -> list[bytes]:
        return [key for _, op, key in self.events if op == Op.INSERT]


class Writer(threading.Thread):
    """Inserts rows, one per transaction, until stopped."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.stopping = threading.Event()
        self.rows = 0

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stopping.is_set():
                self.rows += 1
                conn.execute("INSERT INTO t VALUES (%s, %s)", (self.rows, "x" * 200))

    def stop(self) -> None:
        self.stopping.set()
        self.join(10)


def _config(tmp: Path, dsn: str, port: int, durability: str) -> Path:
    cfg = tmp / "relay.toml"
    cfg.write_text(
        f'data_dir = "{tmp / "data"}"\nflush_interval_s = 3600\n[http]\nport = {port}\n'
        f'[[partitions]]\nname = "pg"\nid = 1\ncapacity_bytes = "16MiB"\n'
        f'durability = "{durability}"\n'
        '[partitions.fetcher]\nkind = "postgres"\n'
        f'options = {{ dsn = "{dsn}", status_interval_s = 0.2 }}\n'
    )
    return cfg


def _confirmed(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT confirmed_flush_lsn::text, active FROM pg_replication_slots"
            " WHERE database = current_database()"
        ).fetchone()
    assert row is not None
    return lsn_to_scn(row[0])


def _freeze_with_unconfirmed_windows(
    relay: subprocess.Popen[bytes], directory: Path, dsn: str
) -> None:
    """SIGSTOP the relay at a moment its buffer holds windows the source has not confirmed.

    A fast relay may have synced and confirmed everything a moment after the
    writer's last commit; then an OS crash would destroy nothing and the test
    would test nothing. So: stop it, let Postgres take any status update
    already on the wire, and compare the buffer's published last SCN
    (``meta.dat``, a shared mapping) with the slot's confirmed position; if
    nothing is pending, let it run a few milliseconds and look again.
    """
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        relay.send_signal(signal.SIGSTOP)
        time.sleep(0.02)
        meta = MetaFile(directory / "meta.dat").load()
        if meta is not None and meta.last_scn > _confirmed(dsn):
            return  # stays stopped: the caller's SIGKILL ends it
        relay.send_signal(signal.SIGCONT)
        time.sleep(0.003)
    raise AssertionError("the relay never held a window the source had not confirmed")


def _slot_released(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT active FROM pg_replication_slots WHERE database = current_database()"
        ).fetchone()
    return row is not None and not row[0]


def _source_rows(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM t").fetchone()
    assert row is not None
    return int(row[0])


def _marker(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_logical_emit_message(false, 'sync', 'x')::text").fetchone()
    assert row is not None
    return message_scn(row[0])


def _crash(tmp: Path, dsn: str, durability: str) -> tuple[Follower, Follower, dict[str, Any]]:
    """Run, kill -9 under load, destroy what the OS crash would lose, restart, catch up.

    Returns the follower that read before and after the crash, one that
    starts from the beginning after it, and what was destroyed.
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id bigint PRIMARY KEY, v text)")
    port = _free_port()
    cfg = _config(tmp, dsn, port, durability)
    log = tmp / "relay.log"
    relay = _start(cfg, port, log)
    live = Follower(port)
    writer = Writer(dsn)
    try:
        live.start()
        writer.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (writer.rows < 1500 or len(live.inserted()) < 1000):
            time.sleep(0.05)
        rows = writer.rows
        while writer.rows == rows and time.monotonic() < deadline + 30:
            time.sleep(0.005)  # the writer committed just now (not stalled by a loaded machine)
        if durability == "fsync":
            _freeze_with_unconfirmed_windows(relay, tmp / "data" / "pg", dsn)
        relay.send_signal(signal.SIGKILL)  # under load
        relay.wait(10)
        writer.stop()
    finally:
        if relay.poll() is None:
            relay.kill()
            relay.wait(10)
    # what the source was told is durable
    deadline = time.monotonic() + 30
    while not _slot_released(dsn) and time.monotonic() < deadline:
        time.sleep(0.1)
    confirmed = _confirmed(dsn)
    directory = tmp / "data" / "pg"
    meta = MetaFile(directory / "meta.dat").load()
    assert meta is not None
    table = CircularTable(directory / "events.dat", EVENT_DTYPE, meta.event_slots, create=False)
    records = table.get(meta.head_event, meta.tail_event).copy()
    table.close()
    scns = records["scn"].astype("int64")
    assert scns[0] <= confirmed, "the source confirmed nothing the buffer holds"
    if durability == "fsync":
        # the OS crash loses everything the source was not told is durable
        first = int((scns > confirmed).argmax()) if (scns > confirmed).any() else len(scns)
    else:
        # page cache: even windows the source did confirm are lost (the last 20 it confirmed)
        ends = [i for i in range(len(scns)) if records["op"][i] == Op.END_OF_WINDOW]
        confirmed_ends = [i for i in ends if scns[i] <= confirmed]
        assert len(confirmed_ends) > 30
        first = confirmed_ends[-21] + 1
    destroyed = records[first:]
    if len(destroyed):
        zero_ring(directory / "ring.dat", 16 << 20, int(destroyed["pos"][0]), meta.tail_pos)
    lost = {
        "events": len(destroyed),
        "inserts": int((destroyed["op"] == Op.INSERT).sum()),
        "first_scn": int(destroyed["scn"][0]) if len(destroyed) else -1,
        "last_scn": meta.last_scn,
        "confirmed": confirmed,
    }
    relay = _start(cfg, port, log)
    fresh = Follower(port)
    try:
        fresh.start()
        target = _marker(dsn)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (live.scn < target or fresh.scn < target):
            assert live.is_alive() and fresh.is_alive()
            time.sleep(0.1)
        lost["status"] = get_json(port, "/v1/status")["partitions"][0]
    finally:
        live.stop()
        fresh.stop()
        relay.send_signal(signal.SIGTERM)
        relay.wait(30)
    assert live.scn >= target and fresh.scn >= target, log.read_text()[-3000:]
    return live, fresh, lost


@pytest.mark.pg
def test_fsync_survives_an_os_crash_without_losing_acknowledged_rows(
    tmp_path: Path, pg_dsn: str
) -> None:
    live, fresh, lost = _crash(tmp_path, pg_dsn, "fsync")
    rows = _source_rows(pg_dsn)
    # the crash destroyed windows (those the source had not confirmed) ...
    assert lost["events"] > 0, lost
    # ... and the source sent them again: every row, once, no DATA_LOSS
    for follower in (live, fresh):
        keys = follower.inserted()
        assert len(keys) == rows, (len(keys), rows, lost)
        assert len(set(keys)) == rows
        assert follower.losses == []
    assert lost["status"]["durability"]["mode"] == "fsync"
    assert lost["status"]["stats"]["recovery_events_dropped"] == lost["events"]


@pytest.mark.pg
def test_page_cache_os_crash_is_a_data_loss_event_never_a_silent_gap(
    tmp_path: Path, pg_dsn: str
) -> None:
    live, fresh, lost = _crash(tmp_path, pg_dsn, "page_cache")
    rows = _source_rows(pg_dsn)
    assert lost["inserts"] > 0, lost
    # a consumer reading after the crash is told: one DATA_LOSS window covering the
    # destroyed windows, and every other row is there
    assert len(fresh.losses) == 1, fresh.losses
    loss = fresh.losses[0]
    assert loss.from_scn <= lost["first_scn"]
    assert loss.to_scn >= lost["last_scn"]
    keys = fresh.inserted()
    assert len(set(keys)) == len(keys) == rows - lost["inserts"]
    # the consumer that had read them before the crash missed nothing, or was told
    assert len(set(live.inserted())) == rows or live.losses
