"""Relay clusters in tests: ``changebus relay`` processes with a ``[cluster]`` table.

:class:`RelayProc` is one relay subprocess (its log in a file), :class:`Cluster`
three of them on one Postgres slot (the ``cluster`` fixture of this directory's
conftest.py starts them); the rest are the checks the cluster tests share: who
leads, who holds what, whether relays hold the same bytes, a steady writer.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psycopg

from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.fetchers.postgres import message_scn
from changebus.schemas import HEADER_SIZE, Op, lsn_to_scn, parse_stream
from fix_mysql import master_scn
from fix_pg import wait_until

PART = "main"
ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        str(ROOT / d)
        for d in ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client", "discovery")
    ),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class RelayProc:
    """One ``changebus relay`` subprocess with a ``[cluster]`` table; its log in a file."""

    name: str
    port: int
    base: Path
    proc: subprocess.Popen[bytes] | None = None
    stopped: bool = field(default=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return (self.base / "relay.log").read_text(errors="replace")

    def get(self, path: str) -> tuple[int, dict[str, str], bytes]:
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=5) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()

    def status(self) -> dict[str, Any] | None:
        """The partition's /v1/status entry (None when the relay does not answer)."""
        if self.stopped or self.proc is None or self.proc.poll() is not None:
            return None
        try:
            code, _h, body = self.get("/v1/status")
        except OSError:
            return None
        if code != 200:
            return None
        part: dict[str, Any] = json.loads(body)["partitions"][0]
        return part


@dataclass
class Cluster:
    relays: list[RelayProc]
    dsn: str
    slot: str
    zk: str = ""
    name: str = ""

    def leader(self, *, above: int = 0) -> RelayProc | None:
        for r in self.relays:
            st = r.status()
            if (
                st
                and st.get("role") == "leader"
                and st["state"] == "streaming"
                and st.get("epoch", 0) > above
            ):
                return r
        return None

    def epoch(self, r: RelayProc) -> int:
        st = r.status()
        assert st is not None
        return int(st.get("epoch", 0))


def pg_source(dsn: str, slot: str) -> str:
    return (
        f'kind = "postgres"\n'
        f'options = {{ dsn = "{dsn}", slot = "{slot}", status_interval_s = 0.2 }}\n'
    )


def write_config(r: RelayProc, source: str, zk: str, cluster: str) -> Path:
    """``source``: the body of ``[partitions.fetcher]`` (kind and options)."""
    cfg = r.base / "relay.toml"
    r.base.mkdir(parents=True, exist_ok=True)
    cfg.write_text(
        f'data_dir = "{r.base / "data"}"\nflush_interval_s = 0\n'
        f"[http]\nport = {r.port}\nmax_wait_s = 10\n"
        f'[cluster]\nzookeeper = "{zk}"\nname = "{cluster}"\nmember_id = "{r.name}"\n'
        f"session_timeout_s = 2.0\n"
        f'[[partitions]]\nname = "{PART}"\nid = 1\ncapacity_bytes = "16MiB"\n'
        f"[partitions.fetcher]\nretry_initial_s = 0.1\nretry_max_s = 1.0\n{source}"
    )
    return cfg


def start(r: RelayProc) -> None:
    with (r.base / "relay.log").open("ab") as logfile:
        r.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "changebus.schemas",
                "relay",
                "--config",
                str(r.base / "relay.toml"),
            ],
            env=ENV,
            stdout=logfile,
            stderr=subprocess.STDOUT,
        )
    r.stopped = False


def stop_all(relays: list[RelayProc]) -> None:
    for r in relays:
        if r.proc is not None and r.proc.poll() is None:
            if r.stopped:
                os.kill(r.proc.pid, signal.SIGCONT)
            r.proc.kill()
        if r.proc is not None:
            r.proc.wait(10)


def walsenders(dsn: str) -> list[int]:
    """The replication connections to the test's database."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'walsender'"
            " AND datname = current_database()"
        ).fetchall()
    return [int(r[0]) for r in rows]


def slot_state(dsn: str, slot: str) -> tuple[int | None, int]:
    """(active_pid, confirmed_flush_lsn as an SCN) of the slot."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT active_pid, confirmed_flush_lsn::text FROM pg_replication_slots"
            " WHERE slot_name = %s",
            (slot,),
        ).fetchone()
    assert row is not None
    return row[0], lsn_to_scn(row[1])


