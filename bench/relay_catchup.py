"""A consumer catching up on a backlog the relay holds: follow mode against long-poll.

A relay process with the synthetic fetcher produces ``--windows`` windows of
10 events (``--row-bytes`` bytes of row each, ~2.5 KB by default) as fast as
it can and stops. Once it has finished, a :class:`Consumer` in this process
reads the partition from the earliest window to the last, once in follow
mode (one held response, pushes; the default) and once with long-polls
(a request per response of ``max_bytes``), each on a fresh relay process over
the same backlog (the synthetic source is seeded: the same bytes).

Figures per mode: rows/s from the first request to the last row, CPU
microseconds per row of the relay process (all threads) and of this process
(the consumer). The baseline is long-poll in the same run:
``follow_vs_longpoll_rows_ratio`` (goal: >= 0.9, follow must catch up about as
fast as the bulk path) and ``follow_vs_longpoll_relay_cpu_ratio`` (relay CPU
per row, follow over long-poll). Last line: one JSON object.

Usage: ``python bench/relay_catchup.py [--windows 8000] [--row-bytes 2400]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from _common import cpu_seconds, free_port, start_relay, stop_relay
from changebus.client import Consumer, ConsumerConfig

_EVENTS = 10


def _config(tmp: Path, port: int, windows: int, row_bytes: int) -> Path:
    config = tmp / "relay.toml"
    config.write_text(
        f'data_dir = "{tmp}/relay"\nflush_interval_s = 0\nlog_level = "warning"\n'
        f"[http]\nport = {port}\n"
        f'[[partitions]]\nname = "cu"\nid = 1\ncapacity_bytes = "512MiB"\n'
        f'[partitions.fetcher]\nkind = "synthetic"\n'
        f"options = {{ windows_per_s = 0, events_per_window = {_EVENTS}, "
        f"row_bytes = {row_bytes}, max_windows = {windows}, update_ratio = 0, "
        f"delete_ratio = 0 }}\n"
    )
    return config


def _wait_finished(port: int, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status") as resp:
            if json.load(resp)["partitions"][0]["state"] == "finished":
                return
        time.sleep(0.2)
    raise TimeoutError("the synthetic backlog did not finish")


async def _consume(url: str, rows: int, follow: bool) -> tuple[float, float]:
    """Read ``rows`` rows from the earliest window; (wall seconds, this process's CPU seconds)."""
    cfg = ConsumerConfig(relays=(url,), partition="cu", start="earliest", wait_s=1.0, follow=follow)
    seen = 0
    t0, cpu0 = time.perf_counter(), time.process_time()
    async with Consumer(cfg) as consumer:
        async for window in consumer:
            seen += len(window.events)
            if seen >= rows:
                break
    return time.perf_counter() - t0, time.process_time() - cpu0


def run(mode: str, windows: int, row_bytes: int) -> dict[str, float]:
    rows = windows * _EVENTS
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        port = free_port()
        relay = start_relay(_config(Path(tmp), port, windows, row_bytes), port)
        try:
            _wait_finished(port)
            cpu0 = cpu_seconds(relay.pid)
            wall, consumer_cpu = asyncio.run(
                _consume(f"http://127.0.0.1:{port}", rows, mode == "follow")
            )
            relay_cpu = cpu_seconds(relay.pid) - cpu0
        finally:
            stop_relay(relay)
    return {
        f"{mode}_rows_per_s": round(rows / wall),
        f"{mode}_relay_cpu_us_per_row": round(relay_cpu / rows * 1e6, 2),
        f"{mode}_consumer_cpu_us_per_row": round(consumer_cpu / rows * 1e6, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=8000)
    ap.add_argument("--row-bytes", type=int, default=2400)
    args = ap.parse_args()
    result: dict[str, Any] = {"load_1min": round(os.getloadavg()[0], 2)}
    result["rows"] = args.windows * _EVENTS
    for mode in ("longpoll", "follow"):
        figs = run(mode, args.windows, args.row_bytes)
        result.update(figs)
        print(
            f"{mode:8s} {figs[f'{mode}_rows_per_s']:9,} rows/s  relay "
            f"{figs[f'{mode}_relay_cpu_us_per_row']:6.2f} us/row  consumer "
            f"{figs[f'{mode}_consumer_cpu_us_per_row']:6.2f} us/row",
            flush=True,
        )
    result["follow_vs_longpoll_rows_ratio"] = round(
        result["follow_rows_per_s"] / result["longpoll_rows_per_s"], 3
    )
    result["follow_vs_longpoll_relay_cpu_ratio"] = round(
        result["follow_relay_cpu_us_per_row"] / result["longpoll_relay_cpu_us_per_row"], 3
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
