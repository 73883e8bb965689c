"""Relay latency: window committed by the fetcher -> received by long-polling consumers.

A relay process runs the synthetic fetcher at 1,000 windows/s (3 events of
~200 B each). Consumers long-poll ``/v1/stream`` (``wait=5``) and note, for
every END_OF_WINDOW they receive, ``receipt time - window timestamp``; the
timestamp is taken when the fetcher creates the window, so the figure
includes the fetcher -> writer hand-off, the append, the wake-up, the HTTP
response and the client's parsing. Runs with 1 and with 50 consumers (the
50 spread over 2 processes of asyncio tasks: the machine has 2 cores).
Baseline in the same run: a bare asyncio TCP echo round trip on loopback.

Goals: p50 <= 1 ms and p99 <= 5 ms with 1 consumer; p99 <= 20 ms with 50.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
_PATHS = [str(_ROOT / s) for s in ("schemas", "fetchers", "relay", "bootstrap", "client")]
sys.path[:0] = _PATHS

import numpy as np  # noqa: E402

from changebus.schemas import Op, parse_stream  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def consumer_proc(url: str, tasks: int, seconds: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    import aiohttp

    async def one(http: aiohttp.ClientSession, lat: list[float], stop_at: float) -> None:
        scn = -1
        async with http.get(url, params={"from": "latest", "wait": "0"}) as resp:
            scn = int(resp.headers["X-Changebus-Next-Scn"])
        while time.monotonic() < stop_at:
            async with http.get(url, params={"scn": str(scn), "wait": "5"}) as resp:
                if resp.status == 204:
                    continue
                body = await resp.read()
                now = time.time_ns()
                scn = int(resp.headers["X-Changebus-Next-Scn"])
            _, headers = parse_stream(body, verify_payload=False)
            eow = headers[headers["op"] == Op.END_OF_WINDOW]
            lat.extend(((now - eow["timestamp_ns"].astype(np.int64)) / 1e6).tolist())

    async def main() -> list[float]:
        lat: list[float] = []
        stop_at = time.monotonic() + seconds
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as http:
            await asyncio.gather(*(one(http, lat, stop_at) for _ in range(tasks)))
        return lat

    out.put(asyncio.run(main()))


def measure(url: str, consumers: int, seconds: float) -> dict[str, float]:
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    nproc = 1 if consumers == 1 else 2
    per = [consumers // nproc + (1 if i < consumers % nproc else 0) for i in range(nproc)]
    procs = [ctx.Process(target=consumer_proc, args=(url, n, seconds, out)) for n in per]
    for p in procs:
        p.start()
    lat = np.concatenate([np.asarray(out.get(timeout=seconds + 120)) for _ in procs])
    for p in procs:
        p.join()
    # drop the first second (connection set-up, warm-up)
    return {
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "samples": float(lat.size),
    }


def echo_baseline(samples: int = 2000) -> dict[str, float]:
    async def main() -> list[float]:
        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            while data := await r.read(100):
                w.write(data)
                await w.drain()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        lat = []
        for _ in range(samples):
            t0 = time.perf_counter_ns()
            writer.write(b"x" * 64)
            await reader.readexactly(64)
            lat.append((time.perf_counter_ns() - t0) / 1e6)
        writer.close()
        server.close()
        return lat

    lat = np.asarray(asyncio.run(main()))
    return {"p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=1000.0)
    args = ap.parse_args()
    result: dict[str, float] = {}
    base = echo_baseline()
    result["loopback_echo_p50_ms"] = round(base["p50_ms"], 3)
    result["loopback_echo_p99_ms"] = round(base["p99_ms"], 3)
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        config = Path(tmp) / "relay.toml"
        config.write_text(
            f'data_dir = "{tmp}/relay"\nflush_interval_s = 0\nlog_level = "warning"\n[http]\nport = {port}\n'
            f'[[partitions]]\nname = "lat"\nid = 1\ncapacity_bytes = "64MiB"\n'
            f'[partitions.fetcher]\nkind = "synthetic"\n'
            f"options = {{ windows_per_s = {args.rate}, events_per_window = 3, row_bytes = 200 }}\n"
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(_PATHS)}
        relay = subprocess.Popen(
            [sys.executable, "-m", "changebus.schemas", "relay", "--config", str(config)], env=env
        )
        try:
            deadline = time.time() + 60
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.time() > deadline:
                        raise
                    time.sleep(0.1)
            url = f"http://127.0.0.1:{port}/v1/stream"
            time.sleep(1.0)
            for n in (1, 50):
                figs = measure(url, n, args.seconds)
                result[f"c{n}_p50_ms"] = round(figs["p50_ms"], 3)
                result[f"c{n}_p99_ms"] = round(figs["p99_ms"], 3)
                result[f"c{n}_samples"] = int(figs["samples"])
                result[f"c{n}_p99_vs_echo_ratio"] = round(figs["p99_ms"] / base["p99_ms"], 1)
                print(
                    f"{n:2d} consumers at {args.rate:.0f} windows/s: p50 {figs['p50_ms']:.3f} ms, "
                    f"p99 {figs['p99_ms']:.3f} ms over {int(figs['samples']):,} receipts "
                    f"(loopback echo p50 {base['p50_ms']:.3f} ms, p99 {base['p99_ms']:.3f} ms)",
                    flush=True,
                )
        finally:
            relay.terminate()
            relay.wait(30)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
