"""Sending stream bodies to clients that may stop reading.

Two ways out, both as chunks of a prepared chunked :class:`aiohttp.web.StreamResponse`:

* :func:`send_selection` writes a pinned selection's ring slices (zero
  copy where the transport allows it) and releases the pin;
* :class:`SendWatch` (:func:`send_body` for one) writes copies
  (follow-mode pushes, ``format=ndjson``).

Both write in pieces of at most :data:`PIECE_BYTES` and give every piece
``send_timeout_s`` to leave the process (a watch: up to a quarter more): a
client that accepts nothing for that long has its connection aborted (the body then ends without its
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
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any, Literal

from aiohttp import web

from changebus.schemas.server import CopyBudget

from ._buffer import EventBuffer, Selection

__all__ = ["PIECE_BYTES", "STALL_S", "SendWatch", "pieces", "send_body", "send_selection"]

log = logging.getLogger("changebus.relay.http")

#: the largest single write (and so roughly the most unsent bytes a transport holds)
PIECE_BYTES = 1 << 20
#: a reader waiting this long for one piece to leave is stalled: the writer overruns it
STALL_S = 0.5
#: runs shorter than this are gathered into writes of about _COALESCE_BYTES
_SMALL_RUN = 64 * 1024
_COALESCE_BYTES = 256 * 1024
#: the smallest piece (a budget cut to its floor still sends in useful writes)
_MIN_PIECE = 16 * 1024
#: 3.11 transports copy unsent bytes; newer ones keep references to the memoryviews
_ZERO_COPY_SAFE = sys.version_info < (3, 12)

Outcome = Literal["sent", "overrun", "timeout"]


def pieces(views: Iterable[memoryview], size: int = PIECE_BYTES) -> Iterator[memoryview | bytes]:
    """The writes for a list of ring runs: large runs in slices, small ones joined.

    A run of at least 64 KiB is written as it is (zero copy), in slices of
    at most ``size`` bytes. A filtered selection is many short runs;
    one write per run would cost a system call and an HTTP chunk each, so
    shorter runs are gathered (one copy) into writes of about 256 KiB (at
    most ``size`` and one run).
    """
    gather = min(_COALESCE_BYTES, size)
    pending: list[memoryview] = []
    pending_bytes = 0
    for view in views:
        if len(view) >= _SMALL_RUN:
            if pending:
                yield b"".join(pending)
                pending, pending_bytes = [], 0
            for start in range(0, len(view), size):
                yield view[start : start + size]
            continue
        pending.append(view)
        pending_bytes += len(view)
        if pending_bytes >= gather:
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
    copies: CopyBudget | None = None,
) -> Outcome:
    """Write ``selection``'s ring slices to ``resp`` and release its pin.

    ``"sent"``: every byte left from ring bytes the writer did not overrun;
    the caller ends the body (3.11: ended here already, before the final drain). ``"overrun"`` or ``"timeout"``: the connection
    has been aborted (the body has no terminating chunk); nothing more may
    be written.

    ``copies``: the bytes a transport holds of this answer (3.11 copies what
    the socket does not take) are charged to the relay's copy budget: the
    pieces are at most the grant, and the grant is held until the last piece
    left the process. A thousand clients that read nothing thus hold the
    budget, not a MiB each.
    """
    loop = asyncio.get_running_loop()
    pin = selection.pin
    stall: asyncio.TimerHandle | None = None
    outcome: Outcome = "overrun"
    released = False
    charged = copies.grant(PIECE_BYTES) if copies is not None else PIECE_BYTES
    if pin is not None:  # the pace the writer judges the pin by (._evict)
        pin.total, pin.since = selection.nbytes, time.monotonic()
    try:
        async with asyncio.timeout(send_timeout_s) as deadline:
            for piece in pieces(selection.views, max(charged, _MIN_PIECE)):
                if pin is not None:
                    if pin.overrun:
                        break
                    stall = loop.call_later(STALL_S, buffer.stall, pin)
                await resp.write(piece)
                if stall is not None:
                    stall.cancel()
                    stall = None
                    assert pin is not None
                    pin.sent += len(piece)
                    if pin.stalled:
                        buffer.stall(pin, False)
                deadline.reschedule(loop.time() + send_timeout_s)
            else:
                if _ZERO_COPY_SAFE:
                    # 3.11: what the socket did not take the transport copied: the ring
                    # may move on now (the grant below still covers those copies), and
                    # the body is whole: its end goes out now, or the client would wait
                    # for the drain below before it could ask again
                    released = True
                    if not buffer.release(selection):
                        raise _Overrun  # bytes may have been overwritten while written
                    await resp.write_eof()
                transport = request.transport
                if (copies is not None or not _ZERO_COPY_SAFE) and transport is not None:
                    # until everything left the process: the grant covers the transport's
                    # copy (3.11); newer transports keep references to unsent memoryviews,
                    # which must not outlive the pin (a slow reader is stalled meanwhile
                    # as for a piece). Then the limits as they were: the connection's next
                    # answers keep their pipelining
                    limits = _write_limits(transport)
                    unbuffered(transport)
                    if pin is not None and not released:
                        stall = loop.call_later(STALL_S, buffer.stall, pin)
                    await request.writer.drain()
                    if limits is not None:
                        assert isinstance(transport, asyncio.WriteTransport)
                        transport.set_write_buffer_limits(high=limits[1], low=limits[0])
                outcome = "sent"
    except TimeoutError:
        outcome = "timeout"
    except _Overrun:
        outcome = "overrun"
    finally:
        if copies is not None:
            copies.release(charged)
        if stall is not None:
            stall.cancel()
        if not released and not buffer.release(selection) and outcome == "sent":
            outcome = "overrun"  # the bytes may have been overwritten while being sent
    if outcome != "sent":
        _abort(request, outcome, send_timeout_s)
    return outcome


class _Overrun(Exception):
    """The writer overran the pin while its bytes were written (send_selection)."""


class SendWatch:
    """One response's guard against a client that stops reading, for many :meth:`send` calls.

    A follow stream sends a push every few milliseconds. An
    ``asyncio.timeout`` around each send would schedule and cancel two
    timers per push, a fair share of a small push's cost with a thousand
    followers. Instead one timer per response checks every quarter of
    ``send_timeout_s`` whether the piece being sent has waited longer than
    ``send_timeout_s`` (``_since``: when it was handed to the transport;
    None between sends), and aborts the connection if so. A client that
    accepts nothing is thus cut off after ``send_timeout_s`` to 1.25 times
    that, and ``on_abort`` is called (the caller counts it there: the
    lost connection may also cancel the handler's task, which then never
    sees :meth:`send` return). Call :meth:`close` when the response ends.

    Event loop only.
    """

    def __init__(
        self,
        request: web.Request,
        send_timeout_s: float,
        on_abort: Callable[[], None] | None = None,
    ) -> None:
        self._request = request
        self._on_abort = on_abort
        self._timeout = send_timeout_s
        self._loop = asyncio.get_running_loop()
        self._since: float | None = None
        #: the task in :meth:`send` (cancelled when the watch fires)
        self._sender: asyncio.Task[Any] | None = None
        #: the watch aborted the connection: every later send fails
        self.fired = False
        self._handle: asyncio.TimerHandle | None = self._loop.call_later(
            send_timeout_s / 4, self._check
        )

    def _check(self) -> None:
        since = self._since
        if since is not None and self._loop.time() - since >= self._timeout:
            self.fired = True
            self._handle = None
            if self._on_abort is not None:  # counted here: the sender may be cancelled twice
                self._on_abort()
            _abort(self._request, "timeout", self._timeout)
            # the send may wait for a drain that the lost connection never ends
            if self._sender is not None:
                self._sender.cancel()
            return
        self._handle = self._loop.call_later(self._timeout / 4, self._check)

    def close(self) -> None:
        """Stop watching (the response ended)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    async def send(self, resp: web.StreamResponse, body: bytes | memoryview) -> bool:
        """Write ``body`` to ``resp`` and wait until it left the process.

        One chunk per :data:`PIECE_BYTES` (a follow push up to that size is
        one chunk, as docs/protocol.md says). The transport keeps a copy of
        the unsent part of a write: a slow client costs up to twice its body.
        False: the client accepted nothing for ``send_timeout_s`` and the
        connection has been aborted. ``ConnectionResetError``: the client
        went away.
        """
        view = memoryview(body)

        async def write() -> None:
            for start in range(0, len(view), PIECE_BYTES):
                self._since = self._loop.time()
                await resp.write(view[start : start + PIECE_BYTES])
            self._since = self._loop.time()
            await self._request.writer.drain()

        return await self._watched(write)

    async def drain(self) -> bool:
        """Wait until what the transport holds left the process (bytes written elsewhere).

        False and ``ConnectionResetError`` as for :meth:`send`.
        """

        async def drain() -> None:
            self._since = self._loop.time()
            await self._request.writer.drain()

        return await self._watched(drain)

    async def _watched(self, step: Callable[[], Awaitable[None]]) -> bool:
        """Run ``step`` (which sets ``_since`` per piece) under the watch; False if it fired."""
        if self.fired:
            return False
        self._sender = sender = asyncio.current_task()
        try:
            await step()
        except asyncio.CancelledError:
            # ours (the watch fired) unless somebody else cancelled the task too
            if self._aborted() and sender is not None and sender.uncancel() == 0:
                return False
            raise
        except ConnectionResetError:
            if self._aborted():
                return False
            raise
        finally:
            self._since = None
            self._sender = None
        return not self._aborted()

    def _aborted(self) -> bool:
        # (a method: the timer sets ``fired`` while a send is suspended)
        return self.fired


