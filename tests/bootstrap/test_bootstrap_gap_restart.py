"""A catch-up pruned by a gap on its own bootstrap server runs the snapshot again there.

A consumer in the catch-up of a bootstrap on server A (from nothing, or after
its snapshot): A's producer falls off the relay, A records the lost range and
moves its log's start past it, and the consumer's next catch-up page is a 410.
Every row the consumer holds came from A's store, at SCNs A had (the range
starts after them), and the re-seed and sweep repair that store: the snapshot
runs again there, with deletes. The restart was taken for rows of another
server's snapshot, checked against A's lost ranges, and failed the consumer
for good ("never received SCNs ..."); with A alone at once (found by review).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from synthetic_boot import synthetic_boot

from changebus.bootstrap._store import Store
from changebus.client import ConsumerConfig
from changebus.client._bootstrap import Bootstrapper
from changebus.client._decode import SchemaCache
from changebus.client._model import ChangeOp
from changebus.client._queue import WindowQueue
from changebus.schemas import BootstrapFailedError, BootstrapProgress, Mode, PartitionCheckpoint

pytestmark = pytest.mark.usefixtures("no_blocking")


def _gap_and_repair(store: Store) -> None:
    """The producer fell off after SCN 1020 and resumed at 1030; the tables were seeded
    again since (an empty seed: the sweep turns the rows older than the gap into
    tombstones), so the gap is repaired and the lost range stays for good."""
    store.mark_gap("syn", 1030, after=1020)
    for table in store.source_names("syn"):
        store.seed_rows("syn", table, [], 1035)
    assert store.clear_gap("syn")


async def test_a_catch_up_pruned_by_a_gap_on_its_own_server_runs_the_snapshot_again(
    tmp_path: Path,
) -> None:
    async with synthetic_boot(tmp_path, 40) as (relay, boot), aiohttp.ClientSession() as http:
        last = relay.hosts["syn"].buffer.meta.last_scn
        base = boot.service.workers["syn"].base_scn
        assert 0 <= base < 1005 and last > 1035
        await boot.service.stores.write(_gap_and_repair)
        async with http.get(f"{boot.url}/v1/bootstrap/status?partition=syn") as r:
            status = await r.json()
        assert status["lost_ranges"] == [[1020, 1030]] and status["log_min_scn"] >= 1030

        # the consumer bootstrapped from nothing on this server: a snapshot at 1005 and
        # the catch-up up to 1010, before the range (it holds nothing of it)
        progress = BootstrapProgress(since_scn=-1, start_scn=1005, target_scn=1039, server=boot.url)
        resume = PartitionCheckpoint(
            window_scn=1010, prev_scn=1010, mode=Mode.CATCHUP, bootstrap=progress
        )
        config = ConsumerConfig(
            relays=(relay.url,),
            partition="syn",
            bootstrap_servers=(boot.url,),
            backoff_initial_s=0.01,
            backoff_max_s=0.05,
        )
        queue = WindowQueue(1 << 16, 1 << 30)
        runner = Bootstrapper(config, http, queue, SchemaCache())
        target = await asyncio.wait_for(runner.run(-1, resume), 30)
        windows = list(queue._items)
    assert target >= last
    snapshot = [w for w in windows if w.phase == "snapshot"]
    assert snapshot, [w.phase for w in windows]
    # the new snapshot carries the deletes (the rows the sweep found deleted in the gap)
    assert any(e.op is ChangeOp.DELETE for w in snapshot for e in w.events)
    first = snapshot[0].checkpoint
    assert first is not None and first.bootstrap is not None
    assert first.bootstrap.since_scn == base  # (everything after the base: deletes too)


async def test_a_pruned_catch_up_still_refuses_a_history_that_starts_after_it(
    tmp_path: Path,
) -> None:
    """The restart keeps the other check: rows of a snapshot that started before the
    history of the store now behind the URL (a rebuilt store) are refused."""
    async with synthetic_boot(tmp_path, 40) as (relay, boot), aiohttp.ClientSession() as http:
        base = boot.service.workers["syn"].base_scn
        await boot.service.stores.write(_gap_and_repair)
        progress = BootstrapProgress(
            since_scn=-1, start_scn=base - 5, target_scn=1039, server=boot.url
        )
        resume = PartitionCheckpoint(
            window_scn=1010, prev_scn=1010, mode=Mode.CATCHUP, bootstrap=progress
        )
        config = ConsumerConfig(relays=(relay.url,), partition="syn", bootstrap_servers=(boot.url,))
        runner = Bootstrapper(config, http, WindowQueue(1 << 16, 1 << 30), SchemaCache())
        with pytest.raises(BootstrapFailedError, match=f"starts at SCN {base}, after SCN"):
            await asyncio.wait_for(runner.run(-1, resume), 30)


async def test_one_servers_refusal_waits_for_another_that_is_re_seeding(tmp_path: Path) -> None:
    """Server A's history starts after the position (410); server B can serve it but is
    seeding again after a gap (503 not_yet, for minutes in real life). After five
    503s of B in a row -- a second or two -- A's refusal was taken as final: the
    consumer had to start from nothing (a replica with on_unservable=reset wiped
    its tables), found by review. B is waited for."""
    async with (
        synthetic_boot(tmp_path / "late", 20, start_scn=5000) as (_late_relay, late),
        synthetic_boot(tmp_path / "full", 40) as (relay, full),
        aiohttp.ClientSession() as http,
    ):
        last = relay.hosts["syn"].buffer.meta.last_scn
        await full.service.stores.write(lambda s: s.mark_gap("syn", 1030, after=1020))
        params = {"partition": "syn", "since": "1010"}
        async with http.get(f"{full.url}/v1/bootstrap/start", params=params) as r:
            assert r.status == 503 and (await r.json())["error"] == "not_yet"
        config = ConsumerConfig(
            relays=(relay.url,),
            partition="syn",
            bootstrap_servers=(late.url, full.url),
            backoff_initial_s=0.02,
            backoff_max_s=0.1,
        )
        runner = Bootstrapper(config, http, WindowQueue(1 << 16, 1 << 30), SchemaCache())
        task = asyncio.create_task(runner.run(1010, None))
        await asyncio.sleep(2.0)  # (20 and more rounds)
        assert not task.done(), task.result()
        await full.service.stores.write(_gap_and_repair_seeded)
        assert await asyncio.wait_for(task, 30) >= last


def _gap_and_repair_seeded(store: Store) -> None:
    for table in store.source_names("syn"):
        store.seed_rows("syn", table, [], 1035)
    assert store.clear_gap("syn")


async def test_one_servers_refusal_waits_for_another_that_does_not_answer(
    tmp_path: Path,
) -> None:
    """B restarting (nothing listens): retried as long as ``max_attempts`` allows, and
    then a RelayUnavailableError naming both (not A's refusal, which a replica takes
    as 'start from nothing')."""
    from changebus.client import RelayUnavailableError

    async with (
        synthetic_boot(tmp_path / "late", 20, start_scn=5000) as (relay, late),
        aiohttp.ClientSession() as http,
    ):
        config = ConsumerConfig(
            relays=(relay.url,),
            partition="syn",
            bootstrap_servers=(late.url, "http://127.0.0.1:9"),
            backoff_initial_s=0.01,
            backoff_max_s=0.02,
            max_attempts=12,
        )
        runner = Bootstrapper(config, http, WindowQueue(1 << 16, 1 << 30), SchemaCache())
        with pytest.raises(RelayUnavailableError, match="in 12 attempts") as info:
            await asyncio.wait_for(runner.run(1010, None), 30)
        assert "older than this bootstrap server" in str(info.value)
