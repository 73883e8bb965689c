"""Connection limits of the server frame: keep-alive, header timeout, connection caps.

aiohttp serves each connection with a ``RequestHandler`` protocol; on its
own it keeps an idle connection for 3,630 s, never limits how long a
client may take to send a request head (a "slowloris" client sends it a
byte at a time, or nothing), accepts any number of connections and lets a
handler run on after its client went away. :class:`ConnectionLimits`
bounds all of that, and the pieces below apply it:

* :func:`runner_options` -- the ``web.AppRunner`` arguments: aiohttp's
  ``keepalive_timeout`` (an idle connection, or one that has begun its next
  request head but not finished it, is closed that long after its last
  response, or after it opened) and ``handler_cancellation`` (a client that
  disconnects cancels its handler: a long-poll or a follow stream stops at
  once instead of running to its end).
* :class:`LimitedSite` -- the listening socket (a ``web.BaseSite`` like
  ``TCPSite``) whose protocol factory is a :class:`_Gate`. Its accept
  backlog follows ``max_connections`` (at least aiohttp's 128, at most
  :data:`MAX_BACKLOG`; the kernel caps it at ``net.core.somaxconn``): with
  aiohttp's 128, a thousand consumers connecting at once (a relay's restart,
  a failover) overflow the queue, and the dropped ones wait for TCP's SYN
  retransmissions, 1, 3, 7 s and more, before they are even seen. Each accepted
  connection gets a :class:`_Connection`, a thin protocol in front of
  aiohttp's ``RequestHandler`` that

  - counts the open connections (all, and per client IP under a per-IP
    cap: by default half of ``max_connections`` for any address but
    loopback, so no one client can hold every slot). Beyond a cap the connection is
    *refused*: no ``RequestHandler`` is made; once the request head has
    arrived (or after at most a second) it is answered ``503`` with a JSON
    body (``{"error": "overloaded", ...}``), ``Retry-After`` and
    ``Connection: close``, and closed. Connections already open are not
    touched. Too many refusals pending at once are aborted outright
    (a refusal must not hold resources itself).
  - runs a *header watchdog*: a new connection must deliver its first
    request head (up to the empty line) within ``header_timeout_s``, else it
    is answered ``408`` (when it sent anything) and closed. The watchdog
    looks only at the bytes before the first head's end (a search for the
    empty line, once per connection); after that every byte goes straight
    through. Later requests on a kept-alive connection are bounded by the
    keep-alive timeout (see above). With TLS the handshake is bounded by the
    same ``header_timeout_s`` (``ssl_handshake_timeout``); a TLS connection is
    counted (and refused, by closing it: no answer can be sent before a
    handshake) when it is accepted, before its handshake, so connections
    that never finish one cannot pile up uncounted. Blank lines
    before the request line do not count as its end.
  - runs a *write watchdog*: a connection whose socket buffer stays full
    (the client reads nothing) for ``write_timeout_s`` is dropped. aiohttp
    itself waits for a full buffer to drain without a limit, so a client
    pipelining requests (even unauthenticated ones, each a 401) and never
    reading held its connection, and what was written for it, forever. The
    watchdog arms past the transport's high-water mark; below it, the
    kernel ends a connection whose client window stays shut for
    ``write_timeout_s`` + 10 s (``TCP_USER_TIMEOUT``).

* :class:`~._server_stats.ConnectionStats` -- the Prometheus collector of the above
  (its own module).
* :func:`client_gone` -- whether a request's client has disconnected: the
  error middleware then counts the request as ``499`` (client closed) and
  logs nothing, instead of a ``500`` with a traceback.

Thread-safety: everything here runs on the server's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import socket
import sys
import termios
import time
from collections import Counter
from typing import Any, Final

from aiohttp import web

from ._conn_limits import ConnectionLimits, client_of
from ._server_stats import CONNECTION_STATS, ConnectionStats

__all__ = [
    "CONNECTION_STATS",
    "MAX_BACKLOG",
    "MAX_HEADERS",
    "ConnectionLimits",
    "ConnectionStats",
    "LimitedSite",
    "client_gone",
    "listen_backlog",
    "runner_options",
]

#: status counted for a request whose client went away before its answer
CLIENT_CLOSED: Final = 499
#: how long a refused connection may take to send its request head
_REFUSE_WAIT_S: Final = 1.0
#: header fields a request head may have (more: 400)
MAX_HEADERS: Final = 32
#: bytes read from a refused connection before it is answered anyway
_REFUSE_READ_BYTES: Final = 16 * 1024
#: refusals pending at once (beyond: aborted at once, no answer)
_MAX_PENDING_REFUSALS: Final = 256
#: at most one warning about refused connections per this many seconds
_WARN_EVERY_S: Final = 60.0


def runner_options(limits: ConnectionLimits) -> dict[str, Any]:
    """The ``web.AppRunner`` keyword arguments that apply ``limits`` (module docstring).

    A request head has at most :data:`MAX_HEADERS` fields (aiohttp's default is
    128 of 8,190 bytes each: 1 MB a head, and a connection may queue pipelined
    requests behind a long-poll; no changebus client sends more than a dozen).
    """
    return {
        "keepalive_timeout": limits.keepalive_timeout_s,
        "handler_cancellation": True,
        "max_headers": MAX_HEADERS,
    }


def _bound_unacked(transport: asyncio.Transport, seconds: float) -> None:
    """The kernel ends the connection when what was sent stays unacknowledged, or the
    client's window stays shut, for ``seconds`` (``TCP_USER_TIMEOUT``).

    The write watchdog arms only when the transport's buffer passes its high-water
    mark (64 KiB): an answer whose last bytes stayed below it, to a client that never
    reads, was left to ``close()``, which waits for them to drain; the connection, and
    its slot of the caps, stayed for as long as the client kept its socket open
    (found by review). Not TCP (a Unix socket): nothing to do.
    """
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(int(seconds * 1000), 1))


def client_gone(request: web.BaseRequest) -> bool:
    """True when the request's connection is closed or closing (the client went away)."""
    transport = request.transport
    return transport is None or transport.is_closing()


