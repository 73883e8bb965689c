"""Where a consumer goes online after a bootstrap, on real servers.

* **The seed's rows.** A seed stores the rows it copies at its chunk's tag
  (Postgres: the WAL insert position before the chunk, minus one), usually
  ahead of the windows the server's log holds; a re-seed (or a first seed that
  started after the consumer planned) running during a consumer's snapshot
  sends such rows on its pages. The catch-up's target was the server's newest
  window only: the consumer went online before those rows' SCN, holding newer
  versions than the state at its position, and the relay windows after it
  took them back to older versions, then forward again ("after window G the
  consumer holds the source's state at G" broken; found by review). The
  consumer's state when it goes online is compared, row by row, with the
  source's state at that SCN, and at the end with the source's; a snapshot
  resumed from its checkpoint keeps the newest row SCN the pages before sent.
* **A group's idle units.** Units without events in a lane window move by
  position only, at most every 50 ms per lane: the batches in between only
  replace the lane's pending one. When the catch-up's last window (carrying
  the online checkpoint) was passed over so and the next move came with a
  relay window, a unit still in ``bootstrap-catchup`` kept that mode and its
  bootstrap progress at an SCN past the target, and that was stored: ``group
  status`` showed the wrong mode, and after a restart or a move the unit went
  back to the target and read the relays again from there (found by review).

Set-up: a relay fed by a script released in parts (:class:`Gate`; partition
``syn``, one table ``app.kv``: ``id`` -> ``v``): :data:`FIRST` up to SCN 1010,
then :data:`LATER` up to 1030; a bootstrap server (SQLite store) that applied
the first part, holding, for the first tests, a seed read at :data:`TAG` (the
source's rows then, stored at the tag as a re-seed's chunk is), ahead of its
log. :func:`state_at` is the source's state at an SCN (the script folded).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from changebus.bootstrap import (
    BootstrapConfig,
    BootstrapServer,
    HttpConfig as BootHttp,
    StoreConfig,
)
from changebus.bootstrap._store import Store
from changebus.client import Consumer, ConsumerConfig, FileUnitStore, Window
from changebus.client._bootstrap import Bootstrapper
from changebus.client._decode import SchemaCache
from changebus.client._model import ChangeOp
from changebus.client._queue import WindowQueue
from changebus.fetchers import ResumePoint, Window as FetchedWindow, register_fetcher
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import (
    BootstrapProgress,
    Checkpoint,
    Column,
    EndOfWindow,
    Mode,
    Op,
    PartitionCheckpoint,
    RowEncoder,
    SchemaChange,
    TableSchema,
    Unit,
    UnitCommit,
    encode_control,
)
from waiting import wait_until

pytestmark = pytest.mark.usefixtures("no_blocking")

KV = TableSchema("app.kv", (Column("id", "long", nullable=False), Column("v", "long")), ("id",), 1)
SID = 1
#: a seed's tag: between the windows 1015 and 1020, as a Postgres tag is (the WAL
#: insert position before the chunk, minus one: no window's SCN)
TAG = 1017

Row = tuple[Op, int, int | None]  # op, id, v (None: a delete)

#: the source's changes, by window: released up to 1010 at first
FIRST: list[tuple[int, list[Row]]] = [
    (1001, [(Op.INSERT, i, 1001) for i in range(1, 7)]),
    (1005, [(Op.UPDATE, 1, 1005), (Op.UPDATE, 2, 1005)]),
    (1010, [(Op.UPDATE, 3, 1010)]),
]
LATER: list[tuple[int, list[Row]]] = [
    (1015, [(Op.UPDATE, 1, 1015), (Op.DELETE, 4, None)]),
    (1020, [(Op.UPDATE, 2, 1020), (Op.UPDATE, 5, 1020)]),
    (1030, [(Op.UPDATE, 6, 1030)]),
]


def state_at(scn: int) -> dict[int, int]:
    """The source's rows (id -> v) after the windows up to ``scn``."""
    rows: dict[int, int] = {}
    for at, changes in FIRST + LATER:
        if at > scn:
            break
        for _op, key, value in changes:
            if value is None:
                rows.pop(key, None)
            else:
                rows[key] = value
    return rows


