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

import aiohttp
import psycopg
import pytest
from kazoo.client import KazooClient

from changebus.client import ChangeOp, Consumer, ConsumerConfig
from changebus.cluster import ClusterConfig, member_path
from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import HEADER_SIZE, Op, lsn_to_scn, parse_stream
from fix_mysql import master_scn
from fix_pg import wait_until
from fix_zk import ZkServer

pytestmark = pytest.mark.zk

PART = "main"
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


@pytest.fixture
def cluster(tmp_path: Path, pg_dsn: str, zk_hosts: str, zk_cluster: str) -> Iterator[Cluster]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL)")
    slot = f"cb_{uuid.uuid4().hex[:10]}"
    relays = [RelayProc(f"r{i}", _free_port(), tmp_path / f"r{i}") for i in range(3)]
    for r in relays:
        write_config(r, pg_source(pg_dsn, slot), zk_hosts, zk_cluster)
    for r in relays:
        start(r)
    c = Cluster(relays, pg_dsn, slot, zk_hosts, zk_cluster)
    try:
        yield c
    finally:
        stop_all(relays)
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
    mins = []
    for r in relays:
        st = r.status()
        assert st is not None
        mins.append(st["min_scn"])
    after = -1 if len(set(mins)) == 1 else max(mins)
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


@pytest.mark.pg
async def test_the_slot_never_passes_a_live_follower(cluster: Cluster) -> None:
    """The leader acknowledges no further than a paused follower holds, until its node goes."""
    leader = await settled(cluster)
    follower = next(r for r in cluster.relays if r is not leader)
    assert follower.proc is not None

    def held() -> int:
        """The SCN the follower registered it holds (its own ZooKeeper node)."""
        zk = KazooClient(hosts=cluster.zk)
        zk.start(10)
        try:
            data, _stat = zk.get(member_path(cluster.name, follower.name))
        finally:
            zk.stop()
            zk.close()
        return int(json.loads(data)["partitions"][PART]["max_scn"])

    with Writer(cluster.dsn, rate=200) as w:
        await wait_until(lambda: w.committed >= 50, 30, "50 transactions")
        os.kill(follower.proc.pid, signal.SIGSTOP)
        follower.stopped = True
        await asyncio.sleep(0.3)
        position = await asyncio.to_thread(held)
        lacking = [scn for scn in stream_bytes(leader, -1)[1] if scn > position]
        # while the paused follower's member node lives (2 s session), the slot stays behind
        deadline = time.monotonic() + 1.2
        while time.monotonic() < deadline:
            confirmed = slot_state(cluster.dsn, cluster.slot)[1]
            lacking = lacking or [s for s in stream_bytes(leader, -1)[1] if s > position]
            if lacking:
                assert confirmed <= lacking[0], "the slot passed what a live follower holds"
            await asyncio.sleep(0.1)
        assert lacking, "the writer ran: the follower must lack windows"
        # its session expires: it holds nothing back any more
        await wait_until(
            lambda: slot_state(cluster.dsn, cluster.slot)[1] > lacking[0], 15, "the slot released"
        )
        os.kill(follower.proc.pid, signal.SIGCONT)
        follower.stopped = False
    await all_hold(cluster.relays, marker(cluster.dsn))
    identical(cluster.relays)


@pytest.mark.pg
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
        source: dict[int, int] = dict(conn.execute("SELECT id, v FROM t").fetchall())
    assert sorted(ids) == list(range(len(source)))  # every transaction, once
    assert replica == source
    survivors = [r for r in cluster.relays if r is not leader]
    await all_hold(survivors, target[0])
    assert len(walsenders(cluster.dsn)) == 1
    # byte for byte: a window the new leader re-read from the slot equals the copy the
    # other follower got from the dead leader (no table announced again)
    identical(survivors)


