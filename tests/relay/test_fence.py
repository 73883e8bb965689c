"""The leader's fence in the partition ingest (``PartitionHost.fence``), without ZooKeeper.

A fence whose lease is withdrawn stops the ingest at the next group: nothing
more is appended or acknowledged, the partition is ``fenced`` (``/readyz`` 503
with the reason) and the fence hears about it once. A hold limits how far
the source is acknowledged.
"""

from __future__ import annotations

import threading
from pathlib import Path

import aiohttp
import pytest

from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from fix_pg import wait_until

pytestmark = pytest.mark.usefixtures("no_blocking")

SYN = FetcherConfig(
    "synthetic", {"windows_per_s": 500, "events_per_window": 2, "row_bytes": 50, "keys": 100}
)


class Fence:
    """A lease the test withdraws by hand, and a hold on acknowledgements."""

    def __init__(self) -> None:
        self.valid = True
        self.hold = (1 << 63) - 1
        self.refusals: list[str] = []
        self.admits = 0
        self.lock = threading.Lock()

    def admit(self) -> bool:  # the writer thread
        with self.lock:
            self.admits += 1
        return self.valid

    def ack_scn(self, scn: int) -> int | None:
        return min(scn, self.hold) if self.valid else None

    def refused(self, reason: str) -> None:
        self.refusals.append(reason)


def config(tmp: Path) -> RelayConfig:
    return RelayConfig(
        data_dir=tmp,
        http=HttpConfig(port=0),
        partitions=(PartitionConfig("syn", 1, capacity_bytes=8 << 20),),
        flush_interval_s=0,
    )


async def test_a_withdrawn_lease_stops_appending_and_acknowledging(tmp_path: Path) -> None:
    async with Relay(config(tmp_path)) as relay, aiohttp.ClientSession() as http:
        host = relay.hosts["syn"]
        fence = Fence()
        await host.switch_fetcher(SYN, fence=fence)
        await wait_until(lambda: host.buffer.meta.windows >= 50, 20, "50 windows")
        fetcher = host.fetcher
        assert fetcher is not None
        assert fence.admits > 0
        # twice per group (before any work, and just before it is published), not per
        # window or event; the group the writer holds right now was admitted before it
        # is appended (one in flight at most)
        assert fence.admits <= 2 * (host.buffer.meta.windows + 1)

        fence.hold = host.buffer.meta.last_scn  # followers hold no more than this
        held = fence.hold
        await wait_until(lambda: host.buffer.meta.last_scn > held + 20, 20, "more windows")
        assert fetcher.status()["acknowledged_scn"] <= held

        fence.valid = False
        # (the refusal is told once the fetcher is closed, a moment after the state)
        await wait_until(lambda: host.state == "fenced" and fence.refusals, 10, "fenced")
        last, acked = host.buffer.meta.last_scn, fetcher.status()["acknowledged_scn"]
        assert acked <= held
        assert len(fence.refusals) == 1 and "not valid" in fence.refusals[0]
        assert host.fetcher is None  # the source is closed
        async with http.get(f"{relay.url}/readyz") as resp:
            assert resp.status == 503
            body = await resp.json()
        assert body["partitions"]["syn"].startswith("fenced: the leadership lease is not valid")
        await host.acknowledge_held()  # the periodic catch-up is fenced too
        assert fetcher.status()["acknowledged_scn"] == acked
        assert host.buffer.meta.last_scn == last  # nothing appended after the refusal

        # a new term (a valid fence) may read again, from the buffer's newest SCN
        fence2 = Fence()
        await host.switch_fetcher(SYN, fence=fence2)
        await wait_until(lambda: host.buffer.meta.last_scn > last, 20, "appending again")
        assert host.state == "streaming" and host.ready