def encode(scn: int, changes: list[Row], partition_id: int, first: bool) -> FetchedWindow:
    """One window of ``changes`` (a SCHEMA_CHANGE first in the first window)."""
    ts = time.time_ns()
    events: list[bytes] = []
    if first:
        text = json.dumps(KV.to_json(), separators=(",", ":"))
        change = SchemaChange(SID, KV.name, KV.version, KV.fingerprint, text)
        events.append(encode_control(change, scn, 0, ts, partition=partition_id))
    enc = RowEncoder(KV, source_id=SID, partition=partition_id)
    for op, key, value in changes:
        after = None if value is None else {"id": key, "v": value}
        before = {"id": key, "v": None} if op is Op.DELETE else None
        events.append(enc.encode(op, scn, len(events), ts, after, before))
    events.append(
        encode_control(
            EndOfWindow(len(changes), f"gate:{scn}"), scn, len(events), ts, partition=partition_id
        )
    )
    return FetchedWindow(scn, ts, b"".join(events), len(events), f"gate:{scn}")


class Gate:
    """The script of a relay: windows served as they are released."""

    def __init__(self, windows: Sequence[tuple[int, list[Row]]]) -> None:
        self.windows = list(windows)
        self.changed = asyncio.Event()

    def release(self, windows: Sequence[tuple[int, list[Row]]]) -> None:
        self.windows.extend(windows)
        self.changed.set()


_GATES: dict[str, Gate] = {}
_ids = itertools.count()


class GatedFetcher:
    """Serves its gate's windows, waiting for more after the last one."""

    def __init__(self, name: str, partition_id: int, options: Mapping[str, Any]) -> None:
        self.name = name
        self._gate = _GATES[str(options["gate"])]
        self._partition_id = partition_id
        self._after = -1

    async def start(self, resume: ResumePoint) -> int:
        self._after = resume.scn
        return max(resume.scn, self._gate.windows[0][0] - 1)

    async def windows(self) -> AsyncIterator[FetchedWindow]:
        served = 0
        while True:
            while served < len(self._gate.windows):
                scn, changes = self._gate.windows[served]
                served += 1
                if scn > self._after:
                    yield encode(scn, changes, self._partition_id, served == 1)
            self._gate.changed.clear()
            await self._gate.changed.wait()

    async def acknowledge(self, scn: int) -> None:
        return None

    async def close(self) -> None:
        return None

    def status(self) -> dict[str, Any]:
        return {"kind": "gated-script"}


register_fetcher("gated-script", GatedFetcher)


def seed_at(tag: int) -> Callable[[Store], None]:
    """A re-seed of app.kv read at ``tag``: the source's rows then (a row deleted before
    is not in a seed's chunk), stored at the tag (a store write)."""

    def write(store: Store) -> None:
        enc = RowEncoder(KV, source_id=SID, partition=1)
        ts = time.time_ns()
        events = [
            enc.encode(Op.INSERT, tag, i, ts, {"id": key, "v": value}, None)
            for i, (key, value) in enumerate(sorted(state_at(tag).items()))
        ]
        store.seed_rows("syn", KV.name, events, tag)

    return write


