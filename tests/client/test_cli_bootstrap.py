"""``changebus tail`` and ``changebus replicate`` with ``--bootstrap URL`` (real servers).

Postgres -> relay (tiny buffer: the beginning of the stream is evicted) ->
bootstrap server, both in the test's loop; the consumers are subprocesses
that start from earliest after the eviction, so they can only get the first
rows through the bootstrap server (snapshot + catch-up) while a writer keeps
writing. Routes: ``--relay``, ``--zookeeper/--cluster`` (the relay registered
in a real ZooKeeper's routing table) and ``--group`` on that cluster. Each
consumer must end equal to the source row by row.

Also two regressions of consumers given only a cluster (``zookeeper`` and
``cluster``, no ``bootstrap_servers``): one whose stored checkpoint is in the
middle of a bootstrap continues it with the routing table's bootstrap
servers (it used to refuse to start), and one started while the table listed
no bootstrap server uses one registered later (it used to keep none).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sqlite3
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import aiohttp
import psycopg
import pytest

from changebus.bootstrap import (
    BootstrapConfig,
    BootstrapServer,
    HttpConfig as BootstrapHttp,
    StoreConfig,
)
from changebus.client import Consumer, ConsumerConfig, MemoryCheckpointPersister
from changebus.cluster import ClusterConfig, PartitionState, Registry, ZkSession
from changebus.fetchers.postgres import message_scn
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import (
    BootstrapProgress,
    Checkpoint,
    Mode,
    PartitionCheckpoint,
)
from waiting import wait_until

pytestmark = [pytest.mark.pg, pytest.mark.zk]

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        str(ROOT / s)
        for s in ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client", "discovery")
    ),
}
TABLES = ("acct", "item")
TINY = 256 << 10  # relay buffer: a few hundred windows
Rows = dict[str, dict[int, tuple[Any, ...]]]
MakeRelay = Callable[..., AbstractAsyncContextManager[Relay]]


def create_tables(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for t in TABLES:
            conn.execute(f"CREATE TABLE {t} (id int8 PRIMARY KEY, bal int8, name text)")


def workload(dsn: str, seed: int, txns: int, keys: int = 300) -> None:
    """Upserts (most), increments and deletes, 1..4 changes per transaction."""
    rnd = random.Random(seed)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(txns):
            with conn.transaction():
                for _ in range(rnd.randint(1, 4)):
                    t = rnd.choice(TABLES)
                    k = rnd.randint(1, keys)
                    r = rnd.random()
                    if r < 0.7:
                        conn.execute(
                            f"INSERT INTO {t} VALUES (%s, %s, %s) ON CONFLICT (id) DO UPDATE "
                            "SET bal = EXCLUDED.bal, name = EXCLUDED.name",
                            (k, rnd.randint(0, 10**6), f"n{k}-{rnd.randint(0, 99)}"),
                        )
                    elif r < 0.85:
                        conn.execute(f"UPDATE {t} SET bal = bal + 1 WHERE id = %s", (k,))
                    else:
                        conn.execute(f"DELETE FROM {t} WHERE id = %s", (k,))


def sync_marker(dsn: str) -> int:
    """An SCN at or after every change committed so far."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_logical_emit_message(false, 'sync', 'x')::text").fetchone()
    assert row is not None
    return message_scn(row[0])


def source_rows(dsn: str) -> Rows:
    with psycopg.connect(dsn) as conn:
        return {
            t: {r[0]: tuple(r) for r in conn.execute(f"SELECT id, bal, name FROM {t}")}
            for t in TABLES
        }


def sqlite_rows(path: Path) -> Rows:
    out: Rows = {t: {} for t in TABLES}
    if not path.exists():
        return out
    conn = sqlite3.connect(path, timeout=10)
    try:
        for t in TABLES:
            with contextlib.suppress(sqlite3.OperationalError):  # not created yet
                rows = conn.execute(f'SELECT id, bal, name FROM "public_{t}"').fetchall()
                out[t] = {r[0]: tuple(r) for r in rows}
    finally:
        conn.close()
    return out


