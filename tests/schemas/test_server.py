"""The server frame (changebus.schemas.server) through a real aiohttp server and client."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from changebus.schemas import BadRequestError, CheckpointError, ConfigError, NotYetError
from changebus.schemas.server import (
    Server,
    check_params,
    json_response,
    query_choice,
    query_float,
    query_int,
    query_parsed,
    server_app,
)

pytestmark = pytest.mark.usefixtures("no_blocking")

log = logging.getLogger("changebus.test.server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# ---- query parameters ------------------------------------------------------


def test_query_int_bounds_and_garbage() -> None:
    q = {"a": "12", "neg": "-1", "big": "9" * 5000, "bad": "1_000", "sp": " 5", "uni": "٣"}
    assert query_int(q, "a", lo=0, hi=100) == 12
    assert query_int(q, "neg", lo=-1, hi=5) == -1
    assert query_int(q, "absent", default=7, lo=0, hi=1) == 7  # the default is not checked
    for name, needle in [
        ("big", "within"),
        ("bad", "integer"),
        ("sp", "integer"),
        ("uni", "integer"),
        ("absent", "required"),
    ]:
        with pytest.raises(BadRequestError, match=needle) as info:
            query_int(q, name, lo=0, hi=2**63 - 1)
        assert info.value.retriable is False and info.value.http_status == 400
        assert len(info.value.message) < 200  # a 5,000-digit value is not echoed
    with pytest.raises(BadRequestError, match=r"within 0\.\.10, got 12"):
        query_int(q, "a", lo=0, hi=10)


def test_query_float_rejects_non_finite_and_long() -> None:
    q = {"w": "0.25", "e": "2e-3", "nan": "nan", "inf": "inf", "big": "9" * 5000, "x": "0x10"}
    assert query_float(q, "w", default=0, lo=0, hi=1) == 0.25
    assert query_float(q, "e", default=0, lo=0, hi=1) == 0.002
    assert query_float(q, "absent", default=3.5, lo=0, hi=1) == 3.5
    for name in ("nan", "inf", "x"):
        with pytest.raises(BadRequestError, match="number"):
            query_float(q, name, default=0, lo=0, hi=1e9)
    with pytest.raises(BadRequestError, match="within"):
        query_float(q, "big", default=0, lo=0, hi=1e9)


def test_query_choice_params_and_parsed() -> None:
    q = {"fmt": "xml", "cp": "{" + "[" * 100_000}
    with pytest.raises(BadRequestError, match="binary or ndjson"):
        query_choice(q, "fmt", ("binary", "ndjson"), default="binary")
    assert query_choice(q, "absent", ("a", "b"), default="b") == "b"
    check_params(q, {"fmt", "cp"})
    with pytest.raises(BadRequestError, match="unknown parameter"):
        check_params(q, {"fmt"})
    assert query_parsed(q, "absent", int) is None

    def raises_value_error(text: str) -> int:
        return int("9" * 5000)  # Python's own digit limit: a ValueError

    with pytest.raises(BadRequestError, match="cp is malformed"):
        query_parsed(q, "cp", raises_value_error)

    def raises_changebus_error(text: str) -> int:
        raise CheckpointError("not a checkpoint")

    with pytest.raises(CheckpointError):  # a ChangebusError passes through as it is
        query_parsed(q, "cp", raises_changebus_error)


# ---- errors, health, metrics -------------------------------------------------


async def _boom(request: web.Request) -> web.Response:
    raise RuntimeError("connect to postgresql://app:s3cret@db/prod failed")


async def _not_yet(request: web.Request) -> web.Response:
    raise NotYetError("come back later", behind=3)


async def _number(request: web.Request) -> web.Response:
    check_params(request.query, {"n"})
    return json_response({"n": query_int(request.query, "n", lo=0, hi=10)})


@pytest.fixture
async def frame() -> AsyncIterator[tuple[Server, dict[str, Any]]]:
    state: dict[str, Any] = {"ready": False}
    app = server_app(
        "frametest",
        readiness=lambda: (state["ready"], {"p": "streaming" if state["ready"] else "starting"}),
        logger=log,
    )
    app.router.add_get("/boom", _boom)
    app.router.add_get("/not-yet", _not_yet)
    app.router.add_get("/number", _number)
    async with Server(app, name="frame test", host="127.0.0.1", port=0, logger=log) as server:
        yield server, state


async def test_errors_are_json_and_leak_nothing(
    frame: tuple[Server, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    server, _ = frame
    assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{server.url}/boom?token=abc") as r:
            assert r.status == 500
            text = await r.text()
        assert "s3cret" not in text and "RuntimeError" not in text and "postgresql" not in text
        body = await r.json()
        assert body["error"] == "internal" and set(body) == {"error", "message", "retriable"}
        # the server's log has the whole story, the query string (tokens) stays out of it
        record = next(r for r in caplog.records if r.name == log.name and r.exc_info)
        assert "GET /boom" in record.getMessage() and "token" not in record.getMessage()
        async with http.get(f"{server.url}/not-yet") as r:
            assert r.status == 503
            assert await r.json() == {
                "error": "not_yet",
                "message": "come back later",
                "retriable": True,
                "behind": 3,
            }
        async with http.get(f"{server.url}/number", params={"n": "9" * 5000}) as r:
            assert r.status == 400
            body = await r.json()
            assert body["error"] == "bad_request" and body["retriable"] is False
        async with http.get(f"{server.url}/number", params={"n": "3", "m": "1"}) as r:
            assert r.status == 400 and "unknown parameter" in (await r.json())["message"]
        async with http.get(f"{server.url}/nowhere") as r:
            assert r.status == 404
            assert (await r.json())["error"] == "http"
        async with http.post(f"{server.url}/number") as r:
            assert r.status == 405
            assert "GET" in r.headers["Allow"]
            assert (await r.json())["retriable"] is False


async def test_health_readiness_and_metrics(frame: tuple[Server, dict[str, Any]]) -> None:
    server, state = frame
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{server.url}/healthz") as r:
            assert r.status == 200 and await r.json() == {"status": "ok"}
        async with http.get(f"{server.url}/readyz") as r:
            assert r.status == 503
            assert await r.json() == {"ready": False, "partitions": {"p": "starting"}}
        state["ready"] = True
        async with http.get(f"{server.url}/readyz") as r:
            assert r.status == 200 and (await r.json())["partitions"] == {"p": "streaming"}
        async with http.get(f"{server.url}/number?n=1") as r:
            assert r.status == 200
        async with http.get(f"{server.url}/metrics") as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = await r.text()
    assert 'changebus_frametest_http_requests_total{route="/number",status="200"} 1.0' in text
    assert 'changebus_frametest_http_requests_total{route="/readyz",status="503"} 1.0' in text


# ---- start-up and shutdown through cleanup_ctx -----------------------------


def _steps(events: list[str], second: str) -> web.Application:
    """An app with two start-up steps; the second fails, hangs or works."""
    app = server_app("frametest", readiness=lambda: (True, {}), logger=log)

    async def first(app: web.Application) -> AsyncIterator[None]:
        events.append("first started")
        try:
            yield
        finally:
            events.append("first stopped")

    async def then(app: web.Application) -> AsyncIterator[None]:
        try:
            events.append("second starting")
            if second == "fails":
                raise ConfigError("bad second step")
            if second == "hangs":
                await asyncio.Event().wait()
            yield
        finally:
            events.append("second stopped")

    app.cleanup_ctx.append(first)
    app.cleanup_ctx.append(then)
    return app


async def test_failed_startup_releases_what_it_started() -> None:
    events: list[str] = []
    port = free_port()
    server = Server(_steps(events, "fails"), name="t", host="127.0.0.1", port=port, logger=log)
    with pytest.raises(ConfigError, match="bad second step"):
        await server.start()
    assert events == ["first started", "second starting", "second stopped", "first stopped"]
    assert not listening(port)
    await server.stop()  # idempotent
    assert len(events) == 4


async def test_cancelled_startup_releases_what_it_started() -> None:
    events: list[str] = []
    port = free_port()
    server = Server(_steps(events, "hangs"), name="t", host="127.0.0.1", port=port, logger=log)
    starting = asyncio.create_task(server.start())
    while "second starting" not in events:
        await asyncio.sleep(0.01)
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert events == ["first started", "second starting", "second stopped", "first stopped"]
    assert not listening(port)


async def test_stop_runs_the_steps_backwards_after_the_listener_closed() -> None:
    events: list[str] = []
    port = free_port()
    async with Server(
        _steps(events, "works"), name="t", host="127.0.0.1", port=port, logger=log
    ) as server:
        assert server.port == port and listening(port)
    assert events == ["first started", "second starting", "second stopped", "first stopped"]
    assert not listening(port)


async def test_an_error_mid_stream_cuts_the_response() -> None:
    async def half(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await resp.write(b"first part")
        raise RuntimeError("after the first chunk")

    app = server_app("frametest", readiness=lambda: (True, {}), logger=log)
    app.router.add_get("/half", half)
    async with (
        Server(app, name="t", host="127.0.0.1", port=0, logger=log) as server,
        aiohttp.ClientSession() as http,
    ):
        async with http.get(f"{server.url}/half") as r:
            assert r.status == 200
            # the body ends without its last chunk: the client sees it incomplete
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.read()
        async with http.get(f"{server.url}/healthz") as r:  # the server goes on
            assert r.status == 200
