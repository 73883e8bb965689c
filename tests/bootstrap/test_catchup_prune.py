"""A catch-up page read while the applier prunes the log is refused, not cut short.

The page's windows are read in batches (statements of their own); the writer
thread may prune the log between them. A page that lost windows that way went
out complete, the consumer skipped them; now the pruning is seen after the read
and the answer is the 410 a pruned start gets.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from synthetic_boot import synthetic_boot

from changebus.bootstrap._store import Store

pytestmark = pytest.mark.usefixtures("no_blocking")


async def test_a_page_the_log_was_pruned_under_is_a_410(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with synthetic_boot(tmp_path) as (_relay, boot), aiohttp.ClientSession() as http:
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
