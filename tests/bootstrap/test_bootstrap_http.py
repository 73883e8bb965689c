"""The bootstrap server's HTTP frame in-process: parameter errors, health, metrics.

No source database and no relay are needed for these: the server starts its
partition's producer (which keeps trying to reach a relay that is not there)
and answers requests from its empty SQLite store meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from changebus.bootstrap import (
    BootstrapConfig,
    BootstrapServer,
    HttpConfig,
    SeedConfig,
    StoreConfig,
)
from waiting import wait_until

# the bootstrap server runs in the test's event loop: it may not block that loop
pytestmark = pytest.mark.usefixtures("no_blocking")

HUGE = "9" * 5000


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def boot(tmp_path: Path) -> AsyncIterator[BootstrapServer]:
    cfg = BootstrapConfig(
        relays=(f"http://127.0.0.1:{closed_port()}",),
        partitions=("p",),
        data_dir=tmp_path / "boot",
        store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
        http=HttpConfig(port=0),
    )
    async with BootstrapServer(cfg) as server:
        yield server


@pytest.mark.parametrize(
    "query",
    [
        f"/v1/bootstrap/start?partition=p&since={HUGE}",
        f"/v1/bootstrap/start?partition=p&since=-{HUGE}",
        f"/v1/bootstrap/snapshot?partition=p&start={HUGE}",
        f"/v1/bootstrap/snapshot?partition=p&start=1&since={HUGE}",
        f"/v1/bootstrap/snapshot?partition=p&start=1&max_bytes={HUGE}",
        f"/v1/bootstrap/snapshot?partition=p&start=1&position={HUGE}:1",
        f"/v1/bootstrap/snapshot?partition=p&start=1&position=1:{'9' * 25}",
        f"/v1/bootstrap/snapshot?partition=p&start=1&filter=mod:{HUGE}:1",
        f"/v1/bootstrap/catchup?partition=p&after={HUGE}&target=1",
        f"/v1/bootstrap/catchup?partition=p&after=1&target={HUGE}",
        f"/v1/bootstrap/catchup?partition=p&after=1&target=2&max_bytes={HUGE}",
        f"/v1/bootstrap/catchup?partition=p&after=1&target=2&filter=mod:3:{HUGE}",
    ],
)
async def test_huge_numbers_are_bad_requests_never_retried(
    boot: BootstrapServer, query: str
) -> None:
    async with aiohttp.ClientSession() as http, http.get(boot.url + query) as r:
        assert r.status == 400
        body = await r.json()
    assert body["error"] == "bad_request" and body["retriable"] is False
    assert len(body["message"]) < 300


LONG = "9" * 4000  # under Python's 4,300-digit int() limit: it must be refused before


@pytest.mark.parametrize(
    "query",
    [
        f"/v1/bootstrap/snapshot?partition=p&start=1&filter=mod:3:{LONG}",
        f"/v1/bootstrap/snapshot?partition=p&start=1&filter=mod:3:0-{LONG}",
        f"/v1/bootstrap/snapshot?partition=p&start=1&filter=range:{LONG}:max",
        f"/v1/bootstrap/catchup?partition=p&after=1&target=2&filter=slice:1/{HUGE}",
        f"/v1/bootstrap/catchup?partition=p&after=1&target=2&filter=mod:{LONG}:1",
        f"/v1/bootstrap/snapshot?partition=p&start=1&position={LONG}:{LONG}",
        f"/v1/bootstrap/start?partition=p&since={LONG}",
    ],
)
async def test_long_numbers_are_short_bad_requests_without_tracebacks(
    boot: BootstrapServer, query: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with aiohttp.ClientSession() as http, http.get(boot.url + query) as r:
        assert r.status == 400
        body = await r.json()
    assert body["error"] == "bad_request" and body["retriable"] is False
    assert len(body["message"]) < 300
    assert not [rec for rec in caplog.records if rec.levelno >= 40 or rec.exc_info]


@pytest.mark.parametrize("sources", ["", ", ,"])
async def test_sources_naming_none_is_a_bad_request(boot: BootstrapServer, sources: str) -> None:
    """As on the relay: ``sources=`` naming no source is 400 (here it meant every source,
    there messages only)."""
    query = f"/v1/bootstrap/snapshot?partition=p&start=1&sources={sources}"
    async with aiohttp.ClientSession() as http, http.get(boot.url + query) as r:
        body = await r.json()
    assert r.status == 400, body
    assert "names no source" in body["message"]


async def test_health_readiness_metrics_and_errors(boot: BootstrapServer) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(boot.url + "/healthz") as r:
            assert r.status == 200
        async with http.get(boot.url + "/readyz") as r:
            body = await r.json()
            assert r.status == (200 if body["ready"] else 503)
            assert set(body["partitions"]) == {"p"}
        async with http.get(boot.url + "/v1/bootstrap/start?partition=p") as r:
            assert r.status == 503
            body = await r.json()
            assert body["error"] == "not_yet" and body["retriable"] is True
        async with http.get(boot.url + "/v1/bootstrap/start?partition=q") as r:
            assert r.status == 404
        async with http.get(boot.url + "/v1/bootstrap/start?partition=p&bogus=1") as r:
            assert r.status == 400
        async with http.get(boot.url + "/v1/bootstrap/start?partition=p&mode=fast") as r:
            assert r.status == 400
            assert "must be auto or catchup" in (await r.json())["message"]
        for page in ("snapshot", "catchup"):  # (a streamed page would write its body)
            async with http.head(f"{boot.url}/v1/bootstrap/{page}?partition=p") as r:
                assert r.status == 405
        async with http.get(boot.url + "/metrics") as r:
            text = await r.text()
    assert (
        'changebus_bootstrap_http_requests_total{route="/v1/bootstrap/start",status="503"} 1.0'
        in text
    )
    assert 'changebus_bootstrap_producer_scn{partition="p"} -1.0' in text


def test_a_seed_source_of_several_partitions_must_name_its_own(tmp_path: Path) -> None:
    """``seed.dsn`` with partitions listed and no ``seed.partition``: refused by ``--check``
    (the start-up seed raised at start, and the daemon exited; review)."""
    from changebus.schemas import ConfigError

    for seed, why in (
        (SeedConfig(dsn="host=127.0.0.1 dbname=a"), "name it"),
        (SeedConfig(dsn="host=127.0.0.1 dbname=a", partition="c"), "not one of partitions"),
    ):
        with pytest.raises(ConfigError, match=why):
            BootstrapConfig(relays=("http://127.0.0.1:1",), partitions=("a", "b"), seed=seed)


@pytest.mark.parametrize("seed_partition", ["a"])
async def test_the_seed_source_seeds_its_own_partition_only(
    tmp_path: Path, seed_partition: str
) -> None:
    """``seed.dsn`` is the source of ``seed.partition`` (or of the only partition): a
    seed or snapshot of another partition is refused. It was accepted, and filled that
    partition's snapshot from the other database (two databases of one Postgres
    cluster pass the seeder's identity check); a gap there re-seeded it so too."""
    cfg = BootstrapConfig(
        relays=(f"http://127.0.0.1:{closed_port()}",),
        partitions=("a", "b"),
        data_dir=tmp_path / "boot",
        store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
        http=HttpConfig(port=0),
        seed=SeedConfig(
            dsn=f"host=127.0.0.1 port={closed_port()} dbname=a", partition=seed_partition
        ),
    )
    async with BootstrapServer(cfg) as server, aiohttp.ClientSession() as http:
        assert [server.service.seeds(p) for p in "ab"] == [seed_partition == "a", False]
        for part in "ab":
            async with http.post(f"{server.url}/v1/seed?partition={part}&tables=public.t") as r:
                body = await r.json()
            if part == "a" and seed_partition:
                # refused for another reason only: the table is not known (no relay)
                assert r.status == 503, body
                continue
            assert r.status == 400, body
            assert "not the source of partition " + part in body["message"]
            assert "port=" not in body["message"]  # (the DSN is a secret)
            doc = {"partition": part, "table": "public.t"}
            async with http.post(f"{server.url}/v1/snapshot", json=doc) as r:
                body = await r.json()
            assert r.status == 400, body
            assert "not the source of partition " + part in body["message"]
        assert all(w.seeding is None for w in server.service.workers.values())


