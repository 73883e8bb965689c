"""Member processes of the consumer-group fault tests and their logs: writers on the
source, a :class:`Group` of ``group_member.py`` processes sharing one target database,
and the readings of their logs (all on one host clock, ``time.monotonic()``)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from decimal import Decimal
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
from test_client_cli import ENV
from test_e2e_pg import (
    TABLES,
    Target,
    free_port,
    pg_relay,
    source_rows,
    sync_marker,
)

from _zk import TICK_MS
from fix_pg import wait_until, writer_txn

MEMBER = Path(__file__).with_name("group_member.py")
PART = "pg"
BUCKETS = 12
SESSION_S = 2.0
#: the ZooKeeper server's tick: it expires a session up to a tick after its timeout
TICK_S = TICK_MS / 1000
#: the longest pause allowed to a unit that stays with its member while writers run
GAP_S = 1.0
KEYS = 400
UNITS = tuple(f"{PART}.{b}" for b in range(BUCKETS))


# ---- the source's writers ------------------------------------------------------------


class Writers:
    """Threads committing random multi-row transactions (inserts, updates, deletes)."""

    def __init__(self, dsn: str, threads: int = 2, pause_s: float = 0.02) -> None:
        self.dsn = dsn
        self.pause_s = pause_s
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(seed,), daemon=True) for seed in range(threads)
        ]
        self.started = self.stopped = 0.0
        self.errors: list[psycopg.Error] = []

    def start(self) -> None:
        self.started = time.monotonic()
        for t in self._threads:
            t.start()

    async def stop(self) -> None:
        if self._stop.is_set() or not self.started:
            return
        self._stop.set()
        self.stopped = time.monotonic()
        for t in self._threads:
            await asyncio.to_thread(t.join)
        assert not self.errors, self.errors

    def _run(self, seed: int) -> None:
        rnd = random.Random(seed)
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                i = 0
                while not self._stop.is_set():
                    i += 1
                    writer_txn(conn, partial(self._ops, conn, rnd, i))
                    self._stop.wait(self.pause_s)
        except psycopg.Error as exc:  # reported by stop()
            self.errors.append(exc)

    @classmethod
    def _ops(cls, conn: psycopg.Connection[Any], rnd: random.Random, i: int) -> None:
        for _ in range(rnd.randint(1, 4)):
            cls._op(conn, rnd, i)

    @staticmethod
    def _op(conn: psycopg.Connection[Any], rnd: random.Random, i: int) -> None:
        k = rnd.randint(1, KEYS)
        r = rnd.random()
        if r < 0.4:
            conn.execute(
                "INSERT INTO acct VALUES (%s, %s, %s, %s) ON CONFLICT (id) DO UPDATE"
                " SET bal = EXCLUDED.bal, name = EXCLUDED.name",
                (k, Decimal(rnd.randint(0, 10**6)) / 100, f"n{k}-{i}", k % 2 == 0),
            )
        elif r < 0.6:
            conn.execute("UPDATE acct SET bal = bal + 1.25 WHERE id = %s", (k,))
        elif r < 0.7:
            conn.execute("DELETE FROM acct WHERE id = %s", (k,))
        elif r < 0.93:
            conn.execute(
                "INSERT INTO orders VALUES (%s, %s, %s, %s) ON CONFLICT (acct, no)"
                " DO UPDATE SET amount = orders.amount + 1",
                (k, rnd.randint(1, 3), rnd.randint(-(2**40), 2**40), "x" * (k % 5)),
            )
        else:
            conn.execute("DELETE FROM orders WHERE acct = %s", (k,))


# ---- member processes and their logs ----------------------------------------------------


@dataclass
class Proc:
    """One member process and its JSON-lines log."""

    name: str
    log: Path
    err: Path
    proc: asyncio.subprocess.Process
    stopped_at: float = 0.0

    def lines(self, ev: str | None = None) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        out = []
        for raw in self.log.read_text().splitlines():
            if raw.endswith("}"):
                line = json.loads(raw)
                if ev is None or line["ev"] == ev:
                    out.append(line)
        return out

    @property
    def member_id(self) -> str:
        """The member id of the latest assignment callback ("" before any)."""
        ids = [x["m"] for x in self.lines() if x["ev"] == "assigned" and x["m"]]
        return ids[-1] if ids else ""

    def owned(self) -> set[str]:
        """The units this member holds now, by its rebalance callbacks."""
        units: set[str] = set()
        for x in self.lines():
            if x["ev"] == "assigned":
                units |= set(x["units"])
            elif x["ev"] in ("revoked", "lost"):
                units -= set(x["units"])
        return units

    def stderr(self) -> str:
        return self.err.read_text(errors="replace") if self.err.exists() else ""

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    def signal(self, sig: int) -> None:
        if self.alive:
            os.kill(self.proc.pid, sig)

    async def ready(self) -> None:
        """Wait until the held process has imported everything (``--hold``)."""
        await wait_until(lambda: self.lines("ready"), 30, f"{self.name} ready")

    async def go(self) -> None:
        assert self.proc.stdin is not None
        await self.ready()
        self.proc.stdin.write(b"go\n")
        await self.proc.stdin.drain()

    async def terminate(self) -> None:
        # the time is taken before the signal: the woken member may preempt this process and
        # log its revocation before the line after ``kill`` runs
        self.stopped_at = time.monotonic()
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        await asyncio.wait_for(self.proc.wait(), 30)
        assert self.proc.returncode == 0, self.stderr()[-3000:]


@dataclass
class Group:
    """A consumer group's member processes against one relay and one target database."""

    tmp: Path
    zookeeper: str
    relay: str
    target: Target
    name: str = field(default_factory=lambda: f"g{uuid.uuid4().hex[:10]}")
    procs: list[Proc] = field(default_factory=list)

    async def spawn(
        self, name: str, *, buckets: int = BUCKETS, hold: bool = True, extra: Sequence[str] = ()
    ) -> Proc:
        log, err = self.tmp / f"{name}.log", self.tmp / f"{name}.err"
        args = [
            str(MEMBER),
            *("--zookeeper", self.zookeeper, "--group", self.name, "--relay", self.relay),
            *("--partition", PART, "--buckets", str(buckets), "--log", str(log)),
            *("--name", name, "--session-timeout", str(SESSION_S), "--commit-interval", "0.2"),
        ]
        if hold:
            args.append("--hold")
        args.extend(extra)
        with err.open("wb") as errfile:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                *args,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=errfile,
                env={**ENV, **self.target.env},
            )
        p = Proc(name, log, err, proc)
        self.procs.append(p)
        return p

    async def join(self, name: str) -> Proc:
        p = await self.spawn(name)
        await p.go()
        return p

    async def balanced(self, members: list[Proc], seconds: float = 30) -> None:
        """Wait until ``members`` hold every unit, evenly, each unit once."""
        quota = {BUCKETS // len(members), -(-BUCKETS // len(members))}

        def ok() -> bool:
            held = [p.owned() for p in members]
            return (
                all(len(h) in quota for h in held)
                and sum(len(h) for h in held) == BUCKETS
                and set().union(*held) == set(UNITS)
            )

        await self.wait(ok, seconds, f"balanced over {[p.name for p in members]}")

    async def delivering(self, members: list[Proc], seconds: float = 20) -> None:
        """Wait until each member delivered a window after its latest assignment."""

        def ok(p: Proc) -> bool:
            assigned = p.lines("assigned")
            return bool(assigned) and any(w["t"] > assigned[-1]["t"] for w in p.lines("win"))

        await self.wait(lambda: all(ok(p) for p in members), seconds, "deliveries")

    async def wait(
        self, pred: Callable[[], object], seconds: float, what: str, interval: float = 0.02
    ) -> None:
        """``wait_until`` that shows the members' state and errors when it times out."""
        try:
            await wait_until(pred, seconds, what, interval)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.diagnosis()}") from None

    def diagnosis(self) -> str:
        out = []
        for p in self.procs:
            out.append(
                f"--- {p.name} (exit {p.proc.returncode}, member {p.member_id or '-'},"
                f" owns {sorted(p.owned())}, {len(p.lines('win'))} windows)"
            )
            out.append(p.stderr()[-1500:])
        return "\n".join(out)

    async def converged(self, source_dsn: str, seconds: float = 60) -> None:
        """Wait until the target tables equal the source, row by row."""
        await sync_marker(source_dsn)
        expected = source_rows(source_dsn)
        assert expected["acct"] and expected["orders"]
        last: dict[str, Any] = {}

        def same() -> bool:
            try:
                last["rows"] = self.target.rows()
            except psycopg.errors.UndefinedTable:
                return False
            return bool(last["rows"] == expected)

        try:
            await wait_until(same, seconds, "target == source", interval=0.3)
        except AssertionError:
            got = last.get("rows", {})
            diff = {t: len(expected[t] ^ got.get(t, set())) for t in expected}
            raise AssertionError(f"target differs from source (rows differing: {diff})") from None

    def stored(self) -> dict[str, tuple[str, int, int]]:
        """The unit checkpoints in the target database: unit -> (owner, generation, window SCN)."""
        with psycopg.connect(self.target.dsn) as conn:
            rows = conn.execute(
                "SELECT unit, owner, generation, checkpoint FROM changebus_unit_checkpoints"
                " WHERE group_name = %s",
                (self.name,),
            ).fetchall()
        return {u: (o, int(g), _scn(c)) for u, o, g, c in rows}

    async def close(self) -> None:
        for p in self.procs:
            with suppress(ProcessLookupError):
                p.signal(signal.SIGCONT)
                p.signal(signal.SIGKILL)
            with suppress(TimeoutError):
                await asyncio.wait_for(p.proc.wait(), 10)


