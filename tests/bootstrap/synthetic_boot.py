"""A relay with a synthetic source and a bootstrap server that has applied all of it.

For tests of the bootstrap server's HTTP answers that need some windows in its
log and snapshot but no source database: ``async with synthetic_boot(tmp) as
(relay, boot)`` yields both once the server's applier reached the relay's last
window (partition ``syn``, one table, 4 events per window); :func:`synthetic_relay` is
that relay's configuration, for tests that build their own set-up.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from changebus.bootstrap import BootstrapConfig, BootstrapServer, HttpConfig, StoreConfig
from changebus.relay import (
    FetcherConfig,
    HttpConfig as RelayHttp,
    PartitionConfig,
    Relay,
    RelayConfig,
)
from waiting import wait_until


def synthetic_relay(
    data_dir: Path, windows: int = 40, *, capacity_bytes: int = 1 << 20, **options: Any
) -> RelayConfig:
    """A relay of one synthetic partition ``syn`` (one table, 4 events per window, as fast
    as it can; ``options``: more of the synthetic fetcher's options)."""
    fetcher = {
        "windows_per_s": 0,
        "max_windows": windows,
        "events_per_window": 4,
        "tables": 1,
        **options,
    }
    return RelayConfig(
        data_dir=data_dir,
        http=RelayHttp(port=0),
        partitions=(
            PartitionConfig(
                "syn",
                1,
                capacity_bytes=capacity_bytes,
                fetcher=FetcherConfig("synthetic", fetcher),
            ),
        ),
        flush_interval_s=0,
    )


@contextlib.asynccontextmanager
async def synthetic_boot(
    tmp: Path, windows: int = 40, start_scn: int = 1000
) -> AsyncIterator[tuple[Relay, BootstrapServer]]:
    relay_cfg = synthetic_relay(tmp / "relay", windows, start_scn=start_scn)
    async with Relay(relay_cfg) as relay:
        await wait_until(lambda: relay.hosts["syn"].buffer.meta.windows >= windows)
        last = relay.hosts["syn"].buffer.meta.last_scn
        cfg = BootstrapConfig(
            relays=(relay.url,),
            data_dir=tmp / "boot",
            store=StoreConfig(kind="sqlite", path=tmp / "boot" / "b.db"),
            http=HttpConfig(port=0),
        )
        async with BootstrapServer(cfg) as boot:
            w = boot.service.workers
            await wait_until(lambda: "syn" in w and w["syn"].applier_scn >= last, what="applier")
            yield relay, boot
