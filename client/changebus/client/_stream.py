"""The low-level relay stream reader: HTTP -> validated raw windows -> an async sink.

:class:`RelayStream` is the one piece of code that reads ``GET /v1/stream``.
The consumer (which decodes into its queue), the bootstrap server's
producer (which appends raw windows to its log), the Spark source and a
relay following another relay all use it; none of them subclasses it::

    stream = RelayStream(StreamConfig(relays=(url,), partition="p"), session, position=scn)
    async def sink(window: RawWindow, relay: str) -> None:
        ...                       # store, decode, forward; may raise
    await stream.run(sink)        # until cancelled or a terminal error

Transfer. In follow mode (``follow``) one held response carries the windows
as the relay commits them; otherwise long-poll requests (``wait_s``). Each
window is validated and assembled (:mod:`._assembler`) before the sink sees
it. A long-poll response cut by ``max_bytes`` inside a window continues on
the same relay from the relay's ``X-Changebus-Next-Scn`` /
``X-Changebus-Next-Offset``; a follow response cut by ``follow_bytes`` is
asked again from the window's start.

Position. :attr:`RelayStream.position` is the SCN of the last window the
sink *returned from* (-1: none yet, which asks for the relay's oldest
window). It is the one position of a reader: the assembler's order
watermark and the mid-window continuation are reset from it whenever a
window restarts, and only :meth:`run` (after the sink), :meth:`seek` and
:meth:`seek_latest` move it. So a window is handed over whole or not at all,
and after a failure of any kind the next request asks for the windows after
:attr:`position`: no window is skipped, and one is handed again only when
the sink failed on it.

Checkpoint. The reader asks with ``scn``/``offset`` and never sends the
relay a ``checkpoint=`` token, so the relay does not answer one
(``X-Changebus-Checkpoint``). A checkpoint is the *application's* record
(bootstrap progress, other partitions, what it finished processing: the
consumer's :class:`~._position.PositionTracker`); the reader's position is
one SCN plus a continuation offset, which the relay's ``X-Changebus-Next-*``
headers give exactly. Keeping the two apart means no second copy of the
position travels through the relay.

Failures (:mod:`._failover`, decided by each exception's ``retriable``):
transport failures, 5xx answers, damaged events, an overrun reader and a
sink that raises a retriable error restart the window and move to the next
relay (backoff after a whole round, ``max_attempts``); a 410 from every
relay raises :class:`~._errors.FellOffRelayError`; a bad request, an
unknown partition or source, and any non-retriable exception of the sink
end :meth:`run` with that exception.

Changing relays. :meth:`RelayStream.set_relays` replaces the list while
:meth:`run` runs (a cluster's routing table changed). The relay in use stays
when it is still listed; otherwise its open response is closed and the next
request goes to the first of the new list, after :attr:`position` as always
(the window in progress is read again whole; none is lost or repeated),
without counting a failed attempt. :attr:`StreamConfig.relays` keeps the
list the stream started with; :attr:`RelayStream.relays` is the current one.

Not thread-safe: one task runs :meth:`run`; the attributes may be read
from the same event loop at any time (monitoring).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import aiohttp

from changebus.schemas import (
    ConfigError,
    PartitionFilter,
    ProtocolError,
    TransportError,
)

from ._assembler import DEFAULT_MAX_WINDOW_BYTES, EventSplitter, RawWindow, WindowAssembler
from ._backoff import Backoff
from ._config import ConsumerConfig
from ._failover import Failover
from ._http import read_body, response_error, safe_url, transport_errors

__all__ = ["RelayStream", "ResponseCheck", "StreamConfig", "StreamSink"]

log = logging.getLogger(__name__)

#: what :meth:`RelayStream.run` hands each window to: ``await sink(window, relay_url)``
StreamSink = Callable[[RawWindow, str], Awaitable[None]]

#: what :class:`RelayStream` calls with ``(relay_url, headers)`` of every 200/204
#: answer before its body is read (e.g. a relay's ``X-Changebus-Epoch`` checked
#: for fencing); an exception it raises fails the request like a transport failure
#: would (retriable: the next relay; else the end of :meth:`RelayStream.run`)
ResponseCheck = Callable[[str, Mapping[str, str]], None]


@dataclass(frozen=True)
class StreamConfig:
    """What a :class:`RelayStream` reads and how (the transfer part of a ``ConsumerConfig``).

    ``relays`` are base URLs serving the same partition, tried in order;
    ``partition`` may be None when the relay has exactly one (the stream
    learns it from the first answer). ``sources`` and ``key_filter`` narrow
    the stream server-side. ``client_id`` names the reader in the relay's
    metrics. Transfer, timeouts and failover as in
    :class:`~changebus.client.ConsumerConfig` (same names, same units).
    """

    relays: tuple[str, ...]
    partition: str | None = None
    sources: tuple[str, ...] = ()
    key_filter: PartitionFilter | None = None
    client_id: str = ""
    follow: bool = True
    wait_s: float = 10.0
    max_bytes: int = 1 << 20
    follow_bytes: int = 64 << 20
    max_window_bytes: int = DEFAULT_MAX_WINDOW_BYTES
    connect_timeout_s: float = 5.0
    read_margin_s: float = 10.0
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 10.0
    backoff_multiplier: float = 2.0
    max_attempts: int = 0

    def __post_init__(self) -> None:
        relays: object = self.relays
        if isinstance(relays, str):
            relays = (relays,)
        if not isinstance(relays, tuple | list) or not relays:
            raise ConfigError("relays: give at least one relay URL")
        if any(not isinstance(u, str) or not u.startswith(("http://", "https://")) for u in relays):
            raise ConfigError("relays: every relay must be an http:// or https:// URL")
        object.__setattr__(self, "relays", tuple(u.rstrip("/") for u in relays))
        object.__setattr__(self, "sources", tuple(self.sources))
        if min(self.max_bytes, self.follow_bytes, self.max_window_bytes) <= 0:
            raise ConfigError("max_bytes, follow_bytes and max_window_bytes must be positive")
        if self.max_attempts < 0:
            raise ConfigError("max_attempts must be >= 0")
        if min(self.wait_s, self.connect_timeout_s, self.read_margin_s) < 0:
            raise ConfigError("wait_s, connect_timeout_s and read_margin_s must not be negative")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s or self.backoff_multiplier < 1:
            raise ConfigError(
                "backoff: need 0 < backoff_initial_s <= backoff_max_s and backoff_multiplier >= 1"
            )

    @classmethod
    def of(cls, config: ConsumerConfig, partition: str | None = None) -> StreamConfig:
        """The stream part of a consumer's configuration."""
        return cls(
            relays=config.relays,
            partition=partition if partition is not None else config.partition,
            sources=config.sources,
            key_filter=config.key_filter,
            client_id=config.client_id,
            follow=config.follow,
            wait_s=config.wait_s,
            max_bytes=config.max_bytes,
            follow_bytes=config.follow_bytes,
            max_window_bytes=config.max_window_bytes,
            connect_timeout_s=config.connect_timeout_s,
            read_margin_s=config.read_margin_s,
            backoff_initial_s=config.backoff_initial_s,
            backoff_max_s=config.backoff_max_s,
            backoff_multiplier=config.backoff_multiplier,
            max_attempts=config.max_attempts,
        )

    @property
    def head_timeout_s(self) -> float:
        """How long a follow request may wait for its answer's head.

        A relay answers a follow request's head at once (only a long-poll
        holds it up to the wait), so a longer silence means a connection into a
        black hole (a half-open peer or proxy): give up long before the body's
        read timeout (``wait_s + read_margin_s``).
        """
        return self.connect_timeout_s + self.read_margin_s / 2

    @property
    def info_timeout(self) -> aiohttp.ClientTimeout:
        """For the requests a relay answers at once (``/v1/status``, sources, schemas)."""
        return aiohttp.ClientTimeout(
            total=None, sock_connect=self.connect_timeout_s, sock_read=self.head_timeout_s
        )

    @property
    def timeout(self) -> aiohttp.ClientTimeout:
        """Per request: connect within ``connect_timeout_s``; silence beyond the wait is a failure."""
        return aiohttp.ClientTimeout(
            total=None,
            sock_connect=self.connect_timeout_s,
            sock_read=self.wait_s + self.read_margin_s,
        )