@pytest.mark.pg
async def test_sigstop_leader_is_fenced_and_steps_down(cluster: Cluster) -> None:
    old = await settled(cluster)
    epoch = cluster.epoch(old)
    assert old.proc is not None
    with Writer(cluster.dsn, rate=200) as w:
        await wait_until(lambda: w.committed >= 100, 30, "100 transactions")
        old_sender = slot_state(cluster.dsn, cluster.slot)[0]
        assert old_sender is not None
        stopped_at = time.monotonic()
        os.kill(old.proc.pid, signal.SIGSTOP)
        old.stopped = True
        new = await new_leader(cluster, epoch)
        takeover = time.monotonic() - stopped_at
        assert new is not old
        new_epoch = cluster.epoch(new)

        # the new leader holds the slot; the paused one's walsender was ended (the new
        # walsender connects first and takes the slot a moment later: wait for both)
        def one_holder() -> bool:
            senders = walsenders(cluster.dsn)
            return len(senders) == 1 and slot_state(cluster.dsn, cluster.slot)[0] == senders[0]

        await wait_until(one_holder, 10, "one walsender, holding the slot")
        holder, confirmed_before = slot_state(cluster.dsn, cluster.slot)
        assert holder is not None and holder != old_sender
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
    # whatever the old leader holds is what the new leader serves, byte for byte: it
    # re-read the old leader's last windows from the slot without announcing the table again
    assert same_content(cluster.relays) == identical(cluster.relays)
    with psycopg.connect(cluster.dsn) as conn:
        (count,) = conn.execute("SELECT count(*) FROM t").fetchone() or (0,)
    assert count == w.committed


# ---- MariaDB: one binlog reader, a server id per member -----------------------------


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


@pytest.mark.mysql
async def test_mariadb_one_binlog_reader_unique_server_ids(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str, zk_hosts: str, zk_cluster: str
) -> None:
    my_rows_table = mysql_server.connect(mysql_db)
    try:
        with my_rows_table.cursor() as cur:
            cur.execute("CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL)")
    finally:
        my_rows_table.close()
    source = (
        'kind = "mysql"\n'
        f'options = {{ host = "127.0.0.1", port = {mysql_server.port}, user = "root", '
        f'databases = ["{mysql_db}"] }}\n'
    )
    relays = [RelayProc(f"m{i}", _free_port(), tmp_path / f"m{i}") for i in range(3)]
    for r in relays:
        write_config(r, source, zk_hosts, zk_cluster)
        start(r)
    c = Cluster(relays, "", "")
    try:
        leader = await settled(c)
        epoch = c.epoch(leader)
        await asyncio.to_thread(my_rows, mysql_server, mysql_db, 0, 100)
        await wait_until(lambda: binlog_dumps(mysql_server) >= 1, 10, "a binlog reader")
        await asyncio.sleep(0.5)
        assert binlog_dumps(mysql_server) == 1
        st = leader.status()
        assert st is not None
        first_id = st["fetcher"]["server_id"]
        assert leader.proc is not None
        leader.proc.kill()
        leader.proc.wait(10)
        new = await new_leader(c, epoch)
        await asyncio.to_thread(my_rows, mysql_server, mysql_db, 100, 100)
        # a new leader shows its fetcher once it has made one (just after the election: not yet)
        await wait_until(lambda: "fetcher" in (new.status() or {}), 15, "the new leader's fetcher")
        st = new.status()
        assert st is not None
        assert st["fetcher"]["server_id"] != first_id
        survivors = [r for r in relays if r is not leader]
        end = await asyncio.to_thread(_master_scn, mysql_server)
        await all_hold(survivors, end)
        assert same_content(survivors) >= 100
        identical(survivors)
        _body, scns = stream_bytes(new, -1)
        assert scns == sorted(set(scns))
        await wait_until(lambda: binlog_dumps(mysql_server) == 1, 10, "one binlog reader")
    finally:
        stop_all(relays)


def _master_scn(server: EmbeddedMariaDB) -> int:
    return int(master_scn(server))


def aiohttp_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession()


# ---- ZooKeeper restarted under load ---------------------------------------------------