def _scn(checkpoint: str | None) -> int:
    if not checkpoint:
        return -1
    value = json.loads(checkpoint)
    return int(value.get("window_scn", -1)) if isinstance(value, dict) else -1


@asynccontextmanager
async def group_setup(
    pg_dsn: str, tmp_path: Path, zk_hosts: str
) -> AsyncIterator[tuple[Group, Writers]]:
    """Source tables, a target database, a streaming relay, a group and (unstarted) writers."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(TABLES)
    target = Target("postgres", tmp_path, pg_dsn)
    port = free_port()
    writers = Writers(pg_dsn)
    group = Group(tmp_path, zk_hosts, f"http://127.0.0.1:{port}", target)
    try:
        async with pg_relay(tmp_path, pg_dsn, port) as relay:
            await wait_until(lambda: relay.hosts[PART].status()["state"] == "streaming")
            try:
                yield group, writers
            finally:
                await writers.stop()
                await group.close()
    finally:
        target.drop(pg_dsn)


def first_after(procs: Iterable[Proc], ev: str, unit: str, after: float) -> float | None:
    """The earliest time a member of ``procs`` logged ``ev`` for ``unit`` after ``after``."""
    times = []
    for p in procs:
        for x in p.lines(ev):
            t = x.get("t_start", x["t"])
            if t > after and (x.get("u") == unit or unit in x.get("units", ())):
                times.append(t)
    return min(times) if times else None
