"""Where commit -> callback latency goes: the stages of one window, timed in place.

The setting of ``bench/client.py``'s latency run (a private Postgres, 10-row
transactions at 1,000 rows/s, each ending with a logical message that names
it; a follow-mode consumer with async callbacks) with the relay in this
process, so that its stages can be timed, and the consumer in a process of
its own. Every clock is ``perf_counter_ns`` (CLOCK_MONOTONIC, the same in
every process). Per transaction:

* ``commit_to_emit``: COMMIT returned in the writer -> the fetcher thread
  hands the window over (Postgres's walsender, the socket, pgoutput decoding
  and Avro encoding);
* ``emit_to_commit``: -> the ingest task starts the group commit (the hop to
  the event loop, the fetcher's queue, the pump, the window queue);
* ``commit_to_append``: -> the append starts (on the loop, or a hop to the
  writer thread);
* ``append_to_publish``: -> the buffer publishes the window (validation,
  copy, event table, index, meta);
* ``publish_to_select``: -> the follower's push selects it;
* ``select_to_sent``: -> the push left the relay (copy, write, drain);
* ``sent_to_split``: -> the consumer's stream reader splits the bytes
  (loopback, the consumer's wake-up, HTTP parsing);
* ``split_to_window``: -> the assembled window reaches the consumer's sink
  (validation, assembly);
* ``window_to_callback``: -> ``on_end_window`` (decoding, the queue, the
  dispatcher, the callbacks before it).

Baseline in the same run: Postgres's own ``SELECT 1`` round trip, measured
after 10 ms of quiet like the windows are (``pg_idle_roundtrip_p50_ms``), and
without a pause (``pg_busy_roundtrip_p50_ms``); on an idle virtual machine
the difference is the cost of waking a sleeping CPU, which every hop of the
chain pays. The timing hooks patch private functions: this is a diagnostic,
``bench/client.py`` is the latency benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import tempfile
import time
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import psycopg

from changebus.client import AsyncCallbacks, Consumer, ConsumerConfig, Window
from changebus.fetchers.postgres import EmbeddedPostgres
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import HEADER_SIZE, Op, decode_control
from client import writer

STAGES = (
    "commit_to_emit",
    "emit_to_commit",
    "commit_to_append",
    "append_to_publish",
    "publish_to_select",
    "select_to_sent",
    "sent_to_split",
    "split_to_window",
    "window_to_callback",
)


def consumer_process(url: str, seconds: float, out: Any) -> None:
    """Follow the partition for ``seconds``; send ``(split, window, callback)`` times by SCN."""
    from changebus.client import _assembler, _stream

    split_at: dict[int, int] = {}
    window_at: dict[int, int] = {}
    callback_at: dict[int, int] = {}
    last_split = [0]
    split = _assembler.EventSplitter.split

    def timed_split(self: Any, chunk: bytes) -> Any:
        last_split[0] = time.perf_counter_ns()
        return split(self, chunk)

    hand = _stream.RelayStream._hand

    async def timed_hand(self: Any, raw: Any, url: str, sink: Any) -> None:
        window_at[raw.scn] = time.perf_counter_ns()
        split_at[raw.scn] = last_split[0]
        await hand(self, raw, url, sink)

    _assembler.EventSplitter.split = timed_split  # type: ignore[method-assign]
    _stream.RelayStream._hand = timed_hand  # type: ignore[method-assign]

    class Receipts(AsyncCallbacks):
        async def on_end_window(self, window: Window) -> None:
            callback_at[window.scn] = time.perf_counter_ns()

    async def main() -> None:
        cfg = ConsumerConfig(relays=(url,), partition="bench", wait_s=1.0, start="latest")
        async with Consumer(cfg) as consumer:
            task = asyncio.create_task(consumer.run(Receipts()))
            await asyncio.sleep(seconds)
            consumer.stop()
            await task
        out.put((split_at, window_at, callback_at))

    asyncio.run(main())


def round_trips(dsn: str) -> tuple[float, float]:
    """Postgres ``SELECT 1`` p50 in ms: after 10 ms of quiet, and back to back."""
    idle: list[float] = []
    busy: list[float] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        for pause, into in ((0.01, idle), (0.0, busy)):
            for _ in range(200):
                if pause:
                    time.sleep(pause)
                t0 = time.perf_counter_ns()
                conn.execute("SELECT 1").fetchone()
                into.append((time.perf_counter_ns() - t0) / 1e6)
    return float(np.percentile(idle, 50)), float(np.percentile(busy, 50))


class Stamps:
    """Timestamps taken inside the relay, by SCN (and the message number -> SCN)."""

    def __init__(self) -> None:
        self.by_stage: dict[str, dict[int, int]] = {
            s: {} for s in ("emit", "commit", "append", "select", "sent")
        }
        self.published: dict[int, int] = {}  # message number -> ns
        self.scn_of: dict[int, int] = {}

    def stamp(self, stage: str, scn: int) -> None:
        self.by_stage[stage][scn] = time.perf_counter_ns()


def instrument(host: Any, stamps: Stamps) -> None:
    """Wrap the relay's stages of ``host`` (one partition) with timestamps."""
    from changebus.relay import _broadcast, _follow, _send

    buf = host.buffer
    on_publish = buf.on_publish

    def published() -> None:
        now = time.perf_counter_ns()
        rec = buf._events.at(buf.meta.tail_event - 2)  # the MESSAGE before END_OF_WINDOW
        if int(rec["op"]) == Op.MESSAGE:
            start = int(rec["pos"]) % buf.capacity
            payload = bytes(buf._ring[start + HEADER_SIZE : start + int(rec["length"])])
            n = int(decode_control(Op.MESSAGE, payload).content)  # type: ignore[union-attr]
            stamps.published[n] = now
            stamps.scn_of[n] = int(rec["scn"])
        if on_publish is not None:
            on_publish()

    buf.on_publish = published
    fetcher = host.fetcher
    emit = fetcher._emit

    def timed_emit(window: Any, out: Callable[[Any], None]) -> None:
        stamps.stamp("emit", window.scn)
        emit(window, out)

    fetcher._emit = timed_emit
    commit = host._commit

    async def timed_commit(f: Any, batch: list[Any]) -> None:
        stamps.stamp("commit", batch[-1].scn)
        await commit(f, batch)

    host._commit = timed_commit
    append = host._append

    def timed_append(batch: list[Any]) -> bool:
        stamps.stamp("append", batch[-1].scn)
        return bool(append(batch))

    host._append = timed_append
    # the follow stream's pushes: its own (at start-up, catching up) or the broadcast's
    copy = _follow._copy
    broadcast_copy = _broadcast.copy_out  # type: ignore[attr-defined]
    send = _send.SendWatch.send
    write = _broadcast.TailBroadcast._write
    pushed = [0]

    async def timed_copy(*args: Any) -> Any:
        t = time.perf_counter_ns()
        cached = await copy(*args)
        if cached is not None:
            stamps.by_stage["select"][cached.next_scn] = t
            pushed[0] = cached.next_scn
        return cached

    def timed_broadcast_copy(*args: Any) -> Any:
        t = time.perf_counter_ns()
        cached = broadcast_copy(*args)
        stamps.by_stage["select"][cached.next_scn] = t
        return cached

    async def timed_send(self: Any, *args: Any) -> bool:
        ok = await send(self, *args)
        stamps.stamp("sent", pushed[0])
        return bool(ok)

    def timed_write(self: Any, by_pos: Any, pos: Any, group: Any, push: Any) -> None:
        write(self, by_pos, pos, group, push)
        stamps.stamp("sent", push.next_scn)

    _follow._copy = timed_copy  # type: ignore[assignment]
    _broadcast.copy_out = timed_broadcast_copy  # type: ignore[attr-defined,assignment]
    _send.SendWatch.send = timed_send  # type: ignore[method-assign,assignment]
    _broadcast.TailBroadcast._write = timed_write  # type: ignore[method-assign]