@asynccontextmanager
async def gated_servers(
    tmp: Path, seed_tag: int | None = None
) -> AsyncIterator[tuple[Relay, BootstrapServer, Gate]]:
    """The relay (windows up to 1010 released) and a bootstrap server that applied them
    (and holds a seed at ``seed_tag``: module docstring)."""
    name = f"g{next(_ids)}"
    gate = _GATES[name] = Gate(FIRST)
    relay_cfg = RelayConfig(
        data_dir=tmp / "relay",
        http=HttpConfig(port=0, max_wait_s=10),
        partitions=(
            PartitionConfig(
                "syn",
                1,
                capacity_bytes=4 << 20,
                fetcher=FetcherConfig("gated-script", {"gate": name}),
            ),
        ),
        flush_interval_s=0,
    )
    try:
        async with Relay(relay_cfg) as relay:
            await wait_until(lambda: relay.hosts["syn"].buffer.meta.last_scn >= 1010)
            boot_cfg = BootstrapConfig(
                relays=(relay.url,),
                data_dir=tmp / "boot",
                store=StoreConfig(kind="sqlite", path=tmp / "boot" / "b.db"),
                http=BootHttp(port=0),
            )
            async with BootstrapServer(boot_cfg) as boot:
                w = boot.service.workers
                await wait_until(
                    lambda: "syn" in w and w["syn"].applier_scn >= 1010, what="applier"
                )
                if seed_tag is not None:
                    await boot.service.stores.write(seed_at(seed_tag))
                assert w["syn"].producer_scn == 1010  # (a seed's rows ahead of the log)
                yield relay, boot, gate
    finally:
        del _GATES[name]


def fold(rows: dict[int, int], window: Window) -> None:
    for e in window.events:
        key = int(e.key["id"])
        if e.op is ChangeOp.DELETE:
            rows.pop(key, None)
        else:
            assert e.after is not None
            rows[key] = int(e.after["v"])


async def release_later(gate: Gate, seconds: float = 1.0) -> None:
    await asyncio.sleep(seconds)
    gate.release(LATER)


def config(relay: Relay, boot: BootstrapServer, **kw: Any) -> ConsumerConfig:
    return ConsumerConfig(
        relays=(relay.url,),
        partition="syn",
        bootstrap_servers=(boot.url,),
        wait_s=0.5,
        backoff_initial_s=0.05,
        backoff_max_s=0.2,
        **kw,
    )


async def test_a_consumer_goes_online_at_or_after_the_seed_rows_it_received(
    tmp_path: Path,
) -> None:
    async with gated_servers(tmp_path, TAG) as (relay, boot, gate):
        release = asyncio.create_task(release_later(gate))
        rows: dict[int, int] = {}
        online_at = -1
        try:
            async with Consumer(
                config(relay, boot, yield_empty_windows=True, bootstrap_page_bytes=64)
            ) as consumer:
                async for window in consumer:
                    fold(rows, window)
                    pc = window.checkpoint
                    if online_at < 0 and pc is not None and pc.mode is Mode.ONLINE:
                        online_at = window.scn
                        # online at G: the source's state at G, row by row
                        assert online_at >= TAG, f"online at {online_at}, rows of {TAG} held"
                        assert rows == state_at(online_at)
                    if window.scn >= 1030:
                        break
        finally:
            await release
    assert online_at >= TAG
    assert rows == state_at(1030)  # the end: the source's rows


async def test_a_snapshot_resumed_from_its_checkpoint_keeps_the_newest_row_scn(
    tmp_path: Path,
) -> None:
    async with gated_servers(tmp_path, TAG) as (relay, boot, gate), aiohttp.ClientSession() as http:
        cfg = config(relay, boot, bootstrap_page_bytes=64)  # a row a page
        # a consumer stopped after two snapshot pages (the first sent a row at the tag)
        queue = WindowQueue(2, 1 << 30)
        first = asyncio.create_task(Bootstrapper(cfg, http, queue, SchemaCache()).run(-1, None))
        await wait_until(lambda: len(queue) >= 2, what="two snapshot pages")
        first.cancel()
        windows = list(queue._items)
        assert [w.phase for w in windows] == ["snapshot", "snapshot"]
        assert windows[0].events[0].scn == TAG
        pc = windows[1].checkpoint
        assert pc is not None and pc.mode is Mode.SNAPSHOT and pc.bootstrap is not None
        # what it stores, and what a restart reads back
        stored = Checkpoint.from_token(Checkpoint({"syn": pc}).to_token()).get("syn")
        assert stored == pc and stored.bootstrap is not None
        assert stored.bootstrap.target_scn == TAG

        # the restart goes on after the second page: it never sees the first one's row,
        # and still goes online at or after it (the log gets there a moment later)
        release = asyncio.create_task(release_later(gate))
        queue = WindowQueue(1 << 16, 1 << 30)
        target = await asyncio.wait_for(
            Bootstrapper(cfg, http, queue, SchemaCache()).run(-1, stored), 30
        )
        await release
        assert target >= TAG
        windows = list(queue._items)
        assert windows[-1].checkpoint == PartitionCheckpoint(
            window_scn=target, prev_scn=target, timestamp_ns=windows[-1].timestamp_ns
        )

        # a checkpoint of the version before (no target_scn in a snapshot) still resumes
        assert stored.bootstrap is not None
        old = dataclasses.replace(
            stored, bootstrap=dataclasses.replace(stored.bootstrap, target_scn=-1)
        )
        old = PartitionCheckpoint.from_dict(old.to_dict())
        queue = WindowQueue(1 << 16, 1 << 30)
        again = await asyncio.wait_for(
            Bootstrapper(cfg, http, queue, SchemaCache()).run(-1, old), 30
        )
        assert again >= 1030


