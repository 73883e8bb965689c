"""The bootstrap server's HTTP API with [security]: tokens, partition and source grants, admin seed.

A relay with a synthetic source (two tables) feeds the bootstrap server, so
snapshot pages and catch-up windows hold both sources' rows.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from changebus.bootstrap import BootstrapConfig, BootstrapServer, HttpConfig, StoreConfig
from changebus.relay import (
    FetcherConfig,
    HttpConfig as RelayHttp,
    PartitionConfig,
    Relay,
    RelayConfig,
)
from changebus.schemas import Op, parse_stream
from changebus.schemas.security import PrincipalConfig, SecurityConfig, TlsConfig, hash_token

pytestmark = pytest.mark.usefixtures("no_blocking")

#: the ``tls_files`` fixture's type (tests/fix_tls.py)
TlsFiles = Any

ADMIN = "A" * 43
READER = "R" * 43  # partition syn, source synthetic.t0 only
WIDE = "W" * 43  # everything, no admin


async def wait_until(cond: Callable[[], bool], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


@pytest.fixture
async def boot(tmp_path: Path, tls_files: TlsFiles) -> AsyncIterator[BootstrapServer]:
    options = {"windows_per_s": 0, "max_windows": 40, "events_per_window": 4, "tables": 2}
    relay_cfg = RelayConfig(
        data_dir=tmp_path / "relay",
        http=RelayHttp(port=0),
        partitions=(
            PartitionConfig(
                "syn", 1, capacity_bytes=1 << 20, fetcher=FetcherConfig("synthetic", options)
            ),
            PartitionConfig("idle", 2, capacity_bytes=1 << 20),
        ),
        flush_interval_s=0,
    )
    sec = SecurityConfig(
        tls=TlsConfig(tls_files.server_cert, tls_files.server_key),
        principals=(
            PrincipalConfig("ops", (hash_token(ADMIN),), scopes=("admin",)),
            PrincipalConfig(
                "t0-reader", (hash_token(READER),), partitions=("syn",), sources=("synthetic.t0",)
            ),
            PrincipalConfig("wide", (hash_token(WIDE),)),
        ),
    )
    async with Relay(relay_cfg) as relay:
        await wait_until(lambda: relay.hosts["syn"].buffer.meta.windows >= 40)
        last = relay.hosts["syn"].buffer.meta.last_scn
        cfg = BootstrapConfig(
            relays=(relay.url,),
            data_dir=tmp_path / "boot",
            store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
            http=HttpConfig(port=0),
            security=sec,
        )
        async with BootstrapServer(cfg) as server:
            w = server.service.workers
            await wait_until(lambda: "syn" in w and w["syn"].applier_scn >= last)
            yield server


@pytest.fixture
async def http(tls_files: TlsFiles) -> AsyncIterator[aiohttp.ClientSession]:
    ctx = ssl.create_default_context(cafile=str(tls_files.ca))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s:
        yield s


async def call(
    http: aiohttp.ClientSession, url: str, token: str | None, method: str = "GET", **params: Any
) -> tuple[int, Any, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else None
    async with http.request(method, url, params=params, headers=headers) as resp:
        if resp.content_type == "application/json":
            return resp.status, await resp.json(), resp.headers
        return resp.status, await resp.read(), resp.headers


def data_sources(body: bytes) -> list[int]:
    if not body:
        return []
    _, headers = parse_stream(body)
    return [int(h["source_id"]) for h in headers if not Op(int(h["op"])).is_control]


async def snapshot(
    http: aiohttp.ClientSession, boot: BootstrapServer, token: str, **params: Any
) -> list[int]:
    """Every page of a snapshot of partition syn from nothing: the data events' source ids."""
    _, plan, _ = await call(http, f"{boot.url}/v1/bootstrap/start", token, partition="syn")
    out: list[int] = []
    position = "0:0"
    while True:
        status, body, headers = await call(
            http,
            f"{boot.url}/v1/bootstrap/snapshot",
            token,
            partition="syn",
            start=plan["start_scn"],
            position=position,
            **params,
        )
        assert status == 200, body
        out.extend(data_sources(body))
        position = headers["X-Changebus-Snapshot-Position"]
        if headers["X-Changebus-Snapshot-Complete"] == "1":
            return out


