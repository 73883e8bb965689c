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

Thread-safety: event loop only (the handlers).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from changebus.schemas.server import CopyBudget

__all__ = ["BUDGET", "EVENTS_TYPE", "send_page"]

#: the app's copy budget (:func:`send_page`)
BUDGET: web.AppKey[CopyBudget] = web.AppKey("page_budget", CopyBudget)
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
    charged = granted
    try:
        data, headers = await build(granted)
        charged = budget.resize(granted, len(data))
        response = web.StreamResponse(headers=headers)
        response.content_type = EVENTS_TYPE
        response.content_length = len(data)
        await response.prepare(request)
        await response.write(data)
        await response.write_eof()
        return response
    finally:
        budget.release(charged)
