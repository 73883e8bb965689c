"""Follow mode of ``GET /v1/stream`` (``follow=1``): one held response, a chunk per batch.

Each new batch of windows is pushed as a chunk of one long response. The
response ends when ``wait`` seconds pass with nothing new, when ``budget``
bytes were sent, or when the client goes away. Every push is a copy taken
under a pin and checked before it is written (:func:`~._respond.copy_out`),
so every byte on the wire is valid, and no pin is held while a push waits
for the client; the client tracks its position from the END_OF_WINDOW events
it reads (see docs/protocol.md 6.1).

Who writes the pushes: the partition's :class:`~._broadcast.TailBroadcast`.
A stream parks there and the broadcast writes one shared copy to every parked
stream at the same position with the same request, at a cadence that keeps
the writes per second bounded with many followers. The stream's own task
takes over only for what the broadcast hands back: waiting for a slow client
to drain a push (under its :class:`~._send.SendWatch`, one timer per stream:
a push the client does not accept within the send timeout aborts the
connection), ending the response (budget, idle), and pushes the broadcast
cannot make (larger than one chunk, or an error to report). Without a
broadcast (a server whose writer cannot send headers ahead) the task pushes
everything itself, self-clocked: a small socket send buffer, and the next push
only once the previous one has left the process.

Pushes are shared with identical followers through the partition's
response cache, which is bounded by bytes (:mod:`._respcache`): pushes
never accumulate there. Every push is charged to the relay-wide
:class:`~changebus.schemas.server.CopyBudget` while it is being made or drained (no
grant is held while a stream waits for new windows): with many slow
followers the pushes get smaller, never more numerous in memory than the
budget allows.

Event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from dataclasses import dataclass

from aiohttp import web

from changebus.schemas import ChangebusError, PartitionFilter, ScnNotFoundError
from changebus.schemas.server import CopyBudget

from ._broadcast import Parked, TailBroadcast
from ._host import PartitionHost
from ._metrics import RelayMetrics
from ._respcache import CachedResponse, ResponseCache
from ._respond import copy_out, next_headers
from ._send import SendWatch, unbuffered

__all__ = ["FollowRequest", "follow"]

log = logging.getLogger("changebus.relay.http")

_FOLLOW_SNDBUF = 64 * 1024


@dataclass(frozen=True)
class FollowRequest:
    """What a follow request asked for (parsed and checked by the handler)."""

    scn: int
    offset: int
    max_bytes: int
    key_filter: PartitionFilter | None
    filter_text: str | None
    sources: frozenset[int] | None
    wait: float
    budget: int
    client: str


async def follow(
    request: web.Request,
    host: PartitionHost,
    ask: FollowRequest,
    cache: ResponseCache,
    copies: CopyBudget,
    metrics: RelayMetrics,
    send_timeout_s: float,
    broadcast: TailBroadcast | None = None,
) -> web.StreamResponse:
    """Serve one follow request (module docstring).

    ``broadcast``: the partition's :class:`~._broadcast.TailBroadcast`, which
    writes the pushes while the stream is at the tail (None: the stream's
    task waits and pushes itself).
    """
    scn, offset = ask.scn, ask.offset
    # fail before the 200 when the checkpoint is already too old
    try:
        host.buffer.locate(scn, offset)
    except ScnNotFoundError:
        metrics.fell_off(host.name)  # answered 410
        raise
    resp = web.StreamResponse(status=200, headers=next_headers(host, scn, offset, None))
    resp.headers["X-Changebus-Follow"] = "1"
    resp.content_type = "application/vnd.changebus.events"
    resp.enable_chunked_encoding()
    transport = request.transport
    if transport is not None:
        # the socket's send buffer is locked small and its write limit is 0 for good
        # (Linux stops autotuning a buffer once set): the connection ends with the
        # response, or a keep-alive reuse would pull large answers through 64 KiB
        resp.force_close()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _FOLLOW_SNDBUF)
        unbuffered(transport)
    await resp.prepare(request)
    if broadcast is not None:
        # the broadcast writes whole chunks to the transport: headers must be out first
        send_headers = getattr(request.writer, "send_headers", None)
        if send_headers is None:
            broadcast = None
        else:
            send_headers()
    watch = SendWatch(request, send_timeout_s, lambda: metrics.aborted(host.name))
    try:
        return await _pushes(request, resp, host, ask, cache, copies, metrics, watch, broadcast)
    finally:
        watch.close()


async def _pushes(
    request: web.Request,
    resp: web.StreamResponse,
    host: PartitionHost,
    ask: FollowRequest,
    cache: ResponseCache,
    copies: CopyBudget,
    metrics: RelayMetrics,
    watch: SendWatch,
    broadcast: TailBroadcast | None,
) -> web.StreamResponse:
    """The pushes of one follow response, until its budget, its idle time or the client ends it."""
    scn, offset = ask.scn, ask.offset
    sent = 0
    idle_until = time.monotonic() + ask.wait
    #: the broadcast handed the next push to this task ("task")
    own_push = broadcast is None
    while sent < ask.budget:
        transport = request.transport
        if not own_push and broadcast is not None and transport is not None:
            # parked: the broadcast writes the pushes (no grant held here meanwhile)
            parked = Parked(
                request,
                transport,
                ask.max_bytes,
                ask.filter_text,
                ask.key_filter,
                ask.sources,
                ask.client,
                scn,
                offset,
                sent,
                ask.budget,
                ask.wait,
                idle_until,
            )
            why = await broadcast.park(parked)
            scn, offset, sent, idle_until = (
                parked.scn,
                parked.offset,
                parked.sent,
                parked.idle_until,
            )
            if why == "closed":
                return resp
            if why == "idle":
                break
            if why == "drain" and not await _drain(request, watch, copies, ask.client):
                return resp
            own_push = why == "task"  # ("budget" ends the loop)
            continue
        m = host.buffer.meta
        key = (scn, offset, ask.max_bytes, ask.filter_text, ask.sources)
        cached = cache.get(m.tail_event, key, m.head_pos)
        charged = copies.grant(ask.max_bytes if cached is None else len(cached.body))
        try:
            if cached is None or charged < len(cached.body):
                # (a shared push larger than the grant: a fresh, smaller copy instead)
                try:
                    cached = await _copy(host, scn, offset, charged, ask, metrics)
                except ChangebusError as exc:  # evicted or overrun meanwhile: the client re-asks
                    log.info("follow stream for %s ends: %s", ask.client, exc.message)
                    break
                if cached is not None:
                    charged = copies.resize(charged, len(cached.body))
                    # shared even when the grant was cut: a push smaller than max_bytes is a
                    # valid answer to the same request, and a herd catching up must share
                    # its pushes to catch up at all
                    cache.put(m.tail_event, key, cached)
            if cached is not None:
                try:
                    # limits are 0: returns once the push left the process
                    if not await watch.send(resp, cached.body):  # (counted by the watch)
                        return resp
                except ConnectionResetError:  # the consumer went away: nothing to report
                    log.debug("follow stream for %s: the consumer disconnected", ask.client)
                    return resp
        finally:
            copies.release(charged)
        if cached is None:
            left = idle_until - time.monotonic()
            if left <= 0:
                break
            if broadcast is None or request.transport is None:
                await host.wait_for_window(left)  # (no grant held while waiting)
                continue
            own_push = False  # back to the broadcast
            continue
        # write and drain often complete without suspending; yield so that a
        # stream that always finds new windows cannot starve the others
        await asyncio.sleep(0)
        metrics.streamed(host.name, len(cached.body), cached.events)
        sent += len(cached.body)
        scn, offset = cached.next_scn, cached.next_offset
        reached = (
            -1 if cached.to_tail or cached.start_pos < 0 else cached.start_pos + len(cached.body)
        )
        host.saw_consumer(ask.client, scn, request.remote or "", reached)
        idle_until = time.monotonic() + ask.wait
        own_push = broadcast is None  # the next push: the broadcast's again
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    return resp


async def _drain(request: web.Request, watch: SendWatch, copies: CopyBudget, client: str) -> bool:
    """Wait until a broadcast push left the transport (charged to the budget meanwhile)."""
    transport = request.transport
    held = 0 if transport is None else transport.get_write_buffer_size()
    charged = copies.grant(held)
    try:
        return await watch.drain()
    except ConnectionResetError:
        log.debug("follow stream for %s: the consumer disconnected", client)
        return False
    finally:
        copies.release(charged)


async def _copy(
    host: PartitionHost, scn: int, offset: int, max_bytes: int, ask: FollowRequest, m: RelayMetrics
) -> CachedResponse | None:
    """The next push of at most ``max_bytes`` (None: nothing new yet); a checked copy.

    A window longer than a scan may read is scanned over several turns of
    the event loop (:attr:`~._reader.Selection.resume_at`).
    """
    resume = -1
    while True:
        selection = host.buffer.select(
            scn, offset, max_bytes, key_filter=ask.key_filter, sources=ask.sources, skip_to=resume
        )
        if selection is None:
            return None
        if selection.resume_at < 0:
            return copy_out(host, selection, m)
        resume = selection.resume_at
        host.buffer.release(selection)
        await asyncio.sleep(0)