@pytest.mark.pg
@pytest.mark.usefixtures("no_blocking")
async def test_zookeeper_restart_under_load(
    tmp_path: Path, pg_dsn: str, zk_server: ZkServer, zk_cluster: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL)")
    slot = f"cb_{uuid.uuid4().hex[:10]}"

    def config(name: str) -> RelayConfig:
        source = FetcherConfig(
            "postgres",
            {"dsn": pg_dsn, "slot": slot, "status_interval_s": 0.2},
            retry_initial_s=0.1,
            retry_max_s=1.0,
        )
        return RelayConfig(
            data_dir=tmp_path / name,
            http=HttpConfig(port=0, max_wait_s=10),
            partitions=(PartitionConfig(PART, 1, capacity_bytes=16 << 20, fetcher=source),),
            flush_interval_s=0,
            cluster=ClusterConfig(
                zookeeper=zk_server.hosts, name=zk_cluster, member_id=name, session_timeout_s=2.0
            ),
        )

    async with Relay(config("a")) as a, Relay(config("b")) as b:
        hosts = [a.hosts[PART], b.hosts[PART]]
        await wait_until(
            lambda: (
                sorted(h.role for h in hosts) == ["follower", "leader"]
                and all(h.state == "streaming" for h in hosts)
            ),
            30,
            "a leader and a follower",
        )
        leader = a if a.hosts[PART].role == "leader" else b
        epoch = leader.hosts[PART].epoch or 0
        with Writer(pg_dsn, rate=200) as w:
            await wait_until(lambda: w.committed >= 100, 30, "100 transactions")
            await asyncio.to_thread(zk_server.stop)
            host = leader.hosts[PART]
            await wait_until(lambda: host.state == "fenced", 10, "the leader fenced")
            async with aiohttp_session() as http:
                async with http.get(f"{leader.url}/readyz") as resp:
                    assert resp.status == 503
                    body = await resp.json()
                # whichever notices the lost session first fences it: the step-down, or the
                # source acknowledgement that finds the leadership lease invalid
                assert body["partitions"][PART].startswith(
                    ("fenced: stepped down", "fenced: the leadership lease is not valid")
                ), body
                async with http.get(f"{leader.url}/metrics") as resp:
                    text = await resp.text()
                assert (
                    f'changebus_relay_partition_leader{{partition="{PART}",role="follower"}} 0.0'
                    in text
                )
                for r in (a, b):  # both keep serving what they hold
                    async with http.get(f"{r.url}/v1/stream?partition={PART}&scn=-1") as resp:
                        assert resp.status == 200
            # nobody acknowledges the slot while nobody can prove it leads
            await wait_until(lambda: not walsenders(pg_dsn), 10, "the source closed")
            confirmed = slot_state(pg_dsn, slot)[1]
            await asyncio.sleep(1.0)
            assert slot_state(pg_dsn, slot)[1] == confirmed
            await asyncio.to_thread(zk_server.start)
            await wait_until(
                lambda: (
                    any(h.role == "leader" and h.state == "streaming" for h in hosts)
                    and all(h.state == "streaming" for h in hosts)
                    and all((h.epoch or 0) > epoch for h in hosts)
                ),
                60,
                "a new leader after ZooKeeper came back",
            )
            # both are registered (again, or still: ZooKeeper restores unexpired sessions)
            # with the new epoch, as every member sees them
            new_epoch = max(h.epoch or 0 for h in hosts)

            def registered() -> bool:
                for r in (a, b):
                    assert r.cluster is not None
                    members = r.cluster.table.snapshot().members
                    if sorted(members) != ["a", "b"]:
                        return False
                    if any(m.partitions[PART].epoch != new_epoch for m in members.values()):
                        return False
                return True

            await wait_until(registered, 20, "both registered with the new epoch")
            before = w.committed
            await wait_until(lambda: w.committed >= before + 100, 30, "100 more transactions")
        end = marker(pg_dsn)
        await wait_until(lambda: all(h.buffer.meta.last_scn >= end for h in hosts), 30, "caught up")
        leader = a if a.hosts[PART].role == "leader" else b
        windows: list[Any] = []
        cfg = ConsumerConfig(relays=(a.url, b.url), partition=PART, start="earliest", wait_s=0.5)
        async with asyncio.timeout(60), Consumer(cfg) as consumer:
            async for window in consumer:
                windows.append(window)
                if window.scn >= end:
                    break
    scns = [win.scn for win in windows]
    assert scns == sorted(set(scns))
    ids = sorted(int(e.key["id"]) for win in windows for e in win.events if e.op == ChangeOp.INSERT)
    assert ids == list(range(w.committed))


