"""Relay latency: window committed by the fetcher -> received by long-polling consumers.

A relay process runs the synthetic fetcher at 1,000 windows/s (3 events of
~200 B each). Consumers long-poll ``/v1/stream`` (``wait=5``) and note, for
every END_OF_WINDOW they receive, ``receipt time - window timestamp``; the
timestamp is taken when the fetcher creates the window, so the figure
includes the fetcher -> writer hand-off, the append, the wake-up, the HTTP
response and the client's parsing. Runs with 1 and with 50 consumers (the
50 spread over 2 processes of asyncio tasks: the machine has 2 cores).
Baseline in the same run: a bare asyncio TCP echo round trip on loopback.

Each is measured in both stream modes: plain long-poll (one request per
response) and follow (one held request, the relay pushes each new batch).

Goals: p50 <= 1 ms and p99 <= 5 ms with 1 consumer; p99 <= 20 ms with 50.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import tempfile
import time
from pathlib import Path

import numpy as np

from _common import free_port, start_relay, stop_relay
from changebus.schemas import Op, parse_stream

#: receipts in the first second (connections, catching up to the newest window) are not counted
WARMUP_S = 1.0


class LeanHttp:
    """A minimal HTTP/1.1 keep-alive GET client (the benchmark's consumer side).

    Parses only what the relay sends: a status line, headers, then either a
    Content-Length body or a chunked one. Keeps client CPU low so that the
    figures describe the relay, not the client library.
    """

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str
    ) -> None:
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def connect(cls, host: str, port: int, rcvbuf: int = 0) -> LeanHttp:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:  # a small receive window: the relay cannot run far ahead
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        reader, writer = await asyncio.open_connection(sock=sock)
        return cls(reader, writer, f"{host}:{port}")

    async def get(self, target: str) -> tuple[int, dict[str, str], bytes]:
        self.writer.write(f"GET {target} HTTP/1.1\r\nHost: {self.host}\r\n\r\n".encode())
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if line:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
        if "content-length" in headers:
            body = await self.reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding") == "chunked":
            parts = []
            while True:
                size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
                if size == 0:
                    await self.reader.readuntil(b"\r\n")
                    break
                parts.append(await self.reader.readexactly(size))
                await self.reader.readexactly(2)
            body = b"".join(parts)
        else:
            body = b""
        return status, headers, body


def consumer_proc(
    host: str,
    port: int,
    tasks: int,
    seconds: float,
    follow: bool,
    out: mp.Queue,  # type: ignore[type-arg]
) -> None:
    async def one(lat: list[float], stop_at: float) -> None:
        http = await LeanHttp.connect(host, port, 64 * 1024 if follow else 0)
        _, headers, _ = await http.get("/v1/stream?from=latest")
        scn = int(headers["x-changebus-next-scn"])
        if follow:
            await follow_one(http, scn, lat, stop_at)
            return
        while time.monotonic() < stop_at:
            status, headers, body = await http.get(f"/v1/stream?scn={scn}&wait=5")
            if status == 204:
                continue
            now = time.time_ns()
            scn = int(headers["x-changebus-next-scn"])
            _, hdr = parse_stream(body, verify_payload=False)
            eow = hdr[hdr["op"] == Op.END_OF_WINDOW]
            if time.monotonic() >= record_from:
                lat.extend(((now - eow["timestamp_ns"].astype(np.int64)) / 1e6).tolist())
        http.writer.close()

    async def follow_one(http: LeanHttp, scn: int, lat: list[float], stop_at: float) -> None:
        # one held request; each chunk the relay pushes holds whole new windows
        http.writer.write(
            f"GET /v1/stream?scn={scn}&follow=1&wait=5 HTTP/1.1\r\nHost: {http.host}\r\n\r\n".encode()
        )
        await http.reader.readuntil(b"\r\n\r\n")
        while time.monotonic() < stop_at:
            size = int((await http.reader.readuntil(b"\r\n"))[:-2], 16)
            if size == 0:
                break
            chunk = await http.reader.readexactly(size)
            await http.reader.readexactly(2)
            now = time.time_ns()
            _, hdr = parse_stream(chunk, verify_payload=False)
            eow = hdr[hdr["op"] == Op.END_OF_WINDOW]
            if time.monotonic() >= record_from:
                lat.extend(((now - eow["timestamp_ns"].astype(np.int64)) / 1e6).tolist())
        http.writer.close()

    record_from = time.monotonic() + WARMUP_S

    async def main() -> list[float]:
        lat: list[float] = []
        stop_at = time.monotonic() + seconds + WARMUP_S
        await asyncio.gather(*(one(lat, stop_at) for _ in range(tasks)))
        return lat

    out.put(asyncio.run(main()))


def measure(port: int, consumers: int, seconds: float, follow: bool) -> dict[str, float]:
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    nproc = 1 if consumers == 1 else 2
    per = [consumers // nproc + (1 if i < consumers % nproc else 0) for i in range(nproc)]
    procs = [
        ctx.Process(target=consumer_proc, args=("127.0.0.1", port, n, seconds, follow, out))
        for n in per
    ]
    for p in procs:
        p.start()
    lat = np.concatenate([np.asarray(out.get(timeout=seconds + 120)) for _ in procs])
    for p in procs:
        p.join()
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
        relay = start_relay(config, port)
        try:
            time.sleep(1.0)
            for mode in ("longpoll", "follow"):
                for n in (1, 50):
                    figs = measure(port, n, args.seconds, follow=mode == "follow")
                    key = f"{mode}_c{n}"
                    result[f"{key}_p50_ms"] = round(figs["p50_ms"], 3)
                    result[f"{key}_p99_ms"] = round(figs["p99_ms"], 3)
                    result[f"{key}_samples"] = int(figs["samples"])
                    result[f"{key}_p99_vs_echo_ratio"] = round(figs["p99_ms"] / base["p99_ms"], 1)
                    print(
                        f"{mode:8s} {n:2d} consumers at {args.rate:.0f} windows/s: p50 {figs['p50_ms']:.3f} ms, "
                        f"p99 {figs['p99_ms']:.3f} ms over {int(figs['samples']):,} receipts "
                        f"(loopback echo p50 {base['p50_ms']:.3f} ms, p99 {base['p99_ms']:.3f} ms)",
                        flush=True,
                    )
        finally:
            stop_relay(relay)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
