"""Relay serving throughput against raw socket push, same data, same run.

A relay process serves a pre-filled buffer of ~2.5 KB events; 1, 4 and 16
consumer processes each read the whole buffer through ``/v1/stream`` (binary,
``max_bytes`` 4 MiB per request, no decoding). Baseline: a raw asyncio socket
server pushing the same bytes as 1 MiB memoryview slices to the same number
of client processes. A second relay pass gives each consumer a ``mod:4``
partition filter (consumer i takes bucket i % 4).

A TLS pass (unless ``--no-tls``) then restarts the relay on the same buffer
with ``[security.tls]`` (a throwaway CA and certificate from trustme) and
reads it with 4 consumers over HTTPS.

Goals: relay >= 0.5 of raw push with 4 consumers; relay over TLS >= 0.6 of
the plain relay with 4 consumers (``relay_tls_4c_vs_plain_ratio``). Last
line: one JSON object.

Usage: ``python bench/relay_throughput.py [--mib 200] [--consumers 1,4,16] [--no-tls]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from _common import PushHandler, free_port, push_server, start_relay, stop_relay
from changebus.relay import BufferConfig, EventBuffer
from changebus.schemas import EndOfWindow, Op, encode_control, encode_event, key_hash


def prefill(directory: Path, capacity: int, fill: int) -> tuple[int, int]:
    """Write ~``fill`` bytes of 10-event windows; returns (bytes, events)."""
    buf = EventBuffer(directory, BufferConfig(capacity_bytes=capacity))
    buf.set_start(999)
    rng = np.random.default_rng(5)
    blob = rng.integers(0, 256, size=10_000, dtype=np.uint8).tobytes()
    total = events = 0
    scn = 1000
    while total < fill:
        parts = []
        for i in range(10):
            key = (scn * 10 + i).to_bytes(8, "little")
            parts.append(
                encode_event(
                    Op.INSERT,
                    scn,
                    i,
                    0,
                    key,
                    blob[i * 100 : i * 100 + 2400],
                    key_hash=key_hash(key),
                    source_id=1,
                )
            )
        parts.append(encode_control(EndOfWindow(10, ""), scn, 10, 0))
        window = b"".join(parts)
        buf.append_window(window)
        total += len(window)
        events += 11
        scn += 1
    buf.close()
    return total, events


# ---- relay consumers ---------------------------------------------------------


def relay_consumer(url: str, filt: str | None, out: mp.Queue, cafile: str | None = None) -> None:  # type: ignore[type-arg]
    import ssl

    import aiohttp

    async def go() -> tuple[int, int]:
        got = 0
        requests = 0
        scn, offset = -1, -1
        connector = None
        if cafile is not None:
            connector = aiohttp.TCPConnector(ssl=ssl.create_default_context(cafile=cafile))
        async with aiohttp.ClientSession(connector=connector) as http:
            while True:
                params = {"scn": str(scn), "offset": str(offset), "max_bytes": str(4 << 20)}
                if filt:
                    params["filter"] = filt
                async with http.get(url, params=params) as resp:
                    if resp.status == 204:
                        return got, requests
                    resp.raise_for_status()
                    async for chunk in resp.content.iter_any():
                        got += len(chunk)
                    scn = int(resp.headers["X-Changebus-Next-Scn"])
                    offset = int(resp.headers["X-Changebus-Next-Offset"])
                    requests += 1

    t0 = time.perf_counter()
    got, requests = asyncio.run(go())
    out.put((got, time.perf_counter() - t0, requests))


def run_relay_pass(
    url: str, consumers: int, filtered: bool, cafile: str | None = None
) -> dict[str, float]:
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    procs = [
        ctx.Process(
            target=relay_consumer,
            args=(url, f"mod:4:{i % 4}" if filtered else None, out, cafile),
        )
        for i in range(consumers)
    ]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    total = sum(r[0] for r in results)
    return {"mb_per_s": total / wall / 1e6, "bytes": float(total), "seconds": wall}


# ---- raw push baseline -------------------------------------------------------


def raw_server(data_path: str, port: int, ready: Any, clients: int) -> None:
    data = np.memmap(data_path, dtype=np.uint8, mode="r")
    view = memoryview(data)  # type: ignore[arg-type]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for start in range(0, len(view), 1 << 20):
            writer.write(view[start : start + (1 << 20)])
            await writer.drain()
        writer.close()
        await writer.wait_closed()

    async def setup() -> PushHandler:
        return handle

    push_server(port, ready, setup)


def raw_client(port: int, expect: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    t0 = time.perf_counter()
    got = 0
    with socket.create_connection(("127.0.0.1", port)) as s:
        buf = bytearray(1 << 20)
        while got < expect:
            n = s.recv_into(buf)
            if not n:
                break
            got += n
    out.put((got, time.perf_counter() - t0))


def run_raw_pass(data_path: str, size: int, consumers: int) -> dict[str, float]:
    ctx = mp.get_context("fork")
    port = free_port()
    ready = ctx.Event()
    server = ctx.Process(target=raw_server, args=(data_path, port, ready, consumers), daemon=True)
    server.start()
    ready.wait(30)
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    procs = [ctx.Process(target=raw_client, args=(port, size, out)) for _ in range(consumers)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    server.kill()
    server.join()
    total = sum(r[0] for r in results)
    return {"mb_per_s": total / wall / 1e6, "bytes": float(total), "seconds": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=200, help="bytes of events to serve")
    ap.add_argument("--consumers", default="1,4,16")
    ap.add_argument("--no-tls", action="store_true", help="skip the TLS pass")
    args = ap.parse_args()
    counts = [int(c) for c in args.consumers.split(",")]
    result: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        data_dir = Path(tmp) / "relay"
        capacity = (args.mib + 16) << 20
        size, events = prefill(data_dir / "bench", capacity, args.mib << 20)
        # the raw baseline pushes the same event bytes
        raw_path = Path(tmp) / "raw.dat"
        ring = np.memmap(data_dir / "bench" / "ring.dat", dtype=np.uint8, mode="r")
        np.asarray(ring[:size]).tofile(raw_path)
        del ring
        print(f"prefilled {size / 1e6:.0f} MB, {events:,} events", flush=True)
        port = free_port()
        config = Path(tmp) / "relay.toml"
        base_config = (
            f'data_dir = "{data_dir}"\nflush_interval_s = 0\nlog_level = "warning"\n'
            f"[http]\nport = {port}\nmax_response_bytes = {64 << 20}\n"
            f'[[partitions]]\nname = "bench"\nid = 1\ncapacity_bytes = {capacity}\n'
        )
        config.write_text(base_config)
        relay = start_relay(config, port)
        try:
            url = f"http://127.0.0.1:{port}/v1/stream"
            for n in counts:
                raw = run_raw_pass(str(raw_path), size, n)
                rel = run_relay_pass(url, n, filtered=False)
                filt = run_relay_pass(url, n, filtered=True)
                result[f"raw_{n}c_mb_per_s"] = round(raw["mb_per_s"], 1)
                result[f"relay_{n}c_mb_per_s"] = round(rel["mb_per_s"], 1)
                result[f"relay_{n}c_events_per_s"] = round(
                    rel["bytes"] / (size / events) / rel["seconds"]
                )
                result[f"relay_{n}c_ratio"] = round(rel["mb_per_s"] / raw["mb_per_s"], 3)
                result[f"relay_mod4_{n}c_mb_per_s"] = round(filt["mb_per_s"], 1)
                result[f"relay_mod4_{n}c_events_per_s"] = round(
                    filt["bytes"] / (size / events) / filt["seconds"]
                )
                print(
                    f"{n:2d} consumers: relay {rel['mb_per_s']:,.0f} MB/s, raw push {raw['mb_per_s']:,.0f} MB/s "
                    f"(ratio {result[f'relay_{n}c_ratio']:.2f}); with mod-4 filter {filt['mb_per_s']:,.0f} MB/s",
                    flush=True,
                )
        finally:
            stop_relay(relay)
        if not args.no_tls:
            tls_pass(Path(tmp), config, base_config, port, result)
    print(json.dumps(result))


def tls_pass(
    tmp: Path, config: Path, base_config: str, port: int, result: dict[str, float]
) -> None:
    """The same relay with TLS on, 4 consumers over HTTPS (module docstring)."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cafile, certfile, keyfile = tmp / "ca.pem", tmp / "relay.pem", tmp / "relay.key"
    ca.cert_pem.write_to_path(str(cafile))
    cert.private_key_pem.write_to_path(str(keyfile))
    for i, pem in enumerate(cert.cert_chain_pems):
        pem.write_to_path(str(certfile), append=i > 0)
    config.write_text(
        base_config + f'[security.tls]\ncert_file = "{certfile}"\nkey_file = "{keyfile}"\n'
    )
    relay = start_relay(config, port)
    try:
        url = f"https://127.0.0.1:{port}/v1/stream"
        run_relay_pass(url, 1, filtered=False, cafile=str(cafile))  # warm-up
        tls = run_relay_pass(url, 4, filtered=False, cafile=str(cafile))
    finally:
        stop_relay(relay)
    result["relay_tls_4c_mb_per_s"] = round(tls["mb_per_s"], 1)
    plain = result.get("relay_4c_mb_per_s")
    if plain:
        result["relay_tls_4c_vs_plain_ratio"] = round(tls["mb_per_s"] / plain, 3)
    print(
        f" 4 consumers over TLS: {tls['mb_per_s']:,.0f} MB/s "
        f"(ratio to plain {result.get('relay_tls_4c_vs_plain_ratio', float('nan')):.2f})",
        flush=True,
    )


if __name__ == "__main__":
    main()