async def run(seconds: float) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="changebus-bench-stages-"))
    base.chmod(0o755)  # noqa: ASYNC240 - a benchmark's set-up, nothing else runs yet
    server = EmbeddedPostgres.start(base / "pg")
    try:
        dsn = server.dsn()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (id int8 PRIMARY KEY, name text, at timestamptz)")
        idle_rtt, busy_rtt = round_trips(dsn)
        cfg = RelayConfig(
            data_dir=base / "relay",
            http=HttpConfig(port=0),
            partitions=(
                PartitionConfig(
                    "bench",
                    1,
                    capacity_bytes=64 << 20,
                    fetcher=FetcherConfig("postgres", {"dsn": dsn, "status_interval_s": 0.5}),
                ),
            ),
            flush_interval_s=0,
        )
        stamps = Stamps()
        async with Relay(cfg) as relay:
            host = relay.hosts["bench"]
            while host.state != "streaming":  # noqa: ASYNC110 - a benchmark's start-up poll
                await asyncio.sleep(0.05)
            instrument(host, stamps)
            ctx = mp.get_context("spawn")
            results, commits = ctx.Queue(), ctx.Queue()
            url = f"http://127.0.0.1:{relay.port}"
            consumer = ctx.Process(target=consumer_process, args=(url, seconds + 3.5, results))
            consumer.start()
            await asyncio.sleep(1.5)
            source = ctx.Process(target=writer, args=(dsn, seconds, commits))
            source.start()
            committed, _ = await asyncio.to_thread(commits.get)
            split_at, window_at, callback_at = await asyncio.to_thread(results.get)
            await asyncio.to_thread(consumer.join)
            await asyncio.to_thread(source.join)
    finally:
        server.stop()
    points: dict[str, list[float]] = {s: [] for s in STAGES}
    totals: list[float] = []
    st = stamps.by_stage
    for n, at in committed.items():
        scn = stamps.scn_of.get(n)
        if n <= 50 or scn is None or scn not in callback_at or scn not in st["sent"]:
            continue  # warm-up, or a push that carried more than this window
        chain = [
            at,
            st["emit"][scn],
            st["commit"][scn],
            st["append"][scn],
            stamps.published[n],
            st["select"][scn],
            st["sent"][scn],
            split_at[scn],
            window_at[scn],
            callback_at[scn],
        ]
        for stage, (a, b) in zip(STAGES, pairwise(chain), strict=True):
            points[stage].append((b - a) / 1e6)
        totals.append((chain[-1] - chain[0]) / 1e6)
    result: dict[str, Any] = {
        f"{s}_p50_ms": round(float(np.median(v)), 3) for s, v in points.items()
    }
    result["total_p50_ms"] = round(float(np.percentile(totals, 50)), 3)
    result["total_p99_ms"] = round(float(np.percentile(totals, 99)), 3)
    result["samples"] = len(totals)
    result["pg_idle_roundtrip_p50_ms"] = round(idle_rtt, 3)
    result["pg_busy_roundtrip_p50_ms"] = round(busy_rtt, 3)
    result["total_vs_pg_idle_roundtrip_ratio"] = round(result["total_p50_ms"] / idle_rtt, 2)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    args = ap.parse_args()
    # the relay daemon's GIL switch interval (changebus relay sets it from its config)
    sys.setswitchinterval(RelayConfig.gil_switch_interval_s)
    result = asyncio.run(run(args.seconds))
    for stage in STAGES:
        print(f"{stage:20s} p50 {result[f'{stage}_p50_ms']:.3f} ms")
    print(
        f"commit -> callback p50 {result['total_p50_ms']} ms, p99 {result['total_p99_ms']} ms "
        f"over {result['samples']} transactions; Postgres SELECT 1 after 10 ms idle "
        f"{result['pg_idle_roundtrip_p50_ms']} ms, back to back {result['pg_busy_roundtrip_p50_ms']} ms",
        flush=True,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