def _answer(status: int, reason: str, error: str, message: str, retry_after: int = 0) -> bytes:
    """A complete HTTP/1.1 answer that closes the connection, with a JSON error body."""
    body = json.dumps({"error": error, "message": message, "retriable": status != 408}).encode()
    head = [
        f"HTTP/1.1 {status} {reason}",
        "Content-Type: application/json; charset=utf-8",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    if retry_after:
        head.append(f"Retry-After: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


_OVERLOADED: Final = _answer(
    503,
    "Service Unavailable",
    "overloaded",
    "too many open connections; retry later",
    retry_after=1,
)
_HEADER_TIMEOUT: Final = _answer(
    408, "Request Timeout", "timeout", "the request head did not arrive in time"
)


def _head_ends(data: bytes) -> bool:
    """True when ``data`` holds the empty line that ends a request head (CRLF or bare LF)."""
    return b"\n\r\n" in data or b"\n\n" in data


class _Gate:
    """The protocol factory of a :class:`LimitedSite`: one :class:`_Connection` per accept.

    Keeps the counts the caps need: ``open`` (mirrored into the stats),
    ``per_ip`` (only addresses under a per-IP cap) and the refusals pending.
    """

    def __init__(
        self,
        server: web.Server,
        limits: ConnectionLimits,
        stats: ConnectionStats,
        log: logging.Logger,
        ssl_context: Any = None,
    ) -> None:
        self.server = server
        #: TLS: each admitted connection is upgraded after it is counted
        self.ssl_context = ssl_context
        self.limits = limits
        self.stats = stats
        self.log = log
        self.loop = asyncio.get_running_loop()
        self.per_ip: Counter[str] = Counter()
        self.refusing: set[_Connection] = set()
        #: TLS: connections admitted whose handshake has not ended
        self.handshaking: set[_Connection] = set()
        self._warned_at = -float("inf")
        self._unreported = 0

    def __call__(self) -> _Connection:
        return _Connection(self)

    def admit(self, ip: str) -> str | None:
        """Count a new connection from ``ip`` in, or say which cap refuses it."""
        limits = self.limits
        if self.stats.open >= limits.max_connections:
            return "max_connections"
        cap = limits.cap_for(ip)
        if cap:
            client = client_of(ip)
            if self.per_ip[client] >= cap:
                return "max_connections_per_ip"
            self.per_ip[client] += 1
        self.stats.open += 1
        return None

    def release(self, ip: str) -> None:
        """Count an admitted connection out."""
        self.stats.open -= 1
        if self.limits.cap_for(ip):  # (the same answer as at admission)
            client = client_of(ip)
            left = self.per_ip[client] - 1
            if left > 0:
                self.per_ip[client] = left
            else:
                del self.per_ip[client]

    def refused(self, reason: str) -> None:
        """Count a refusal; warn at most once a minute (a flood must not flood the log)."""
        self.stats.refused[reason] += 1
        self._unreported += 1
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            self.log.warning(
                "refusing connections (answered 503): %s reached (max_connections=%d, "
                "max_connections_per_ip=%d); %d refused since the last such warning",
                reason,
                self.limits.max_connections,
                self.limits.max_connections_per_ip,
                self._unreported,
            )
            self._warned_at = now
            self._unreported = 0

    def close_refusals(self) -> None:
        """Abort the refusals and TLS handshakes still pending (the server stops)."""
        for conn in [*self.refusing, *self.handshaking]:
            conn.abort()
            conn.cancel_handshake()


class _Connection(asyncio.Protocol):
    """One accepted connection: admitted (aiohttp's handler behind it) or refused.

    Admitted: every protocol call is passed to ``inner`` (the
    ``RequestHandler``), the header watchdog (``timer``) runs until the
    first request head has arrived, and the write watchdog (``stall``) while
    the transport's buffer is full (between ``pause_writing`` and
    ``resume_writing``): aiohttp waits for the buffer to drain with no
    limit, so a client that sends requests and never reads would otherwise
    hold the connection, and the answers buffered for it, forever. Refused: ``inner`` stays None; the
    connection reads the request head (``timer`` bounds the wait), answers
    503 and closes.
    """

    __slots__ = (
        "_early",
        "_gate",
        "_handshake",
        "_inner",
        "_ip",
        "_received",
        "_stall",
        "_stall_size",
        "_tail",
        "_timer",
        "_transport",
    )

    def __init__(self, gate: _Gate) -> None:
        self._gate = gate
        self._inner: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None
        self._stall_size = 0  # the unsent bytes when the write watchdog was armed
        self._ip = ""
        self._tail = b""  # the last bytes of an unfinished head (the empty line may straddle)
        self._received = 0
        #: TLS: the handshake in progress (None: none, or done)
        self._handshake: asyncio.Future[None] | None = None
        #: TLS: what arrived between the handshake's end and ``_admitted`` (None: nothing)
        self._early: list[bytes | None] | None = None

    # ---- asyncio.Protocol ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        gate = self._gate
        self._transport = transport
        # (10 s more than the watchdog's: where it can see a stall, it drops and counts
        # it first; the kernel's clock starts as the window shuts, which may be long
        # before the transport's buffer passes its mark and arms the watchdog)
        _bound_unacked(transport, gate.limits.write_timeout_s + 10.0)
        peer = transport.get_extra_info("peername")
        self._ip = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        reason = gate.admit(self._ip)
        if reason is not None:
            if gate.ssl_context is not None:
                gate.refused(reason)  # (no answer before a handshake: just closed)
                transport.abort()
                return
            self._refuse(reason)
            return
        if gate.ssl_context is not None:
            self._early = []
            transport.pause_reading()  # (the ClientHello is for start_tls, which resumes)
            self._handshake = asyncio.ensure_future(self._upgrade(transport))
            gate.handshaking.add(self)
            return
        self._admitted(transport)

    async def _upgrade(self, raw: asyncio.Transport) -> None:
        """TLS on the counted connection; closed (and counted out) when it fails."""
        gate = self._gate
        try:
            tls = await gate.loop.start_tls(
                raw,
                self,
                gate.ssl_context,
                server_side=True,
                ssl_handshake_timeout=gate.limits.header_timeout_s,
            )
        except Exception as exc:  # noqa: BLE001 - any failed handshake: the client's
            gate.log.debug("TLS handshake from %s failed: %s", self._ip, exc)
            self._count_out_early()  # (no connection_lost comes for a handshake)
            return
        finally:
            self._handshake = None
            gate.handshaking.discard(self)
        if tls is None or self._transport is None:  # (lost meanwhile, or aborted at stop)
            self._count_out_early()
            return
        self._transport = tls
        self._admitted(tls)

    def _admitted(self, transport: asyncio.Transport) -> None:
        gate = self._gate
        self._timer = gate.loop.call_later(gate.limits.header_timeout_s, self._header_timeout)
        self._inner = inner = gate.server()
        inner.connection_made(transport)
        early, self._early = self._early, None
        for data in early or ():
            if data is None:
                if not self.eof_received():
                    transport.close()
            else:
                self.data_received(data)

    def data_received(self, data: bytes) -> None:
        inner = self._inner
        if self._early is not None:
            self._early.append(data)  # (TLS: handed on once admitted, a moment later)
        elif inner is None:
            self._refusal_data(data)
        else:
            if self._timer is not None:
                self._watch_head(data)
            inner.data_received(data)

    def eof_received(self) -> bool | None:
        inner = self._inner
        if self._early is not None:
            self._early.append(None)
            return None  # (TLS: a half-close cannot be kept open)
        if inner is None:
            self._answer_refusal()
            return None
        return inner.eof_received()

    def pause_writing(self) -> None:
        if self._inner is not None:
            if self._stall is None:
                self._arm_stall()
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        for timer in (self._timer, self._stall):
            if timer is not None:
                timer.cancel()
        self._timer = self._stall = None
        inner, self._inner = self._inner, None
        if self._count_out_early():  # (TLS: lost before it was handed to aiohttp)
            return
        if inner is None:
            self._gate.refusing.discard(self)
            return
        self._gate.release(self._ip)
        inner.connection_lost(exc)

    # ---- admitted: the header watchdog ------------------------------------------

    def _watch_head(self, data: bytes) -> None:
        if not self._received:
            data = data.lstrip(b"\r\n")  # blank lines before the request line end no head
            if not data:
                return
        seen = self._tail + data if self._tail else data
        if _head_ends(seen):
            assert self._timer is not None
            self._timer.cancel()
            self._timer = None
            self._tail = b""
        else:
            self._tail = seen[-2:]
            self._received += len(data)

    def _header_timeout(self) -> None:
        self._timer = None
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        self._gate.stats.header_timeouts += 1
        self._gate.log.debug("closing a connection from %s: no request head in time", self._ip)
        if self._received:
            transport.write(_HEADER_TIMEOUT)
        transport.close()

    def _arm_stall(self) -> None:  # (see also _bound_unacked, for what stays below it)
        gate = self._gate
        self._stall_size = self._unsent()
        self._stall = gate.loop.call_later(gate.limits.write_timeout_s, self._stalled)

    def _unsent(self) -> int:
        """Bytes written and not yet taken by the client: the transport's buffer and the
        kernel's send queue (which moves in big steps: a slow reader shows there first)."""
        transport = self._transport
        if transport is None:
            return 0
        size = transport.get_write_buffer_size()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError, ValueError):
                out = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
                size += int.from_bytes(out, sys.byteorder, signed=True)
        return size

    def _stalled(self) -> None:
        self._stall = None
        transport = self._transport
        if transport is None:
            return
        if self._unsent() < self._stall_size:
            self._arm_stall()  # slow, but it reads: watched again
            return
        self._gate.stats.write_timeouts += 1
        self._gate.log.debug("dropping a connection from %s: it read nothing in time", self._ip)
        transport.abort()  # (its buffer cannot drain: close() would wait on it)

    # ---- refused -------------------------------------------------------------

    def _refuse(self, reason: str) -> None:
        gate = self._gate
        gate.refused(reason)
        if len(gate.refusing) >= _MAX_PENDING_REFUSALS:
            self.abort()
            return
        gate.refusing.add(self)
        self._timer = gate.loop.call_later(_REFUSE_WAIT_S, self._answer_refusal)

    def _refusal_data(self, data: bytes) -> None:
        if self._transport is None:
            return
        seen = self._tail + data if self._tail else data
        self._received += len(data)
        if _head_ends(seen) or self._received >= _REFUSE_READ_BYTES:
            self._answer_refusal()
        else:
            self._tail = seen[-2:]

    def _answer_refusal(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        transport.write(_OVERLOADED)
        transport.close()

    def abort(self) -> None:
        """Drop the connection at once (no answer)."""
        if self._transport is not None:
            self._transport.abort()

    def cancel_handshake(self) -> None:
        """Stop a TLS handshake in progress (the server stops); counted out."""
        handshake = self._handshake
        if handshake is not None and not handshake.done():
            handshake.cancel()
            self._count_out_early()

    def _count_out_early(self) -> bool:
        """A TLS connection counted in and not handed to aiohttp yet: count it out, once
        (whichever of a failed handshake, a stop or connection_lost comes first)."""
        if self._early is None:
            return False
        self._early, self._transport = None, None
        self._gate.release(self._ip)
        return True


#: the largest accept backlog a :class:`LimitedSite` asks for
MAX_BACKLOG = 4096


def listen_backlog(limits: ConnectionLimits) -> int:
    """The accept backlog for ``limits``: ``max_connections`` within [128, MAX_BACKLOG]."""
    return max(128, min(limits.max_connections, MAX_BACKLOG))


class LimitedSite(web.BaseSite):
    """A TCP listening socket whose connections obey :class:`ConnectionLimits`.

    Like ``web.TCPSite(runner, host, port, ssl_context=..., reuse_address=True)``
    (module docstring); ``port`` 0 picks a free port. ``stats`` default to the
    app's :data:`CONNECTION_STATS` (a private instance when the app has none).
    """

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        *,
        limits: ConnectionLimits,
        log: logging.Logger,
        ssl_context: Any = None,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=listen_backlog(limits))
        self._host = host
        self._port = port
        self._limits = limits
        self._log = log
        self._gate: _Gate | None = None

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context is not None else "http"
        return f"{scheme}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        runner = self._runner
        assert isinstance(runner, web.AppRunner)
        assert runner.server is not None
        stats = runner.app.get(CONNECTION_STATS) or ConnectionStats("http")
        self._gate = gate = _Gate(
            runner.server, self._limits, stats, self._log, ssl_context=self._ssl_context
        )
        self._server = await gate.loop.create_server(
            gate,  # (TLS too: counted when accepted, then upgraded by the connection)
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=True,
        )

    async def stop(self) -> None:
        await super().stop()
        if self._gate is not None:
            self._gate.close_refusals()
