"""The bootstrap server stops even when a stop meets a wake-up (Python 3.11 ``wait_for``).

Found as a rare hang at teardown: the applier idles in a wait for its wake-up
event with a timeout; when the cancellation of ``stop()`` and the wake-up land
in the same turn of the event loop, ``asyncio.wait_for`` of Python 3.11 returns
the wake-up and drops the cancellation, so the applier ran on and ``stop()``
waited forever. Here both are made to land together on purpose.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from changebus.bootstrap import BootstrapConfig, BootstrapServer, HttpConfig, StoreConfig
from changebus.relay import (
    FetcherConfig,
    HttpConfig as RelayHttp,
    PartitionConfig,
    Relay,
    RelayConfig,
)
from waiting import wait_until


async def test_an_applier_woken_as_it_is_cancelled_still_stops(tmp_path: Path) -> None:
    relay_cfg = RelayConfig(
        data_dir=tmp_path / "relay",
        http=RelayHttp(port=0),
        partitions=(
            PartitionConfig("syn", 1, fetcher=FetcherConfig("synthetic", {"windows_per_s": 50})),
        ),
        flush_interval_s=0,
    )
    async with Relay(relay_cfg) as relay:
        boot_cfg = BootstrapConfig(
            relays=(relay.url,),
            data_dir=tmp_path / "boot",
            store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
            http=HttpConfig(port=0),
        )
        async with BootstrapServer(boot_cfg) as boot:
            w = boot.service.workers["syn"]
            await wait_until(lambda: w.applier_scn > 0, 30, "the applier")
            (applier,) = [t for t in asyncio.all_tasks() if t.get_name() == "applier-syn"]
            await asyncio.sleep(0.05)  # idle, in its wait for a wake-up
            w.wake.set()
            applier.cancel()  # the same turn of the loop
            await asyncio.wait({applier}, timeout=5)
            assert applier.done(), "the applier swallowed its cancellation"
            assert applier.cancelled()
