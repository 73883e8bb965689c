"""One bootstrap server at a time in a data directory (``DirLock``): a second one
on the same ``data_dir`` stops at once, naming the pid holding it, and the first
one goes on; after a stop the directory is free again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from synthetic_boot import synthetic_relay

from changebus.bootstrap import BootstrapConfig, BootstrapServer, HttpConfig
from changebus.relay import Relay
from changebus.schemas import ConfigError
from waiting import wait_until


async def test_a_second_bootstrap_server_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    async with Relay(synthetic_relay(tmp_path / "relay", 30)) as relay:
        cfg = BootstrapConfig(
            relays=(relay.url,), data_dir=tmp_path / "boot", http=HttpConfig(port=0)
        )
        async with BootstrapServer(cfg) as boot:
            w = boot.service.workers
            await wait_until(lambda: "syn" in w and w["syn"].applier_scn > 0, what="applied")
            with pytest.raises(ConfigError, match=rf"in use by process {os.getpid()}"):
                await BootstrapServer(cfg).start()
            scn = relay.hosts["syn"].buffer.meta.last_scn
            await wait_until(lambda: w["syn"].applier_scn >= scn, what="the first goes on")
        async with BootstrapServer(cfg) as again:
            assert again.port > 0
