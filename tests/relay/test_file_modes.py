"""Data files are the owner's only (0600 in 0700 directories) whatever the umask, and
partition names that are not one safe path component (``.``, ``..``) are refused.

A relay (synthetic fetcher), a bootstrap server (SQLite store) and a
consumer's file checkpoint run under a permissive umask; every directory and
file they made is checked with ``os.stat`` while they run (SQLite's ``-wal``
and ``-shm`` exist only then) and after a restart over files an older version
left world-readable.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from changebus.bootstrap import (
    BootstrapConfig,
    BootstrapServer,
    HttpConfig as BootHttp,
    StoreConfig,
)
from changebus.client import FileCheckpointPersister
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import Checkpoint, ConfigError, PartitionCheckpoint
from waiting import wait_until


@pytest.fixture
def loose_umask() -> Iterator[None]:
    old = os.umask(0o002)
    try:
        yield
    finally:
        os.umask(old)


def modes(root: Path) -> dict[str, int]:
    """``{relative path: permission bits}`` of ``root`` and everything below it."""
    found = {".": stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        found[str(path.relative_to(root))] = stat.S_IMODE(path.lstat().st_mode)
    return found


def assert_private(root: Path, must_have: tuple[str, ...] = ()) -> dict[str, int]:
    found = modes(root)
    for name in must_have:
        assert name in found, sorted(found)
    for name, mode in found.items():
        want = 0o700 if (root / name).is_dir() else 0o600
        assert mode == want, f"{root / name}: {oct(mode)}, not {oct(want)}"
    return found


def relay_config(tmp: Path) -> RelayConfig:
    return RelayConfig(
        data_dir=tmp / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "syn",
                1,
                capacity_bytes=1 << 20,
                fetcher=FetcherConfig("synthetic", {"windows_per_s": 100, "tables": 2}),
            ),
        ),
        flush_interval_s=0,
    )


def boot_config(tmp: Path, relay_url: str) -> BootstrapConfig:
    return BootstrapConfig(
        relays=(relay_url,),
        data_dir=tmp / "boot",
        store=StoreConfig(kind="sqlite"),  # <data_dir>/bootstrap.db
        http=BootHttp(port=0),
    )


RELAY_FILES = (
    "syn",
    "syn/meta.dat",
    "syn/ring.dat",
    "syn/events.dat",
    "syn/index.dat",
    "syn/schemas.jsonl",
)
BOOT_FILES = ("bootstrap.db", "bootstrap.db-wal", "bootstrap.db-shm")


@pytest.mark.usefixtures("loose_umask")
async def test_relay_bootstrap_and_checkpoint_files_are_private(tmp_path: Path) -> None:
    checkpoint = tmp_path / "consumer" / "state" / "checkpoint.json"
    async with Relay(relay_config(tmp_path)) as relay:
        await wait_until(lambda: relay.hosts["syn"].buffer.meta.windows > 5, 30, "windows")
        async with BootstrapServer(boot_config(tmp_path, relay.url)) as boot:
            w = boot.service.workers["syn"]
            await wait_until(lambda: w.applier_scn > 0, 30, "the applier")
            assert_private(tmp_path / "boot", BOOT_FILES)
        await relay.hosts["syn"].flush()
        assert_private(tmp_path / "relay", RELAY_FILES)
    await FileCheckpointPersister(checkpoint).store(
        Checkpoint({"syn": PartitionCheckpoint(window_scn=5, prev_scn=4)})
    )
    found = assert_private(tmp_path / "consumer", ("state", "state/checkpoint.json"))
    assert "state/checkpoint.json.tmp" not in found
    # a checkpoint in a directory the user made (and may share) leaves that directory alone
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    await FileCheckpointPersister(shared / "c.json").store(Checkpoint({}))
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755
    assert stat.S_IMODE((shared / "c.json").stat().st_mode) == 0o600


@pytest.mark.usefixtures("loose_umask")
async def test_files_left_world_readable_are_narrowed_at_start(tmp_path: Path) -> None:
    async with Relay(relay_config(tmp_path)) as relay:
        await wait_until(lambda: relay.hosts["syn"].buffer.meta.windows > 5, 30, "windows")
        async with BootstrapServer(boot_config(tmp_path, relay.url)) as boot:
            w = boot.service.workers["syn"]
            await wait_until(lambda: w.applier_scn > 0, 30, "the applier")
    for root in (tmp_path / "relay", tmp_path / "boot"):
        for path in [root, *root.rglob("*")]:
            os.chmod(path, 0o777 if path.is_dir() else 0o666)  # as an older version left them
    async with Relay(relay_config(tmp_path)) as relay:
        await wait_until(lambda: relay.hosts["syn"].buffer.meta.windows > 5, 30, "windows")
        async with BootstrapServer(boot_config(tmp_path, relay.url)) as boot:
            w = boot.service.workers["syn"]
            await wait_until(lambda: w.applier_scn > 0, 30, "the applier")
            assert_private(tmp_path / "boot", BOOT_FILES)
        assert_private(tmp_path / "relay", RELAY_FILES)


@pytest.mark.parametrize("name", [".", "..", "a/b", "", "x" * 129, "é"])
def test_unsafe_partition_names_are_refused_in_configs(name: str) -> None:
    with pytest.raises(ConfigError, match="partition name"):
        PartitionConfig(name, 1)
    with pytest.raises(ConfigError, match="partition name"):
        BootstrapConfig(relays=("http://127.0.0.1:1",), partitions=(name,))


async def test_unsafe_partition_names_are_bad_requests(tmp_path: Path) -> None:
    async with Relay(relay_config(tmp_path)) as relay:
        cfg = BootstrapConfig(
            relays=(relay.url,),
            partitions=("syn",),
            data_dir=tmp_path / "boot",
            http=BootHttp(port=0),
        )
        async with BootstrapServer(cfg) as boot, aiohttp.ClientSession() as s:
            for url in (
                f"{relay.url}/v1/stream?partition=..",
                f"{relay.url}/v1/stream?partition=.",
                f"{boot.url}/v1/bootstrap/status?partition=..",
                f"{boot.url}/v1/bootstrap/start?partition=.",
            ):
                async with s.get(url) as r:
                    assert r.status == 400, url
                    assert "partition name" in (await r.json())["message"]
            async with s.post(f"{boot.url}/v1/seed?partition=..") as r:
                assert r.status == 400
