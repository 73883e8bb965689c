"""Relay ingest benchmark: appending windows of ~2.5 KB events to the buffer.

Appends pre-encoded windows (10 events of ~2.5 KB each + END_OF_WINDOW) to an
``EventBuffer`` much smaller than the data, so the run includes validation
(every CRC), wraparound, eviction and SCN-index maintenance. Measured two
ways: in group commits of 64 windows (what the relay's writer thread does
when windows queue up faster than one append takes) and one window at a
time (an idle source). Baseline in the same run: plain ``memcpy`` of the same
bytes into the same memory-mapped ring (numpy slice assignment), the memory
bandwidth the relay could at best reach.

Goal: >= 300,000 events/s. Last line of output: one JSON object.

Usage: ``python bench/relay_ingest.py [--events N] [--capacity-mib M]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_ROOT / s) for s in ("schemas", "fetchers", "relay", "bootstrap", "client")]

import numpy as np  # noqa: E402

from changebus.relay import BufferConfig, EventBuffer  # noqa: E402
from changebus.schemas import EndOfWindow, Op, encode_control, encode_event, key_hash  # noqa: E402


def make_windows(count: int, per_window: int, payload_bytes: int) -> list[bytes]:
    rng = np.random.default_rng(3)
    blob = rng.integers(0, 256, size=payload_bytes * 4, dtype=np.uint8).tobytes()
    windows = []
    for w in range(count):
        scn = 1000 + w
        events = []
        for i in range(per_window):
            key = (w * per_window + i).to_bytes(8, "little")
            start = (w * 7 + i * 13) % (payload_bytes * 3)
            events.append(
                encode_event(
                    Op.INSERT,
                    scn,
                    i,
                    0,
                    key,
                    blob[start : start + payload_bytes],
                    key_hash=key_hash(key),
                    source_id=1,
                )
            )
        events.append(encode_control(EndOfWindow(per_window, ""), scn, per_window, 0))
        windows.append(b"".join(events))
    return windows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=300_000)
    ap.add_argument("--per-window", type=int, default=10)
    ap.add_argument("--payload-bytes", type=int, default=2400)
    ap.add_argument("--capacity-mib", type=int, default=128)
    ap.add_argument("--group", type=int, default=64, help="windows per group commit")
    args = ap.parse_args()
    nwin = args.events // args.per_window
    distinct = min(nwin, 2000)
    print(f"encoding {distinct} distinct windows ...", flush=True)
    templates = make_windows(distinct, args.per_window, args.payload_bytes)
    # re-stamp SCNs cheaply is not possible (CRC): encode all windows up front
    windows = (
        templates if nwin <= distinct else make_windows(nwin, args.per_window, args.payload_bytes)
    )
    total_bytes = sum(map(len, windows))
    events = nwin * (args.per_window + 1)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        cfg = BufferConfig(capacity_bytes=args.capacity_mib << 20)
        rates = {}
        for label, group in (("grouped", args.group), ("single", 1)):
            path = Path(tmp) / label
            buf = EventBuffer(path, cfg)
            buf.set_start(999)
            ring = np.memmap(path / "ring.dat", dtype=np.uint8, mode="r+")
            ring[:] = 0  # resident pages, as in a relay that has run a while
            del ring
            t0 = time.perf_counter()
            for i in range(0, len(windows), group):
                buf.append_windows(windows[i : i + group])
            rates[label] = time.perf_counter() - t0
            evicted = buf.stats["windows_evicted"]
            buf.close()
        ring = np.memmap(Path(tmp) / "grouped" / "ring.dat", dtype=np.uint8, mode="r+")
        cap = ring.size
        t1 = time.perf_counter()
        pos = 0
        for w in windows:
            n = len(w)
            if pos + n > cap:
                pos = 0
            ring[pos : pos + n] = np.frombuffer(w, dtype=np.uint8)
            pos += n
        dt_copy = time.perf_counter() - t1
        del ring
    dt = rates["grouped"]
    result = {
        "events": events,
        "bytes": total_bytes,
        "ingest_events_per_s": round(events / dt),
        "ingest_mb_per_s": round(total_bytes / dt / 1e6, 1),
        "ingest_single_window_events_per_s": round(events / rates["single"]),
        "memcpy_events_per_s": round(events / dt_copy),
        "memcpy_mb_per_s": round(total_bytes / dt_copy / 1e6, 1),
        "ingest_vs_memcpy_ratio": round(dt_copy / dt, 3),
        "windows_evicted": evicted,
    }
    print(
        f"appended {events:,} events ({total_bytes / 1e6:,.0f} MB) through a "
        f"{args.capacity_mib} MiB ring: {result['ingest_events_per_s']:,} events/s, "
        f"{result['ingest_mb_per_s']} MB/s in groups of {args.group} windows; "
        f"{result['ingest_single_window_events_per_s']:,} events/s one window at a time "
        f"(memcpy baseline {result['memcpy_mb_per_s']} MB/s); evicted {evicted:,} windows"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
