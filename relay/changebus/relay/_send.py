"""Sending stream bodies to clients that may stop reading.

Two ways out, both as chunks of a prepared chunked :class:`aiohttp.web.StreamResponse`:

* :func:`send_selection` writes a pinned selection's ring slices (zero
  copy where the transport allows it) and releases the pin;
* :func:`send_body` writes a copy (follow-mode pushes, ``format=ndjson``).

Both write in pieces of at most :data:`PIECE_BYTES` and give every piece
``send_timeout_s`` to leave the process: a client that accepts nothing for
that long has its connection aborted (the body then ends without its
terminating chunk, which tells the client to discard it). So a client that
stops reading holds at most about one piece of unsent bytes in the
transport, and only for ``send_timeout_s``.

A reader waiting longer than :data:`STALL_S` for one piece marks its pin
*stalled* (:meth:`EventBuffer.stall`): the buffer's writer then overruns it at
once instead of waiting ``pin_timeout_s`` for it (see :mod:`._evict`), and
the reader, seeing the overrun, aborts its response before sending more.
Appends therefore never wait for a client that does not read.

Event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Iterable, Iterator
from typing import Literal

from aiohttp import web

from ._buffer import EventBuffer, Selection

__all__ = ["PIECE_BYTES", "STALL_S", "pieces", "send_body", "send_selection"]

log = logging.getLogger("changebus.relay.http")

#: the largest single write (and so roughly the most unsent bytes a transport holds)
PIECE_BYTES = 1 << 20
#: a reader waiting this long for one piece to leave is stalled: the writer overruns it
STALL_S = 0.5
#: runs shorter than this are gathered into writes of about _COALESCE_BYTES
_SMALL_RUN = 64 * 1024
_COALESCE_BYTES = 256 * 1024
#: 3.11 transports copy unsent bytes; newer ones keep references to the memoryviews
_ZERO_COPY_SAFE = sys.version_info < (3, 12)

Outcome = Literal["sent", "overrun", "timeout"]


def pieces(views: Iterable[memoryview]) -> Iterator[memoryview | bytes]:
    """The writes for a list of ring runs: large runs in slices, small ones joined.

    A run of at least 64 KiB is written as it is (zero copy), in slices of
    at most :data:`PIECE_BYTES`. A filtered selection is many short runs;
    one write per run would cost a system call and an HTTP chunk each, so
    shorter runs are gathered (one copy) into writes of about 256 KiB.
    """
    pending: list[memoryview] = []
    pending_bytes = 0
    for view in views:
        if len(view) >= _SMALL_RUN:
            if pending:
                yield b"".join(pending)
                pending, pending_bytes = [], 0
            for start in range(0, len(view), PIECE_BYTES):
                yield view[start : start + PIECE_BYTES]
            continue
        pending.append(view)
        pending_bytes += len(view)
        if pending_bytes >= _COALESCE_BYTES:
            yield b"".join(pending)
            pending, pending_bytes = [], 0
    if pending:
        yield pending[0] if len(pending) == 1 else b"".join(pending)


async def send_selection(
    request: web.Request,
    resp: web.StreamResponse,
    buffer: EventBuffer,
    selection: Selection,
    send_timeout_s: float,
) -> Outcome:
    """Write ``selection``'s ring slices to ``resp`` and release its pin.

    ``"sent"``: every byte left from ring bytes the writer did not overrun;
    the caller ends the body. ``"overrun"`` or ``"timeout"``: the connection
    has been aborted (the body has no terminating chunk); nothing more may
    be written.
    """
    loop = asyncio.get_running_loop()
    pin = selection.pin
    stall: asyncio.TimerHandle | None = None
    outcome: Outcome = "overrun"
    try:
        async with asyncio.timeout(send_timeout_s) as deadline:
            for piece in pieces(selection.views):
                if pin is not None:
                    if pin.overrun:
                        break
                    stall = loop.call_later(STALL_S, buffer.stall, pin)
                await resp.write(piece)
                if stall is not None:
                    stall.cancel()
                    stall = None
                    if pin is not None and pin.stalled:
                        buffer.stall(pin, False)
                deadline.reschedule(loop.time() + send_timeout_s)
            else:
                if not _ZERO_COPY_SAFE and request.transport is not None:
                    # newer asyncio transports keep references to unsent memoryviews:
                    # wait until everything left the process before the pin goes
                    unbuffered(request.transport)
                    await request.writer.drain()
                outcome = "sent"
    except TimeoutError:
        outcome = "timeout"
    finally:
        if stall is not None:
            stall.cancel()
        if not buffer.release(selection) and outcome == "sent":
            outcome = "overrun"  # the bytes may have been overwritten while being sent
    if outcome != "sent":
        _abort(request, outcome, send_timeout_s)
    return outcome


async def send_body(
    request: web.Request, resp: web.StreamResponse, body: bytes, send_timeout_s: float
) -> bool:
    """Write a copied ``body`` to ``resp`` and wait until it left the process.

    One chunk per :data:`PIECE_BYTES` (a follow push up to that size is one
    chunk, as docs/protocol.md says). The transport keeps a copy of the
    unsent part of a write: a slow client costs up to twice its body.
    False: the client accepted nothing for ``send_timeout_s`` and the
    connection has been aborted.
    """
    loop = asyncio.get_running_loop()
    view = memoryview(body)
    try:
        async with asyncio.timeout(send_timeout_s) as deadline:
            for start in range(0, len(view), PIECE_BYTES):
                await resp.write(view[start : start + PIECE_BYTES])
                deadline.reschedule(loop.time() + send_timeout_s)
            await request.writer.drain()
    except TimeoutError:
        _abort(request, "timeout", send_timeout_s)
        return False
    return True


def _abort(request: web.Request, outcome: Outcome, send_timeout_s: float) -> None:
    if outcome == "timeout":
        log.info(
            "aborted a response to %s: the client read nothing for %.1f s",
            request.remote,
            send_timeout_s,
        )
    if request.transport is not None:
        request.transport.abort()


def unbuffered(transport: asyncio.BaseTransport) -> None:
    """Write-buffer limit 0: ``drain()`` then returns once the bytes left the process.

    Not over TLS: asyncio's TLS transport never resumes a writer paused at a
    zero limit (``drain()`` would hang), and it encrypts -- copies -- what is
    written at once, so no reference to the ring outlives the write anyway.
    """
    if transport.get_extra_info("ssl_object") is None and isinstance(
        transport, asyncio.WriteTransport
    ):
        transport.set_write_buffer_limits(high=0)
