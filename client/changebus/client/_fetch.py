"""The fetcher task: pulls windows from the relays into the consumer's queue.

One :class:`RelayFetcher` per consumer runs as an asyncio task. It asks
``GET /v1/stream`` of the current relay for the windows after its position
-- in follow mode one held response the relay keeps pushing into, otherwise
long-poll requests -- validates and assembles them (:mod:`._assembler`),
decodes them (:mod:`._decode`) and puts them into the bounded
:class:`~._queue.WindowQueue`, waiting while it is full (flow control).

Position. ``position`` is the SCN of the last window put into the queue
(-1: none yet, which asks the relay for its oldest window). A window is
either delivered whole or not at all: whatever fails in the middle of a
response (connection cut, body ending early, a corrupt event, a schema
fetch) drops the unfinished window and the next request starts after
``position``. In long-poll mode a response cut by ``max_bytes`` inside a
window continues on the same relay from the relay's ``X-Changebus-Next-*``
position; a failure there also restarts the window.

Failover. Any retriable failure moves to the next relay at once; after a
whole round of failures the fetcher sleeps with exponential backoff and
jitter (:mod:`._backoff`). A success resets both. A 410 ``scn_not_found``
from one relay tries the others; when every relay says so it ends the stream
with :class:`~._errors.FellOffRelayError`. Errors that a retry cannot fix
(bad request, unknown partition or source) end it at once; so does
``max_attempts`` consecutive failures (:class:`~._errors.RelayUnavailableError`).
A terminal error is queued behind the windows already fetched.

Runs on the consumer's event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import yarl

from changebus.schemas import (
    BadRequestError,
    ChangebusError,
    CheckpointError,
    CorruptEventError,
    OverwrittenError,
    ProtocolError,
    TableSchema,
    TransportError,
    UnknownSourceError,
)

from ._assembler import EventSplitter, RawWindow, WindowAssembler
from ._backoff import Backoff
from ._config import ConsumerConfig
from ._decode import SchemaCache, decode_window
from ._errors import FellOffRelayError, RelayUnavailableError
from ._queue import QueueClosed, WindowQueue

__all__ = ["RelayFetcher", "safe_url"]

log = logging.getLogger(__name__)

#: failures that another attempt (here or on another relay) may cure
_RETRIABLE = (
    aiohttp.ClientError,
    TimeoutError,
    ConnectionError,
    TransportError,
    OverwrittenError,
    CorruptEventError,
)


def safe_url(url: str) -> str:
    """``url`` without user name and password (for logs and messages)."""
    try:
        return str(yarl.URL(url).with_user(None))
    except (ValueError, TypeError):
        return "<unparsable url>"


class _RelaySchemas:
    """Schema look-ups on one relay (the :class:`~._decode.SchemaSource` of the cache)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        partition: str | None,
        timeout: aiohttp.ClientTimeout,
    ) -> None:
        self._session = session
        self._url = yarl.URL(url)
        self._partition = partition
        self._timeout = timeout

    async def _get(self, url: yarl.URL, params: dict[str, str]) -> Any:
        async with self._session.get(url, params=params, timeout=self._timeout) as resp:
            if resp.status == 404:
                raise UnknownSourceError(f"relay {safe_url(str(self._url))}: {await resp.text()}")
            if resp.status != 200:
                raise TransportError(
                    f"relay {safe_url(str(self._url))} answered {resp.status} to {url.path}"
                )
            return await resp.json()

    async def source_names(self) -> dict[int, str]:
        data = await self._get(self._url / "v1" / "sources", {})
        parts = data.get("partitions", [])
        if self._partition is not None:
            parts = [p for p in parts if p.get("partition") == self._partition]
        if len(parts) != 1:
            raise UnknownSourceError(f"relay {safe_url(str(self._url))} lacks this partition")
        return {int(s["id"]): str(s["name"]) for s in parts[0]["sources"]}

    async def source_schemas(self, name: str) -> list[tuple[int, TableSchema]]:
        params = {"partition": self._partition} if self._partition else {}
        data = await self._get(self._url / "v1" / "schemas" / name, params)
        out: list[tuple[int, TableSchema]] = []
        for part in data.get("partitions", []):
            sid = int(part["source_id"])
            out.extend((sid, TableSchema.from_json(v["schema"])) for v in part["versions"])
        return out