def tail_lines(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines a tail printed so far."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def tail_rows(path: Path) -> Rows:
    """The tables rebuilt from a tail's JSON lines, applied in order."""
    out: Rows = {t: {} for t in TABLES}
    for ev in tail_lines(path):
        table = out[ev["table"].rsplit(".", 1)[-1]]
        if ev["op"] == "delete":
            table.pop(ev["key"]["id"], None)
        else:
            after = ev["after"]
            table[after["id"]] = (after["id"], after["bal"], after["name"])
    return out


def diff(got: Rows, want: Rows) -> list[str]:
    bad = []
    for t in TABLES:
        g, w = got[t], want[t]
        bad += [f"{t}:{k}" for k in sorted(set(g) | set(w)) if g.get(k) != w.get(k)]
    return bad


def stored_mode(path: Path) -> tuple[Mode, int]:
    """The mode and window SCN of a plain replicate's stored checkpoint (partition pg)."""
    conn = sqlite3.connect(path, timeout=10)
    try:
        rows = conn.execute("SELECT checkpoint FROM changebus_checkpoints").fetchall()
    finally:
        conn.close()
    pc = Checkpoint.parse(rows[0][0]).get("pg")
    return pc.mode, pc.window_scn


@asynccontextmanager
async def registered(
    zk_hosts: str,
    cluster: str,
    url: str,
    member_id: str = "relay-1",
    kind: Literal["relay", "bootstrap"] = "relay",
    partition: str = "pg",
) -> AsyncIterator[None]:
    """A member in the cluster's routing table: a relay leading ``partition``, or a
    bootstrap server following it."""
    session = ZkSession(
        ClusterConfig(
            zookeeper=zk_hosts,
            name=cluster,
            member_id=member_id,
            advertised_url=url,
            session_timeout_s=4.0,
            connect_timeout_s=10.0,
        )
    )
    await session.start()
    registry = Registry(session, kind)
    try:
        await registry.start()
        registry.update({partition: PartitionState("leader" if kind == "relay" else "follower", 1)})
        await registry.flush()
        yield
    finally:
        with contextlib.suppress(Exception):
            await registry.stop()
        await session.stop()


async def cli(*args: str, stdout: Any = asyncio.subprocess.DEVNULL) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "changebus.schemas",
        *args,
        stdout=stdout,
        stderr=asyncio.subprocess.PIPE,
        env=ENV,
    )


async def test_tail_and_replicate_bootstrap_after_eviction(
    tmp_path: Path, pg_dsn: str, zk_hosts: str, zk_cluster: str
) -> None:
    await asyncio.to_thread(create_tables, pg_dsn)
    relay_cfg = RelayConfig(
        data_dir=tmp_path / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "pg",
                1,
                capacity_bytes=TINY,
                fetcher=FetcherConfig("postgres", {"dsn": pg_dsn, "status_interval_s": 0.2}),
            ),
        ),
        flush_interval_s=0,
    )
    async with Relay(relay_cfg) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        boot_cfg = BootstrapConfig(
            relays=(relay.url,),
            data_dir=tmp_path / "boot",
            store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
            http=BootstrapHttp(port=0),
        )
        async with (
            BootstrapServer(boot_cfg) as boot,
            registered(zk_hosts, zk_cluster, relay.url),
        ):
            await asyncio.to_thread(workload, pg_dsn, 1, 1500)
            marker = await asyncio.to_thread(sync_marker, pg_dsn)
            worker = boot.service.workers["pg"]
            await wait_until(lambda: worker.applier_scn >= marker, 60, "the bootstrap applier")
            evicted = relay.hosts["pg"].status()["prev_scn"]
            assert evicted > worker.base_scn  # the relay no longer has the beginning
            # consumers start from earliest while a writer writes
            writer = threading.Thread(target=workload, args=(pg_dsn, 2, 400))
            writer.start()
            cluster = ("--zookeeper", zk_hosts, "--cluster", zk_cluster)
            plain_db, group_db, out = tmp_path / "r.db", tmp_path / "g.db", tmp_path / "tail.out"
            ckpt = tmp_path / "tail.json"
            common = ("--bootstrap", boot.url, "--log-level", "warning")
            group = f"g{uuid.uuid4().hex[:8]}"
            plain_args = ("replicate", "--relay", relay.url, "--partition", "pg",
                          "--sqlite", str(plain_db), *common)  # fmt: skip
            tail_args = ("tail", *cluster, "--partition", "pg", "--from", "earliest",
                         "--checkpoint", str(ckpt), *common)  # fmt: skip
            group_args = ("replicate", *cluster, "--group", group, "--partitions", "pg",
                          "--buckets", "4", "--commit-interval", "0.2",
                          "--sqlite", str(group_db), *common)  # fmt: skip
            with out.open("wb") as sink:
                procs = {
                    "replicate --relay": await cli(*plain_args),
                    "tail --cluster": await cli(*tail_args, stdout=sink),
                    "replicate --group": await cli(*group_args),
                }
            try:
                await asyncio.to_thread(writer.join)

                async def equal(want: Rows) -> list[str]:
                    for name, proc in procs.items():
                        assert proc.returncode is None, f"{name} exited: {proc.returncode}"
                    plain = await asyncio.to_thread(sqlite_rows, plain_db)
                    grouped = await asyncio.to_thread(sqlite_rows, group_db)
                    tailed = await asyncio.to_thread(tail_rows, out)
                    return [
                        f"{name}: {len(bad)} rows differ, e.g. {bad[:3]}"
                        for name, bad in (
                            ("replicate --relay", diff(plain, want)),
                            ("replicate --group", diff(grouped, want)),
                            ("tail --cluster", diff(tailed, want)),
                        )
                        if bad
                    ]

                async def converge() -> None:
                    want = await asyncio.to_thread(source_rows, pg_dsn)
                    assert sum(map(len, want.values())) > 200
                    for _ in range(900):
                        if not (problems := await equal(want)):
                            return
                        await asyncio.sleep(0.1)
                    raise AssertionError("; ".join(problems))

                await converge()
                # more changes once every consumer is back on the relay: read online
                await asyncio.to_thread(workload, pg_dsn, 3, 30)
                marker = await asyncio.to_thread(sync_marker, pg_dsn)
                await converge()
                # the plain replica and the tail are online past the last change
                await wait_until(
                    lambda: (s := stored_mode(plain_db))[0] is Mode.ONLINE and s[1] >= marker,
                    60,
                    "the replica's checkpoint",
                )
                await wait_until(
                    lambda: (
                        ckpt.exists()
                        and (pc := Checkpoint.parse(ckpt.read_text()).get("pg")).mode is Mode.ONLINE
                        and pc.window_scn >= marker
                    ),
                    60,
                    "the tail's checkpoint",
                )
            finally:
                for proc in procs.values():
                    if proc.returncode is None:
                        proc.send_signal(signal.SIGTERM)
                for name, proc in procs.items():
                    _, err = await asyncio.wait_for(proc.communicate(), 30)
                    assert proc.returncode == 0, f"{name}: {err.decode()}"
                    assert b"Traceback" not in err, err.decode()
            # the tail printed rows older than the relay keeps: they came from the bootstrap,
            # marked with their phase; the catch-up and online lines are in commit order
            lines = await asyncio.to_thread(tail_lines, out)
            phases = [ev.get("phase", "online") for ev in lines]
            assert phases[0] == "snapshot" and phases[-1] == "online"
            assert phases == sorted(phases, key=["snapshot", "catchup", "online"].index)
            assert min(ev["scn"] for ev in lines if ev.get("phase") == "snapshot") <= evicted
            ordered = [(ev["scn"], ev["seq"]) for ev in lines if ev.get("phase") != "snapshot"]
            assert ordered == sorted(set(ordered))
            async with aiohttp.ClientSession() as s, s.get(f"{boot.url}/metrics") as r:
                text = await r.text()
            served = [ln for ln in text.splitlines() if 'what="snapshot_rows"' in ln]
            assert served and float(served[0].split()[-1]) > 0


