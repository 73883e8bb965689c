"""Relay cluster failover: three relays on one Postgres partition, the leader killed 5 times.

Starts a private ZooKeeper (``_zk.ZkServer``, the tests' launcher) and a private
Postgres 15 (``EmbeddedPostgres``), then three ``changebus relay`` processes
with a ``[cluster]`` table (``session_timeout_s = 4``) on one partition read
from one replication slot. A writer thread commits 1,000 rows/s (100
transactions/s of 10 rows, ids 0, 1, 2, ... in order). A consumer reads the
partition through the cluster's ZooKeeper routing table
(``ConsumerConfig(zookeeper=..., cluster=...)``).

* **follower lag** (steady state, before the first kill): two follow-mode
  readers (``RelayStream``, ``follow=1``), one on the leader and one on a
  follower, record the receipt time of every window SCN; the lag of a window is
  follower receipt - leader receipt. Both readers run in one child process of
  their own (``--lag-probe``) and one event loop, so what their path adds
  mostly cancels out: this is leader append -> follower append plus the
  difference of the two relays' serve paths (and any stall of the probe's loop
  between the two receipts). A third reader, a second one on the leader, gives
  the method's own floor (``probe_floor_*``: same relay, same windows).
* **rounds** (``--rounds``, 5): kill -9 of the current leader; failover = kill ->
  the consumer receives its first window of a transaction that *began after
  the kill* (so it can only come from the new leader's reading of the slot);
  also kill -> a relay reports itself leader of a higher epoch and streaming.
  Then the killed relay is started again (it rejoins as a follower) and the
  cluster settles (one leader, two followers of its epoch) before the next
  round.
* **checks over the whole run**: ``lost_windows`` = committed transactions of
  which the consumer did not get all 10 rows; ``duplicate_rows``;
  ``out_of_order`` = windows whose SCN is not above the previous one;
  ``source_readers`` = the most replication connections (walsenders) to the
  source database seen by a sampler every 100 ms from start-up to the end.
* **baselines, same run**: the session timeout itself
  (``failover_vs_session_timeout_ratio`` = worst failover / 4 s) and a plain
  loopback HTTP round trip (``GET /v1/status`` on a relay, p50), the floor of
  any relay-to-relay hop.

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import psycopg

import _common
from _zk import ZkServer
from changebus.client import Consumer, ConsumerConfig, RelayStream, StreamConfig
from changebus.fetchers.postgres import EmbeddedPostgres

PART = "main"
SESSION_TIMEOUT_S = 4.0
DB = "bench"


@dataclass
class RelayProc:
    """One ``changebus relay`` subprocess with a ``[cluster]`` table; its log in a file."""

    name: str
    port: int
    base: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_config(self, dsn: str, slot: str, zk: str, cluster: str) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        (self.base / "relay.toml").write_text(
            f'data_dir = "{self.base / "data"}"\nflush_interval_s = 0\n'
            f"[http]\nport = {self.port}\nmax_wait_s = 10\n"
            f'[cluster]\nzookeeper = "{zk}"\nname = "{cluster}"\nmember_id = "{self.name}"\n'
            f"session_timeout_s = {SESSION_TIMEOUT_S}\n"
            f'[[partitions]]\nname = "{PART}"\nid = 1\ncapacity_bytes = "64MiB"\n'
            f"[partitions.fetcher]\nretry_initial_s = 0.1\nretry_max_s = 1.0\n"
            f'kind = "postgres"\n'
            f'options = {{ dsn = "{dsn}", slot = "{slot}", status_interval_s = 0.2 }}\n'
        )

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(_common.PATHS)}
        with (self.base / "relay.log").open("ab") as logfile:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "changebus.schemas",
                    "relay",
                    "--config",
                    str(self.base / "relay.toml"),
                ],
                env=env,
                stdout=logfile,
                stderr=subprocess.STDOUT,
            )

    def kill(self) -> None:
        """kill -9 by pid and reap."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)


async def status(session: aiohttp.ClientSession, r: RelayProc) -> dict[str, Any] | None:
    """The partition's /v1/status entry (None when the relay does not answer)."""
    if r.proc is None or r.proc.poll() is not None:
        return None
    try:
        async with session.get(
            f"{r.url}/v1/status", timeout=aiohttp.ClientTimeout(total=2)
        ) as resp:
            if resp.status != 200:
                return None
            part: dict[str, Any] = (await resp.json())["partitions"][0]
            return part
    except (aiohttp.ClientError, TimeoutError, KeyError, IndexError):
        return None