def marker(dsn: str) -> int:
    """The SCN of a logical message written now (every relay must pass it)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_logical_emit_message(false, 'sync', 'x')::text").fetchone()
    assert row is not None
    return message_scn(row[0])


class Writer:
    """Commits one row per transaction (ids 0, 1, 2, ...) from a thread until stopped."""

    def __init__(self, dsn: str, rate: float = 150.0) -> None:
        self.dsn = dsn
        self.rate = rate
        self.committed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self._stop.is_set():
                i = self.committed
                with conn.transaction():
                    conn.execute("INSERT INTO t VALUES (%s, %s)", (i, i * 3))
                    if i % 7 == 0 and i > 0:
                        conn.execute("UPDATE t SET v = v + 1 WHERE id = %s", (i - 1,))
                self.committed = i + 1
                time.sleep(1 / self.rate)

    def __enter__(self) -> Writer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def stream_bytes(r: RelayProc, after: int) -> tuple[bytes, list[int]]:
    """Everything ``r`` holds after SCN ``after``: the raw bytes and the window SCNs."""
    body, scn = b"", after
    scns: list[int] = []
    while True:
        code, headers, chunk = r.get(f"/v1/stream?partition={PART}&scn={scn}&max_bytes=4000000")
        if code == 204:
            return body, scns
        assert code == 200, chunk
        body += chunk
        _, hdr = parse_stream(chunk)
        scns.extend(int(h["scn"]) for h in hdr if h["op"] == Op.END_OF_WINDOW)
        scn = int(headers["X-Changebus-Next-Scn"])


async def new_leader(c: Cluster, above: int, seconds: float = 20) -> RelayProc:
    """Wait for a streaming leader of an epoch above ``above``; returns it."""
    found: list[RelayProc] = []

    def look() -> bool:
        leader = c.leader(above=above)
        if leader is not None:
            found.append(leader)
        return leader is not None

    await wait_until(look, seconds, f"a leader above epoch {above}")
    return found[-1]


async def all_hold(relays: list[RelayProc], scn: int, seconds: float = 30) -> None:
    await wait_until(
        lambda: all((st := r.status()) is not None and st["max_scn"] >= scn for r in relays),
        seconds,
        f"every relay at SCN {scn}",
    )


async def settled(c: Cluster, seconds: float = 30) -> RelayProc:
    """Wait for one streaming leader and two streaming followers of its epoch."""
    await wait_until(lambda: c.leader() is not None, seconds, "a leader")
    leader = c.leader()
    assert leader is not None
    epoch = c.epoch(leader)

    def followers() -> bool:
        for r in c.relays:
            st = r.status()
            if r is not leader and not (
                st and st.get("role") == "follower" and st.get("epoch") == epoch
            ):
                return False
        return True

    await wait_until(followers, seconds, "two followers")
    return leader


def _common_start(relays: list[RelayProc]) -> int:
    """Where all relays' streams hold the same windows: -1 (everything) when their oldest
    windows agree, else after the newest of their first windows."""
    mins = []
    for r in relays:
        st = r.status()
        assert st is not None
        mins.append(st["min_scn"])
    return -1 if len(set(mins)) == 1 else max(mins)


def identical(relays: list[RelayProc]) -> int:
    """All relays serve the same bytes (from their common oldest window); the window count."""
    after = _common_start(relays)
    streams = [stream_bytes(r, after) for r in relays]
    for i, other in enumerate(streams[1:], 1):
        assert other[1] == streams[0][1]
        if other[0] != streams[0][0]:
            _, ha = parse_stream(streams[0][0])
            _, hb = parse_stream(other[0])
            diff = [(a, b) for a, b in zip(ha, hb, strict=False) if a != b][:3]
            raise AssertionError(f"{relays[0].name} != {relays[i].name}: {diff}")
    return len(streams[0][1])


def same_content(relays: list[RelayProc]) -> int:
    """All relays hold the same windows with the same data events (SCN, op, key, schema,
    payload), SCHEMA_CHANGE announcements aside; the window count.

    A new Postgres leader announces each table again in the first window touching it
    (a new stream session): a window the new leader re-read from the slot while a
    follower already had the deposed leader's copy differs by that announcement and
    the events' seq numbers (see docs/cluster.md).
    """
    after = _common_start(relays)
    contents = []
    for r in relays:
        body, scns = stream_bytes(r, after)
        offsets, headers = parse_stream(body)
        events = [
            (
                int(h["scn"]),
                int(h["op"]),
                int(h["key_hash"]),
                int(h["schema_id"]),
                body[int(o) + HEADER_SIZE : int(o) + int(h["total_length"])],
            )
            for o, h in zip(offsets, headers, strict=True)
            if int(h["op"]) != int(Op.SCHEMA_CHANGE)
        ]
        contents.append((scns, events))
    for r, other in zip(relays[1:], contents[1:], strict=True):
        assert other[0] == contents[0][0], f"{r.name} holds other windows"
        assert other[1] == contents[0][1], f"{r.name} holds other events"
    return len(contents[0][0])


def binlog_dumps(server: EmbeddedMariaDB) -> int:
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT count(*) FROM information_schema.PROCESSLIST WHERE COMMAND LIKE 'Binlog Dump%'"
            )
            (count,) = cur.fetchone()
    finally:
        conn.close()
    return int(count)


def my_rows(server: EmbeddedMariaDB, db: str, start: int, count: int) -> None:
    conn = server.connect(db)
    try:
        with conn.cursor() as cur:
            for i in range(start, start + count):
                cur.execute("INSERT INTO t VALUES (%s, %s)", (i, i * 3))
    finally:
        conn.close()


def binlog_scn(server: EmbeddedMariaDB) -> int:
    return int(master_scn(server))


def aiohttp_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession()


# ---- ZooKeeper restarted under load ---------------------------------------------------
