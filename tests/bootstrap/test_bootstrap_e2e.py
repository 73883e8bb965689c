"""Postgres -> relay (postgres fetcher, tiny buffer) -> bootstrap server -> consumer replica.

Every test ends by comparing the consumer's tables with the source tables row
by row. Sizes are scaled down from the issue's 100k changes to keep the suite
fast (a few thousand changes per test); bench/bootstrap_e2e.py runs the issue's ~100k
changes through the same pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import pytest

from changebus.bootstrap import (
    BootstrapConfig,
    BootstrapServer,
    HttpConfig as BootstrapHttp,
    SeedConfig,
    StoreConfig,
)
from changebus.client import (
    ConsumerConfig,
    FellOffRelayError,
    SqliteReplica,
    Window,
)
from changebus.fetchers.postgres import message_scn
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import Mode, Op
from waiting import wait_until

# relays and bootstrap servers run in the test's event loop: none may block that loop
pytestmark = [pytest.mark.pg, pytest.mark.usefixtures("no_blocking")]

TABLES = ("acct", "item")


def relay_config(tmp: Path, dsn: str, capacity_bytes: int = 8 << 20, port: int = 0) -> RelayConfig:
    return RelayConfig(
        data_dir=tmp / "relay",
        http=HttpConfig(port=port),
        partitions=(
            PartitionConfig(
                "pg",
                1,
                capacity_bytes=capacity_bytes,
                fetcher=FetcherConfig("postgres", {"dsn": dsn, "status_interval_s": 0.2}),
            ),
        ),
        flush_interval_s=0,
    )


def bootstrap_config(
    tmp: Path, relay_url: str, store: str, store_dsn: str = "", port: int = 0
) -> BootstrapConfig:
    st = (
        StoreConfig(kind="postgres", dsn=store_dsn)
        if store == "postgres"
        else StoreConfig(kind="sqlite", path=tmp / "boot" / "b.db")
    )
    return BootstrapConfig(
        relays=(relay_url,),
        data_dir=tmp / "boot",
        store=st,
        http=BootstrapHttp(port=port),
    )


def create_tables(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for t in TABLES:
            conn.execute(f"CREATE TABLE {t} (id int8 PRIMARY KEY, bal int8, name text)")
            # long names live out of line: updates of other columns do not send them
            conn.execute(f"ALTER TABLE {t} ALTER COLUMN name SET STORAGE EXTERNAL")


def workload(dsn: str, seed: int, txns: int, keys: int = 300, per_txn: int = 5) -> None:
    """Random inserts, updates and deletes (upserts of existing keys dominate).

    Some names are long (TOASTed: an update of ``bal`` leaves them unsent) and
    some updates change a row's primary key.
    """
    rnd = random.Random(seed)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(txns):
            with conn.transaction():
                for _ in range(rnd.randint(1, per_txn)):
                    t = rnd.choice(TABLES)
                    k = rnd.randint(1, keys)
                    r = rnd.random()
                    if r < 0.65:
                        name = f"n{k}-{rnd.randint(0, 99)}"
                        if rnd.random() < 0.05:
                            name = name * 400
                        conn.execute(
                            f"INSERT INTO {t} VALUES (%s, %s, %s) ON CONFLICT (id) DO UPDATE "
                            "SET bal = EXCLUDED.bal, name = EXCLUDED.name",
                            (k, rnd.randint(0, 10**6), name),
                        )
                    elif r < 0.7:
                        k2 = rnd.randint(1, keys)
                        conn.execute(
                            f"UPDATE {t} SET id = %s WHERE id = %s "
                            f"AND NOT EXISTS (SELECT 1 FROM {t} WHERE id = %s)",
                            (k2, k, k2),
                        )
                    elif r < 0.85:
                        conn.execute(f"UPDATE {t} SET bal = bal + 1 WHERE id = %s", (k,))
                    else:
                        conn.execute(f"DELETE FROM {t} WHERE id = %s", (k,))


def source_rows(dsn: str) -> dict[str, dict[int, tuple[Any, ...]]]:
    out: dict[str, dict[int, tuple[Any, ...]]] = {}
    with psycopg.connect(dsn) as conn:
        for t in TABLES:
            out[t] = {r[0]: tuple(r) for r in conn.execute(f"SELECT id, bal, name FROM {t}")}
    return out


def sync_marker(dsn: str) -> int:
    """An SCN at or after every change committed so far."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_logical_emit_message(false, 'sync', 'x')::text").fetchone()
    assert row is not None
    return message_scn(row[0])


