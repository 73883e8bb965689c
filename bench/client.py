"""Client throughput: decoded events per second through the consumer library.

An in-process relay (synthetic fetcher, pre-filled with ``--windows`` windows
of 5 events of ~200 B) serves one consumer reading from the earliest window
in follow mode; the figure is events delivered to ``async for`` per second,
every event validated (CRCs), decoded (Avro) and grouped into windows.
Baseline in the same run: the bare minimum a client must do with the same
bytes -- one HTTP read of the stream (long-poll, 4 MiB responses),
``parse_stream`` and ``ChangeDecoder.decode_many`` -- with no windows, no
keys, no queue and no checkpoints. ``client_vs_bare_ratio`` =
client / bare (1.0 = the library adds nothing).

The relay shares the event loop with the consumer (both figures pay that).
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import aiohttp

import _common  # noqa: F401  (puts the checkout on sys.path)
from changebus.client import Consumer, ConsumerConfig
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import HEADER_SIZE, ChangeDecoder, Op, parse_stream

EVENTS_PER_WINDOW = 5


async def bare(relay: Relay) -> int:
    """Events decoded by a minimal client (see the module docstring)."""
    registry = relay.hosts["bench"].registry
    decoders: dict[tuple[int, int], ChangeDecoder] = {}
    events = 0
    scn = -1
    async with aiohttp.ClientSession() as http:
        while True:
            params = {"partition": "bench", "scn": str(scn), "max_bytes": str(4 << 20)}
            async with http.get(f"{relay.url}/v1/stream", params=params) as resp:
                if resp.status == 204:
                    return events
                body = await resp.read()
                scn = int(resp.headers["X-Changebus-Next-Scn"])
            offsets, headers = parse_stream(body)
            for i in range(len(offsets)):
                h = headers[i]
                if int(h["op"]) >= int(Op.END_OF_WINDOW):
                    continue
                key = (int(h["source_id"]), int(h["schema_version"]))
                dec = decoders.get(key)
                if dec is None:
                    table = registry.get(registry.name_for_id(key[0]), key[1])
                    dec = decoders[key] = ChangeDecoder(table)
                start = int(offsets[i]) + HEADER_SIZE + int(h["key_length"])
                dec.decode_many(body, [start], [int(offsets[i]) + int(h["total_length"])])
                events += 1


async def client(relay: Relay, windows: int) -> int:
    cfg = ConsumerConfig(relays=(relay.url,), partition="bench", wait_s=0.5)
    events = 0
    async with Consumer(cfg) as consumer:
        n = 0
        async for window in consumer:
            events += len(window.events)
            n += 1
            if n == windows:
                break
    return events


async def run(windows: int, repeat: int) -> dict[str, float]:
    options = {
        "windows_per_s": 0,
        "max_windows": windows,
        "events_per_window": EVENTS_PER_WINDOW,
        "row_bytes": 200,
        "tables": 2,
    }
    with tempfile.TemporaryDirectory(prefix="changebus-bench-") as tmp:
        config = RelayConfig(
            data_dir=Path(tmp),
            http=HttpConfig(port=0),
            partitions=(
                PartitionConfig(
                    "bench",
                    1,
                    capacity_bytes=256 << 20,
                    fetcher=FetcherConfig("synthetic", options),
                ),
            ),
            flush_interval_s=0,
        )
        async with Relay(config) as relay:
            while relay.hosts["bench"].state != "finished":  # noqa: ASYNC110 - no event to wait on
                await asyncio.sleep(0.05)
            best_client = best_bare = 0.0
            for _ in range(repeat):
                t0 = time.perf_counter()
                n = await client(relay, windows)
                best_client = max(best_client, n / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                n = await bare(relay)
                best_bare = max(best_bare, n / (time.perf_counter() - t0))
    return {
        "client_events_per_s": best_client,
        "bare_events_per_s": best_bare,
        "client_vs_bare_ratio": best_client / best_bare,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    result = asyncio.run(run(args.windows, args.repeat))
    print(
        f"client {result['client_events_per_s']:,.0f} events/s, "
        f"bare parse+decode {result['bare_events_per_s']:,.0f} events/s "
        f"(ratio {result['client_vs_bare_ratio']:.2f})"
    )
    print(json.dumps({k: round(v, 3) for k, v in result.items()}))


if __name__ == "__main__":
    main()
