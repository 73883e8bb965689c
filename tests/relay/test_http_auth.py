"""The relay's HTTP API with [security]: TLS, tokens, partition and source grants."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import Checkpoint, Op, parse_stream
from changebus.schemas.security import PrincipalConfig, SecurityConfig, TlsConfig, hash_token

pytestmark = pytest.mark.usefixtures("no_blocking")

#: the ``tls_files`` fixture's type (tests/fix_tls.py, not a module mypy sees from here)
TlsFiles = Any

ADMIN = "A" * 43
READER = "R" * 43  # partition syn, source synthetic.t0 only
WIDE = "W" * 43  # every partition and source, no admin


def relay_config(tmp_path: Path, sec: SecurityConfig) -> RelayConfig:
    options = {"windows_per_s": 0, "max_windows": 300, "events_per_window": 3, "tables": 2}
    return RelayConfig(
        data_dir=tmp_path / "relay",
        http=HttpConfig(port=0, max_wait_s=10),
        partitions=(
            PartitionConfig(
                "syn", 1, capacity_bytes=1 << 20, fetcher=FetcherConfig("synthetic", options)
            ),
            PartitionConfig("idle", 2, capacity_bytes=1 << 20),
        ),
        flush_interval_s=0,
        security=sec,
    )


async def wait_windows(relay: Relay, n: int) -> None:
    deadline = time.monotonic() + 20
    while relay.hosts["syn"].buffer.meta.windows < n and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert relay.hosts["syn"].buffer.meta.windows >= n


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
async def relay(tmp_path: Path, tls_files: TlsFiles) -> AsyncIterator[Relay]:
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
    async with Relay(relay_config(tmp_path, sec)) as r:
        await wait_windows(r, 300)
        yield r


@pytest.fixture
async def http(tls_files: TlsFiles) -> AsyncIterator[aiohttp.ClientSession]:
    ctx = ssl.create_default_context(cafile=str(tls_files.ca))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s:
        yield s


async def call(
    http: aiohttp.ClientSession, url: str, token: str | None, **params: Any
) -> tuple[int, Any]:
    async with http.get(url, params=params, headers=auth(token) if token else None) as resp:
        if resp.content_type == "application/json":
            return resp.status, await resp.json()
        return resp.status, await resp.read()


async def read_all(
    http: aiohttp.ClientSession, relay: Relay, token: str, **params: Any
) -> list[tuple[int, int, int]]:
    """Every event of partition syn as (scn, op, source_id), following checkpoints."""
    events: list[tuple[int, int, int]] = []
    cp = Checkpoint({}).to_token()
    while True:
        query = {"partition": "syn", "checkpoint": cp, "max_bytes": 65536, **params}
        async with http.get(f"{relay.url}/v1/stream", params=query, headers=auth(token)) as resp:
            assert resp.status in (200, 204), await resp.text()
            cp = resp.headers["X-Changebus-Checkpoint"]
            if resp.status == 204:
                return events
            _, headers = parse_stream(await resp.read())
            events.extend((int(h["scn"]), int(h["op"]), int(h["source_id"])) for h in headers)


def data(events: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    return [e for e in events if not Op(e[1]).is_control]


async def test_stream_needs_a_known_token(relay: Relay, http: aiohttp.ClientSession) -> None:
    url = f"{relay.url}/v1/stream"
    for token in (None, "x" * 43):
        status, body = await call(http, url, token, partition="syn")
        assert status == 401 and body["error"] == "unauthorized"
    status, _ = await call(http, url, WIDE, partition="syn", **{"from": "earliest"})
    assert status == 200
    assert (await call(http, f"{relay.url}/healthz", None))[0] == 200


async def test_partition_not_granted_is_403(relay: Relay, http: aiohttp.ClientSession) -> None:
    url = f"{relay.url}/v1/stream"
    for part in ("idle", "no-such"):
        status, body = await call(http, url, READER, partition=part)
        assert status == 403 and "t0-reader" in body["message"], body
    assert (await call(http, url, ADMIN, partition="no-such"))[0] == 404
    assert (await call(http, url, WIDE, partition="idle", **{"from": "earliest"}))[0] == 204
    # the split points of a partition are refused the same way, and need a token
    splits = f"{relay.url}/v1/splits"
    cut = {"since": "-1", "until": "100", "parts": "2"}
    for part in ("idle", "no-such"):
        status, body = await call(http, splits, READER, partition=part, **cut)
        assert status == 403 and "t0-reader" in body["message"], body
    assert (await call(http, splits, None, partition="syn", **cut))[0] == 401
    assert (await call(http, splits, READER, partition="syn", **cut))[0] == 200


async def test_restricted_principal_reads_only_its_sources(
    relay: Relay, http: aiohttp.ClientSession
) -> None:
    t0 = relay.hosts["syn"].registry.source_id("synthetic.t0")
    whole = await read_all(http, relay, ADMIN)
    assert len({e[2] for e in data(whole)}) == 2 and t0 in {e[2] for e in data(whole)}
    mine = await read_all(http, relay, READER)
    assert data(mine) == [e for e in data(whole) if e[2] == t0]
    assert data(mine)  # something was delivered
    # every window still ends (control events pass)
    eow = int(Op.END_OF_WINDOW)
    assert [e for e in mine if e[1] == eow] == [e for e in whole if e[1] == eow]
    # schema changes follow the grant: the other table's definition is not shown
    sc = int(Op.SCHEMA_CHANGE)
    t1 = relay.hosts["syn"].registry.source_id("synthetic.t1")
    assert {e[2] for e in whole if e[1] == sc} == {t0, t1}
    assert [e for e in mine if e[1] == sc] == [e for e in whole if e[1] == sc and e[2] == t0]
    # naming the granted source explicitly gives the same
    assert await read_all(http, relay, READER, sources="synthetic.t0") == mine
    # a key filter narrows, never widens
    for b in range(2):
        part = await read_all(http, relay, READER, filter=f"mod:2:{b}")
        assert {e[2] for e in data(part)} <= {t0}
    # follow mode too
    async with http.get(
        f"{relay.url}/v1/stream",
        params={"partition": "syn", "from": "earliest", "follow": "1", "wait": "0.2"},
        headers=auth(READER),
    ) as resp:
        assert resp.status == 200
        _, headers = parse_stream(await resp.read())
    assert {int(h["source_id"]) for h in headers if not Op(int(h["op"])).is_control} == {t0}


async def test_sources_parameter_cannot_widen_the_grant(
    relay: Relay, http: aiohttp.ClientSession
) -> None:
    url = f"{relay.url}/v1/stream"
    for sources in ("synthetic.t1", "synthetic.t0,synthetic.t1", "no.such"):
        status, body = await call(http, url, READER, partition="syn", sources=sources)
        assert status == 403 and "may not read source" in body["message"]
    status, _ = await call(
        http, url, READER, partition="syn", sources="synthetic.t0", **{"from": "earliest"}
    )
    assert status == 200


async def test_sources_schemas_status_show_only_what_is_granted(
    relay: Relay, http: aiohttp.ClientSession
) -> None:
    # a consumer with a client id, seen by the relay
    await call(http, f"{relay.url}/v1/stream", WIDE, partition="syn", client="orders-app")
    status, body = await call(http, f"{relay.url}/v1/sources", READER)
    assert status == 200
    assert [(p["partition"], [s["name"] for s in p["sources"]]) for p in body["partitions"]] == [
        ("syn", ["synthetic.t0"])
    ]
    _, body = await call(http, f"{relay.url}/v1/sources", WIDE)
    assert {p["partition"] for p in body["partitions"]} == {"syn", "idle"}

    assert (await call(http, f"{relay.url}/v1/schemas/synthetic.t0", READER))[0] == 200
    status, body = await call(http, f"{relay.url}/v1/schemas/synthetic.t1", READER)
    assert status == 403 and body["error"] == "forbidden"
    assert (await call(http, f"{relay.url}/v1/schemas/synthetic.t1", WIDE))[0] == 200
    status, _ = await call(http, f"{relay.url}/v1/schemas/synthetic.t0", READER, partition="idle")
    assert status == 403

    # granted one source of the partition: its bounds, nothing that tells of the others
    # (the fetcher's state names every table, counts and consumers show their traffic)
    _, body = await call(http, f"{relay.url}/v1/status", READER)
    assert [p["name"] for p in body["partitions"]] == ["syn"]
    (part,) = body["partitions"]
    assert part["consumers"] == [] and part["consumer_count"] >= 1
    assert not {"stats", "last_error", "events", "windows", "bytes_used"} & set(part)
    assert part["fetcher"] == {"kind": "synthetic"}  # which source; nothing of its tables
    assert part["max_scn"] > 0 and "synthetic.t1" not in str(body)
    _, body = await call(http, f"{relay.url}/v1/status", WIDE)
    assert {p["name"] for p in body["partitions"]} == {"syn", "idle"}
    assert "orders-app" not in str(body)
    consumers = [c for p in body["partitions"] for c in p["consumers"]]
    assert consumers and all("client" not in c and "peer" not in c for c in consumers)
    assert "fetcher" in next(p for p in body["partitions"] if p["name"] == "syn")
    # another principal naming its consumer alike gets a row of its own: ids are per
    # principal, so none can overwrite (hide) another's lag (review)
    await call(http, f"{relay.url}/v1/stream", READER, partition="syn", client="orders-app")
    _, body = await call(http, f"{relay.url}/v1/status", ADMIN)
    clients = {c["client"] for p in body["partitions"] for c in p["consumers"]}
    assert {"wide/orders-app", "t0-reader/orders-app"} <= clients
    assert "orders-app" not in clients


async def test_errors_name_only_the_partitions_granted(
    relay: Relay, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """A partition not granted could be learnt from "name the partition: one of ...";
    and a path's decoded line break forged a second log line (found by review)."""
    status, body = await call(http, f"{relay.url}/v1/stream", READER)
    assert status == 400 and body["message"].endswith("one of syn"), body
    status, body = await call(http, f"{relay.url}/v1/stream", WIDE)
    assert status == 400 and body["message"].endswith("one of idle, syn"), body
    with caplog.at_level("WARNING"):
        async with http.get(f"{relay.url}/v1/x%0AWARNING%20forged") as resp:
            assert resp.status == 401
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert refused and all("\n" not in m for m in refused), refused
