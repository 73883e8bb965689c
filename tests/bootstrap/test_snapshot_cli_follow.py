"""``changebus bootstrap snapshot`` following a run on a server that restarted without it.

The CLI polls ``/v1/status`` until the partition's seed run ends. A server that
restarted and did not resume the run (a finished job's, a key list's) shows the
partition ``idle`` for good: the CLI polled for ever (review). A small aiohttp
server on loopback (``stub_http``) answers the status as such a server does.
"""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from changebus.bootstrap import _cli_snapshot
from stub_http import serve_routes


def status_server(states: list[str]) -> AbstractAsyncContextManager[str]:
    """A server whose ``/v1/status`` shows partition ``p``'s seed in ``states`` in turn
    (the last one for good); its base URL."""
    seen = 0

    async def status(_request: web.Request) -> web.Response:
        nonlocal seen
        state = states[min(seen, len(states) - 1)]
        seen += 1
        return web.json_response({"partitions": [{"partition": "p", "seed": {"state": state}}]})

    server: AbstractAsyncContextManager[str] = serve_routes({"/v1/status": status})
    return server


async def test_a_run_the_server_no_longer_has_ends_the_follow(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(_cli_snapshot, "_IDLE_S", 0.3)
    async with status_server(["running", "idle"]) as base, aiohttp.ClientSession() as session:
        async with asyncio.timeout(10):  # (it polled for ever)
            code = await _cli_snapshot._follow(session, base, "p", 0.02)
    assert code == 1
    assert "runs no snapshot of 'p' any more" in capsys.readouterr().err


async def test_a_short_idle_spell_before_the_run_starts_is_waited_through(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(_cli_snapshot, "_IDLE_S", 5.0)
    states: list[Any] = ["idle", "idle", "running", "done"]
    async with status_server(states) as base, aiohttp.ClientSession() as session:
        async with asyncio.timeout(10):
            code = await _cli_snapshot._follow(session, base, "p", 0.02)
    assert code == 0