async def test_a_start_up_seed_with_no_partition_to_seed_does_not_stop_the_server(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``partitions = []`` (every partition of the relay), ``seed.on_start`` and no
    ``seed.partition``, the relay serving two: the start-up seed raised, the daemon
    exited and its supervisor restarted it into the same failure (review). It serves,
    seeds nothing and says why."""
    from changebus.relay import (
        FetcherConfig,
        HttpConfig as RelayHttp,
        PartitionConfig,
        Relay,
        RelayConfig,
    )

    syn = FetcherConfig("synthetic", {"windows_per_s": 20, "tables": 1})
    rcfg = RelayConfig(
        data_dir=tmp_path / "relay",
        http=RelayHttp(port=0),
        partitions=tuple(
            PartitionConfig(n, i, capacity_bytes=1 << 20, fetcher=syn)
            for i, n in ((1, "a"), (2, "b"))
        ),
    )
    async with Relay(rcfg) as relay:
        cfg = BootstrapConfig(
            relays=(relay.url,),
            data_dir=tmp_path / "boot",
            store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
            http=HttpConfig(port=0),
            seed=SeedConfig(dsn=f"host=127.0.0.1 port={closed_port()}", on_start=True),
        )
        async with BootstrapServer(cfg) as server:
            assert sorted(server.service.workers) == ["a", "b"]
            assert not any(server.service.seeds(p) for p in "ab")
            assert all(w.seeding is None for w in server.service.workers.values())
    assert any("no seed at start-up" in r.getMessage() for r in caplog.records)


async def test_plans_wait_for_each_other_and_a_long_wait_is_a_retriable_busy(
    boot: BootstrapServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each plan may count a million snapshot rows on a store reader thread: a few hundred
    concurrent ``start`` requests queued on the two readers, and every page and status
    read waited behind them (review). One plan runs at a time; the others wait on the
    loop, and a long wait is a retriable 503 the client retries."""
    from changebus.bootstrap import _http

    monkeypatch.setattr(_http, "PLAN_WAIT_S", 0.3)
    plans = boot.server.app[_http.PLANS]
    url = boot.url + "/v1/bootstrap/start?partition=p&since=-1"
    async with aiohttp.ClientSession() as http:
        await plans.acquire()  # a plan under way
        try:
            async with http.get(url) as r:
                assert r.status == 503
                body = await r.json()
            assert body["retriable"] is True and "busy planning" in body["message"]
            # meanwhile, what does not plan is answered at once
            async with http.get(boot.url + "/v1/bootstrap/status?partition=p") as r:
                assert r.status in (200, 503)
                assert "busy" not in (await r.json()).get("message", "")
        finally:
            plans.release()
        async with http.get(url) as r:  # its turn: planned (no windows yet: not yet)
            body = await r.json()
        assert "busy planning" not in body["message"]
        assert plans._value == 1  # (released again)


async def test_a_plan_whose_client_went_away_keeps_its_slot_until_it_ends(
    boot: BootstrapServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disconnect cancels the handler, not the plan in its reader thread: the slot was
    released at once and the next plan ran beside the first (review)."""
    from changebus.bootstrap import _http

    gate = threading.Event()
    running: list[int] = [0, 0]  # now, most at once
    lock = threading.Lock()

    def slow_plan(*args: Any, **kwargs: Any) -> dict[str, Any]:
        with lock:
            running[0] += 1
            running[1] = max(running)
        try:
            gate.wait(20)
            return {"partition": "p", "planned": True}
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(_http, "plan_bootstrap", slow_plan)
    url = boot.url + "/v1/bootstrap/start?partition=p&since=-1"
    try:
        async with aiohttp.ClientSession() as http:

            async def ask() -> int:
                async with http.get(url) as r:
                    return r.status

            first = asyncio.create_task(ask())
            await wait_until(lambda: running[0] == 1, what="the first plan")
            first.cancel()  # the client goes away (its connection is closed)
            with contextlib.suppress(asyncio.CancelledError):
                await first
            second = asyncio.create_task(ask())
            await asyncio.sleep(1.0)
            assert running[1] == 1  # the second waits for the slot the first still holds
            gate.set()
            assert await second == 200
            assert running[1] == 1
    finally:
        gate.set()
    await wait_until(lambda: boot.server.app[_http.PLANS]._value == 1, what="the slot back")
