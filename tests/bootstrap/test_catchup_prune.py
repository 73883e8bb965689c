"""A catch-up page read while the applier prunes the log is refused, not cut short.

The page's windows are read in batches (statements of their own); the writer
thread may prune the log between them. A page that lost windows that way went
out complete, the consumer skipped them; now the pruning is seen after the read
and the answer is the 410 a pruned start gets.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from changebus.bootstrap import BootstrapConfig, BootstrapServer, HttpConfig, StoreConfig
from changebus.bootstrap._store import Store
from changebus.relay import (
    FetcherConfig,
    HttpConfig as RelayHttp,
    PartitionConfig,
    Relay,
    RelayConfig,
)

pytestmark = pytest.mark.usefixtures("no_blocking")


async def wait_until(cond: Callable[[], bool], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_a_page_the_log_was_pruned_under_is_a_410(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = {"windows_per_s": 0, "max_windows": 40, "events_per_window": 4, "tables": 1}
    relay_cfg = RelayConfig(
        data_dir=tmp_path / "relay",
        http=RelayHttp(port=0),
        partitions=(
            PartitionConfig(
                "syn", 1, capacity_bytes=1 << 20, fetcher=FetcherConfig("synthetic", options)
            ),
        ),
        flush_interval_s=0,
    )
    async with Relay(relay_cfg) as relay:
        await wait_until(lambda: relay.hosts["syn"].buffer.meta.windows >= 40)
        last = relay.hosts["syn"].buffer.meta.last_scn
        cfg = BootstrapConfig(
            relays=(relay.url,),
            data_dir=tmp_path / "boot",
            store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
            http=HttpConfig(port=0),
        )
        async with BootstrapServer(cfg) as boot, aiohttp.ClientSession() as http:
            w = boot.service.workers
            await wait_until(lambda: "syn" in w and w["syn"].applier_scn >= last)
            stores = boot.service.stores
            st = await stores.read(lambda s: s.state("syn"))
            loop = asyncio.get_running_loop()
            read_page = Store.catchup_page

            def pruned_meanwhile(self: Store, part: str, **kw: Any) -> Any:
                # the writer prunes between the page's checks and its reads
                future = asyncio.run_coroutine_threadsafe(
                    stores.write(lambda s: s.prune_to(part, 20)), loop
                )
                assert future.result(10) > 0
                return read_page(self, part, **kw)

            monkeypatch.setattr(Store, "catchup_page", pruned_meanwhile)
            url = f"{boot.url}/v1/bootstrap/catchup"
            params = {
                "partition": "syn",
                "after": str(st.log_min_scn),
                "target": str(st.producer_scn),
            }
            async with http.get(url, params=params) as resp:
                status, body = resp.status, await resp.json()
    assert status == 410, body
    assert "pruned" in body["message"]