TINY = 256 << 10  # relay buffer: a few hundred windows


class WatchedReplica(SqliteReplica):
    """A SQLite replica recording the phases of the windows it applied.

    ``hook(phase, n)`` runs before the n-th window of a phase; it may raise
    :class:`Crash` to end the consumer abruptly there (like a kill: whatever
    the replica committed stays, nothing else is stored).
    """

    def __init__(self, path: Path, hook: Callable[[str, int], None] | None = None) -> None:
        super().__init__(path)
        self.phases: list[str] = []
        self._hook = hook

    async def on_start_window(self, window: Window) -> Any:
        self.phases.append(window.phase)
        if self._hook is not None:
            self._hook(window.phase, self.phases.count(window.phase))
        return await super().on_start_window(window)


class Crash(BaseException):
    """Ends a consumer run abruptly (not an error the consumer handles)."""


def consumer_config(relay: str, boot: str | None, **kw: Any) -> ConsumerConfig:
    return ConsumerConfig(
        relays=(relay,),
        partition="pg",
        wait_s=0.5,
        bootstrap_servers=(boot,) if boot else (),
        backoff_initial_s=0.05,
        backoff_max_s=0.5,
        **kw,
    )


def assert_same(
    got: dict[str, dict[int, tuple[Any, ...]]], want: dict[str, dict[int, tuple[Any, ...]]]
) -> None:
    for t in TABLES:
        g, w = got[t], want[t]
        bad = sorted(k for k in set(g) | set(w) if g.get(k) != w.get(k))
        detail = [(k, str(g.get(k))[:60], str(w.get(k))[:60]) for k in bad[:5]]
        assert not bad, f"{t}: {len(bad)} rows differ of {len(w)}: {detail}"


def replica_rows(path: Path) -> dict[str, dict[int, tuple[Any, ...]]]:
    conn = sqlite3.connect(path)
    try:
        out: dict[str, dict[int, tuple[Any, ...]]] = {}
        for t in TABLES:
            try:
                rows = conn.execute(f'SELECT id, bal, name FROM "public_{t}"').fetchall()
            except sqlite3.OperationalError:
                rows = []
            out[t] = {r[0]: tuple(r) for r in rows}
        return out
    finally:
        conn.close()


def stored_checkpoint(replica: SqliteReplica) -> Any:
    stored = replica._stored
    return stored.get("pg") if stored is not None else None


async def replicate_until(
    replica: SqliteReplica, cfg: ConsumerConfig, marker: int, seconds: float = 90
) -> None:
    """Run the replica until its stored checkpoint is online at or after ``marker``."""

    async def watch() -> None:
        while True:
            pc = stored_checkpoint(replica)
            if pc is not None and pc.mode is Mode.ONLINE and pc.window_scn >= marker:
                replica.stop()
                return
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait_for(replica.run(cfg), seconds)
    finally:
        watcher.cancel()


async def bootstrap_caught_up(boot: BootstrapServer, marker: int) -> None:
    w = boot.service.workers["pg"]
    await wait_until(lambda: w.applier_scn >= marker, 60, "the bootstrap applier")


@pytest.fixture(params=["sqlite", "postgres"])
def store_kind(request: Any) -> str:
    return str(request.param)


@pytest.fixture
def store_dsn(store_kind: str, pg_server: Any) -> Iterator[str]:
    if store_kind == "sqlite":
        yield ""
        return
    name = f"boot_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield pg_server.dsn(name)
    finally:
        with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


