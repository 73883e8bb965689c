"""One consumer-group member in its own process, for the group fault tests.

Usage (PYTHONPATH as the tests' ``ENV``; the target DSN in the environment
variable ``CHANGEBUS_REPLICA_DSN``, never on the command line)::

    python group_member.py --zookeeper HOSTS --group G --relay URL --partition P
        --buckets N --log FILE [--name X] [--session-timeout 2] [--commit-interval 0.2]
        [--hold] [--fail-on-wake]

With ``--hold`` the process imports everything, logs ``ready`` and joins
only when a line arrives on stdin (so a test can time a join without the
CPU burst of a Python start-up).

The member joins group ``G`` with a :class:`PostgresReplica` sink writing to
the target database shared by all members (effectively-once: each window's
rows and its unit checkpoint in one transaction). It appends one JSON object
per line to ``FILE`` (flushed at once, so a kill -9 loses nothing written),
every line with ``t`` = ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for
all processes of the host) and ``pid``:

* ``{"ev": "win", "m": member_id, "u": unit, "scn": s, "n": events, "applied": bool,
  "t_start": t0, "admitted": t1}`` -- one per window handed to ``on_end_window``
  (``applied``: the replica wrote it; false when it skipped a replay or the
  unit was fenced; ``t_start``: when its ``on_start_window`` came;
  ``admitted``: when the group's fence let it through, just before);
* ``{"ev": "assigned" | "revoked" | "lost", "m": member_id, "units": [...]}``
  -- the rebalance callbacks;
* ``{"ev": "claim", "m", "u", "token", "generation"}`` and
  ``{"ev": "commit", "m", "written": [...], "fenced": [...], "t_start": t0}``
  -- the unit store calls the engine makes (the replica is the store;
  ``t_start``: when the commit was sent, which may be before a stop that
  came while it waited for the answer);
* ``{"ev": "self_stop", "u", "scn"}`` -- after a SIGUSR1, the member stops
  itself (SIGSTOP) in the middle of its next unit window's ``on_end_window``
  (a stop at the worst moment; the test sends SIGCONT);
* ``{"ev": "fail", "u", "scn"}`` -- with ``--fail-on-wake``, the window in
  progress when the process was stopped fails once (ERROR, before it is
  applied) when it ends, so the dispatcher rolls back and replays at once;
* ``{"ev": "wake", "gap_s": g}`` -- a probe thread saw its own clock jump
  (the process was stopped): right after it the member tries to commit, with
  its old tokens, a checkpoint of every unit it held before, and logs
  ``{"ev": "zombie_commit", "written": [...], "fenced": [...]}``;
* ``{"ev": "stats", ...}`` every second and at a clean stop (SIGTERM); ``{"ev": "error",
  "type", "message"}`` when the consumer fails (also printed on stderr as
  ``error: <Type>: <message>``, exit status 2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from changebus.client import CallbackResult, Consumer, ConsumerConfig, PostgresReplica, Window
from changebus.schemas import (
    ChangebusError,
    CommitResult,
    PartitionCheckpoint,
    Unit,
    UnitClaim,
    UnitCommit,
)


class Log:
    """JSON lines, one write + flush each (thread-safe)."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._lock = threading.Lock()
        self.pid = os.getpid()

    def __call__(self, ev: str, **fields: Any) -> None:
        line = json.dumps({"ev": ev, "t": time.monotonic(), "pid": self.pid, **fields})
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()


class Member:
    """Who this process is in the group now (the consumer's ``member_id`` stat)."""

    def __init__(self) -> None:
        self.consumer: Consumer | None = None

    @property
    def id(self) -> str:
        consumer = self.consumer
        if consumer is None:
            return ""
        return str(consumer.stats().get("member_id", ""))


class LoggingReplica(PostgresReplica):
    """A PostgresReplica (sink and unit store) that logs deliveries, claims and commits."""

    def __init__(self, dsn: str, log: Log, member: Member, *, fail_on_wake: bool = False) -> None:
        super().__init__(dsn)
        self.log = log
        self.member = member
        self.fail_on_wake = fail_on_wake
        self.stop_next = False  # SIGUSR1: stop this process in the next window
        self.claims: dict[Unit, UnitClaim] = {}
        self.positions: dict[Unit, PartitionCheckpoint] = {}
        self.window_started = 0.0  # when the window being delivered began (on_start_window)
        self.window_admitted = 0.0  # when the group's fence let that window through

    async def on_start_window(self, window: Window) -> Any:
        self.window_started = time.monotonic()
        consumer = self.member.consumer
        group = consumer._group if consumer is not None else None
        self.window_admitted = group.admitted_at if group is not None else 0.0
        return await super().on_start_window(window)

    async def on_end_window(self, window: Window) -> Any:
        t = self.window_started
        if self.stop_next and window.unit:
            self.stop_next = False
            self.log("self_stop", u=window.unit, scn=window.scn)
            os.kill(os.getpid(), signal.SIGSTOP)
        if self.fail_on_wake and time.monotonic() - t > 1.0:  # it spanned a stop
            self.fail_on_wake = False
            self.log("fail", u=window.unit, scn=window.scn)
            return CallbackResult.ERROR
        before = self.windows_applied
        result = await super().on_end_window(window)
        self.log(
            "win",
            m=self.member.id,
            u=window.unit,
            scn=window.scn,
            n=len(window.events),
            applied=self.windows_applied > before,
            t_start=t,
            admitted=self.window_admitted,
        )
        if window.unit:
            self.positions[Unit.parse(window.unit)] = window.position_after(PartitionCheckpoint())
        return result

    async def claim(self, group: str, unit: Unit, owner: str, fence: int = -1) -> UnitClaim:
        claim = await super().claim(group, unit, owner, fence)
        self.claims[unit] = claim
        self.log(
            "claim",
            m=owner,
            u=str(unit),
            token=claim.token,
            generation=claim.generation,
            scn=claim.checkpoint.window_scn if claim.checkpoint else -1,
        )
        return claim

    async def commit(self, group: str, commits: Sequence[UnitCommit]) -> CommitResult:
        t = time.monotonic()
        result = await super().commit(group, commits)
        if commits:
            self.log(
                "commit",
                m=self.member.id,
                written=sorted(str(u) for u in result.tokens),
                fenced=sorted(str(u) for u in result.fenced),
                t_start=t,
            )
        return result


