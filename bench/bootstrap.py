"""Bootstrap: snapshot delta vs catch-up log replay (the Databus paper's Figure 16).

For each update ratio r in 0, 0.1, ..., 0.9 (updates and deletes of existing
keys / all changes) a fresh bootstrap store (SQLite by default) receives
``--changes`` row changes in 5-change windows -- "one hour of changes" --
through the store's own producer and applier paths (``Store.append`` /
``Store.apply``). A bootstrap server (the real HTTP app) then serves a new
consumer (the real :class:`changebus.client.Consumer`: validation, Avro
decoding, windows) twice:

* **snapshot**: the server is told to always plan a snapshot: the consumer
  gets the latest version of every live row, then an empty catch-up;
* **catch-up** (the baseline): the server is told to always replay the log:
  the consumer gets every change of the hour.

The figure is the wall time from the consumer's start until it holds the
state at the target SCN (its checkpoint goes online); each path runs
``--repeat`` times, interleaved, and the fastest run counts (the machine is
shared: the minimum is the least disturbed). ``snapshot_vs_catchup
_ratio`` = snapshot time / catch-up time per r (< 1: the snapshot is
faster); the break-even r is interpolated where the ratio crosses 1. Also:
the snapshot serving rate (rows/s through HTTP with a bare client that only
validates the pages, at r = 0: every change is a live row) against the
issue's goal of 50k rows/s with SQLite.

A plot goes to docs/bootstrap_fig16.png (matplotlib, the ``bench`` extra).
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

import _common
from changebus.bootstrap import BootstrapConfig, Store, StoreConfig
from changebus.bootstrap._http import build_app
from changebus.bootstrap._service import BootstrapService, PartitionWorker
from changebus.client import Consumer, ConsumerConfig
from changebus.schemas import (
    Column,
    EndOfWindow,
    Mode,
    Op,
    RowEncoder,
    SchemaRegistry,
    TableSchema,
    encode_control,
    parse_stream,
)

PART = "bench"
PER_WINDOW = 5
TABLE = TableSchema(
    "app.items",
    (
        Column("id", "long", nullable=False),
        Column("n", "long"),
        Column("payload", "string"),
        Column("updated_ns", "long"),
    ),
    ("id",),
)


def fill(store: Store, changes: int, ratio: float, seed: int) -> dict[str, int]:
    """Append ``changes`` changes (``ratio`` of them to existing keys) and apply them."""
    reg = SchemaRegistry()
    table = reg.register(TABLE)
    sid = reg.source_id(TABLE.name)
    store.put_schemas(PART, [(sid, table.version, table.name, json.dumps(table.to_json()))])
    enc = RowEncoder(table, source_id=sid, partition=1)
    rnd = random.Random(seed)
    live: list[int] = []
    where: dict[int, int] = {}
    next_key = 1
    scn = 1000
    batch: list[bytes] = []
    for i in range(0, changes, PER_WINDOW):
        scn += 10
        events = []
        for seq in range(min(PER_WINDOW, changes - i)):
            row_ts = time.time_ns()
            if live and rnd.random() < ratio:
                k = live[rnd.randrange(len(live))]
                if rnd.random() < 0.1:  # a tenth of the updates are deletes
                    events.append(enc.encode(Op.DELETE, scn, seq, row_ts, None, {"id": k}))
                    j = where.pop(k)
                    last = live.pop()
                    if last != k:
                        live[j] = last
                        where[last] = j
                    continue
                op = Op.UPDATE
            else:
                k, next_key, op = next_key, next_key + 1, Op.INSERT
                where[k] = len(live)
                live.append(k)
            row = {"id": k, "n": rnd.randrange(10**9), "payload": "x" * 80, "updated_ns": row_ts}
            events.append(enc.encode(op, scn, seq, row_ts, row))
        events.append(encode_control(EndOfWindow(len(events), ""), scn, len(events), 0))
        batch.append(b"".join(events))
        if len(batch) == 500:
            store.append(PART, b"".join(batch), start_scn=-1)
            batch = []
    if batch:
        store.append(PART, b"".join(batch), start_scn=-1)
    while store.state(PART).applier_scn < store.state(PART).producer_scn:
        store.apply(PART, 50_000)
    return {"live_rows": len(live), "target_scn": scn}


class Server:
    """The bootstrap HTTP app over an existing store (no producer: the store is filled)."""

    def __init__(self, path: Path) -> None:
        self.config = BootstrapConfig(
            relays=("http://127.0.0.1:9",),  # never contacted
            data_dir=path.parent,
            store=StoreConfig(kind="sqlite", path=path),
        )
        self.service = BootstrapService(self.config)
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> Server:
        self.service.workers[PART] = PartitionWorker(PART, state="streaming")
        self.runner = web.AppRunner(build_app(self.service), access_log=None)
        await self.runner.setup()
        port = _common.free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()
        await asyncio.get_running_loop().run_in_executor(None, self.service.stores.close)

    def plan(self, *, snapshot: bool) -> None:
        # 0: a snapshot is always cheaper; huge: the log replay always is
        self.service.config = dataclasses.replace(
            self.config, catchup_ratio=0.0 if snapshot else 1e18
        )


async def consume(url: str) -> tuple[float, int, int]:
    """A new consumer bootstraps; returns (seconds, events, snapshot pages)."""
    cfg = ConsumerConfig(
        relays=("http://127.0.0.1:9",),
        partition=PART,
        bootstrap_servers=(url,),
        bootstrap_page_bytes=1 << 20,
        yield_empty_windows=True,
        queue_windows=64,
    )
    events = pages = 0
    t0 = time.perf_counter()
    async with Consumer(cfg) as consumer:
        async for window in consumer:
            events += len(window.events)
            pages += window.phase == "snapshot"
            cp = window.checkpoint
            if cp is not None and cp.mode is Mode.ONLINE:
                break
    return time.perf_counter() - t0, events, pages


async def serve_rate(url: str, start_scn: int) -> tuple[float, int]:
    """Rows/s of snapshot pages through HTTP for a bare client (fetch + validate)."""
    rows, position = 0, ""
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as http:
        while True:
            params = {"partition": PART, "start": str(start_scn), "max_bytes": str(1 << 20)}
            if position:
                params["position"] = position
            async with http.get(f"{url}/v1/bootstrap/snapshot", params=params) as resp:
                body = await resp.read()
                position = resp.headers["X-Changebus-Snapshot-Position"]
                done = resp.headers["X-Changebus-Snapshot-Complete"] == "1"
            rows += len(parse_stream(body)[0])
            if done:
                break
    return time.perf_counter() - t0, rows


def plot(points: list[dict[str, Any]], out: Path, changes: int, break_even: float | None) -> bool:
    """Draw the figure; False when matplotlib is missing (``pip install -e .[bench]``)."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p["update_ratio"] * 100 for p in points]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(xs, [p["snapshot_s"] for p in points], "o-", label="snapshot delta")
    ax.plot(xs, [p["catchup_s"] for p in points], "s-", label="catch-up log replay")
    if break_even is not None:
        ax.axvline(break_even * 100, color="grey", linestyle=":", label="break-even")
    ax.set_xlabel("updates to existing keys (% of changes)")
    ax.set_ylabel("time to bring a new consumer up to date (s)")
    ax.set_title(f"Bootstrap of {changes:,} changes (SQLite store)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--changes", type=int, default=100_000, help="changes per update ratio")
    ap.add_argument("--ratios", default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9")
    ap.add_argument("--repeat", type=int, default=3, help="runs per path (the fastest counts)")
    ap.add_argument("--plot", type=Path, default=_common.ROOT / "docs" / "bootstrap_fig16.png")
    args = ap.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]
    points: list[dict[str, Any]] = []
    serving: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="changebus-bench-boot-") as tmp:
        for i, r in enumerate(ratios):
            path = Path(tmp) / f"r{i}.db"
            store = Store.sqlite(path)
            t0 = time.perf_counter()
            info = fill(store, args.changes, r, seed=i)
            fill_s = time.perf_counter() - t0
            counts = store.counts(PART)
            store.close()
            async with Server(path) as server:
                if i == 0:
                    secs, rows = await serve_rate(server.url, info["target_scn"])
                    serving = {"rows": rows, "seconds": secs, "rows_per_s": rows / secs}
                snaps, catches = [], []
                for _ in range(args.repeat):  # interleaved; the fastest run of each counts
                    server.plan(snapshot=True)
                    snaps.append(await consume(server.url))
                    server.plan(snapshot=False)
                    catches.append(await consume(server.url))
                snap_s, snap_events, pages = min(snaps)
                catch_s, catch_events, _ = min(catches)
            point = {
                "update_ratio": r,
                "snapshot_s": round(snap_s, 3),
                "catchup_s": round(catch_s, 3),
                "snapshot_vs_catchup_ratio": round(snap_s / catch_s, 3),
                "snapshot_rows": snap_events,
                "catchup_events": catch_events,
                "live_rows": info["live_rows"],
                "snapshot_pages": pages,
                "fill_s": round(fill_s, 2),
            }
            assert snap_events == info["live_rows"] == counts["rows"], (point, counts)
            assert catch_events == args.changes, point
            points.append(point)
            print(
                f"r={r:.1f}: snapshot {snap_s:6.2f} s ({snap_events:>7,} rows), "
                f"catch-up {catch_s:6.2f} s ({catch_events:>7,} events), "
                f"ratio {snap_s / catch_s:.2f}   (store filled in {fill_s:.1f} s)",
                flush=True,
            )
    break_even = None
    for a, b in itertools.pairwise(points):
        ra, rb = a["snapshot_vs_catchup_ratio"], b["snapshot_vs_catchup_ratio"]
        if (ra - 1) * (rb - 1) <= 0 and ra != rb:
            x = a["update_ratio"] + (1 - ra) * (b["update_ratio"] - a["update_ratio"]) / (rb - ra)
            break_even = round(x, 3)
            break
    if not plot(points, args.plot, args.changes, break_even):
        print("matplotlib is missing (pip install -e .[bench]): no plot written")
    print(
        f"snapshot serving (bare HTTP client, SQLite): {serving['rows_per_s']:,.0f} rows/s "
        f"({serving['rows']:,} rows in {serving['seconds']:.2f} s); goal >= 50,000"
    )
    print(f"break-even update ratio: {break_even}; plot: {args.plot}")
    result = {
        "changes": args.changes,
        "points": points,
        "break_even_update_ratio": break_even,
        "snapshot_serving_rows_per_s": round(serving["rows_per_s"]),
        "snapshot_serving_goal_ratio": round(serving["rows_per_s"] / 50_000, 3),
        "plot": str(args.plot),
    }
    print(json.dumps(result, separators=(",", ":")))


if __name__ == "__main__":
    asyncio.run(main())