async def test_late_consumer_with_writers_running(
    tmp_path: Path, pg_dsn: str, store_kind: str, store_dsn: str
) -> None:
    """A consumer started late (the relay evicted most windows) catches up exactly,
    while writers keep writing during its snapshot; then one that was offline
    falls off (410) and gets only what changed."""
    create_tables(pg_dsn)
    async with Relay(relay_config(tmp_path, pg_dsn, TINY)) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        bcfg = bootstrap_config(tmp_path, relay.url, store_kind, store_dsn)
        async with BootstrapServer(bcfg) as boot:
            await asyncio.to_thread(workload, pg_dsn, 1, 1500)
            await bootstrap_caught_up(boot, sync_marker(pg_dsn))
            status = relay.hosts["pg"].status()
            assert status["prev_scn"] > boot.service.workers["pg"].base_scn  # evicted
            writer = threading.Thread(target=workload, args=(pg_dsn, 2, 600))
            writer.start()
            db = tmp_path / "replica.db"
            replica = WatchedReplica(db)
            try:
                cfg = consumer_config(relay.url, boot.url, bootstrap_page_bytes=8 << 10)
                # runs while the writer writes; ends once online after the writer's end
                task = asyncio.create_task(replicate_until(replica, cfg, 2**62, 120))
                await asyncio.to_thread(writer.join)
                marker = sync_marker(pg_dsn)
                await wait_until(
                    lambda: (
                        (pc := stored_checkpoint(replica)) is not None
                        and pc.mode is Mode.ONLINE
                        and pc.window_scn >= marker
                    ),
                    90,
                    "the replica",
                )
                replica.stop()
                await task
            finally:
                await replica.close()
            assert_same(replica_rows(db), source_rows(pg_dsn))
            assert replica.phases.count("snapshot") > 3  # several pages
            assert "catchup" in replica.phases and replica.phases[-1] == "online"
            # offline while the relay moves on: 410, then only the changed keys
            await asyncio.to_thread(workload, pg_dsn, 3, 1500, 300, 2)
            marker = sync_marker(pg_dsn)
            await bootstrap_caught_up(boot, marker)
            replica2 = WatchedReplica(db)
            try:
                await replicate_until(replica2, cfg, marker)
            finally:
                await replica2.close()
            assert_same(replica_rows(db), source_rows(pg_dsn))
            assert replica2.phases[0] in ("snapshot", "catchup")
            async with aiohttp.ClientSession() as s, s.get(f"{boot.url}/metrics") as r:
                text = await r.text()
            served = [ln for ln in text.splitlines() if 'what="snapshot_rows"' in ln]
            assert served and float(served[0].split()[-1]) > 0


async def test_no_bootstrap_server_raises_unless_jump_chosen(tmp_path: Path, pg_dsn: str) -> None:
    create_tables(pg_dsn)
    async with Relay(relay_config(tmp_path, pg_dsn, TINY)) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        await asyncio.to_thread(workload, pg_dsn, 5, 1200)
        marker = sync_marker(pg_dsn)
        await wait_until(lambda: relay.hosts["pg"].buffer.meta.last_scn >= marker)
        db = tmp_path / "r.db"
        replica = SqliteReplica(db)
        try:
            # a checkpoint the relay no longer has
            cfg = consumer_config(
                relay.url, None, start=str(relay.hosts["pg"].status()["prev_scn"] - 1)
            )
            with pytest.raises(FellOffRelayError, match="bootstrap"):
                await asyncio.wait_for(replica.run(cfg), 30)
        finally:
            await replica.close()
        replica = SqliteReplica(tmp_path / "r2.db")
        try:
            cfg = consumer_config(
                relay.url,
                None,
                start=str(relay.hosts["pg"].status()["prev_scn"] - 1),
                on_fell_off="latest",
            )
            task = asyncio.create_task(replica.run(cfg))
            marks: list[int] = []

            async def online_past_a_marker() -> bool:
                marks.append(await asyncio.to_thread(sync_marker, pg_dsn))
                pc = stored_checkpoint(replica)
                return pc is not None and pc.mode is Mode.ONLINE and pc.window_scn >= marks[0]

            for _ in range(200):
                if await online_past_a_marker():
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the consumer did not jump to the newest SCN")
            replica.stop()
            await asyncio.wait_for(task, 30)
            # it skipped the evicted windows: it has only rows changed after the jump
            assert sum(len(r) for r in replica_rows(tmp_path / "r2.db").values()) == 0
        finally:
            await replica.close()