async def statuses(
    session: aiohttp.ClientSession, relays: list[RelayProc]
) -> list[dict[str, Any] | None]:
    return list(await asyncio.gather(*(status(session, r) for r in relays)))


async def settled(
    session: aiohttp.ClientSession, relays: list[RelayProc], seconds: float = 60
) -> tuple[RelayProc, int]:
    """Wait for one streaming leader and streaming followers of its epoch; (leader, epoch)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sts = await statuses(session, relays)
        leaders = [
            (r, st)
            for r, st in zip(relays, sts, strict=True)
            if st and st.get("role") == "leader" and st.get("state") == "streaming"
        ]
        if len(leaders) == 1:
            leader, lst = leaders[0]
            epoch = int(lst.get("epoch", 0))
            if all(
                st
                and st.get("role") == "follower"
                and st.get("epoch") == epoch
                and st.get("state") == "streaming"
                for r, st in zip(relays, sts, strict=True)
                if r is not leader
            ):
                return leader, epoch
        await asyncio.sleep(0.1)
    raise TimeoutError("the cluster did not settle (one leader, two followers)")


class Writer:
    """Commits 10-row transactions (ids 10n .. 10n+9) at ``rate`` transactions/s from a thread.

    ``began[n]`` is the monotonic time transaction n began; ``committed`` counts the
    transactions committed (0 .. committed-1).
    """

    def __init__(self, dsn: str, rate: float = 100.0) -> None:
        self.dsn = dsn
        self.rate = rate
        self.began: list[float] = []
        self.committed = 0
        self.error: Exception | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="writer")

    def _run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                next_at = time.monotonic()
                while not self._stop.is_set():
                    n = self.committed
                    self.began.append(time.monotonic())
                    conn.execute(
                        "INSERT INTO t SELECT g, g * 3 FROM generate_series(%s::int8, %s::int8) g",
                        (n * 10, n * 10 + 9),
                    )
                    self.committed = n + 1
                    next_at += 1 / self.rate
                    time.sleep(max(0.0, next_at - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - reported by the main loop
            self.error = exc

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


class Sampler:
    """Counts the replication connections (walsenders) to the source database every 100 ms."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.max = 0
        self.samples = 0
        self.over_one = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="sampler")

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self._stop.is_set():
                row = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'walsender'"
                    " AND datname = current_database()"
                ).fetchone()
                n = int(row[0]) if row else 0
                self.max = max(self.max, n)
                self.samples += 1
                self.over_one += n > 1
                self._stop.wait(0.1)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@dataclass
class Received:
    """What the consumer got: (receipt time, SCN, highest transaction number) per window."""

    windows: list[tuple[float, int, int]] = field(default_factory=list)
    rows: dict[int, int] = field(default_factory=dict)  # id -> times received


