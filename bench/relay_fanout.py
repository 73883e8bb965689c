"""Relay fan-out: one stream served to 50, 200 and 1,000 consumers, against raw push.

A relay process runs the synthetic fetcher at 1,000 windows/s (4 events of
~200 B plus END_OF_WINDOW). Consumers are spread over ``--procs`` client
processes of asyncio tasks, each on its own keep-alive connection, in two
modes: plain long-poll (``wait=5``, a request per response) and follow (one
held request, ``follow=1``). See :mod:`_fanout_client` for the consumers.

Per consumer count and mode: the latency from the window's creation in the
fetcher (its timestamp) to its receipt by a consumer (p50, p99, the worst
single window of any consumer), windows delivered per second (all consumers;
and the slowest consumer's share of the source's rate, to show none starves),
and the relay's CPU seconds per second, also per delivered window with the
ingest's own CPU (measured first, with no consumer) taken off.

Baseline in the same run: the raw asyncio push server of
``bench/relay_throughput.py`` (:func:`_common.push_server`) with the same
synthetic fetcher in its process, pushing every new window to every
connection as a chunk, to the same consumers (read like follow mode).

Idle consumers: the relay's memory (``VmRSS`` and ``RssAnon``) and CPU with
1,000 long-polls held on a partition with no traffic, measured first (the
relay has served nobody yet; its CPU net of the ingest alone). Each case
also gives the relay's anonymous memory at its end.

Goals (issue 23): p99 <= 20 ms with 50 consumers (both modes), p99 <= 50 ms
with 1,000, relay CPU per delivered window within 2x from 50 to 1,000
consumers, no consumer starved. Last line: one JSON object.

Usage: ``python bench/relay_fanout.py [--seconds 10] [--consumers 50,200,1000]
[--modes longpoll,follow] [--procs 4] [--no-raw] [--profile relay.prof]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from _common import (
    PushHandler,
    cpu_seconds,
    free_port,
    memory_kib,
    push_server,
    start_relay,
    stop_relay,
)
from _fanout_client import consumer_proc, idle_proc, percentile
from changebus.fetchers import ResumePoint, create_fetcher

#: the synthetic source of both the relay and the raw push baseline
_EVENTS, _ROW_BYTES = 4, 200
_RAW_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def _split(total: int, parts: int) -> list[int]:
    parts = max(1, min(parts, total))
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def measure(
    port: int, mode: str, consumers: int, procs: int, seconds: float, pid: int, rate: float
) -> dict[str, float]:
    """Run ``consumers`` consumers against ``port``; figures over ``seconds`` after set-up."""
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    record_from = time.time() + 2.0 + consumers / 400
    window = (record_from, record_from + seconds)
    workers, first = [], 0
    for n in _split(consumers, procs):
        workers.append(
            ctx.Process(target=consumer_proc, args=(port, mode, "fan", n, first, window, out))
        )
        first += n
    for w in workers:
        w.start()
    time.sleep(max(0.0, record_from - time.time()))
    cpu0 = cpu_seconds(pid)
    clients0 = sum(cpu_seconds(w.pid) for w in workers if w.pid is not None)
    time.sleep(max(0.0, window[1] - time.time()))
    cpu1 = cpu_seconds(pid)
    clients1 = sum(cpu_seconds(w.pid) for w in workers if w.pid is not None)
    anon_mib = memory_kib(pid)["RssAnon"] / 1024
    results = [out.get(timeout=seconds + 120) for _ in workers]
    for w in workers:
        w.join(30)
    hist = sum((r[0] for r in results), np.zeros_like(results[0][0]))
    rows = [row for r in results for row in r[1]]
    windows = np.asarray([row[0] for row in rows], dtype=np.float64)
    ready = np.asarray([row[5] for row in rows], dtype=np.float64)
    late = int(((ready == 0) | (ready > record_from)).sum())
    if late:
        print(
            f"  {mode}: {late} of {len(rows)} consumers were not ready when measuring began "
            f"(last ready {ready.max() - record_from:+.1f} s after)",
            flush=True,
        )
    errors = sorted({row[4] for row in rows if row[4]})
    if errors:
        print(f"  {mode} consumer errors: {'; '.join(errors[:3])}", flush=True)
    return {
        "p50_ms": percentile(hist, 50),
        "p99_ms": percentile(hist, 99),
        "max_consumer_lag_ms": max(row[1] for row in rows),
        "windows_per_s": float(windows.sum()) / seconds,
        "receipts_per_s": sum(row[6] for row in rows) / seconds,
        "min_consumer_share": float(windows.min()) / seconds / rate,
        "relay_cpu_s_per_s": (cpu1 - cpu0) / seconds,
        "clients_cpu_s_per_s": (clients1 - clients0) / seconds,
        "relay_anon_mib": anon_mib,
        "errors": float(sum(row[3] for row in rows)),
        "late": float(late),
        "distinct_chunks": float(sum(r[2] for r in results)),
    }


def idle_longpolls(port: int, pid: int, count: int, procs: int, hold_s: float) -> dict[str, float]:
    """Relay memory and CPU while ``count`` long-polls wait on the idle partition."""
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    before = memory_kib(pid)
    settle = 2.0
    workers = [
        ctx.Process(target=idle_proc, args=(port, "idle", n, hold_s + settle + 5, out))
        for n in _split(count, procs)
    ]
    for w in workers:
        w.start()
    opened = sum(out.get(timeout=60) for _ in workers)
    time.sleep(settle)  # the relay reads the requests and parks them
    cpu0 = cpu_seconds(pid)
    time.sleep(hold_s)
    cpu1 = cpu_seconds(pid)
    held = memory_kib(pid)
    for w in workers:
        w.join(hold_s + 60)
    return {
        "opened": float(opened),
        "rss_before_kib": float(before["VmRSS"]),
        "rss_delta_kib": float(held["VmRSS"] - before["VmRSS"]),
        "anon_delta_kib": float(held["RssAnon"] - before["RssAnon"]),
        "cpu_s_per_s": (cpu1 - cpu0) / hold_s,
    }


def raw_broadcast(port: int, ready: Any, rate: float) -> None:
    """The raw push server with the synthetic fetcher: every new window to every connection."""

    async def setup() -> PushHandler:
        options = {"windows_per_s": rate, "events_per_window": _EVENTS, "row_bytes": _ROW_BYTES}
        fetcher = create_fetcher("synthetic", "raw", 1, options)
        await fetcher.start(ResumePoint())
        log: list[bytes] = []
        arrived = [asyncio.Event()]

        async def pump() -> None:
            async for window in fetcher.windows():
                log.append(window.data)
                event, arrived[0] = arrived[0], asyncio.Event()
                event.set()

        pumping = asyncio.create_task(pump())

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            assert not pumping.done()
            try:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(_RAW_HEAD)
                pos = len(log)
                while True:
                    if pos == len(log):
                        await arrived[0].wait()
                        continue
                    body = b"".join(log[pos:])
                    pos = len(log)
                    writer.write(b"%x\r\n%b\r\n" % (len(body), body))
                    await writer.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        return handle

    push_server(port, ready, setup)


def run_raw(consumers: int, procs: int, seconds: float, rate: float) -> dict[str, float]:
    ctx = mp.get_context("fork")
    port = free_port()
    ready = ctx.Event()
    server = ctx.Process(target=raw_broadcast, args=(port, ready, rate), daemon=True)
    server.start()
    try:
        ready.wait(30)
        assert server.pid is not None
        return measure(port, "raw", consumers, procs, seconds, server.pid, rate)
    finally:
        server.kill()
        server.join()


def relay_config(tmp: Path, port: int, rate: float) -> Path:
    # max_connections: room for the 1,000 consumers and the idle long-polls, not far beyond
    # (every possible connection keeps a floor of the copy budget; see docs/operations.md)
    config = tmp / "relay.toml"
    config.write_text(
        f'data_dir = "{tmp}/relay"\nflush_interval_s = 0\nlog_level = "warning"\n'
        f"[http]\nport = {port}\nmax_connections = 2048\n"
        f'[[partitions]]\nname = "fan"\nid = 1\ncapacity_bytes = "64MiB"\n'
        f'[partitions.fetcher]\nkind = "synthetic"\n'
        f"options = {{ windows_per_s = {rate}, events_per_window = {_EVENTS}, "
        f"row_bytes = {_ROW_BYTES} }}\n"
        f'[[partitions]]\nname = "idle"\nid = 2\ncapacity_bytes = "16MiB"\n'
    )
    return config


def _report(result: dict[str, float], key: str, figs: dict[str, float], ingest: float) -> None:
    for name in (
        "p50_ms",
        "p99_ms",
        "max_consumer_lag_ms",
        "relay_cpu_s_per_s",
        "clients_cpu_s_per_s",
        "relay_anon_mib",
    ):
        result[f"{key}_{name}"] = round(figs[name], 3)
    result[f"{key}_windows_per_s"] = round(figs["windows_per_s"])
    # responses (long-poll) or pushes (follow, raw) received per second, all consumers
    result[f"{key}_receipts_per_s"] = round(figs["receipts_per_s"])
    if figs["receipts_per_s"]:
        per = figs["relay_cpu_s_per_s"] / figs["receipts_per_s"] * 1e6
        result[f"{key}_relay_cpu_us_per_receipt"] = round(per, 1)
    result[f"{key}_min_consumer_share"] = round(figs["min_consumer_share"], 3)
    result[f"{key}_errors"] = int(figs["errors"])
    result[f"{key}_late_consumers"] = int(figs["late"])
    serving = max(figs["relay_cpu_s_per_s"] - ingest, 0.0)
    if figs["windows_per_s"]:
        result[f"{key}_cpu_us_per_window"] = round(serving / figs["windows_per_s"] * 1e6, 2)
    print(
        f"{key:16s} p50 {figs['p50_ms']:7.2f} ms  p99 {figs['p99_ms']:7.2f} ms  "
        f"worst {figs['max_consumer_lag_ms']:7.1f} ms  {figs['windows_per_s']:9,.0f} windows/s  "
        f"slowest {figs['min_consumer_share']:.3f}  cpu {figs['relay_cpu_s_per_s']:.2f} s/s "
        f"(clients {figs['clients_cpu_s_per_s']:.2f})  anon {figs['relay_anon_mib']:.0f} MiB  errors {int(figs['errors'])}  chunks {int(figs['distinct_chunks']):,}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="measured seconds per case")
    ap.add_argument("--rate", type=float, default=1000.0, help="windows per second")
    ap.add_argument("--consumers", default="50,200,1000")
    ap.add_argument("--modes", default="longpoll,follow")
    ap.add_argument("--procs", type=int, default=4, help="client processes")
    ap.add_argument("--idle", type=int, default=1000, help="idle long-polls (0: skip)")
    ap.add_argument("--no-raw", action="store_true", help="skip the raw push baseline")
    ap.add_argument("--profile", type=Path, help="run the relay under cProfile, stats here")
    args = ap.parse_args()
    counts = [int(c) for c in args.consumers.split(",") if c]
    modes = args.modes.split(",")
    result: dict[str, float] = {"load_1min": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        port = free_port()
        relay = start_relay(relay_config(Path(tmp), port, args.rate), port, profile=args.profile)
        try:
            time.sleep(2.0)
            cpu0 = cpu_seconds(relay.pid)
            time.sleep(args.seconds)
            ingest = (cpu_seconds(relay.pid) - cpu0) / args.seconds
            result["relay_ingest_only_cpu_s_per_s"] = round(ingest, 3)
            print(f"relay with no consumer: {ingest:.3f} CPU s/s", flush=True)
            if args.idle:
                idle = idle_longpolls(port, relay.pid, args.idle, args.procs, args.seconds)
                key = f"idle_{args.idle}"
                result[f"{key}_rss_delta_kib"] = int(idle["rss_delta_kib"])
                result[f"{key}_anon_delta_kib"] = int(idle["anon_delta_kib"])
                result[f"{key}_cpu_s_per_s"] = round(max(idle["cpu_s_per_s"] - ingest, 0.0), 3)
                print(
                    f"{int(idle['opened'])} idle long-polls: RSS +{idle['rss_delta_kib'] / 1024:.1f} MiB "
                    f"(anonymous +{idle['anon_delta_kib'] / 1024:.1f} MiB, before "
                    f"{idle['rss_before_kib'] / 1024:.0f} MiB), CPU {idle['cpu_s_per_s']:.3f} s/s "
                    f"(ingest alone {ingest:.3f})",
                    flush=True,
                )
            for n in counts:
                for mode in modes:
                    figs = measure(port, mode, n, args.procs, args.seconds, relay.pid, args.rate)
                    _report(result, f"{mode}_c{n}", figs, ingest)
        finally:
            stop_relay(relay)
    for n in counts:
        if args.no_raw:
            break
        raw = run_raw(n, args.procs, args.seconds, args.rate)
        _report(result, f"raw_c{n}", raw, 0.0)
        for mode in modes:
            mine = result.get(f"{mode}_c{n}_p99_ms")
            if mine is not None and raw["p99_ms"]:
                result[f"{mode}_c{n}_p99_vs_raw_ratio"] = round(mine / raw["p99_ms"], 3)
            got = result.get(f"{mode}_c{n}_windows_per_s")
            if got is not None and raw["windows_per_s"]:
                result[f"{mode}_c{n}_windows_vs_raw_ratio"] = round(got / raw["windows_per_s"], 3)
    lo, hi = min(counts, default=0), max(counts, default=0)
    for mode in modes:
        a, b = (
            result.get(f"{mode}_c{lo}_cpu_us_per_window"),
            result.get(f"{mode}_c{hi}_cpu_us_per_window"),
        )
        if a and b and lo != hi:
            result[f"{mode}_cpu_per_window_c{hi}_vs_c{lo}_ratio"] = round(b / a, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
