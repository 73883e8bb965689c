"""Relay memory with a large buffer: private memory stays small whatever the capacity.

Fills a 2 GiB buffer with ~2.5 KB events, starts a relay process on it, has
one consumer read all of it through ``/v1/stream``, then reads the relay's
``/proc/<pid>/smaps_rollup``. ``Anonymous`` is the process's own memory (heap,
numpy arrays): the goal is < 200 MB. The buffer's pages are file-backed
(memory-mapped) and show up in RSS as page cache the kernel can drop. The
baseline in the same run is the same relay serving a 64 MiB buffer.

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from _common import start_relay, stop_relay
from changebus.relay import BufferConfig, EventBuffer
from changebus.schemas import EndOfWindow, Op, encode_control, encode_event, key_hash


def fill(directory: Path, capacity: int) -> int:
    buf = EventBuffer(directory, BufferConfig(capacity_bytes=capacity))
    buf.set_start(999)
    blob = np.random.default_rng(1).integers(0, 256, 4000, dtype=np.uint8).tobytes()
    scn, total, group = 1000, 0, []
    while total < capacity - (8 << 20):
        events = []
        for i in range(10):
            key = (scn * 10 + i).to_bytes(8, "little")
            events.append(
                encode_event(
                    Op.INSERT,
                    scn,
                    i,
                    0,
                    key,
                    blob[i : i + 2400],
                    key_hash=key_hash(key),
                    source_id=1,
                )
            )
        events.append(encode_control(EndOfWindow(10, ""), scn, 10, 0))
        window = b"".join(events)
        group.append(window)
        total += len(window)
        scn += 1
        if len(group) == 64:
            buf.append_windows(group)
            group = []
    if group:
        buf.append_windows(group)
    buf.close()
    return total


def smaps(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        out[key.strip()] = int(value.split()[0]) * 1024
    return out


def serve_and_measure(data_dir: Path, name: str, capacity: int) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = data_dir / f"{name}.toml"
    cfg.write_text(
        f'data_dir = "{data_dir}"\nflush_interval_s = 0\nlog_level = "warning"\n'
        f"[http]\nport = {port}\nmax_response_bytes = {64 << 20}\n"
        f'[[partitions]]\nname = "{name}"\nid = 1\ncapacity_bytes = {capacity}\n'
    )
    relay = start_relay(cfg, port)
    try:
        served, scn, t0 = 0, -1, time.perf_counter()
        while True:
            url = f"http://127.0.0.1:{port}/v1/stream?scn={scn}&max_bytes={16 << 20}"
            with urllib.request.urlopen(url, timeout=60) as resp:
                if resp.status == 204:
                    break
                served += len(resp.read())
                scn = int(resp.headers["X-Changebus-Next-Scn"])
        seconds = time.perf_counter() - t0
        mem = smaps(relay.pid)
    finally:
        stop_relay(relay)
    return {
        "served_bytes": float(served),
        "seconds": seconds,
        "rss_bytes": float(mem["Rss"]),
        "anonymous_bytes": float(mem["Anonymous"]),
        "file_backed_bytes": float(mem["Rss"] - mem["Anonymous"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0)
    args = ap.parse_args()
    big = int(args.gib * (1 << 30))
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        root = Path(tmp)
        print(f"filling a {args.gib:g} GiB buffer ...", flush=True)
        filled = fill(root / "big", big)
        fill(root / "small", 64 << 20)
        base = serve_and_measure(root, "small", 64 << 20)
        large = serve_and_measure(root, "big", big)
    mib = 1 << 20
    result = {
        "buffer_bytes": big,
        "filled_bytes": filled,
        "served_bytes": int(large["served_bytes"]),
        "serve_mb_per_s": round(large["served_bytes"] / large["seconds"] / 1e6, 1),
        "anonymous_mib": round(large["anonymous_bytes"] / mib, 1),
        "rss_mib": round(large["rss_bytes"] / mib, 1),
        "file_backed_mib": round(large["file_backed_bytes"] / mib, 1),
        "baseline_64mib_anonymous_mib": round(base["anonymous_bytes"] / mib, 1),
        "anonymous_vs_64mib_buffer_ratio": round(
            large["anonymous_bytes"] / base["anonymous_bytes"], 2
        ),
    }
    print(
        f"served {result['served_bytes'] / 1e9:.2f} GB from a {args.gib:g} GiB buffer at "
        f"{result['serve_mb_per_s']} MB/s; relay private (anonymous) memory {result['anonymous_mib']} MiB "
        f"(with a 64 MiB buffer: {result['baseline_64mib_anonymous_mib']} MiB); RSS {result['rss_mib']} MiB "
        f"of which {result['file_backed_mib']} MiB is the mapped buffer (page cache)"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
