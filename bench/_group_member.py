"""The group member process of bench/consumer_group.py (run as ``consumer_group.py --member``).

A :class:`Consumer` with ``group=...`` (``BUCKETS`` buckets, the default
:class:`ZkUnitStore`, ZooKeeper session timeout ``SESSION_S``) held until a
line on stdin when started with ``--hold``. It writes JSON lines to its log,
each with ``t`` = ``time.monotonic()`` (one clock for all processes of the
host): its rebalance callbacks, the first delivery of each unit after each
assignment, every delivery gap over ``PAUSE_S``, the lease holds of its
engine, and its progress (events delivered, decoded) every 0.2 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import threading
import time
from typing import Any

from changebus.client import AsyncCallbacks, Consumer, ConsumerConfig, Window
from changebus.schemas import ChangebusError, Unit

PART = "bench"
BUCKETS = 64
SESSION_S = 2.0
#: a delivery gap longer than this counts as a pause of the unit
PAUSE_S = 0.5


class Log:
    """JSON lines with ``t`` = monotonic time, written and flushed one at a time (thread-safe)."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._lock = threading.Lock()

    def __call__(self, ev: str, **fields: Any) -> None:
        line = json.dumps({"ev": ev, "t": time.monotonic(), **fields})
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()


class Tracker:
    """The member's listener and delivery bookkeeping (its event loop only)."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.consumer: Consumer | None = None
        self.last: dict[str, float] = {}  # unit -> last delivery (while held)
        self.max_scn: dict[str, int] = {}  # unit -> highest SCN delivered (replays not counted)
        self.events = 0  # distinct data events delivered
        self.decoded = 0  # every data event delivered (replays after a move too)
        self.t_last = 0.0  # when the last new (not replayed) window came

    @property
    def member_id(self) -> str:
        return str(self.consumer.stats().get("member_id", "")) if self.consumer else ""

    def on_assigned(self, units: frozenset[Unit]) -> None:
        self.log("assigned", m=self.member_id, units=sorted(map(str, units)))

    def on_revoked(self, units: frozenset[Unit]) -> None:
        names = sorted(map(str, units))
        last = {u: self.last.pop(u) for u in names if u in self.last}
        self.log("revoked", m=self.member_id, units=names, last=last)

    def on_lost(self, units: frozenset[Unit]) -> None:
        names = sorted(map(str, units))
        for u in names:
            self.last.pop(u, None)
        self.log("lost", m=self.member_id, units=names)

    def deliver(self, window: Window) -> None:
        t = time.monotonic()
        u = window.unit
        self.decoded += len(window.events)
        if window.scn > self.max_scn.get(u, -1):
            self.max_scn[u] = window.scn
            self.events += len(window.events)
            self.t_last = t
        last = self.last.get(u)
        if last is None:
            self.log("first", u=u)
        elif t - last > PAUSE_S:
            self.log("gap", u=u, t0=last, t1=t)
        self.last[u] = t

    async def progress(self) -> None:
        while True:
            self.log("progress", events=self.events, decoded=self.decoded, t_last=self.t_last)
            await asyncio.sleep(0.2)


class LeaseLog(logging.Handler):
    """Logs when the member holds deliveries because its ZooKeeper lease is in doubt."""

    def __init__(self, log: Log) -> None:
        super().__init__(logging.INFO)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "lease is in doubt" in text:
            self.log("lease_hold")
        elif "lease is back" in text:
            self.log("lease_back")


class Deliveries(AsyncCallbacks):
    """The member's callbacks: every window goes to the tracker."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker

    async def on_end_window(self, window: Window) -> None:
        self.tracker.deliver(window)


async def member_main(a: argparse.Namespace) -> int:
    log = Log(a.log)
    log("ready")
    if a.hold:
        await asyncio.to_thread(sys.stdin.readline)
    log("go")
    config = ConsumerConfig(
        relays=(a.relay,),
        group=a.group,
        zookeeper=a.zookeeper,
        partition=PART,
        buckets=a.buckets,
        member_name=a.name,
        zookeeper_session_timeout_s=SESSION_S,
        commit_interval_s=1.0,
        wait_s=1.0,
        queue_bytes=64 << 20,
    )
    engine_log = logging.getLogger("changebus.client._group")
    engine_log.setLevel(logging.INFO)
    engine_log.addHandler(LeaseLog(log))
    tracker = Tracker(log)
    consumer = Consumer(config, listener=tracker)
    tracker.consumer = consumer
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, consumer.stop)
    progress = asyncio.create_task(tracker.progress())
    try:
        async with consumer:
            await consumer.run(Deliveries(tracker))
    except ChangebusError as exc:
        log("error", type=type(exc).__name__, message=exc.message)
        return 2
    finally:
        progress.cancel()
        log("progress", events=tracker.events, decoded=tracker.decoded, t_last=tracker.t_last)
    return 0