async def restart_applier(boot: BootstrapServer, marker: int) -> None:
    worker = boot.service.workers["pg"]
    worker.tasks.append(asyncio.create_task(boot.service._apply(worker)))
    await wait_until(lambda: worker.applier_scn >= marker)


async def test_consumer_killed_in_snapshot_and_in_catchup_resumes(
    tmp_path: Path, pg_dsn: str
) -> None:
    create_tables(pg_dsn)
    async with Relay(relay_config(tmp_path, pg_dsn, TINY)) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        async with BootstrapServer(bootstrap_config(tmp_path, relay.url, "sqlite")) as boot:
            await asyncio.to_thread(workload, pg_dsn, 7, 1200)
            await bootstrap_caught_up(boot, sync_marker(pg_dsn))
            # the applier lags (stopped): the snapshot stays here, the log grows
            applier = boot.service.workers["pg"].tasks[1]
            applier.cancel()
            await asyncio.to_thread(workload, pg_dsn, 8, 600)
            marker = sync_marker(pg_dsn)
            await wait_until(lambda: boot.service.workers["pg"].producer_scn >= marker)
            db = tmp_path / "replica.db"
            cfg = consumer_config(relay.url, boot.url, bootstrap_page_bytes=4 << 10)

            def crash_at(phase: str, n: int) -> Callable[[str, int], None]:
                def hook(p: str, i: int) -> None:
                    if p == phase and i == n:
                        raise Crash

                return hook

            loaded = []
            stages = (crash_at("snapshot", 3), crash_at("catchup", 50), crash_at("catchup", 50))
            for i, hook in enumerate((*stages, None)):
                if i == 3:
                    # meanwhile the applier catches up and the log is pruned past the
                    # consumer's catch-up position: it must run the snapshot again
                    await restart_applier(boot, marker)
                    pruned = await boot.service.stores.write(lambda s: s.prune_to("pg", 100))
                    assert pruned > 0
                replica = WatchedReplica(db, hook)
                try:
                    loaded.append(await replica.load())
                    if hook is None:
                        await replicate_until(replica, cfg, marker)
                    else:
                        with pytest.raises(Crash):
                            await asyncio.wait_for(replica.run(cfg), 60)
                finally:
                    await replica.close()
            assert loaded[0] is None
            assert loaded[1] is not None and loaded[2] is not None
            snap = loaded[1].get("pg")
            assert snap.mode is Mode.SNAPSHOT
            assert snap.bootstrap is not None and snap.bootstrap.snapshot_position
            catch = loaded[2].get("pg")
            assert catch.mode is Mode.CATCHUP and catch.bootstrap is not None
            assert catch.window_scn > catch.bootstrap.start_scn
            assert loaded[3] is not None
            late = loaded[3].get("pg")
            assert late.mode is Mode.CATCHUP and late.bootstrap is not None
            state = await boot.service.stores.read(lambda s: s.state("pg"))
            assert late.window_scn < state.log_min_scn
            # the last run found its catch-up pruned (410) and ran the snapshot again
            assert replica.phases[0] == "snapshot"
            assert_same(replica_rows(db), source_rows(pg_dsn))
            # bad requests get clear JSON errors; the server goes on
            bad = {
                "/v1/bootstrap/snapshot": 400,  # no start
                "/v1/bootstrap/snapshot?start=1&position=abc": 400,
                "/v1/bootstrap/start?since=x": 400,
                "/v1/bootstrap/start?bogus=1": 400,
                "/v1/bootstrap/status?partition=nope": 404,
                "/v1/bootstrap/catchup?after=5&target=1": 400,
                f"/v1/bootstrap/catchup?after=1&target={2**62}": 410,  # pruned
                f"/v1/bootstrap/start?since={2**62}": 503,  # ahead of the log
                "/v1/schemas/public.nope": 404,
            }
            async with aiohttp.ClientSession() as http:
                for path, status in bad.items():
                    async with http.get(boot.url + path) as r:
                        body = await r.json()
                        assert (r.status, set(body) >= {"error", "message"}) == (status, True), path
                async with http.get(boot.url + "/readyz") as r:
                    assert r.status == 200


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_daemon(config: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "changebus.schemas",
                "bootstrap",
                "--config",
                str(config),
                "--set",
                "applier.batch_events=100",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )


async def http_json(url: str) -> Any:
    try:
        async with aiohttp.ClientSession() as s, s.get(url) as r:
            return await r.json() if r.status == 200 else None
    except aiohttp.ClientError:
        return None


async def test_bootstrap_daemon_kill_9_while_producing_applying_and_serving(
    tmp_path: Path, pg_dsn: str
) -> None:
    create_tables(pg_dsn)
    async with Relay(relay_config(tmp_path, pg_dsn)) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        config = tmp_path / "bootstrap.toml"
        store = tmp_path / "boot" / "b.db"
        config.write_text(
            f'relays = ["{relay.url}"]\ndata_dir = "{tmp_path / "boot"}"\n'
            f'[store]\npath = "{store}"\n[http]\nport = {port}\n'
        )
        log = tmp_path / "bootstrap.log"
        proc = start_daemon(config, log)
        try:
            writer = threading.Thread(target=workload, args=(pg_dsn, 9, 2500))
            writer.start()
            # killed while the producer appends and the applier applies
            seen: dict[str, Any] = {}

            async def producing() -> bool:
                st = await http_json(f"{url}/v1/bootstrap/status?partition=pg")
                seen.update(st or {})
                return bool(st and st["producer_scn"] > 0 and writer.is_alive())

            for _ in range(400):
                if await producing():
                    break
                await asyncio.sleep(0.05)
            assert seen.get("producer_scn", -1) > 0, log.read_text()[-2000:]
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            proc = start_daemon(config, log)
            await asyncio.to_thread(writer.join)
            marker = sync_marker(pg_dsn)

            async def applied() -> bool:
                st = await http_json(f"{url}/v1/bootstrap/status?partition=pg")
                return bool(st and st["applier_scn"] >= marker)

            for _ in range(1200):
                if await applied():
                    break
                await asyncio.sleep(0.05)
            assert await applied(), log.read_text()[-2000:]
            # killed while serving a consumer's snapshot; the consumer retries and goes on
            killed: list[int] = []

            def kill_in_snapshot(phase: str, n: int) -> None:
                if phase == "snapshot" and n == 2 and not killed:
                    os.kill(proc.pid, signal.SIGKILL)
                    killed.append(n)

            db = tmp_path / "replica.db"
            replica = WatchedReplica(db, kill_in_snapshot)
            # a one-window queue: the fetcher is at most a page or two ahead of the kill
            cfg = consumer_config(relay.url, url, bootstrap_page_bytes=4 << 10, queue_windows=1)
            task = asyncio.create_task(replicate_until(replica, cfg, marker, 120))
            await wait_until(lambda: bool(killed), 60, "the snapshot")
            proc.wait()
            proc = start_daemon(config, log)
            try:
                await task
            finally:
                await replica.close()
            assert_same(replica_rows(db), source_rows(pg_dsn))
            assert replica.phases.count("snapshot") > 2
            # the log holds each window once, whatever the kills interrupted
            conn = sqlite3.connect(store)
            try:
                n, distinct = conn.execute(
                    "SELECT count(*), count(DISTINCT scn) FROM cb_log WHERE op = ?",
                    (int(Op.END_OF_WINDOW),),
                ).fetchone()
            finally:
                conn.close()
            assert n == distinct > 1000
            # the restarted daemon served the rest of the snapshot
            metrics = None
            async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
                metrics = await r.text()
            rows = [ln for ln in metrics.splitlines() if 'what="snapshot_rows"' in ln]
            assert rows and float(rows[0].split()[-1]) > 0
            # SIGTERM: a graceful stop
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()


