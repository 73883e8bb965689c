"""Snapshot and catch-up pages sent under the server's copy budget.

A page is built whole from the store (one read in a store thread) and
lives until its client has taken it: a client that reads slowly keeps it
for up to the send timeout. Every page is therefore sized by a grant of the
server's :class:`~changebus.schemas.server.CopyBudget` (``http.max_copy_bytes``
over ``http.max_connections``), charged its real size once built, and given
back when the response is written or fails. A busy server answers with
smaller pages, never with a wait or an error; the pages in flight hold at
most the budget plus one event or window per request (a page holds at least
one).

A page goes out in pieces of :data:`PIECE_BYTES`, each of which must leave
within ``http.write_timeout_s`` (:data:`PIECE_TIMEOUT`): a client that reads,
but a few bytes a second, kept its page and its share of the budget for
hours (the frame's write watchdog sees progress; found by review). It is cut
off instead, as the relay cuts such a reader.

Thread-safety: event loop only (the handlers).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

from changebus.schemas import held_until_done
from changebus.schemas.server import CopyBudget

__all__ = ["BUDGET", "EVENTS_TYPE", "PIECE_BYTES", "PIECE_TIMEOUT", "send_page"]

#: the app's copy budget (:func:`send_page`)
BUDGET: web.AppKey[CopyBudget] = web.AppKey("page_budget", CopyBudget)
#: the seconds each piece of a page may take to leave (the app's ``http.write_timeout_s``)
PIECE_TIMEOUT: web.AppKey[float] = web.AppKey("page_piece_timeout", float)
#: a page is written in pieces of this size
PIECE_BYTES = 1 << 20
#: the content type of a page of events
EVENTS_TYPE = "application/vnd.changebus.events"

Page = tuple[bytes, dict[str, str]]


async def send_page(
    request: web.Request, want: int, build: Callable[[int], Awaitable[Page]]
) -> web.StreamResponse:
    """Build a page of at most about ``want`` bytes (``build(max_bytes)``: its bytes and
    headers) within a grant of the budget, send it, and give the grant back."""
    budget = request.app[BUDGET]
    granted = budget.grant(want)
    # (a client that went away cancels this handler, not the read in its store thread:
    # the grant stays counted until that ends; review)
    data, headers = await held_until_done(build(granted), lambda: budget.release(granted))
    charged = granted
    try:
        charged = budget.resize(granted, len(data))
        response = web.StreamResponse(headers=headers)
        response.content_type = EVENTS_TYPE
        response.content_length = len(data)
        await response.prepare(request)
        timeout = request.app.get(PIECE_TIMEOUT, 60.0)
        view = memoryview(data)
        for at in range(0, len(data), PIECE_BYTES):
            try:
                async with asyncio.timeout(timeout):
                    await response.write(view[at : at + PIECE_BYTES])
            except TimeoutError:
                transport = request.transport
                if transport is not None:
                    transport.abort()  # (the body is cut short: the client sees it)
                return response
        await response.write_eof()
        return response
    finally:
        budget.release(charged)