BUCKETS = 8


@pytest.mark.zk
async def test_idle_units_are_stored_online_after_a_catch_up_window_passed_over(
    tmp_path: Path, zk_hosts: str
) -> None:
    """The units' stored checkpoints are in the catch-up of a bootstrap (up to 1010);
    the member's application takes a while over the catch-up's last window, so the
    relay windows after it are queued meanwhile and dequeued within the 50 ms: the
    first relay batch moves the idle units (module docstring)."""
    async with gated_servers(tmp_path) as (relay, boot, gate):
        gate.release(LATER)  # the relay windows after the catch-up's target
        # (the bootstrap server's log too: the catch-up stops at its target all the same)
        worker = boot.service.workers["syn"]
        while worker.producer_scn < 1030:
            await asyncio.sleep(0.01)
        group = f"g{uuid.uuid4().hex[:10]}"
        store = FileUnitStore(tmp_path / "units")
        try:
            # every unit stored in the catch-up of a bootstrap from 1001 to 1010
            progress = BootstrapProgress(
                since_scn=-1, start_scn=1001, target_scn=1010, server=boot.url
            )
            catchup = PartitionCheckpoint(
                mode=Mode.CATCHUP, window_scn=1001, prev_scn=1001, bootstrap=progress
            )
            units = Unit.all_of(["syn"], BUCKETS)
            for unit in units:
                claim = await store.claim(group, unit, "setup")
                await store.commit(group, [UnitCommit(unit, catchup, claim.token)])

            cfg = ConsumerConfig(
                relays=(relay.url,),
                partition="syn",
                group=group,
                zookeeper=zk_hosts,
                buckets=BUCKETS,
                zookeeper_session_timeout_s=2.0,
                commit_interval_s=0.05,
                bootstrap_servers=(boot.url,),
                wait_s=0.3,
                backoff_initial_s=0.01,
                backoff_max_s=0.05,
            )
            phases: list[tuple[str, int]] = []
            async with Consumer(cfg, store) as consumer:
                async for window in consumer:
                    phases.append((window.phase, window.scn))
                    if window.scn == 1010:
                        # the catch-up's last window takes a while: the relay's are queued
                        await asyncio.sleep(0.5)
                    await consumer.commit()
                    if window.scn >= 1030:
                        break
            stored = await store.read(group)
        finally:
            await store.close()
    assert ("catchup", 1010) in phases and ("online", 1030) in phases, phases
    assert len(stored) == BUCKETS
    modes = {
        str(u): (s.checkpoint.mode.value, s.checkpoint.window_scn)
        for u, s in stored.items()
        if s.checkpoint is not None
    }
    # every unit online, at the catch-up's target or after (idle ones as their lane)
    assert all(mode == "online" and scn >= 1010 for mode, scn in modes.values()), modes
