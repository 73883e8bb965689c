"""The relays' JSON questions (RelayInfo, RelayQueries) against real relays and a bad server."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from changebus.client import (
    PartitionStatus,
    RelayInfo,
    RelayQueries,
    RelaySchemas,
    RelayUnavailableError,
)
from changebus.relay import Relay
from changebus.schemas import ProtocolError, TransportError, UnknownSourceError

MakeRelay = Callable[..., AbstractAsyncContextManager[Relay]]
TABLES = ["synthetic.t0", "synthetic.t1"]


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def counting_session() -> AsyncIterator[tuple[aiohttp.ClientSession, list[str]]]:
    """A session that records the URL of every request it starts."""
    sent: list[str] = []

    async def on_start(
        _s: aiohttp.ClientSession, _c: SimpleNamespace, p: aiohttp.TraceRequestStartParams
    ) -> None:
        sent.append(str(p.url))

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(on_start)
    async with aiohttp.ClientSession(trace_configs=[trace]) as session:
        yield session, sent


@contextlib.asynccontextmanager
async def bad_server(answers: dict[str, Callable[[], web.Response]]) -> AsyncIterator[str]:
    """A real HTTP server answering ``path -> make_response()`` (a proxy page, a broken relay)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        return answers[request.path]()

    app = web.Application()
    for path in answers:
        app.router.add_get(path, handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_typed_answers_of_a_live_relay(make_relay: MakeRelay) -> None:
    async with make_relay() as relay, aiohttp.ClientSession() as session:
        info = RelayInfo(session, relay.url + "/")
        status = await info.status()
        sources = await info.sources()
        schemas = await info.schemas("synthetic.t1", partition="syn")
        names = await RelaySchemas(session, relay.url, None).source_names()
    part = status["syn"]
    assert isinstance(part, PartitionStatus)
    assert (part.min_scn, part.max_scn, part.prev_scn) == (1000, 1299, 999)
    assert part.fetcher is not None and part.fetcher["kind"] == "synthetic"
    assert part.newest_timestamp_ns > 0 and part.raw["windows"] == 300
    assert list(sources) == ["syn"] and sources["syn"].id == 1
    assert sorted(s.name for s in sources["syn"].sources) == TABLES
    assert sorted(names.values()) == TABLES
    found = schemas["syn"]
    assert found.source_id in names and names[found.source_id] == "synthetic.t1"
    assert found.newest.name == "synthetic.t1" and found.newest.version >= 1


async def test_a_stopped_relay_then_a_live_one(make_relay: MakeRelay) -> None:
    async with make_relay() as live, contextlib.AsyncExitStack() as stack:
        stopped = await stack.enter_async_context(make_relay())
        await stack.aclose()
        async with counting_session() as (session, sent):
            relays = RelayQueries(session, (stopped.url, live.url))
            status = await relays.first(RelayInfo.status)
            assert status["syn"].max_scn == 1299
            assert [u.split("/v1/")[0] for u in sent] == [stopped.url, live.url]

            # every server asked: the first that has the answer, skipping the stopped one
            async def fetcher_kind(info: RelayInfo) -> str | None:
                part = (await info.status()).get("syn")
                return str(part.fetcher["kind"]) if part and part.fetcher else None

            assert await relays.search(fetcher_kind) == "synthetic"
            answers = [a async for a in relays.answers(RelayInfo.sources)]
            assert len(answers) == 1 and "syn" in answers[0]

            async def nowhere(info: RelayInfo) -> int | None:
                await info.sources()
                return None

            assert await relays.search(nowhere) is None

            # nobody answers: a retriable TransportError each time, then RelayUnavailableError
            with pytest.raises(RelayUnavailableError) as info:
                await RelayQueries(session, (stopped.url, dead_url())).first(RelayInfo.status)
            assert isinstance(info.value.__cause__, TransportError)
            with pytest.raises(TransportError):
                await RelayInfo(session, stopped.url).sources()


async def test_unknown_partition_404_is_not_retried(make_relay: MakeRelay) -> None:
    async with (
        make_relay() as first,
        make_relay() as second,
        counting_session() as (session, sent),
    ):
        relays = RelayQueries(session, (first.url, second.url), max_attempts=0)
        with pytest.raises(UnknownSourceError) as info:
            await relays.first(lambda i: i.schemas("synthetic.t0", partition="nope"))
        assert not info.value.retriable
        assert info.value.message.startswith(f"relay {first.url}:")
        assert len(sent) == 1  # not retried, not asked of the second relay
        with pytest.raises(UnknownSourceError):
            [a async for a in relays.answers(lambda i: i.schemas("no.such.table"))]
        with pytest.raises(UnknownSourceError):
            await RelaySchemas(session, first.url, "nope").source_names()


async def test_an_answer_that_is_not_json_is_a_clear_retriable_error(
    make_relay: MakeRelay,
) -> None:
    page = "<html><body>502 Bad Gateway (the proxy)</body></html>"
    answers: dict[str, Callable[[], web.Response]] = {
        "/v1/status": lambda: web.Response(text=page, content_type="text/html"),
        "/v1/sources": lambda: web.json_response({"partitions": [{"partition": "syn"}]}),
        "/v1/schemas/t": lambda: web.Response(body=b"\xff\xfe{", content_type="application/json"),
        "/v1/bootstrap/status": lambda: web.json_response([1, 2, 3]),
    }
    async with (
        make_relay() as relay,
        bad_server(answers) as url,
        aiohttp.ClientSession() as session,
    ):
        secret = url.replace("http://", "http://user:s3cret@")
        bad = RelayInfo(session, secret)
        with pytest.raises(ProtocolError) as info:
            await bad.status()
        message = info.value.message
        assert info.value.retriable
        assert message.startswith(f"relay {url}/v1/status: ") and "is not JSON" in message
        assert "text/html" in message and "s3cret" not in message and "Bad Gateway" not in message
        with pytest.raises(ProtocolError, match="malformed answer to /v1/sources") as info:
            await bad.sources()
        assert info.value.retriable
        with pytest.raises(ProtocolError, match="not JSON"):
            await bad.schemas("t")
        with pytest.raises(ProtocolError, match="not an object"):
            await bad.bootstrap_status("syn")

        # retriable: the next relay answers
        status = await RelayQueries(session, (secret, relay.url)).first(RelayInfo.status)
        assert status["syn"].max_scn == 1299
        with pytest.raises(RelayUnavailableError, match="is not JSON") as gave_up:
            await RelayQueries(session, (secret,), max_attempts=2).first(RelayInfo.status)
        assert "s3cret" not in str(gave_up.value)


def test_relay_queries_need_a_url() -> None:
    with pytest.raises(ValueError, match="at least one relay"):
        RelayQueries(None, ())  # type: ignore[arg-type]