class _FromSink(Exception):
    """Carries an exception of the sink past :func:`transport_errors` unchanged."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


class RelayStream:
    """Reads one partition's windows from a set of relays into a sink (module docstring).

    ``position``: start after this SCN (-1: the relay's oldest window);
    ``latest``: start with the windows committed from now on instead;
    ``check_response``: a :data:`ResponseCheck` of each answer's headers.
    """

    def __init__(
        self,
        config: StreamConfig,
        session: aiohttp.ClientSession,
        *,
        position: int = -1,
        latest: bool = False,
        check_response: ResponseCheck | None = None,
    ) -> None:
        self.config = config
        self.partition = config.partition
        #: requests sent, windows handed to the sink (and returned from it)
        self.requests = 0
        self.windows = 0
        #: the relay's newest SCN as its last answer said (``X-Changebus-Last-Scn``; -1:
        #: none yet); a follow response says it once, when it starts (progress displays)
        self.head_scn = -1
        #: whether the last request got an answer (200 or 204, headers checked); False
        #: from a failure until the next answer (a daemon's readiness: the bootstrap's)
        self.answering = False
        #: why the last request failed ("" since an answer)
        self.last_error = ""
        self._session = session
        self._position = position
        self._latest = latest
        #: where the newest "from now on" start resolved (an SCN: the stream's windows
        #: are those after it); None while unresolved or when it started by position
        self.resolved_latest: int | None = None
        self._check = check_response
        self._assembler = WindowAssembler(position, config.max_window_bytes)
        self._continue: tuple[int, int] | None = None
        #: the window (SCN) whose continuation a relay refused last (-1: none since it
        #: was read whole): a second refusal of it is a failure (backoff, next relay)
        self._refused_scn = -1
        #: the relay the continuation point came from (its event offsets are its own)
        self._continue_url = ""
        #: follow mode asks by long-poll until the window in hand is whole: a follow
        #: response that ended inside a window (``follow_bytes``) without handing one
        #: over would end there again; long-poll answers say where to continue
        self._whole_window = False
        #: the response being read (closed by :meth:`set_relays` when its relay left)
        self._response: aiohttp.ClientResponse | None = None
        self._moved = False
        self._failover = Failover(
            config.relays,
            Backoff(config.backoff_initial_s, config.backoff_max_s, config.backoff_multiplier),
            max_attempts=config.max_attempts,
        )
        self._timeout = config.timeout
        #: the relays as named in messages (no credentials), worked out once
        self._where = {url: f"relay {safe_url(url)}" for url in config.relays}

    # ---- state ------------------------------------------------------------

    @property
    def position(self) -> int:
        """The SCN of the last window the sink returned from (-1: none)."""
        return self._position

    @property
    def relay(self) -> str:
        """The URL of the relay in use."""
        return self._failover.url

    @property
    def relays(self) -> tuple[str, ...]:
        """The relays in use now (:meth:`set_relays` may have changed them)."""
        return self._failover.urls

    def set_relays(self, relays: tuple[str, ...]) -> None:
        """Read from ``relays`` from now on (module docstring); empty: no change.

        On the event loop of :meth:`run`.
        """
        urls = tuple(u.rstrip("/") for u in relays)
        if any(not u.startswith(("http://", "https://")) for u in urls):
            raise ConfigError("relays: every relay must be an http:// or https:// URL")
        for url in urls:
            if url not in self._where:
                self._where[url] = f"relay {safe_url(url)}"
        old = self._failover.url
        if self._failover.set_urls(urls):
            log.info(
                "relay %s no longer serves; moving to %s", safe_url(old), self._where[self.relay]
            )
            if self._response is not None:
                self._moved = True
                self._response.close()

    @property
    def failovers(self) -> int:
        """How many times the reader moved to another relay."""
        return self._failover.switches

    def seek(self, position: int) -> None:
        """Continue after ``position`` (e.g. a bootstrap's target); not during :meth:`run`.

        The relays' "fell off" answers were about the old position: forgotten
        (else one 410 after a bootstrap would count the others' old ones, and
        bootstrap again without asking them).
        """
        self._position = position
        self._latest = False
        self._whole_window = False  # (about a window before the new position)
        self._restart_window()
        self._failover.succeeded()

    def seek_latest(self) -> None:
        """Continue with the windows committed from now on (skipping the rest).

        The relays' "fell off" answers are forgotten as by :meth:`seek`: kept,
        any failure of the next request raised the old 410 again at once,
        without backoff, attempts or another relay, for ever (found by review).
        """
        self._latest = True
        self.resolved_latest = None  # (resolved again by the next answer)
        self._whole_window = False
        self._restart_window()
        self._failover.succeeded()

    def learn_partition(self, name: str | None) -> None:
        """Adopt ``name`` when no partition is set; refuse a different one."""
        if name is None:
            return
        if self.partition is None:
            self.partition = name
        elif name != self.partition:
            raise ProtocolError(f"asked for partition {self.partition!r}, got {name!r}")

    # ---- the loop -----------------------------------------------------------

    async def run(self, sink: StreamSink) -> None:
        """Hand windows to ``sink`` until cancelled; raise a terminal error.

        The position moves past a window only after ``sink`` returned. A
        retriable exception of the sink restarts that window (like a
        transport failure); any other ends the stream with that exception.
        """
        failover = self._failover
        while True:
            error: Exception
            moved = False
            url = failover.url
            try:
                await self._request(url, sink)
                if self._refused_scn < 0 or self._position >= self._refused_scn:
                    failover.succeeded()  # (not a first part of a window refused before)
                continue
            except _FromSink as wrapped:
                error = wrapped.error  # raised again below as the sink's own, unwrapped
            except Exception as exc:  # noqa: BLE001 - Failover decides, by data
                error = exc
                # set_relays closed the response, or dropped the relay while it connected:
                # not a failure of the new list's relay
                moved = self._moved or url != failover.url
            finally:
                self._response = None
                self._moved = False
            self._restart_window()
            if not moved:
                self.answering = False
                self.last_error = getattr(error, "message", "") or type(error).__name__
                await failover.failed(error)

    def _restart_window(self) -> None:
        self._assembler.reset(self._position)
        self._continue = None

    def _params(self) -> dict[str, str]:
        cfg = self.config
        params: dict[str, str] = {"max_bytes": str(cfg.max_bytes), "wait": f"{cfg.wait_s:g}"}
        if self.partition is not None:
            params["partition"] = self.partition
        if self._continue is not None and self._assembler.in_window:
            params["scn"], params["offset"] = str(self._continue[0]), str(self._continue[1])
        elif self._latest:
            params["from"] = "latest"
        else:
            params["scn"], params["offset"] = str(self._position), "-1"
        if cfg.sources:
            params["sources"] = ",".join(cfg.sources)
        if cfg.key_filter is not None:
            params["filter"] = str(cfg.key_filter)
        if cfg.follow and not self._whole_window:
            params["follow"] = "1"
            params["follow_bytes"] = str(cfg.follow_bytes)
        if cfg.client_id:
            params["client"] = cfg.client_id
        return params

    async def _request(self, url: str, sink: StreamSink) -> None:
        if self._continue is not None and self._continue_url != url:
            # offsets count events of the relay that gave them: the window is read
            # again whole from this one (set_relays moved between two requests)
            self._restart_window()
        params = self._params()
        self.requests += 1
        where = self._where[url]
        follow = "follow" in params
        with transport_errors(where):
            async with (
                asyncio.timeout(self.config.head_timeout_s if follow else None) as head_wait,
                self._session.get(f"{url}/v1/stream", params=params, timeout=self._timeout) as resp,
            ):
                head_wait.reschedule(None)  # (the body: the read timeout alone)
                if self._position >= self._refused_scn:
                    self._refused_scn = -1  # (read past it)
                if resp.status in (400, 410) and params.get("offset", "-1") != "-1":
                    # a place inside a window this relay does not hold (it restarted and
                    # lost the window's unsynced tail, or evicted it): the window is read
                    # again whole, from the last whole one, where only a 410 means the
                    # consumer fell off (it was taken for one: found by review). A 400:
                    # the offset is past the events of the window now at that SCN (one
                    # that replaced it at a restart, a DATA_LOSS): a fatal error before
                    log.info(
                        "partition %s: %s has no longer the window being read (SCN %s); "
                        "reading it again whole",
                        self.partition,
                        where,
                        params["scn"],
                    )
                    self._restart_window()
                    scn = int(params["scn"])
                    if self._refused_scn == scn:
                        # again: relays behind one address that do not all hold it, say.
                        # Returning reset the backoff and read the window's first part
                        # again at once, for as long as it lasted (review)
                        raise ProtocolError(
                            f"{where} refused the continuation of the window at SCN {scn} again",
                            retriable=True,
                        )
                    self._refused_scn = scn
                    return
                if resp.status not in (200, 204):
                    raise await response_error(
                        resp,
                        where,
                        kind="stream",
                        partition=self.partition or "",
                        requested_scn=int(params.get("scn", "-1")),
                    )
                if url != self._failover.url:
                    # set_relays dropped this relay while the request waited for its
                    # headers (no response to close then): nothing of it is read (review)
                    self._restart_window()
                    return
                self._response = resp
                self._moved = False
                self.answering, self.last_error = True, ""
                head = resp.headers.get("X-Changebus-Last-Scn", "")
                if head.isdigit():
                    self.head_scn = int(head)
                if self._check is not None:
                    self._check(url, resp.headers)
                self.learn_partition(resp.headers.get("X-Changebus-Partition"))
                if self._latest and (resp.status == 204 or follow):
                    # the relay's start position: windows after it are "from now on"
                    start = resp.headers.get("X-Changebus-Next-Scn", "")
                    if not start.lstrip("-").isdigit():  # (else -1: the whole buffer)
                        raise ProtocolError(
                            f"{where}: an answer from latest without a valid"
                            " X-Changebus-Next-Scn header",
                            retriable=True,
                        )
                    self.seek(int(start))
                    self.resolved_latest = int(start)
                if resp.status == 204:
                    return
                if self.config.follow and not self._whole_window:
                    await self._read_follow(resp, url, sink)
                else:
                    await self._read_whole(resp, url, sink)
                    # (follow again once the window is whole)
                    self._whole_window = self.config.follow and self._assembler.in_window

    async def _read_follow(self, resp: aiohttp.ClientResponse, url: str, sink: StreamSink) -> None:
        splitter = EventSplitter(self.config.max_window_bytes)
        handed = self.windows
        async for chunk in resp.content.iter_any():
            complete, offsets = splitter.split(chunk)
            if complete:
                for raw in self._assembler.feed(complete, offsets):
                    await self._hand(raw, url, sink)
        if splitter.leftover:
            raise TransportError("the relay's follow response ended inside an event")
        # a push cut inside a window (follow_bytes reached): ask again for it whole,
        # by long-poll if this response could not hand over a single window
        self._whole_window = self._assembler.in_window and self.windows == handed
        self._restart_window()

    async def _read_whole(self, resp: aiohttp.ClientResponse, url: str, sink: StreamSink) -> None:
        # raises when the body ends early (nothing is used) or passes the bound
        body = await read_body(resp, self.config.max_window_bytes, self._where[url])
        windows = self._assembler.feed(body)
        self._check_count(resp, url)
        for raw in windows:
            await self._hand(raw, url, sink)
        if self._assembler.in_window:
            if self._latest:
                # "from now on" starts with this window: after a failure, ask for it
                # again by position (from=latest would then start after it; review)
                self._position, self._latest = self._assembler.pending_scn - 1, False
                self.resolved_latest = self._position
            try:
                self._continue = (
                    int(resp.headers["X-Changebus-Next-Scn"]),
                    int(resp.headers["X-Changebus-Next-Offset"]),
                )
            except (KeyError, ValueError):
                # (a proxy that drops headers): read the window again whole, elsewhere
                raise ProtocolError(
                    f"{self._where[url]}: a window cut by max_bytes came without its"
                    " X-Changebus-Next-Scn / X-Changebus-Next-Offset headers",
                    retriable=True,
                ) from None
            self._continue_url = url
        else:
            self._continue = None

    def _check_count(self, resp: aiohttp.ClientResponse, url: str) -> None:
        """Refuse (retriably, before any of it is used) a body that holds other than the
        events its ``X-Changebus-Events`` header counts -- a proxy that cut it at an
        event boundary: the rest of a window would be skipped at ``Next-Offset`` -- or
        a part of a window without any event (asking for the same part would never
        end). Found by review."""
        said = resp.headers.get("X-Changebus-Events", "")
        got = self._assembler.fed_events
        if said.isdigit() and int(said) != got:
            raise ProtocolError(
                f"{self._where[url]}: the answer holds {got} events, its header says {said}"
                " (cut on the way?)",
                retriable=True,
            )
        if got == 0 and resp.headers.get("X-Changebus-Partial") == "1":
            raise ProtocolError(
                f"{self._where[url]}: a part of a window without events", retriable=True
            )

    async def _hand(self, raw: RawWindow, url: str, sink: StreamSink) -> None:
        try:
            await sink(raw, url)
        except Exception as exc:
            raise _FromSink(exc) from exc
        if self._latest:  # (the first window from now on, no start given before it)
            self.resolved_latest = raw.scn - 1
        self._position = raw.scn
        self._latest = False
        self.windows += 1
        self._failover.succeeded()  # progress: failures are counted afresh
