"""A TCP fault proxy for the chaos harness: 127.0.0.1:<port> -> a target, faults switched at run time.

:class:`FaultProxy` listens on loopback and forwards every accepted connection to
``target_host:target_port``. The harness points one side of a link (consumer -> relay,
relay -> database, bootstrap -> relay) at the proxy and switches faults while the
system runs. One fault *mode* is active at a time; each call replaces the previous one:

``heal()``        pass-through (the initial mode).
``drop()``        reset (RST) every open connection now; new connections pass.
``refuse()``      new connections are reset as soon as they are accepted; open ones too.
``delay(s)``      every chunk, both directions, is held ``s`` seconds after it arrived (a
                  pipeline: latency, not a throughput cap); order is kept.
``throttle(bps)`` each direction of each connection carries at most ``bps`` bytes per second.
``half_open()``   open and new connections forward nothing any more, in either direction;
                  the sockets stay open (a peer that never answers). Data that arrives is
                  discarded. Such a connection stays *stuck* for good (its bytes are lost, so
                  it could never resume correctly): even after ``heal()`` until one of its
                  peers gives up and closes, then the proxy closes the other side too.
``truncate(n)``   each connection's server -> client stream is cut after ``n`` more bytes:
                  the first ``n`` are delivered, then the client side is closed (FIN) and the
                  server side reset. New connections get the same budget.

Data structures: one :class:`_Link` per proxied connection holds the two transports and
one :class:`_Pipe` per direction. A pipe forwards a chunk straight to the other
transport when nothing is pending and no delay/throttle applies (the fast path: no copy,
no per-byte work; ``data_received`` chunks are up to 256 KiB); otherwise the chunk joins a
deque of ``(due_time, bytes)`` that a loop timer drains in order, honouring delay and
throttle. Back-pressure: a source side stops reading while its pipe holds more than
``_HIGH`` bytes or the destination transport's buffer is full (``pause_writing``), and
resumes below ``_LOW`` (so under ``delay(s)`` a direction carries at most about
``_HIGH / s`` bytes per second: 4 MiB in flight).

Thread-safety: everything runs on the event loop that called :meth:`FaultProxy.start`;
the fault switches must be called on that loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import struct
from typing import Literal

__all__ = ["FaultProxy"]

log = logging.getLogger("changebus.bench.chaos.proxy")

Mode = Literal["pass", "refuse", "delay", "throttle", "half_open", "truncate"]

#: a pipe pauses its source above this many pending bytes and resumes below _LOW
_HIGH = 4 * 1024 * 1024
_LOW = 1024 * 1024
#: a throttled pipe may send this many seconds' worth of bytes at once
_BURST_S = 0.05
_CONNECT_TIMEOUT_S = 10.0


def _reset(transport: asyncio.BaseTransport | None) -> None:
    """Close ``transport`` with an RST (SO_LINGER 0) instead of a FIN."""
    if transport is None or transport.is_closing():
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()  # type: ignore[attr-defined]


class _Side(asyncio.Protocol):
    """The protocol of one socket of a link (``down`` = the client's, ``up`` = the target's)."""

    def __init__(self, link: _Link, is_client: bool) -> None:
        self.link = link
        self.is_client = is_client
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.is_client:
            self.link.client_connected(transport)
        else:
            self.link.server = transport

    def data_received(self, data: bytes) -> None:
        pipe = self.link.up if self.is_client else self.link.down
        pipe.feed(data)

    def eof_received(self) -> bool:
        pipe = self.link.up if self.is_client else self.link.down
        pipe.feed_eof()
        return True  # keep the other direction open (half-close)

    def connection_lost(self, exc: Exception | None) -> None:
        self.link.side_lost(self.is_client, exc)

    def pause_writing(self) -> None:
        # our transport's buffer is full: stop the pipe that writes into it reading
        (self.link.down if self.is_client else self.link.up).dest_full(True)

    def resume_writing(self) -> None:
        (self.link.down if self.is_client else self.link.up).dest_full(False)


class _Pipe:
    """One direction of a link: reads from ``src`` and writes to ``dst`` (see module doc)."""

    def __init__(self, link: _Link, upward: bool) -> None:
        self.link = link
        self.upward = upward
        self.pending: collections.deque[tuple[float, bytes]] = collections.deque()
        self.pending_bytes = 0
        self.timer: asyncio.TimerHandle | None = None
        self.tokens = 0.0
        self.tokens_at = 0.0
        self.eof = False  # the source sent EOF: pass it on once pending is written
        self.eof_sent = False
        self.budget: int | None = None  # truncate: bytes still allowed (downward only)
        self.full = False  # destination buffer full
        self.paused = False  # source reading paused by us

    @property
    def src(self) -> asyncio.Transport | None:
        return self.link.client if self.upward else self.link.server

    @property
    def dst(self) -> asyncio.Transport | None:
        return self.link.server if self.upward else self.link.client

    def feed(self, data: bytes) -> None:
        link = self.link
        if link.stuck:
            return  # a peer that never answers: the bytes vanish
        proxy = link.proxy
        dst = self.dst
        if (
            not self.pending
            and dst is not None
            and proxy.mode == "pass"
            and self.budget is None
            and not dst.is_closing()
        ):
            dst.write(data)  # fast path
            proxy.count(self.upward, len(data))
            return
        delay = proxy.delay_s if proxy.mode == "delay" else 0.0
        self.pending.append((link.loop.time() + delay, data))
        self.pending_bytes += len(data)
        self.pump()

    def feed_eof(self) -> None:
        self.eof = True
        if self.link.stuck:
            self.link.give_up()
            return
        self.pump()

    def dest_full(self, full: bool) -> None:
        self.full = full
        self._flow()
        if not full:
            self.pump()

    def _flow(self) -> None:
        if self.link.stuck:
            return  # a stuck link keeps reading (and discarding)
        want = self.full or self.pending_bytes > _HIGH
        if not want and self.paused and self.pending_bytes > _LOW:
            want = True  # hysteresis
        src = self.src
        if src is None or src.is_closing():
            return
        if want and not self.paused:
            self.paused = True
            src.pause_reading()
        elif not want and self.paused:
            self.paused = False
            src.resume_reading()

    def clear(self) -> None:
        """Forget pending bytes and cancel the timer (the link is stuck or closing)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.pending.clear()
        self.pending_bytes = 0

    def pump(self) -> None:
        """Write what is due (delay), as far as the throttle allows; re-arm the timer."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        link = self.link
        dst = self.dst
        if dst is None or link.stuck or link.closed:
            return
        proxy = link.proxy
        loop = link.loop
        now = loop.time()
        rate = proxy.rate if proxy.mode == "throttle" else 0
        while self.pending:
            due, data = self.pending[0]
            if due > now:
                self.timer = loop.call_at(due, self.pump)
                break
            n = len(data)
            if rate:
                burst = max(rate * _BURST_S, 1.0)
                self.tokens = min(burst, self.tokens + (now - self.tokens_at) * rate)
                self.tokens_at = now
                # send in quanta of a quarter burst, not a few bytes per timer
                quantum = min(float(n), max(1.0, burst / 4))
                if self.tokens < quantum:
                    self.timer = loop.call_at(now + (quantum - self.tokens) / rate, self.pump)
                    break
                n = min(n, int(self.tokens))
                self.tokens -= n
            if self.budget is not None and n >= self.budget:
                n = self.budget
                self.budget = 0
                if n:
                    dst.write(data[:n])
                    proxy.count(self.upward, n)
                link.truncate_now()
                return
            if self.budget is not None:
                self.budget -= n
            if n == len(data):
                self.pending.popleft()
                dst.write(data)
            else:
                self.pending[0] = (due, data[n:])
                dst.write(data[:n])
            self.pending_bytes -= n
            proxy.count(self.upward, n)
        else:
            if self.eof and not self.eof_sent:
                self.eof_sent = True
                link.pass_eof(self.upward)
                return
        self._flow()


class _Link:
    """One proxied connection: the client's transport, the target's, and two pipes."""

    def __init__(self, proxy: FaultProxy) -> None:
        self.proxy = proxy
        self.loop = asyncio.get_running_loop()
        self.client: asyncio.Transport | None = None
        self.server: asyncio.Transport | None = None
        self.up = _Pipe(self, upward=True)
        self.down = _Pipe(self, upward=False)
        self.stuck = False
        self.closed = False
        self.connecting: asyncio.Task[None] | None = None
        self.eofs = 0

    def client_connected(self, transport: asyncio.Transport) -> None:
        proxy = self.proxy
        self.client = transport
        proxy.links.add(self)
        proxy.stats["connections"] += 1
        mode = proxy.mode
        if mode == "refuse":
            proxy.stats["resets"] += 1
            self.reset()
            return
        if mode == "half_open":
            self.make_stuck()
            return
        if mode == "truncate":
            self.down.budget = proxy.truncate_after
        transport.pause_reading()  # until the target answers; data waits in the kernel
        self.connecting = self.loop.create_task(self._connect())

    async def _connect(self) -> None:
        proxy = self.proxy
        try:
            async with asyncio.timeout(_CONNECT_TIMEOUT_S):
                transport, _ = await self.loop.create_connection(
                    lambda: _Side(self, is_client=False), proxy.target_host, proxy.target_port
                )
        except (OSError, TimeoutError) as exc:
            log.debug("proxy %s: target unreachable: %s", proxy.name, exc)
            self.connecting = None
            self.reset()
            return
        self.connecting = None
        if self.closed:
            _reset(transport)
            return
        client = self.client
        if client is not None and not client.is_closing():
            client.resume_reading()
        self.up.pump()

    def make_stuck(self) -> None:
        if self.stuck or self.closed:
            return
        self.stuck = True
        self.proxy.stats["stuck"] += 1
        self.up.clear()
        self.down.clear()
        # keep reading (and discarding) so a peer that gives up is noticed
        self.up.paused = self.down.paused = False
        for t in (self.client, self.server):
            if t is not None and not t.is_closing():
                t.resume_reading()

    def give_up(self) -> None:
        """A peer of a stuck link closed: close the other side too."""
        self.close(graceful=True)

    def pass_eof(self, upward: bool) -> None:
        dst = self.server if upward else self.client
        if dst is None or dst.is_closing():
            return
        if dst.can_write_eof():
            dst.write_eof()
        self.eofs += 1
        if self.eofs >= 2:
            self.close(graceful=True)

    def truncate_now(self) -> None:
        self.proxy.stats["truncated"] += 1
        client, server = self.client, self.server
        self.closed = True
        self.up.clear()
        self.down.clear()
        if client is not None:
            client.close()  # FIN after what was written
        _reset(server)
        self._forget()

    def side_lost(self, is_client: bool, exc: Exception | None) -> None:
        if self.closed:
            self._forget()
            return
        if self.stuck:
            self.give_up()
            return
        # an error (RST) is passed on as a reset; a close as a close
        self.close(graceful=exc is None)

    def reset(self) -> None:
        self.closed = True
        self.up.clear()
        self.down.clear()
        if self.connecting is not None:
            self.connecting.cancel()
        _reset(self.client)
        _reset(self.server)
        self._forget()

    def close(self, *, graceful: bool) -> None:
        if not graceful:
            self.reset()
            return
        self.closed = True
        self.up.clear()
        self.down.clear()
        if self.connecting is not None:
            self.connecting.cancel()
        for t in (self.client, self.server):
            if t is not None and not t.is_closing():
                t.close()
        self._forget()

    def _forget(self) -> None:
        self.proxy.links.discard(self)


class FaultProxy:
    """TCP proxy 127.0.0.1:<port> -> target; faults switched at run time (see the module doc).

    ``stats`` counts, since start: ``connections`` accepted, ``bytes_up`` (client -> target)
    and ``bytes_down`` (target -> client) forwarded, ``resets`` (connections reset by
    drop/refuse), ``stuck`` (connections made half-open), ``truncated`` (connections cut);
    ``open`` is the number of connections open now.
    """

    def __init__(self, name: str, target_host: str, target_port: int, *, port: int = 0) -> None:
        self.name = name
        self.target_host = target_host
        self.target_port = target_port
        self.port = port
        self.mode: Mode = "pass"
        self.delay_s = 0.0
        self.rate = 0
        self.truncate_after = 0
        self.links: set[_Link] = set()
        self._stats = dict.fromkeys(
            ("connections", "bytes_up", "bytes_down", "resets", "stuck", "truncated"), 0
        )
        self._server: asyncio.Server | None = None

    @property
    def stats(self) -> dict[str, int]:
        """The counters (a live dict; ``open`` is computed on access)."""
        self._stats["open"] = len(self.links)
        return self._stats

    def count(self, upward: bool, n: int) -> None:
        self._stats["bytes_up" if upward else "bytes_down"] += n

    async def start(self) -> None:
        """Listen on 127.0.0.1 (``port``; 0 picks a free one, then ``port`` is set)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Side(_Link(self), is_client=True),
            "127.0.0.1",
            self.port,
            reuse_address=True,
            backlog=512,
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        log.debug(
            "proxy %s: 127.0.0.1:%d -> %s:%d",
            self.name,
            self.port,
            self.target_host,
            self.target_port,
        )

    async def close(self) -> None:
        """Stop listening and reset every connection. Idempotent."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for link in list(self.links):
            link.reset()

    def address(self) -> tuple[str, int]:
        """``("127.0.0.1", port)`` (valid after :meth:`start`)."""
        return ("127.0.0.1", self.port)

    # -- faults ----------------------------------------------------------------------

    def _set(self, mode: Mode) -> None:
        log.info("proxy %s: %s", self.name, mode)
        old = self.mode
        self.mode = mode
        if mode != "truncate":
            for link in self.links:
                link.down.budget = None
        if old in ("delay", "throttle") or mode in ("delay", "throttle"):
            now = asyncio.get_running_loop().time()
            for link in self.links:
                for pipe in (link.up, link.down):
                    pipe.tokens, pipe.tokens_at = 0.0, now
                    pipe.pump()

    def heal(self) -> None:
        """Pass-through for new and open connections; stuck ones stay stuck."""
        self._set("pass")

    def drop(self) -> None:
        """Reset (RST) every open connection now; new connections pass."""
        self._set("pass")
        for link in list(self.links):
            self._stats["resets"] += 1
            link.reset()

    def refuse(self) -> None:
        """Reset every open connection, and every new one as soon as it is accepted."""
        self._set("refuse")
        for link in list(self.links):
            self._stats["resets"] += 1
            link.reset()

    def delay(self, seconds: float) -> None:
        """Hold every chunk that arrives from now on ``seconds`` before forwarding it."""
        self.delay_s = max(0.0, float(seconds))
        self._set("delay")

    def throttle(self, bytes_per_s: int) -> None:
        """Limit each direction of each connection to ``bytes_per_s``."""
        if bytes_per_s <= 0:
            raise ValueError("bytes_per_s must be positive")
        self.rate = int(bytes_per_s)
        self._set("throttle")

    def half_open(self) -> None:
        """Open and new connections forward nothing any more; their sockets stay open."""
        self._set("half_open")
        for link in list(self.links):
            link.make_stuck()

    def truncate(self, after_bytes: int) -> None:
        """Cut each connection's server -> client stream after ``after_bytes`` more bytes."""
        self.truncate_after = max(0, int(after_bytes))
        self._set("truncate")
        for link in list(self.links):
            link.down.budget = self.truncate_after
            link.down.pump()