async def send_body(
    request: web.Request,
    resp: web.StreamResponse,
    body: bytes,
    send_timeout_s: float,
    on_abort: Callable[[], None] | None = None,
) -> bool:
    """:meth:`SendWatch.send` for one body (a watch just for it)."""
    watch = SendWatch(request, send_timeout_s, on_abort)
    try:
        return await watch.send(resp, body)
    finally:
        watch.close()


def _abort(request: web.Request, outcome: Outcome, send_timeout_s: float) -> None:
    if outcome == "timeout":
        log.info(
            "aborted a response to %s: the client read nothing for %.1f s",
            request.remote,
            send_timeout_s,
        )
    if request.transport is not None:
        request.transport.abort()


def _write_limits(transport: asyncio.BaseTransport) -> tuple[int, int] | None:
    """The transport's ``(low, high)`` write-buffer limits (None: not a write transport)."""
    if isinstance(transport, asyncio.WriteTransport):
        low, high = transport.get_write_buffer_limits()
        return int(low), int(high)
    return None


#: the write-buffer limit of a TLS transport (bytes encrypted and not yet handed to TCP)
TLS_WRITE_HIGH = 16 << 10


def unbuffered(transport: asyncio.BaseTransport) -> None:
    """Write-buffer limit 0: ``drain()`` then returns once the bytes left the process.

    Over TLS :data:`TLS_WRITE_HIGH` instead: asyncio's TLS transport never
    resumes a writer paused at a zero limit (``drain()`` would hang), and it
    encrypts -- copies -- what is written at once, so no reference to the
    ring outlives the write anyway. Its default limit (512 KiB of encrypted
    bytes, beyond the 64 KiB the TCP transport under it holds, which its
    ``get_write_buffer_size()`` does not count) let a follow stream that
    stopped reading hold about 600 KiB the copy budget never saw, so a few
    hundred such streams held more than the whole budget (review).
    """
    if not isinstance(transport, asyncio.WriteTransport):
        return
    if transport.get_extra_info("ssl_object") is None:
        transport.set_write_buffer_limits(high=0)
    else:
        transport.set_write_buffer_limits(high=TLS_WRITE_HIGH)
