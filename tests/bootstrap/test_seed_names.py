"""``POST /v1/seed`` takes table names only: reserved and unknown names are 400, and a
seed whose tables never get a schema fails loudly instead of doing nothing.

A relay with a synthetic fetcher (tables ``synthetic.t0``, ``synthetic.t1``)
feeds a bootstrap server with a SQLite store. The seed source is never
reached: every request here is refused before a seed would connect.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from changebus.bootstrap import (
    BootstrapConfig,
    BootstrapServer,
    HttpConfig,
    SeedConfig,
    StoreConfig,
)
from changebus.relay import (
    FetcherConfig,
    HttpConfig as RelayHttp,
    PartitionConfig,
    Relay,
    RelayConfig,
)
from changebus.schemas import ChangebusError, ConfigError
from waiting import wait_until

pytestmark = pytest.mark.usefixtures("no_blocking")

#: never connected to: the requests are refused first
SEED_DSN = "host=127.0.0.1 port=9 user=nobody dbname=nothing"


def relay_config(tmp: Path, kind: str = "synthetic") -> RelayConfig:
    options = {"windows_per_s": 50, "tables": 2} if kind == "synthetic" else {}
    return RelayConfig(
        data_dir=tmp / "relay",
        http=RelayHttp(port=0),
        partitions=(PartitionConfig("syn", 1, fetcher=FetcherConfig(kind, options)),),
        flush_interval_s=0,
    )


def boot_config(tmp: Path, relay_url: str, **seed: object) -> BootstrapConfig:
    return BootstrapConfig(
        relays=(relay_url,),
        data_dir=tmp / "boot",
        store=StoreConfig(kind="sqlite", path=tmp / "boot" / "b.db"),
        http=HttpConfig(port=0),
        seed=SeedConfig(dsn=SEED_DSN, **seed),  # type: ignore[arg-type]
    )


@pytest.fixture
async def servers(tmp_path: Path) -> AsyncIterator[tuple[Relay, BootstrapServer]]:
    async with (
        Relay(relay_config(tmp_path)) as relay,
        BootstrapServer(boot_config(tmp_path, relay.url)) as boot,
    ):
        w = boot.service.workers["syn"]
        await wait_until(lambda: w.producer_scn > 0, 30, "the producer")
        yield relay, boot


async def post_seed(boot: BootstrapServer, tables: str) -> tuple[int, dict[str, object]]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{boot.url}/v1/seed", params={"tables": tables}) as r,
    ):
        return r.status, await r.json()


@pytest.mark.parametrize(
    ("tables", "named"),
    [
        ("*gap*", "*gap*"),
        ("synthetic.t0,*gap*", "*gap*"),
        ("*anything*", "*anything*"),
        ("gap", "gap"),
        ("synthetic.nope", "synthetic.nope"),
        ("public.t0,synthetic.t1", "public.t0"),
        ("bad\x01.name", "bad"),
    ],
)
async def test_reserved_and_unknown_tables_are_refused(
    servers: tuple[Relay, BootstrapServer], tables: str, named: str
) -> None:
    _relay, boot = servers
    service = boot.service
    # as after the producer fell off: the log continues after the relay's first window
    gap_end = service.workers["syn"].producer_scn
    await service.stores.write(lambda s: s.mark_gap("syn", gap_end))
    status, body = await post_seed(boot, tables)
    assert status == 400, body
    assert body["error"] == "bad_request" and named in str(body["message"])
    # nothing started, and the marker that guards positions before the gap is intact
    assert service.workers["syn"].seed.state == "idle"
    assert await service.stores.read(lambda s: s.gap("syn")) == gap_end
    since = str((await service.stores.read(lambda s: s.state("syn"))).base_scn)
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{boot.url}/v1/bootstrap/start", params={"partition": "syn", "since": since}) as r,
    ):
        assert r.status == 503  # a position before the gap is still not served


async def test_the_store_itself_refuses_reserved_names(
    servers: tuple[Relay, BootstrapServer],
) -> None:
    _relay, boot = servers
    stores = boot.service.stores
    gap_end = boot.service.workers["syn"].producer_scn
    await stores.write(lambda s: s.mark_gap("syn", gap_end))
    for table in ("*gap*", "nodot"):
        with pytest.raises(ChangebusError) as info:
            await stores.write(lambda s, t=table: s.forget_seed("syn", [t]))  # type: ignore[misc]
        assert info.value.http_status == 400
        with pytest.raises(ChangebusError):
            await stores.write(lambda s, t=table: s.seed_rows("syn", t, [], 7))  # type: ignore[misc]
    assert await stores.read(lambda s: s.gap("syn")) == gap_end


def test_seed_config_refuses_reserved_tables_and_unsafe_partitions() -> None:
    for tables in (("*gap*",), ("nodot",), ("a.b", "*x*")):
        with pytest.raises(ConfigError, match=r"seed\.tables"):
            SeedConfig(dsn=SEED_DSN, tables=tables)
    for name in (".", "..", "a/b"):
        with pytest.raises(ConfigError, match=r"seed\.partition"):
            SeedConfig(dsn=SEED_DSN, partition=name)


async def test_a_known_table_is_accepted(servers: tuple[Relay, BootstrapServer]) -> None:
    _relay, boot = servers
    status, body = await post_seed(boot, "synthetic.t1")
    assert status == 202, body  # the seed starts, and fails: no source to copy from
    w = boot.service.workers["syn"]
    await wait_until(lambda: w.seed.state in ("done", "failed"), 30, "the seed")
    assert "cannot connect to the seed source" in w.seed.error


async def test_a_schema_wait_that_times_out_fails_the_seed_loudly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A relay partition that never sees a table: the seed ends ``failed`` with a message
    naming what it waited for (it used to end ``done`` having copied nothing)."""
    caplog.set_level(logging.INFO)
    async with Relay(relay_config(tmp_path, kind="none")) as relay:
        cfg = boot_config(tmp_path, relay.url, schema_wait_s=0.5)
        async with BootstrapServer(cfg) as boot:
            w = boot.service.workers["syn"]
            status, body = await post_seed(boot, "")
            assert status == 202, body
            await wait_until(lambda: w.seed.state in ("done", "failed"), 20, "the seed")
            assert w.seed.state == "failed"
            assert "waiting for any table schema" in w.seed.error
            async with aiohttp.ClientSession() as s, s.get(f"{boot.url}/v1/status") as r:
                seed = (await r.json())["partitions"][0]["seed"]
            assert seed["state"] == "failed" and "gave up after 0.5s" in seed["error"]
        # configured tables at start-up: the same, naming the table
        cfg = dataclasses.replace(
            cfg,
            seed=SeedConfig(
                dsn=SEED_DSN, tables=("synthetic.t0",), on_start=True, schema_wait_s=0.5
            ),
        )
        async with BootstrapServer(cfg) as boot:
            w = boot.service.workers["syn"]
            await wait_until(lambda: w.seed.state in ("done", "failed"), 20, "the seed")
            assert w.seed.state == "failed" and "'synthetic.t0'" in w.seed.error
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("seeding failed" in e and "gave up" in e for e in errors), errors
