"""A bootstrap server's producer moving to a relay with another schema registry.

The log keeps the relay's raw windows, whose events name their table by the
relay registry's ``(source_id, version)``. Two relays reading one source each
on their own may number tables differently; the windows of the second, stored
after the first's, were decoded as another table. The producer now holds a
relay's registry against the log's before it stores that relay's first window.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from synthetic_boot import synthetic_relay

from changebus.bootstrap import BootstrapConfig, BootstrapServer, HttpConfig, StoreConfig
from changebus.relay import Relay
from waiting import wait_until


@contextlib.asynccontextmanager
async def _relay(data_dir: Path, windows: int, first_table: int = 0) -> AsyncIterator[Relay]:
    async with Relay(synthetic_relay(data_dir, windows, first_table=first_table)) as relay:
        await wait_until(lambda: relay.hosts["syn"].buffer.meta.windows >= windows)
        yield relay


async def _switch(tmp: Path, *, other_registry: bool) -> tuple[str, int, int, list[int]]:
    """Relay A (40 windows) then relay B (80, same SCNs): the producer's state after A stops."""
    # with another registry, source id 1 is synthetic.t1 on relay B, synthetic.t0 on A
    async with _relay(tmp / "b", 80, 1 if other_registry else 0) as relay_b:
        async with _relay(tmp / "a", 40) as relay_a:
            cfg = BootstrapConfig(
                relays=(relay_a.url, relay_b.url),
                data_dir=tmp / "boot",
                store=StoreConfig(kind="sqlite", path=tmp / "boot" / "b.db"),
                http=HttpConfig(port=0),
            )
            boot = BootstrapServer(cfg)
            await boot.start()
            w = boot.service.workers
            a_last = relay_a.hosts["syn"].buffer.meta.last_scn
            await wait_until(lambda: "syn" in w and w["syn"].applier_scn >= a_last)
        # relay A is gone: the producer moves to relay B
        try:
            b_last = relay_b.hosts["syn"].buffer.meta.last_scn
            worker = w["syn"]
            if other_registry:
                await wait_until(lambda: worker.state == "error", what="refused")
            else:
                await wait_until(lambda: worker.applier_scn >= b_last, what="moved")
            rows = await boot.service.stores.read(lambda s: s.schemas("syn"))
            ids = sorted({sid for sid, _v, _n, _j in rows})
            return worker.last_error or "", a_last, worker.producer_scn, ids
        finally:
            await boot.stop()


async def test_a_relay_with_another_registry_is_refused(tmp_path: Path) -> None:
    error, a_last, producer_scn, ids = await _switch(tmp_path, other_registry=True)
    assert "schema registry of relay" in error
    assert "source id 1 is table 'synthetic.t1' there, 'synthetic.t0' in the log" in error
    # nothing of relay B was stored: not its windows, not its schemas
    assert producer_scn == a_last
    assert ids == [1]


async def test_a_relay_with_the_same_registry_takes_over(tmp_path: Path) -> None:
    error, a_last, producer_scn, ids = await _switch(tmp_path, other_registry=False)
    assert producer_scn > a_last
    assert ids == [1]
    assert "registry" not in error