async def test_seed_from_the_source_while_writers_write(
    tmp_path: Path, pg_dsn: str, store_kind: str, store_dsn: str
) -> None:
    """Rows written before capture began reach a new consumer through the seed (an
    exported snapshot aligned with an SCN), merged with changes made meanwhile."""
    create_tables(pg_dsn)
    await asyncio.to_thread(workload, pg_dsn, 11, 400)  # before the relay: not in the stream
    before = source_rows(pg_dsn)
    async with Relay(relay_config(tmp_path, pg_dsn)) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for t in TABLES:  # the relay learns the tables' schemas
                conn.execute(f"INSERT INTO {t} VALUES (100000, 1, 'x')")
        bcfg = bootstrap_config(tmp_path, relay.url, store_kind, store_dsn)
        bcfg = dataclasses.replace(bcfg, seed=SeedConfig(dsn=pg_dsn, on_start=True, chunk_rows=100))
        writer = threading.Thread(target=workload, args=(pg_dsn, 12, 600))
        writer.start()
        async with BootstrapServer(bcfg) as boot:
            w = boot.service.workers["pg"]
            await wait_until(lambda: w.seed.state in ("done", "failed"), 90, "the seed")
            assert w.seed.state == "done", w.seed.error
            assert w.seed.rows >= sum(len(r) for r in before.values())
            first_seed = w.seed.scn
            await asyncio.to_thread(writer.join)
            marker = sync_marker(pg_dsn)
            await bootstrap_caught_up(boot, marker)
            db = tmp_path / "replica.db"
            replica = WatchedReplica(db)
            try:
                await replicate_until(replica, consumer_config(relay.url, boot.url), marker)
            finally:
                await replica.close()
            now = source_rows(pg_dsn)
            assert_same(replica_rows(db), now)
            # some rows were never changed after capture began: only the seed had them
            untouched = sum(1 for t in TABLES for k, r in before[t].items() if now[t].get(k) == r)
            assert untouched > 10
            # re-seed one table on demand
            async with (
                aiohttp.ClientSession() as s,
                s.post(f"{boot.url}/v1/seed?tables=public.acct") as r,
            ):
                assert r.status == 202
            await wait_until(lambda: w.seed.state in ("done", "failed"), 60, "the re-seed")
            assert w.seed.state == "done" and w.seed.tables_total == 1
            assert w.seed.scn > first_seed


async def test_producer_fell_off_the_relay_repairs_itself_with_a_seed(
    tmp_path: Path, pg_dsn: str
) -> None:
    """The bootstrap producer stalls, the tiny relay evicts windows it never got: it
    jumps over the gap, seeds its snapshot again (rows deleted in the gap become
    tombstones), and both an old consumer and a new one end exact."""
    create_tables(pg_dsn)
    async with Relay(relay_config(tmp_path, pg_dsn, TINY)) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        bcfg = dataclasses.replace(
            bootstrap_config(tmp_path, relay.url, "sqlite"),
            seed=SeedConfig(dsn=pg_dsn, chunk_rows=200),
        )
        async with BootstrapServer(bcfg) as boot:
            w = boot.service.workers["pg"]
            await asyncio.to_thread(workload, pg_dsn, 21, 800)
            marker = sync_marker(pg_dsn)
            await bootstrap_caught_up(boot, marker)
            old_db = tmp_path / "old.db"
            old = WatchedReplica(old_db)
            cfg = consumer_config(relay.url, boot.url)
            try:
                await replicate_until(old, cfg, marker)
            finally:
                await old.close()
            # the producer stalls while the relay evicts what it did not read
            producer = w.tasks[0]
            producer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await producer
            await asyncio.to_thread(workload, pg_dsn, 22, 1500)
            gap_marker = sync_marker(pg_dsn)
            await wait_until(lambda: relay.hosts["pg"].buffer.meta.last_scn >= gap_marker)
            assert relay.hosts["pg"].status()["prev_scn"] > w.producer_scn  # a real gap
            w.tasks[0] = asyncio.create_task(boot.service._produce(w))
            await wait_until(lambda: w.fell_off > 0, 30, "the producer to fall off")
            await wait_until(lambda: w.seed.state in ("done", "failed"), 90, "the re-seed")
            assert w.seed.state == "done", w.seed.error
            assert await boot.service.stores.read(lambda s: s.gap("pg")) is None
            await asyncio.to_thread(workload, pg_dsn, 23, 200)
            marker = sync_marker(pg_dsn)
            await bootstrap_caught_up(boot, marker)
            for db in (old_db, tmp_path / "new.db"):  # behind the gap, and from nothing
                replica = WatchedReplica(db)
                try:
                    await replicate_until(replica, cfg, marker)
                finally:
                    await replica.close()
                assert replica.phases[0] in ("snapshot", "catchup")
                assert_same(replica_rows(db), source_rows(pg_dsn))