class Listener:
    """The rebalance callbacks: log them."""

    def __init__(self, log: Log, member: Member) -> None:
        self.log = log
        self.member = member

    def on_assigned(self, units: frozenset[Unit]) -> None:
        self.log("assigned", m=self.member.id, units=sorted(str(u) for u in units))

    def on_revoked(self, units: frozenset[Unit]) -> None:
        self.log("revoked", m=self.member.id, units=sorted(str(u) for u in units))

    def on_lost(self, units: frozenset[Unit]) -> None:
        self.log("lost", m=self.member.id, units=sorted(str(u) for u in units))


def probe(log: Log, loop: asyncio.AbstractEventLoop, woke: asyncio.Event) -> None:
    """Notice a stop of the whole process (SIGSTOP): the monotonic clock jumps."""
    prev = time.monotonic()
    while True:
        time.sleep(0.005)
        now = time.monotonic()
        if now - prev > 1.0:
            log("wake", gap_s=round(now - prev, 3))
            loop.call_soon_threadsafe(woke.set)
        prev = now


async def zombie_commit(replica: LoggingReplica, group: str, woke: asyncio.Event, log: Log) -> None:
    """After a wake-up, write every unit held before with its old token: must be refused."""
    while True:
        await woke.wait()
        woke.clear()
        old = dict(replica.claims)
        commits = [
            UnitCommit(
                u, replica.positions.get(u) or c.checkpoint or PartitionCheckpoint(), c.token
            )
            for u, c in sorted(old.items())
        ]
        commits = [c for c in commits if c.checkpoint.has_position]
        if not commits:
            log("zombie_commit", written=[], fenced=[], skipped=sorted(str(u) for u in old))
            continue
        try:
            result = await replica.commit(group, commits)
        except ChangebusError as exc:
            log("zombie_commit", error=f"{type(exc).__name__}: {exc.message}")
            continue
        log(
            "zombie_commit",
            written=sorted(str(u) for u in result.tokens),
            fenced=sorted(str(u) for u in result.fenced),
            tokens={str(c.unit): c.token for c in commits},
        )


async def stats_every(member: Member, log: Log, seconds: float) -> None:
    """The consumer's group counters (``fenced_commits``, ``units_lost``, ...) now and then."""
    while True:
        await asyncio.sleep(seconds)
        if member.consumer is not None:
            log("stats", **{k: v for k, v in member.consumer.stats().items() if _plain(v)})


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--zookeeper", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--relay", required=True)
    ap.add_argument("--partition", required=True)
    ap.add_argument("--buckets", type=int, required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--name", default="")
    ap.add_argument("--session-timeout", type=float, default=2.0)
    ap.add_argument("--commit-interval", type=float, default=0.2)
    ap.add_argument("--hold", action="store_true", help="join only after a line on stdin")
    ap.add_argument("--fail-on-wake", action="store_true", help="fail the window a stop cut")
    args = ap.parse_args()
    log = Log(args.log)
    log("start", name=args.name)
    if args.hold:  # imported and ready: the test starts the join without the import's CPU burst
        log("ready")
        await asyncio.to_thread(sys.stdin.readline)
        log("go")
    member = Member()
    replica = LoggingReplica(
        os.environ["CHANGEBUS_REPLICA_DSN"], log, member, fail_on_wake=args.fail_on_wake
    )
    config = ConsumerConfig(
        relays=(args.relay,),
        group=args.group,
        zookeeper=args.zookeeper,
        partition=args.partition,
        buckets=args.buckets,
        member_name=args.name,
        zookeeper_session_timeout_s=args.session_timeout,
        commit_interval_s=args.commit_interval,
        wait_s=1.0,
        backoff_max_s=0.5,
        rollback_backoff_s=0.0 if args.fail_on_wake else 0.05,
    )
    loop = asyncio.get_running_loop()
    woke = asyncio.Event()
    threading.Thread(target=probe, args=(log, loop, woke), daemon=True).start()
    zombie = asyncio.create_task(zombie_commit(replica, args.group, woke, log))
    stats = asyncio.create_task(stats_every(member, log, 1.0))
    consumer = Consumer(config, persister=replica, listener=Listener(log, member))
    member.consumer = consumer
    loop.add_signal_handler(signal.SIGTERM, consumer.stop)
    loop.add_signal_handler(signal.SIGUSR1, lambda: setattr(replica, "stop_next", True))
    status = 0
    try:
        async with consumer:
            await consumer.run(replica)
            log("stats", **{k: v for k, v in consumer.stats().items() if _plain(v)})
    except ChangebusError as exc:
        log("error", type=type(exc).__name__, message=exc.message)
        print(f"error: {type(exc).__name__}: {exc.message}", file=sys.stderr, flush=True)
        status = 2
    finally:
        zombie.cancel()
        stats.cancel()
        await replica.close()
    return status


def _plain(value: object) -> bool:
    return isinstance(value, int | float | str | bool | list | type(None))


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
