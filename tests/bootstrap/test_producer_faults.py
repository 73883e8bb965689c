"""The bootstrap producer's faults (review): the log writer's memory counted in bytes, a
store error that is not a changebus error, and schemas asked of a relay that died.

* The queue between the producer and the log writer held up to 1,000 windows,
  whatever their size (windows of hundreds of MiB behind a slow store were
  gigabytes); it is now bounded in bytes too (``producer.batch_bytes`` x 2),
  and a log transaction takes at most ``batch_bytes`` of windows.
* A store error in the producer's schema copy (``sqlite3.OperationalError``,
  not a :class:`ChangebusError`) ended the producer task for good while the
  partition still said ``streaming``.
* The schemas of a batch were asked only of the relay that sent it: one that
  died meanwhile stalled the log writer (and the producer behind it) for ever.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
from synthetic_boot import synthetic_relay

from changebus.bootstrap import (
    BootstrapConfig,
    BootstrapServer,
    HttpConfig,
    ProducerConfig,
    StoreConfig,
)
from changebus.relay import Relay
from changebus.schemas import TransportError
from waiting import wait_until


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(tmp: Path, *relays: str, **producer: Any) -> BootstrapConfig:
    return BootstrapConfig(
        relays=relays,
        data_dir=tmp / "boot",
        store=StoreConfig(kind="sqlite", path=tmp / "boot" / "b.db"),
        http=HttpConfig(port=0),
        producer=ProducerConfig(**producer),
    )


async def test_the_log_writers_queue_is_bounded_in_bytes(tmp_path: Path) -> None:
    windows = 900
    relay_cfg = synthetic_relay(
        tmp_path / "relay", windows, capacity_bytes=8 << 20, windows_per_s=300, row_bytes=200
    )
    async with Relay(relay_cfg) as relay:
        host = relay.hosts["syn"]

        def meta() -> Any:
            return host.buffer.meta

        await wait_until(lambda: meta().windows >= 10)
        limit = 4096
        boot = BootstrapServer(_config(tmp_path, relay.url, batch_bytes=limit, max_bytes=2048))
        gate, held = threading.Event(), threading.Event()

        def hold(_s: Any) -> None:
            held.set()
            gate.wait(30)

        await boot.start()
        try:
            w = boot.service.workers["syn"]
            await wait_until(lambda: w.producer_scn >= 0, what="the first batch")
            # the store's writer thread is held: nothing the producer reads gets stored
            blocker = asyncio.ensure_future(boot.service.stores.write(hold))
            await asyncio.to_thread(held.wait, 10)
            appended = w.windows_appended
            await asyncio.sleep(1.5)  # the relay makes ~450 windows of ~1 KB meanwhile
            stream = w.stream
            queued, taken = w.queued_bytes, stream.windows
            made = meta().windows
            gate.set()
            await blocker
            # two batches' worth at most (one window may pass it when nothing else is held)
            assert taken - appended <= 2 * limit // 500, (taken, appended)
            assert 0 < queued <= 2 * limit, queued
            assert made - appended > 100  # the relay had far more: the producer waited
            # every window arrives, in batches of at most ``limit`` bytes
            await wait_until(lambda: meta().windows >= windows, 30, "the relay's windows")
            await wait_until(lambda: w.applier_scn >= meta().last_scn, 30, "the rest")
            assert w.windows_appended == windows
            assert w.queued_bytes == 0
        finally:
            gate.set()
            await boot.stop()


async def test_a_store_error_in_the_schema_copy_does_not_end_the_producer(
    tmp_path: Path,
) -> None:
    async with Relay(synthetic_relay(tmp_path / "relay", 40)) as relay:
        host = relay.hosts["syn"]

        def meta() -> Any:
            return host.buffer.meta

        await wait_until(lambda: meta().windows >= 40)
        boot = BootstrapServer(
            dataclasses.replace(
                _config(tmp_path, relay.url), producer=ProducerConfig(fell_off_retry_s=0.2)
            )
        )
        real = boot.service._sync_schemas
        calls: list[str] = []

        async def flaky(w: Any, url: str) -> set[tuple[int, int]]:
            calls.append(url)
            if len(calls) == 1:
                raise sqlite3.OperationalError("database is locked")
            return await real(w, url)

        boot.service._sync_schemas = flaky  # type: ignore[method-assign]
        await boot.start()
        try:
            w = boot.service.workers["syn"]
            await wait_until(lambda: w.applier_scn >= meta().last_scn, 30, "the windows")
            assert len(calls) >= 2
            assert not w.tasks[0].done()
        finally:
            await boot.stop()


async def test_schemas_come_from_another_relay_when_the_sender_died(
    tmp_path: Path, monkeypatch: Any
) -> None:
    from changebus.bootstrap import _pipeline

    monkeypatch.setattr(_pipeline, "_PREV_SCN_PAUSE_S", 0.05)
    async with Relay(synthetic_relay(tmp_path / "relay", 40)) as relay:
        host = relay.hosts["syn"]

        def meta() -> Any:
            return host.buffer.meta

        await wait_until(lambda: meta().windows >= 40)
        dead = f"http://127.0.0.1:{closed_port()}"
        async with BootstrapServer(_config(tmp_path, dead, relay.url)) as boot:
            w = boot.service.workers["syn"]
            await wait_until(lambda: w.applier_scn >= meta().last_scn, 30, "the windows")
            stored = await boot.service.stores.read(lambda s: s.schemas("syn"))
            pairs = {(sid, v) for sid, v, _n, _j in stored}
            # the batch's relay is the dead one: the stream's other relay answers
            got = await boot.service._sync_schemas_from(w, dead, pairs)
            assert pairs and pairs <= got
            # a version no relay has: the batch waits (it was stored with events no
            # stored schema decodes, when some other relay answered at all)
            with pytest.raises(TransportError, match="no relay gave the schemas of 1 v99"):
                await boot.service._sync_schemas_from(w, dead, {(1, 99)})
            # a new log whose first window's relay died: its history starts just before
            # that window (another relay's start says nothing of what this one evicted)
            assert await boot.service._first_prev_scn(w, 5000, dead) == 4999
            assert (
                await boot.service._first_prev_scn(w, 5000, relay.url)
                == (host.status()["prev_scn"])
            )


async def test_the_log_is_pruned_once_a_tenth_more_came_not_every_step(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Finding the cut walks ``log_keep_events`` index entries, and it ran after every
    applier step, even of one window: a second a step at 10M events kept (review)."""
    from changebus.bootstrap import ApplierConfig
    from changebus.bootstrap._store import Store

    calls: list[int] = []
    real = Store.prune_to

    def counted(self: Store, part: str, keep: int) -> int:
        calls.append(keep)
        return real(self, part, keep)

    monkeypatch.setattr(Store, "prune_to", counted)
    windows = 300  # of 4 events, one at a time (100 a second): a step each
    async with Relay(synthetic_relay(tmp_path / "relay", windows, windows_per_s=100)) as relay:
        host = relay.hosts["syn"]
        cfg = dataclasses.replace(
            _config(tmp_path, relay.url), applier=ApplierConfig(log_keep_events=400)
        )
        async with BootstrapServer(cfg) as boot:
            w = boot.service.workers["syn"]
            await wait_until(lambda: host.buffer.meta.windows >= windows, 30, "the windows")
            await wait_until(lambda: w.applier_scn >= host.buffer.meta.last_scn, 30, "applied")
            counts = await boot.service.stores.read(lambda s: s.counts("syn"))
    # 1,200 row events (and each window's own) appended: a prune each 40 at most, not
    # one a step (about 300)
    assert 1 <= len(calls) <= 60, len(calls)
    assert counts["log_events"] <= 400 + 40 + 4 * 10  # (about keep; a step's windows more)
