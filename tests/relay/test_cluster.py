"""Relay clusters: three ``changebus relay`` processes on one Postgres partition, on a real
ZooKeeper (session timeout 2 s).

One leader reads the slot (exactly one replication connection), the others chain
from it; all serve the same bytes. kill -9 of the leader under a writer: a follower
takes over with a higher epoch and a consumer given the three URLs ends with the
source's rows, every transaction once, SCNs increasing. SIGSTOP of the leader past
its session: a new leader takes the slot over, and the old one, woken, steps down,
never touches the slot again and appends nothing of its own.
"""

from __future__ import annotations

import asyncio
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
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from changebus.client import ChangeOp, Consumer, ConsumerConfig
from changebus.schemas import Op, lsn_to_scn, parse_stream
from fix_pg import wait_until

pytestmark = pytest.mark.pg

PART = "pg"
ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        str(ROOT / d)
        for d in ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client", "discovery")
    ),
}


def _free_port() -> int:
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


def write_config(r: RelayProc, dsn: str, slot: str, zk: str, cluster: str) -> Path:
    cfg = r.base / "relay.toml"
    r.base.mkdir(parents=True, exist_ok=True)
    cfg.write_text(
        f'data_dir = "{r.base / "data"}"\nflush_interval_s = 0\n'
        f"[http]\nport = {r.port}\nmax_wait_s = 10\n"
        f'[cluster]\nzookeeper = "{zk}"\nname = "{cluster}"\nmember_id = "{r.name}"\n'
        f"session_timeout_s = 2.0\n"
        f'[[partitions]]\nname = "{PART}"\nid = 1\ncapacity_bytes = "16MiB"\n'
        f'[partitions.fetcher]\nkind = "postgres"\nretry_initial_s = 0.1\nretry_max_s = 1.0\n'
        f'options = {{ dsn = "{dsn}", slot = "{slot}", status_interval_s = 0.2 }}\n'
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


@pytest.fixture
def cluster(tmp_path: Path, pg_dsn: str, zk_hosts: str, zk_cluster: str) -> Iterator[Cluster]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL)")
    slot = f"cb_{uuid.uuid4().hex[:10]}"
    relays = [RelayProc(f"r{i}", _free_port(), tmp_path / f"r{i}") for i in range(3)]
    for r in relays:
        write_config(r, pg_dsn, slot, zk_hosts, zk_cluster)
    for r in relays:
        start(r)
    c = Cluster(relays, pg_dsn, slot)
    try:
        yield c
    finally:
        for r in relays:
            if r.proc is not None and r.proc.poll() is None:
                if r.stopped:
                    os.kill(r.proc.pid, signal.SIGCONT)
                r.proc.kill()
            if r.proc is not None:
                r.proc.wait(10)
        # the walsenders of killed relays must be gone before the database is dropped
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and walsenders(pg_dsn):
            time.sleep(0.1)


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
    return lsn_to_scn(row[0])


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
    body, scns, scn = b"", [], after
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


def identical(relays: list[RelayProc]) -> int:
    """All relays serve the same bytes (from their common oldest window); the window count."""
    mins = []
    for r in relays:
        st = r.status()
        assert st is not None
        mins.append(st["min_scn"])
    # all the same: everything from the earliest; else after the newest first window
    after = -1 if len(set(mins)) == 1 else max(mins)
    streams = [stream_bytes(r, after) for r in relays]
    for other in streams[1:]:
        assert other[1] == streams[0][1]
        assert other[0] == streams[0][0]
    return len(streams[0][1])


async def test_three_relays_one_slot_reader_identical_bytes(cluster: Cluster) -> None:
    leader = await settled(cluster)
    with Writer(cluster.dsn, rate=400) as w:
        await wait_until(lambda: w.committed >= 200, 30, "200 transactions")
    await all_hold(cluster.relays, marker(cluster.dsn))
    senders = walsenders(cluster.dsn)
    assert len(senders) == 1
    active, _confirmed = slot_state(cluster.dsn, cluster.slot)
    assert active == senders[0]
    assert identical(cluster.relays) >= 200
    # metrics and registry-visible role
    code, _h, body = leader.get("/metrics")
    assert code == 200
    text = body.decode()
    assert f'changebus_relay_partition_leader{{partition="{PART}",role="leader"}} 1.0' in text
    assert f'changebus_relay_partition_epoch{{partition="{PART}"}}' in text