async def consume(zk: str, cluster: str, got: Received) -> None:
    cfg = ConsumerConfig(
        zookeeper=zk,
        cluster=cluster,
        partition=PART,
        start="earliest",
        wait_s=1.0,
        backoff_initial_s=0.05,
        backoff_max_s=0.5,
        zookeeper_session_timeout_s=SESSION_TIMEOUT_S,
    )
    async with Consumer(cfg) as consumer:
        async for window in consumer:
            now = time.monotonic()
            top = -1
            for e in window.events:
                key = int(e.key["id"])
                got.rows[key] = got.rows.get(key, 0) + 1
                top = max(top, key // 10)
            got.windows.append((now, window.scn, top))


async def lag_probe(leader_url: str, follower_url: str, seconds: float) -> dict[str, list[float]]:
    """Receipt-time differences per window SCN (ms), from three follow-mode readers.

    ``lag``: follower reader - first leader reader; ``floor``: second leader reader -
    first leader reader, i.e. what the method itself adds when both ends are the
    same relay (the baseline of the lag). Runs in its own process
    (``--lag-probe``), so the consumer, the writer and the sampler of the main
    process never delay a receipt time stamp.
    """
    names = ("leader", "leader2", "follower")
    urls = (leader_url, leader_url, follower_url)
    seen: dict[str, dict[int, int]] = {n: {} for n in names}
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{leader_url}/v1/status") as resp:
            start = int((await resp.json())["partitions"][0]["max_scn"])

        async def read(name: str, url: str) -> None:
            stream = RelayStream(
                StreamConfig(relays=(url,), partition=PART, follow=True, wait_s=5.0),
                session,
                position=start,
            )
            box = seen[name]

            async def sink(window: Any, _url: str) -> None:
                box[int(window.scn)] = time.monotonic_ns()

            await stream.run(sink)

        tasks = [asyncio.create_task(read(n, u)) for n, u in zip(names, urls, strict=True)]
        await asyncio.sleep(seconds)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    lead = seen["leader"]

    def diff(other: dict[int, int]) -> list[float]:
        return [(other[s] - lead[s]) / 1e6 for s in lead if s in other]

    return {"lag": diff(seen["follower"]), "floor": diff(seen["leader2"])}


def follower_lag(leader: RelayProc, follower: RelayProc, seconds: float) -> dict[str, list[float]]:
    """Run :func:`lag_probe` in a child process (blocking: call it in a thread)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([*_common.PATHS, str(_common.ROOT / "bench")]),
    }
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--lag-probe",
            f"{leader.url},{follower.url}",
            "--lag-seconds",
            str(seconds),
        ],
        env=env,
        check=True,
        capture_output=True,
        timeout=seconds + 60,
    )
    got: dict[str, list[float]] = json.loads(out.stdout.splitlines()[-1])
    return got


async def loopback_rtt_ms(session: aiohttp.ClientSession, r: RelayProc, n: int = 200) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        async with session.get(f"{r.url}/v1/status") as resp:
            await resp.read()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.percentile(times, 50))


async def wait_for(cond: Any, seconds: float, what: str, step: float = 0.01) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(step)


async def run(
    relays: list[RelayProc], zk: str, cluster: str, dsn: str, writer: Writer, args: Any
) -> dict[str, Any]:
    result: dict[str, Any] = {}
    got = Received()
    async with aiohttp.ClientSession() as session:
        leader, epoch = await settled(session, relays)
        print(f"cluster settled: {leader.name} leads epoch {epoch}", flush=True)
        writer.start()
        consumer = asyncio.create_task(consume(zk, cluster, got))
        await wait_for(lambda: len(got.windows) >= 100, 60, "the consumer's first windows", 0.05)
        rtt = await loopback_rtt_ms(session, leader)
        follower = next(r for r in relays if r is not leader)
        probe = await asyncio.to_thread(follower_lag, leader, follower, args.lag_seconds)
        lag = np.array(probe["lag"], dtype=np.float64)
        floor = np.array(probe["floor"], dtype=np.float64)
        result["follower_lag_p50_ms"] = round(float(np.percentile(lag, 50)), 3)
        result["follower_lag_p99_ms"] = round(float(np.percentile(lag, 99)), 3)
        result["follower_lag_max_ms"] = round(float(lag.max()), 3)
        result["follower_lag_windows"] = int(lag.size)
        result["probe_floor_p50_ms"] = round(float(np.percentile(floor, 50)), 3)
        result["probe_floor_p99_ms"] = round(float(np.percentile(floor, 99)), 3)
        result["loopback_rtt_p50_ms"] = round(rtt, 3)
        print(
            f"follower lag over {lag.size} windows: p50 {result['follower_lag_p50_ms']} ms, "
            f"p99 {result['follower_lag_p99_ms']} ms, max {result['follower_lag_max_ms']} ms; "
            f"probe floor (2nd leader reader - 1st) p50 {result['probe_floor_p50_ms']} ms, "
            f"p99 {result['probe_floor_p99_ms']} ms; loopback GET /v1/status p50 {rtt:.3f} ms",
            flush=True,
        )
        failovers: list[float] = []
        leader_s: list[float] = []
        for rnd in range(args.rounds):
            if consumer.done():
                consumer.result()
            await asyncio.sleep(1.0)
            leader, epoch = await settled(session, relays)
            first_new = len(writer.began)  # transactions from here on begin after the kill
            seen_before = len(got.windows)
            killed_at = time.monotonic()
            leader.kill()
            new_leader_at: float | None = None
            served_at: float | None = None
            deadline = killed_at + 60
            idx = seen_before
            while served_at is None or new_leader_at is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"round {rnd + 1}: no new window within 60 s")
                while served_at is None and idx < len(got.windows):
                    at, _scn, top = got.windows[idx]
                    if top >= first_new:
                        served_at = at
                    idx += 1
                if new_leader_at is None:
                    for st in await statuses(session, relays):
                        if (
                            st
                            and st.get("role") == "leader"
                            and st.get("state") == "streaming"
                            and int(st.get("epoch", 0)) > epoch
                        ):
                            new_leader_at = time.monotonic()
                await asyncio.sleep(0.02)
            failovers.append(served_at - killed_at)
            leader_s.append(new_leader_at - killed_at)
            print(
                f"round {rnd + 1}: killed {leader.name} (epoch {epoch}); new leader streaming "
                f"after {leader_s[-1]:.2f} s, first new window at the consumer after "
                f"{failovers[-1]:.2f} s",
                flush=True,
            )
            leader.start()
            await settled(session, relays)
        writer.stop()
        if writer.error is not None:
            raise writer.error
        last = writer.committed - 1
        await wait_for(
            lambda: bool(got.windows) and max(w[2] for w in got.windows[-50:]) >= last,
            60,
            "the consumer to receive the last transaction",
            0.05,
        )
        await asyncio.sleep(0.5)
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)

    lost = sum(
        1
        for n in range(writer.committed)
        if any(got.rows.get(n * 10 + i, 0) == 0 for i in range(10))
    )
    scns = [w[1] for w in got.windows]
    out_of_order = sum(1 for a, b in itertools.pairwise(scns) if b <= a)
    result.update(
        {
            "rounds": args.rounds,
            "session_timeout_s": SESSION_TIMEOUT_S,
            "failover_s": [round(f, 3) for f in failovers],
            "failover_s_max": round(max(failovers), 3),
            "new_leader_s": [round(f, 3) for f in leader_s],
            "failover_vs_session_timeout_ratio": round(max(failovers) / SESSION_TIMEOUT_S, 3),
            "transactions": writer.committed,
            "windows_received": len(got.windows),
            "lost_windows": lost,
            "duplicate_rows": sum(c - 1 for c in got.rows.values() if c > 1),
            "out_of_order": out_of_order,
        }
    )
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lag-seconds", type=float, default=8.0)
    ap.add_argument("--lag-probe", metavar="LEADER_URL,FOLLOWER_URL", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.lag_probe:  # the child process of follower_lag
        leader_url, follower_url = args.lag_probe.split(",")
        print(json.dumps(asyncio.run(lag_probe(leader_url, follower_url, args.lag_seconds))))
        return
    load = os.getloadavg()
    base = Path(tempfile.mkdtemp(prefix="changebus-bench-failover-"))
    base.chmod(0o755)  # as root, Postgres runs as its own user under base / "pg"
    zk: ZkServer | None = None
    pg: EmbeddedPostgres | None = None
    relays: list[RelayProc] = []
    writer: Writer | None = None
    sampler: Sampler | None = None
    t0 = time.monotonic()
    try:
        zk = ZkServer(base / "zk")
        zk.start()
        pg = EmbeddedPostgres.start(base / "pg")
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {DB}")
        dsn = pg.dsn(DB)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (id int8 PRIMARY KEY, v int8 NOT NULL)")
        cluster = f"b{uuid.uuid4().hex[:10]}"
        sampler = Sampler(dsn)
        sampler.start()
        relays = [RelayProc(f"r{i}", _common.free_port(), base / f"r{i}") for i in range(3)]
        for r in relays:
            r.write_config(dsn, "changebus", zk.hosts, cluster)
            r.start()
        writer = Writer(dsn)
        result = asyncio.run(run(relays, zk.hosts, cluster, dsn, writer, args))
        sampler.stop()
        result["source_readers"] = sampler.max
        result["source_reader_samples"] = sampler.samples
        result["source_reader_samples_over_1"] = sampler.over_one
        result["load_avg_1m_at_start"] = round(load[0], 2)
        result["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
        result["run_s"] = round(time.monotonic() - t0, 1)
        print(
            f"failover (kill -9 -> first new window at the consumer): "
            f"{', '.join(f'{f:.2f}' for f in result['failover_s'])} s, max "
            f"{result['failover_s_max']:.2f} s = {result['failover_vs_session_timeout_ratio']:.2f}x "
            f"the {SESSION_TIMEOUT_S:.0f} s session timeout",
            flush=True,
        )
        print(
            f"{result['transactions']:,} transactions, {result['windows_received']:,} windows at the "
            f"consumer: lost {result['lost_windows']}, duplicate rows {result['duplicate_rows']}, "
            f"out of order {result['out_of_order']}; source readers max {sampler.max} over "
            f"{sampler.samples} samples; load average {load[0]:.2f} -> "
            f"{result['load_avg_1m_at_end']:.2f}; run {result['run_s']} s",
            flush=True,
        )
    finally:
        if writer is not None:
            writer.stop()
        if sampler is not None:
            sampler.stop()
        for r in relays:
            r.kill()
        if zk is not None:
            zk.stop()
        if pg is not None:
            pg.stop()
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
