"""A bootstrap server whose log ends before the relays' oldest window.

The consumer bootstrapped, asked the relay from the bootstrap's target, got a 410
(the relay no longer keeps it), bootstrapped again at once, to the same target,
and so on: thousands of bootstraps a second against both servers. It now backs
off (``backoff_*``) while a bootstrap is followed by a 410 before any window.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from synthetic_boot import synthetic_relay

from changebus.bootstrap import BootstrapConfig, BootstrapServer, HttpConfig, StoreConfig
from changebus.client import Consumer, ConsumerConfig
from changebus.relay import Relay
from waiting import wait_until


async def test_a_bootstrap_server_behind_the_relays_is_not_asked_in_a_tight_loop(
    tmp_path: Path,
) -> None:
    async with Relay(synthetic_relay(tmp_path / "old", 20, events_per_window=2)) as old:
        await wait_until(lambda: old.hosts["syn"].buffer.meta.windows >= 20)
        last = old.hosts["syn"].buffer.meta.last_scn
        boot_cfg = BootstrapConfig(
            relays=(old.url,),
            data_dir=tmp_path / "boot",
            store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
            http=HttpConfig(port=0),
        )
        boot = BootstrapServer(boot_cfg)
        await boot.start()
        w = boot.service.workers
        await wait_until(lambda: "syn" in w and w["syn"].applier_scn >= last)
    try:
        # the bootstrap server's log ends at `last`; the relay now keeps SCNs from 5000 on
        async with Relay(
            synthetic_relay(tmp_path / "new", 20, events_per_window=2, start_scn=5000)
        ) as new:
            await wait_until(lambda: new.hosts["syn"].buffer.meta.windows >= 20)
            cfg = ConsumerConfig(
                relays=(new.url,),
                partition="syn",
                bootstrap_servers=(boot.url,),
                backoff_initial_s=0.2,
                backoff_max_s=1.0,
                wait_s=0.2,
            )
            async with Consumer(cfg) as consumer:
                task = asyncio.create_task(consumer.__anext__())
                await asyncio.sleep(3)
                bootstraps = consumer.stats()["bootstraps"]
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
    finally:
        await boot.stop()
    # 0.2 + 0.4 + 0.8 + 1 s pauses: a handful in 3 s (thousands before)
    assert 2 <= bootstraps <= 8, bootstraps
