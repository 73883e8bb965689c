"""``changebus demo`` (interim): an embedded relay with the synthetic source.

Until the Postgres fetcher and the client library land, the demo runs the
relay in-process with the synthetic fetcher and a long-polling consumer that
prints each change as a JSON line, then a summary. Ctrl-C (or ``--seconds``)
stops everything cleanly.
"""

from __future__ import annotations

import asyncio
import json
import signal
import tempfile
import time
from pathlib import Path

import aiohttp

from ._config import FetcherConfig, HttpConfig, PartitionConfig, RelayConfig
from ._daemon import Relay

__all__ = ["run_demo"]


async def run_demo(seconds: float, rate: float) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    with tempfile.TemporaryDirectory(prefix="changebus-demo-") as tmp:
        options = {
            "windows_per_s": rate,
            "events_per_window": 3,
            "row_bytes": 24,
            "tables": 2,
            "keys": 50,
        }
        config = RelayConfig(
            data_dir=Path(tmp),
            http=HttpConfig(port=0),
            partitions=(
                PartitionConfig(
                    "demo", 1, capacity_bytes=8 << 20, fetcher=FetcherConfig("synthetic", options)
                ),
            ),
            flush_interval_s=0,
        )
        async with Relay(config) as relay, aiohttp.ClientSession() as http:
            print(
                f"# relay on {relay.url} (synthetic source, {rate:g} transactions/s); Ctrl-C stops",
                flush=True,
            )
            changes = windows = 0
            first_scn = last_scn = -1
            scn = -1
            deadline = time.monotonic() + seconds
            while not stop.is_set() and time.monotonic() < deadline:
                params = {
                    "partition": "demo",
                    "scn": str(scn),
                    "wait": "1",
                    "format": "ndjson",
                    "max_bytes": "65536",
                }
                async with http.get(f"{relay.url}/v1/stream", params=params) as resp:
                    if resp.status == 204:
                        continue
                    text = await resp.text()
                    scn = int(resp.headers["X-Changebus-Next-Scn"])
                for line in text.splitlines():
                    event = json.loads(line)
                    if event["op"] in ("insert", "update", "delete"):
                        changes += 1
                        print(
                            json.dumps(
                                {
                                    k: event[k]
                                    for k in ("scn", "op", "source", "key", "after")
                                    if k in event
                                }
                            )
                        )
                    elif event["op"] == "end_of_window":
                        windows += 1
                        first_scn = event["scn"] if first_scn < 0 else first_scn
                        last_scn = event["scn"]
            meta = relay.hosts["demo"].buffer.meta
            lag = meta.last_scn - last_scn if last_scn >= 0 else 0
            print(
                f"# {changes} changes in {windows} transactions, SCN {first_scn}..{last_scn}; "
                f"consumer lag at the end: {lag} transactions",
                flush=True,
            )
    return 0