async def test_bad_bootstrap_url_is_refused() -> None:
    for command in (("tail",), ("replicate", "--sqlite", "x.db")):
        args = (*command, "--relay", "http://127.0.0.1:1", "--bootstrap", "ftp://nowhere")
        proc = await cli(*args, stdout=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 2 and b"ftp://nowhere" in err and out == b"", err.decode()


async def test_a_cluster_consumer_resumes_a_bootstrap_with_the_tables_servers(
    make_relay: MakeRelay, zk_hosts: str, zk_cluster: str
) -> None:
    """A consumer given only the cluster (no bootstrap_servers) whose stored checkpoint is in
    the middle of a bootstrap continues it with the bootstrap servers of the routing table."""
    boot = "http://127.0.0.1:9/boot"
    stored = Checkpoint({}).with_partition(
        "syn",
        PartitionCheckpoint(
            mode=Mode.SNAPSHOT,
            window_scn=-1,
            bootstrap=BootstrapProgress(start_scn=1100, snapshot_position="1:5", server=boot),
        ),
    )
    async with (
        make_relay() as relay,
        registered(zk_hosts, zk_cluster, relay.url, "r1", partition="syn"),
        registered(zk_hosts, zk_cluster, boot, "b1", "bootstrap", partition="syn"),
    ):
        config = ConsumerConfig(zookeeper=zk_hosts, cluster=zk_cluster, partition="syn")
        c = Consumer(config, persister=MemoryCheckpointPersister(stored))
        async with c:
            assert c._fetcher is not None and c._fetcher._boot is not None
            assert c._fetcher._boot.config.bootstrap_servers == (boot,)
            assert c._fetcher._resume == stored.get("syn")


async def test_a_bootstrap_server_registered_later_is_used(
    make_relay: MakeRelay, zk_hosts: str, zk_cluster: str
) -> None:
    """A cluster consumer that started while no bootstrap server was registered uses one
    that registers later."""
    boot = "http://127.0.0.1:9/boot"
    async with (
        make_relay() as relay,
        registered(zk_hosts, zk_cluster, relay.url, "r1", partition="syn"),
    ):
        config = ConsumerConfig(
            zookeeper=zk_hosts, cluster=zk_cluster, partition="syn", start="latest"
        )
        c = Consumer(config, persister=MemoryCheckpointPersister())
        async with c:
            assert c._fetcher is not None
            fetcher = c._fetcher

            def bootstrapper() -> Any:
                return fetcher._boot

            assert bootstrapper() is None
            async with registered(zk_hosts, zk_cluster, boot, "b1", "bootstrap", partition="syn"):
                async with asyncio.timeout(20):
                    while bootstrapper() is None:
                        await asyncio.sleep(0.02)
                assert bootstrapper()._failover.urls == (boot,)