async def test_a_relay_started_while_zookeeper_is_down_serves_and_joins_later(
    tmp_path: Path, pg_dsn: str, zk_server: ZkServer, zk_cluster: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL)")
    slot = f"cb_{uuid.uuid4().hex[:10]}"
    source = FetcherConfig(
        "postgres", {"dsn": pg_dsn, "slot": slot}, retry_initial_s=0.1, retry_max_s=1.0
    )
    config = RelayConfig(
        data_dir=tmp_path / "late",
        http=HttpConfig(port=0, max_wait_s=10),
        partitions=(PartitionConfig(PART, 1, capacity_bytes=16 << 20, fetcher=source),),
        flush_interval_s=0,
        cluster=ClusterConfig(
            zookeeper=zk_server.hosts,
            name=zk_cluster,
            member_id="late",
            session_timeout_s=2.0,
            connect_timeout_s=1.0,
        ),
    )
    await asyncio.to_thread(zk_server.stop)
    try:
        async with Relay(config) as relay, aiohttp_session() as http:
            host = relay.hosts[PART]

            def member() -> object:
                return relay.cluster

            assert member() is None  # not joined, yet serving
            async with http.get(f"{relay.url}/v1/status") as resp:
                assert resp.status == 200
            async with http.get(f"{relay.url}/readyz") as resp:
                assert resp.status == 503
                body = await resp.json()
            assert body["partitions"][PART].startswith("fenced: not in the cluster")
            assert not walsenders(pg_dsn)  # nobody reads the source without a leader
            await asyncio.to_thread(zk_server.start)
            await wait_until(
                lambda: host.role == "leader" and host.state == "streaming",
                60,
                "the relay joined and leads",
            )
            assert member() is not None
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute("INSERT INTO t VALUES (1, 1)")
            end = marker(pg_dsn)
            await wait_until(lambda: host.buffer.meta.last_scn >= end, 30, "the insert relayed")
            async with http.get(f"{relay.url}/readyz") as resp:
                assert resp.status == 200
    finally:
        if zk_server.proc is None:  # the test failed while ZooKeeper was down
            await asyncio.to_thread(zk_server.start)


# ---- configuration -------------------------------------------------------------------


def test_cluster_table_in_the_relay_config(tmp_path: Path) -> None:
    from changebus.relay._cluster import member_server_id
    from changebus.schemas import ConfigError
    from changebus.schemas.config import load_config

    cfg = tmp_path / "relay.toml"
    cfg.write_text(
        '[cluster]\nzookeeper = "127.0.0.1:2181"\nname = "prod"\nmember_id = "r1"\n'
        "session_timeout_s = 3.0\n"
    )
    config = load_config(RelayConfig, cfg, env={})
    assert config.cluster == ClusterConfig("127.0.0.1:2181", "prod", "r1", session_timeout_s=3.0)
    assert load_config(RelayConfig, None, env={}).cluster is None  # stand-alone as before
    cfg.write_text('[cluster]\nzookeeper = "127.0.0.1:2181"\nname = "prod"\n')
    with pytest.raises(ConfigError, match="member_id"):
        load_config(RelayConfig, cfg, env={})
    ids = {member_server_id(m, "main") for m in ("r0", "r1", "r2", "relay-a", "relay-b")}
    assert len(ids) == 5 and all(0x4352_0000 <= i <= 0x4352_FFFF for i in ids)