class RelayFetcher:
    """Fills a :class:`~._queue.WindowQueue` from the relays (module docstring)."""

    def __init__(
        self,
        config: ConsumerConfig,
        session: aiohttp.ClientSession,
        queue: WindowQueue,
        cache: SchemaCache,
        *,
        position: int,
        latest: bool,
        partition: str | None,
    ) -> None:
        self.config = config
        self.position = position
        self.partition = partition
        self.relay_index = 0
        self.requests = 0
        self.failovers = 0
        self.windows = 0
        self._session = session
        self._queue = queue
        self._cache = cache
        self._latest = latest
        self._assembler = WindowAssembler(position)
        self._continue: tuple[int, int] | None = None
        self._backoff = Backoff(
            config.backoff_initial_s, config.backoff_max_s, config.backoff_multiplier
        )
        self._timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=config.connect_timeout_s,
            sock_read=config.wait_s + config.read_margin_s,
        )

    @property
    def relay(self) -> str:
        """The URL of the relay in use."""
        return self.config.relays[self.relay_index]

    async def run(self) -> None:
        """Fetch until cancelled; a terminal error goes into the queue."""
        try:
            await self._loop()
        except (asyncio.CancelledError, QueueClosed):
            raise
        except Exception as exc:  # noqa: BLE001 - every terminal error reaches the consumer
            log.debug("fetcher ends: %r", exc)
            await self._queue.fail(exc)

    async def fetch(self) -> None:
        """Fetch until cancelled, *raising* a terminal error (``run`` queues it)."""
        await self._loop()

    async def _loop(self) -> None:
        relays = self.config.relays
        attempts = 0
        failed_in_round = 0
        fell_off: dict[str, FellOffRelayError] = {}
        while True:
            url = self.relay
            try:
                await self._request(url)
            except FellOffRelayError as exc:
                fell_off[url] = exc
                self._restart_window()
                if len(fell_off) == len(relays):
                    raise fell_off[relays[0]] from None
                log.warning("%s; trying the next relay", exc.message)
                self._switch()
                continue
            except _RETRIABLE as exc:
                attempts += 1
                self._restart_window()
                what = exc.message if isinstance(exc, ChangebusError) else repr(exc)
                if self.config.max_attempts and attempts >= self.config.max_attempts:
                    raise RelayUnavailableError(
                        f"no relay answered in {attempts} attempts; last: {what}"
                    ) from exc
                log.warning("relay %s failed: %s", safe_url(url), what)
                self._switch()
                failed_in_round += 1
                if failed_in_round >= len(relays):
                    failed_in_round = 0
                    delay = self._backoff.next_delay()
                    log.info("every relay failed; retrying in %.2fs", delay)
                    await asyncio.sleep(delay)
                continue
            attempts = 0
            failed_in_round = 0
            fell_off.clear()
            self._backoff.reset()

    def _restart_window(self) -> None:
        self._assembler.reset(self.position)
        self._continue = None

    def _switch(self) -> None:
        if len(self.config.relays) > 1:
            self.relay_index = (self.relay_index + 1) % len(self.config.relays)
            self.failovers += 1
            self._cache.clear()  # source ids belong to a relay's registry

    def _params(self) -> dict[str, str]:
        cfg = self.config
        params: dict[str, str] = {"max_bytes": str(cfg.max_bytes), "wait": f"{cfg.wait_s:g}"}
        if self.partition is not None:
            params["partition"] = self.partition
        if self._latest:
            params["from"] = "latest"
        elif self._continue is not None and self._assembler.in_window:
            params["scn"], params["offset"] = str(self._continue[0]), str(self._continue[1])
        else:
            params["scn"], params["offset"] = str(self.position), "-1"
        if cfg.sources:
            params["sources"] = ",".join(cfg.sources)
        if cfg.key_filter is not None:
            params["filter"] = str(cfg.key_filter)
        if cfg.follow:
            params["follow"] = "1"
            params["follow_bytes"] = str(cfg.follow_bytes)
        if cfg.client_id:
            params["client"] = cfg.client_id
        return params

    async def _request(self, url: str) -> None:
        params = self._params()
        self.requests += 1
        async with self._session.get(
            f"{url}/v1/stream", params=params, timeout=self._timeout
        ) as resp:
            if resp.status not in (200, 204):
                raise await self._error(resp, url, int(params.get("scn", "-1")))
            self._learn_partition(resp.headers.get("X-Changebus-Partition"))
            if self._latest and (resp.status == 204 or self.config.follow):
                # the relay's start position: windows after it are "from now on"
                self._latest = False
                self.position = int(resp.headers.get("X-Changebus-Next-Scn", "-1"))
                self._assembler.reset(self.position)
            if resp.status == 204:
                return
            if self.config.follow:
                await self._read_follow(resp, url)
            else:
                self._latest = False
                await self._read_whole(resp, url)

    async def _read_follow(self, resp: aiohttp.ClientResponse, url: str) -> None:
        splitter = EventSplitter()
        async for chunk in resp.content.iter_any():
            complete, offsets = splitter.split(chunk)
            if complete:
                for raw in self._assembler.feed(complete, offsets):
                    await self._emit(raw, url)
        if splitter.leftover:
            raise TransportError("the relay's follow response ended inside an event")
        # a push cut inside a window (follow_bytes reached): ask again for it whole
        self._restart_window()

    async def _read_whole(self, resp: aiohttp.ClientResponse, url: str) -> None:
        body = await resp.read()  # raises when the body ends early: nothing is used
        for raw in self._assembler.feed(body):
            await self._emit(raw, url)
        if self._assembler.in_window:
            self._continue = (
                int(resp.headers["X-Changebus-Next-Scn"]),
                int(resp.headers["X-Changebus-Next-Offset"]),
            )
        else:
            self._continue = None

    async def _emit(self, raw: RawWindow, url: str) -> None:
        source = _RelaySchemas(self._session, url, self.partition, self._timeout)
        window = await decode_window(raw, self.partition or "", self._cache, source)
        await self._queue.put(window)
        self.position = raw.scn
        self.windows += 1

    def _learn_partition(self, name: str | None) -> None:
        if name is None:
            return
        if self.partition is None:
            self.partition = name
        elif name != self.partition:
            raise ProtocolError(f"asked for partition {self.partition!r}, got {name!r}")

    async def _error(
        self, resp: aiohttp.ClientResponse, url: str, requested_scn: int
    ) -> ChangebusError:
        try:
            body = await resp.json(content_type=None)
        except (aiohttp.ClientError, ValueError):
            body = None
        if not isinstance(body, dict):
            body = {}
        code = body.get("error", "")
        message = str(body.get("message") or resp.reason or "")
        where = f"relay {safe_url(url)}"
        if resp.status == 410 or code == "scn_not_found":
            return FellOffRelayError(
                f"{where}: position {requested_scn} is older than the relay keeps"
                f" (oldest window {body.get('oldest_scn')}, newest evicted {body.get('prev_scn')});"
                " catch up from a bootstrap server or restart from prev_scn",
                partition=self.partition or "",
                requested_scn=requested_scn,
                oldest_scn=int(body.get("oldest_scn", -1)),
                prev_scn=int(body.get("prev_scn", -1)),
                relay=safe_url(url),
            )
        if code == "bad_checkpoint":
            return CheckpointError(f"{where}: {message}")
        if resp.status == 400:
            return BadRequestError(f"{where}: {message}")
        if resp.status == 404:
            return UnknownSourceError(f"{where}: {message}")
        if resp.status == 409:
            return OverwrittenError(f"{where}: {message}")
        if resp.status >= 500 or body.get("retriable") is True:
            return TransportError(f"{where} answered {resp.status}: {message}")
        return ChangebusError(f"{where} answered {resp.status}: {message}")