async def test_credentials_and_partitions(
    boot: BootstrapServer, http: aiohttp.ClientSession
) -> None:
    url = f"{boot.url}/v1/bootstrap/start"
    status, body, headers = await call(http, url, None, partition="syn")
    assert status == 401 and body["error"] == "unauthorized"
    assert headers["WWW-Authenticate"].startswith("Bearer")
    assert (await call(http, url, "x" * 43, partition="syn"))[0] == 401
    assert (await call(http, url, READER, partition="syn"))[0] == 200
    for path, params in [
        ("/v1/bootstrap/start", {}),
        ("/v1/bootstrap/status", {}),
        ("/v1/bootstrap/snapshot", {"start": "1"}),
        ("/v1/bootstrap/catchup", {"after": "0", "target": "1"}),
    ]:
        for part in ("idle", "no-such"):
            status, body, _ = await call(
                http, f"{boot.url}{path}", READER, partition=part, **params
            )
            assert status == 403 and "t0-reader" in body["message"], (path, part, body)
    assert (await call(http, f"{boot.url}/v1/bootstrap/status", WIDE, partition="idle"))[0] == 200
    assert (await call(http, f"{boot.url}/healthz", None))[0] == 200


async def test_seed_needs_admin(boot: BootstrapServer, http: aiohttp.ClientSession) -> None:
    url = f"{boot.url}/v1/seed"
    for token in (READER, WIDE):
        status, body, _ = await call(http, url, token, "POST", partition="syn")
        assert status == 403 and "admin" in body["message"]
    assert (await call(http, url, None, "POST", partition="syn"))[0] == 401
    # the admin gets past authorization (this server has no source to seed from)
    status, body, _ = await call(http, url, ADMIN, "POST", partition="syn")
    assert status == 400 and "seed.dsn" in body["message"]


async def test_restricted_principal_gets_only_its_sources(
    boot: BootstrapServer, http: aiohttp.ClientSession
) -> None:
    _, info, _ = await call(http, f"{boot.url}/v1/sources", WIDE)
    ids = {
        s["name"]: s["id"]
        for p in info["partitions"]
        if p["partition"] == "syn"
        for s in p["sources"]
    }
    t0 = ids["synthetic.t0"]
    assert len(ids) == 2
    whole = await snapshot(http, boot, WIDE)
    assert set(whole) == set(ids.values())
    mine = await snapshot(http, boot, READER)
    assert mine and mine == [s for s in whole if s == t0]
    assert await snapshot(http, boot, READER, sources="synthetic.t0") == mine
    assert set(await snapshot(http, boot, READER, filter="mod:2:0")) <= {t0}
    status, body, _ = await call(
        http,
        f"{boot.url}/v1/bootstrap/snapshot",
        READER,
        partition="syn",
        start="1",
        sources="synthetic.t0,synthetic.t1",
    )
    assert status == 403 and "synthetic.t1" in body["message"]

    _, st, _ = await call(http, f"{boot.url}/v1/bootstrap/status", WIDE, partition="syn")
    url = f"{boot.url}/v1/bootstrap/catchup"
    window = {"partition": "syn", "after": st["log_min_scn"], "target": st["producer_scn"]}
    _, all_body, _ = await call(http, url, WIDE, **window)
    _, my_body, _ = await call(http, url, READER, **window)
    assert set(data_sources(all_body)) == set(ids.values())
    assert data_sources(my_body) == [s for s in data_sources(all_body) if s == t0]
    status, _, _ = await call(http, url, READER, sources="synthetic.t1", **window)
    assert status == 403


async def test_sources_schemas_status_show_only_what_is_granted(
    boot: BootstrapServer, http: aiohttp.ClientSession
) -> None:
    _, body, _ = await call(http, f"{boot.url}/v1/sources", READER)
    assert [(p["partition"], [s["name"] for s in p["sources"]]) for p in body["partitions"]] == [
        ("syn", ["synthetic.t0"])
    ]
    assert (await call(http, f"{boot.url}/v1/schemas/synthetic.t0", READER))[0] == 200
    assert (await call(http, f"{boot.url}/v1/schemas/synthetic.t1", READER))[0] == 403
    assert (await call(http, f"{boot.url}/v1/schemas/synthetic.t1", WIDE))[0] == 200
    _, body, _ = await call(http, f"{boot.url}/v1/status", READER)
    assert [p["partition"] for p in body["partitions"]] == ["syn"]
    # granted one source: positions, not the partition's error and traffic (review)
    mine = body["partitions"][0]
    assert "applier_scn" in mine and "producer_scn" in mine
    assert not {"last_error", "events_appended", "applier_lag_events", "gap"} & set(mine)
    _, body, _ = await call(http, f"{boot.url}/v1/status", WIDE)
    assert {p["partition"] for p in body["partitions"]} == {"syn", "idle"}
    assert all("last_error" in p and "events_appended" in p for p in body["partitions"])