async def test_kill_9_of_the_leader_under_a_writer(cluster: Cluster) -> None:
    leader = await settled(cluster)
    epoch = cluster.epoch(leader)
    windows: list[Any] = []
    target = [1 << 62]
    done = asyncio.Event()

    async def reader() -> None:
        cfg = ConsumerConfig(
            relays=tuple(r.url for r in cluster.relays),
            partition=PART,
            start="earliest",
            wait_s=0.5,
            backoff_initial_s=0.05,
            backoff_max_s=0.5,
        )
        async with Consumer(cfg) as consumer:
            async for window in consumer:
                windows.append(window)
                if done.is_set() and window.scn >= target[0]:
                    return

    task = asyncio.create_task(reader())
    with Writer(cluster.dsn, rate=200) as w:
        await wait_until(lambda: w.committed >= 150, 30, "150 transactions")
        assert leader.proc is not None
        killed_at = time.monotonic()
        leader.proc.kill()
        leader.proc.wait(10)
        new = await new_leader(cluster, epoch)
        failover = time.monotonic() - killed_at
        assert new is not leader
        before = w.committed
        await wait_until(lambda: w.committed >= before + 150, 30, "150 more transactions")
    target[0] = marker(cluster.dsn)
    done.set()
    await asyncio.wait_for(task, 60)
    print(f"failover (kill -9 -> new leader streaming): {failover:.2f} s")
    assert failover < 10

    scns = [win.scn for win in windows]
    assert scns == sorted(set(scns)), "windows repeated or out of order"
    ids: list[int] = []
    replica: dict[int, int] = {}
    for win in windows:
        for e in win.events:
            key = int(e.key["id"])
            if e.after is None:
                replica.pop(key, None)
            else:
                if e.op == ChangeOp.INSERT:
                    ids.append(key)
                replica[key] = int(e.after["v"])
    with psycopg.connect(cluster.dsn) as conn:
        source = dict(conn.execute("SELECT id, v FROM t").fetchall())
    assert sorted(ids) == list(range(len(source)))  # every transaction, once
    assert replica == source
    survivors = [r for r in cluster.relays if r is not leader]
    await all_hold(survivors, target[0])
    assert len(walsenders(cluster.dsn)) == 1
    identical(survivors)


async def test_sigstop_leader_is_fenced_and_steps_down(cluster: Cluster) -> None:
    old = await settled(cluster)
    epoch = cluster.epoch(old)
    assert old.proc is not None
    with Writer(cluster.dsn, rate=200) as w:
        await wait_until(lambda: w.committed >= 100, 30, "100 transactions")
        stopped_at = time.monotonic()
        os.kill(old.proc.pid, signal.SIGSTOP)
        old.stopped = True
        new = await new_leader(cluster, epoch)
        takeover = time.monotonic() - stopped_at
        assert new is not old
        new_epoch = cluster.epoch(new)
        # the new leader holds the slot; the paused one's walsender was ended
        await wait_until(lambda: len(walsenders(cluster.dsn)) == 1, 10, "one walsender")
        holder, confirmed_before = slot_state(cluster.dsn, cluster.slot)
        assert holder == walsenders(cluster.dsn)[0]
        before = w.committed
        await wait_until(lambda: w.committed >= before + 100, 30, "100 more transactions")

        os.kill(old.proc.pid, signal.SIGCONT)
        old.stopped = False
        woke_at = time.monotonic()

        def old_follows() -> bool:
            st = old.status()
            return bool(
                st
                and st.get("role") == "follower"
                and st.get("epoch") == new_epoch
                and st["state"] == "streaming"
            )

        await wait_until(old_follows, 20, "the old leader following the new one")
        stepped = time.monotonic() - woke_at
        for _ in range(20):  # the slot stays with the new leader, nobody else connects
            assert slot_state(cluster.dsn, cluster.slot)[0] == holder
            assert walsenders(cluster.dsn) == [holder]
            await asyncio.sleep(0.1)
        before = w.committed
        await wait_until(lambda: w.committed >= before + 50, 30, "50 more transactions")
    end = marker(cluster.dsn)
    await all_hold(cluster.relays, end)
    _holder, confirmed_after = slot_state(cluster.dsn, cluster.slot)
    assert confirmed_after >= confirmed_before
    print(f"SIGSTOP -> new leader: {takeover:.2f} s; SIGCONT -> old one follows: {stepped:.2f} s")
    log = old.log()
    assert "stepped down" in log or "no longer leads epoch" in log
    assert f"follows {new.url} (epoch {new_epoch})" in log
    # whatever the old leader holds is what the new leader serves, byte for byte
    identical(cluster.relays)
    with psycopg.connect(cluster.dsn) as conn:
        (count,) = conn.execute("SELECT count(*) FROM t").fetchone() or (0,)
    assert count == w.committed
