"""The ``relay`` fetcher kind: a relay follows another relay's ``/v1/stream``.

A :class:`ChainFetcher` reads the upstream partition with
:class:`changebus.client.RelayStream` and hands every validated window to
the local relay **as it is**: same SCN, same timestamp, same bytes. It gives
no ``event_sizes``, so the local relay's append path checks every event
again, CRCs included. A follower therefore serves the same stream as its
upstream, byte for byte, and a chain of followers (leader -> follower ->
follower) serves it everywhere.

Data flow and bounds::

    upstream /v1/stream --TCP--> RelayStream (task chain-<p>) --sink--> WindowQueue
        --> windows() --> the relay's pump and ingest tasks (relay/_host.py)

The queue holds at most ``queue_windows`` windows and ``queue_bytes``
bytes; when it is full the sink waits, the reader stops reading the
response, TCP fills and the upstream's handler waits in ``drain()``.

Positions. The stream starts after ``ResumePoint.scn``, the newest window
the local buffer holds (a restart: no window twice, none skipped); a fresh
follower starts where the upstream's buffer is complete (its ``prev_scn``),
and :meth:`ChainFetcher.start` returns that SCN so the local buffer claims
exactly what the upstream claims. The fetcher's position moves past a
window once the window is queued for the relay; nothing is released
upstream, so :meth:`ChainFetcher.acknowledge` only records the SCN.

Schemas. An upstream keeps its table schemas in its registry, and its
ring may no longer hold the SCHEMA_CHANGE events that announced them. Before
the first window of every stream (at start, and after a gap) the fetcher
reads the upstream's registry (``/v1/sources``, ``/v1/schemas/{source}``)
and hands the entries the local registry lacks to the relay with that
window (:attr:`changebus.fetchers.Window.schemas`): the relay registers
them, with the upstream's source ids and versions, before publishing it.
A row of a schema the fetcher does not know (its upstream registered it out
of band after the registry was read: a chained upstream's own start or
fall-off) makes it read the registry again before that window.

Falling off. When the upstream evicted the windows after our position (410
from every upstream: asked once more, each of them, before anything is
recorded; one that does not answer makes it read again later, since it may
hold them), chaining cannot fill the gap. The fetcher never jumps
silently: it queues one DATA_LOSS window ``(position + 1 .. upstream
prev_scn)`` at the upstream's ``prev_scn``, logs it, counts it in
:meth:`ChainFetcher.status` and continues with the upstream's oldest
window. The follower's stream then differs from its upstream by that window.
With ``on_fell_off = "restart"`` (a relay cluster's followers) it raises
:class:`RestartBufferError` instead: the relay empties its buffer and starts
it again at the upstream's ``prev_scn``, like a fresh follower. Nothing was
lost at the source (the leader and other members may hold those windows, the
bootstrap server has them), so its consumers get "older than kept" (410: the
next relay, or a bootstrap) instead of a DATA_LOSS that would stop them.

Fencing. A relay whose partition has an epoch answers ``X-Changebus-Epoch``
on ``/v1/stream``. With ``min_epoch`` (an in-process callable, e.g. the
cluster's current leadership epoch) every answer is checked before its body
is read, and again before each window is queued: an answer without an epoch
or with one below ``min_epoch()`` is refused (:class:`StaleUpstreamError`,
retriable: the next upstream is tried, with backoff after a whole round)
and none of its windows is appended.

Not thread-safe: everything runs on the relay's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp
import numpy as np

from changebus.client import (
    FellOffRelayError,
    RawWindow,
    RelayInfo,
    RelayQueries,
    RelayStream,
    StreamConfig,
    open_session,
    safe_url,
)
from changebus.fetchers import Fetcher, FetcherFactory, ResumePoint, Window
from changebus.schemas import (
    FIRST_CONTROL_OP,
    ChangebusError,
    ConfigError,
    DataLoss,
    EndOfWindow,
    ProtocolError,
    SourceConfigError,
    SourceError,
    UnknownSourceError,
    encode_control,
    stop_task,
)
from changebus.schemas.config import load_config_dict
from changebus.schemas.security import ClientAuth

from ._chainconfig import ChainConfig
from ._chainloss import loss_end
from ._chainschemas import Entry, KnownSchemas
from ._lossmarker import schema_changes
from ._windowqueue import WindowQueue

__all__ = [
    "EPOCH_HEADER",
    "ChainFetcher",
    "StaleUpstreamError",
    "fetcher_factory",
    "make_fetcher_factory",
]

log = logging.getLogger("changebus.relay.chain")

#: the response header a relay names its partition's leadership epoch in
EPOCH_HEADER = "X-Changebus-Epoch"

#: the JSON form of one registry entry (SchemaRegistry.to_json)


class StaleUpstreamError(ProtocolError):
    """An upstream answered under an epoch below the one required (a deposed leader).

    Retriable: the follower moves on to the next upstream (the answer's
    windows are not appended). ``epoch`` is the upstream's (None: it sent
    none), ``required`` the minimum asked for.
    """

    retriable = True


class RestartBufferError(ChangebusError):
    """The upstream evicted what follows our position and ``on_fell_off = "restart"``.

    Raised to the relay's ingest (retriable), which empties the partition's buffer,
    declares it complete after ``scn`` (the upstream's ``prev_scn``) and starts the
    fetcher again from there: the buffer then holds exactly what the upstream holds.
    """

    retriable = True

    def __init__(self, message: str, *, scn: int, position: str = "") -> None:
        super().__init__(message, scn=scn, position=position)
        self.scn = scn
        #: the upstream's source position at the end of the window at ``scn`` ("": not said)
        self.position = position


class ChainFetcher:
    """Follows an upstream relay's partition (module docstring); a :class:`Fetcher`."""

    def __init__(
        self,
        name: str,
        partition_id: int,
        config: ChainConfig,
        *,
        min_epoch: Callable[[], int] | None = None,
        auth: ClientAuth | None = None,
    ) -> None:
        self.name = name
        self.partition_id = partition_id
        self.config = config
        #: TLS settings and token towards the upstream: ``auth`` (the relay's
        #: ``[upstream]``) overridden by the fetcher's own options
        self.auth = config.client_auth(auth or ClientAuth())
        self.upstream_partition = config.partition or name
        self._min_epoch = min_epoch
        self._stream_config = StreamConfig(
            relays=config.upstream,
            partition=self.upstream_partition,
            client_id=config.client_id or f"relay-chain-{name}",
            follow=config.follow,
            wait_s=config.wait_s,
            max_bytes=config.max_bytes,
            follow_bytes=config.follow_bytes,
            connect_timeout_s=config.connect_timeout_s,
            read_margin_s=config.read_margin_s,
            backoff_initial_s=config.backoff_initial_s,
            backoff_max_s=config.backoff_max_s,
            backoff_multiplier=config.backoff_multiplier,
            max_attempts=config.max_attempts,
            max_window_bytes=config.max_window_bytes,
        )
        self._queue: WindowQueue[Window | BaseException] = WindowQueue(
            config.queue_windows, config.queue_bytes
        )
        self._session: aiohttp.ClientSession | None = None
        self._queries: RelayQueries | None = None
        self._task: asyncio.Task[None] | None = None
        self._stream: RelayStream | None = None
        #: the local registry's entries, and the ids whose rows may be appended
        self._schemas = KnownSchemas()
        self._pending: tuple[Entry, ...] = ()  # entries to hand over with the next window
        #: the SCN of the newest window queued for the relay (-1: none)
        self.position = -1
        self.acknowledged = -1
        self.windows_received = 0
        self.data_loss_windows = 0
        self.lost_scns = 0
        self.refused = 0
        self.upstream_last_scn = -1
        #: the upstream's buffer had evicted windows before where this one starts
        self.start_evicted = False
        #: the upstream's source position after its ``prev_scn`` ("": not said), for
        #: the local buffer's start (:meth:`start` returned that SCN)
        self.start_position = ""
        self.upstream_epoch: int | None = None
        self._response_epoch: int | None = None
        self._newest_ts = 0

    # ---- the Fetcher protocol -----------------------------------------

    async def start(self, resume: ResumePoint) -> int:
        """Learn the upstream's registry and bounds; start reading after ``resume.scn``.

        Returns the SCN from which the local buffer is complete: ``resume.scn``,
        or for an empty buffer the upstream's ``prev_scn``. Raises a retriable
        error when no upstream answers, :class:`SourceConfigError` when the
        upstream partition is missing or has another partition id.
        """
        timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=self.config.connect_timeout_s,
            sock_read=self.config.wait_s + self.config.read_margin_s,
        )
        self._session = await open_session(self.auth, timeout=timeout)
        # (answered at once by a relay: a black-holed upstream is given up on soon)
        self._queries = RelayQueries(
            self._session, self.config.upstream, timeout=self._stream_config.info_timeout
        )
        self._schemas = KnownSchemas(resume.schemas)
        try:
            upstream_prev = await self._queries.first(self._bounds)
            self._pending = await self._learn_schemas()
        except BaseException:
            await self.close()
            raise
        self.position = resume.scn if resume.scn >= 0 else upstream_prev
        if resume.scn >= 0:
            self.start_position = ""  # (the local buffer knows its own)
        self._task = asyncio.create_task(self._run(), name=f"chain-{self.name}")
        log.info(
            "partition %s: following %s (partition %s) after SCN %d",
            self.name,
            ", ".join(safe_url(u) for u in self.config.upstream),
            self.upstream_partition,
            self.position,
        )
        return self.position

    async def windows(self) -> AsyncIterator[Window]:
        """The upstream's windows as they arrive (never ends; raises a terminal error)."""
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item

    async def acknowledge(self, scn: int) -> None:
        """Nothing to release upstream: records ``scn`` for :meth:`status` only."""
        self.acknowledged = scn

    async def close(self) -> None:
        if self._task is not None:
            await stop_task(self._task)  # (a cancel of this close is raised, not swallowed)
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def data_loss_events(self) -> dict[str, int]:
        """DATA_LOSS windows this fetcher made, by cause (the relay's ``/metrics``)."""
        return {"fell_off_upstream": self.data_loss_windows} if self.data_loss_windows else {}

    def status(self) -> dict[str, Any]:
        """Upstream in use, position, lag, refused answers and data loss."""
        stream = self._stream
        upstream = stream.relay if stream is not None else self.config.upstream[0]
        out: dict[str, Any] = {
            "kind": "relay",
            "upstream": safe_url(upstream),
            "upstreams": [safe_url(u) for u in self.config.upstream],
            "upstream_partition": self.upstream_partition,
            "position": self.position,
            "acknowledged_scn": self.acknowledged,
            "upstream_last_scn": self.upstream_last_scn,
            "lag_scn": max(self.upstream_last_scn - self.position, 0),
            "newest_timestamp_ns": self._newest_ts,
            "lag_ms": (
                round((time.time_ns() - self._newest_ts) / 1e6, 1)
                if self._newest_ts and self.upstream_last_scn > self.position
                else 0.0
            ),
            "windows_received": self.windows_received,
            "queued_windows_bytes": self._queue.bytes,
            "data_loss_windows": self.data_loss_windows,
            "lost_scns": self.lost_scns,
            "refused_answers": self.refused,
            "upstream_epoch": self.upstream_epoch,
            "requests": stream.requests if stream is not None else 0,
            "failovers": stream.failovers if stream is not None else 0,
        }
        if self._min_epoch is not None:
            out["min_epoch"] = self._min_epoch()
        return out

    # ---- upstream queries ---------------------------------------------

    async def _bounds(self, info: RelayInfo) -> int:
        """The upstream partition's ``prev_scn``; its id must be ours."""
        found = (await info.status()).get(self.upstream_partition)
        if found is None:
            raise SourceConfigError(
                f"{info.where} has no partition {self.upstream_partition!r} to follow"
            )
        if found.id != self.partition_id:
            raise SourceConfigError(
                f"{info.where}: partition {self.upstream_partition!r} has id {found.id}, this"
                f" relay's {self.name!r} has {self.partition_id}; a follower appends the"
                " upstream's events unchanged, so the ids must be equal"
            )
        if found.state in ("starting", "retrying") and found.max_scn < 0:
            # its fetcher has not said yet where its buffer starts: ask again soon
            raise SourceError(f"{info.where}: partition {self.upstream_partition!r} is starting")
        self.upstream_last_scn = found.max_scn
        # (an upstream that does not say: evicted once it has a prev_scn)
        self.start_evicted = bool(found.raw.get("evicted", found.prev_scn >= 0))
        self.start_position = str(found.raw.get("prev_position") or "")
        return found.prev_scn

    async def _learn_schemas(self, serving: str | None = None) -> tuple[Entry, ...]:
        """The upstream registry's entries this relay's registry lacks (by table and version).

        Asked of ``serving`` (the upstream whose window holds rows of schemas unknown
        here) when given, else of the first upstream that answers: another upstream
        may lag and lack the very schemas in question (review). A serving upstream
        that does not answer now is replaced by the first that does.
        """
        assert self._queries is not None
        entries: list[Entry] | None = None
        if serving is not None and serving in self._queries.urls:
            try:
                entries = await self._registry(self._queries.info(serving))
            except Exception as exc:
                if isinstance(exc, ChangebusError) and not exc.retriable:
                    raise
                log.debug("partition %s: registry of %s: %s", self.name, safe_url(serving), exc)
        if entries is None:
            entries = await self._queries.first(self._registry)
        new = self._schemas.learn(entries, self.name)
        if new:
            log.info(
                "partition %s: %d schema versions learned from the upstream registry",
                self.name,
                len(new),
            )
        return new

    async def _registry(self, info: RelayInfo) -> list[Entry]:
        """Every ``{"source_id", "schema"}`` entry of the upstream partition, from one relay."""
        part = (await info.sources()).get(self.upstream_partition)
        if part is None:
            raise SourceConfigError(
                f"{info.where} has no partition {self.upstream_partition!r} to follow"
            )
        entries: list[Entry] = []
        for source in part.sources:
            try:
                found = await info.schemas(source.name, self.upstream_partition)
            except UnknownSourceError as exc:  # its registry moved on: ask again
                raise SourceError(f"{info.where}: {exc.message}") from exc
            schemas = found[self.upstream_partition]
            entries.extend(
                {"source_id": schemas.source_id, "schema": t.to_json()} for t in schemas.schemas
            )
        return entries

    # ---- the stream ---------------------------------------------------

    async def _run(self) -> None:
        """Task ``chain-<p>``: read the upstream into the queue; a terminal error goes there too."""
        assert self._session is not None
        try:
            while True:
                self._stream = RelayStream(
                    self._stream_config,
                    self._session,
                    position=self.position,
                    check_response=self._check,
                )
                try:
                    await self._stream.run(self._sink)
                except FellOffRelayError as exc:
                    await self._fell_off(exc)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - raised again by windows(), in the ingest
            await self._queue.put(exc)

    def _check(self, relay: str, headers: Mapping[str, str]) -> None:
        """Every answer, before its body: the upstream's tail, and its epoch when fenced."""
        last = headers.get("X-Changebus-Last-Scn")
        text = headers.get(EPOCH_HEADER)
        try:
            if last is not None:
                self.upstream_last_scn = int(last)
            epoch = int(text) if text is not None else None
        except ValueError:
            raise ProtocolError(
                f"relay {safe_url(relay)}: malformed stream headers", retriable=True
            ) from None
        self.upstream_epoch = self._response_epoch = epoch
        if self._min_epoch is not None:
            self._fence(relay)

    def _fence(self, relay: str) -> None:
        assert self._min_epoch is not None
        required = self._min_epoch()
        epoch = self._response_epoch
        if epoch is None or epoch < required:
            self.refused += 1
            raise StaleUpstreamError(
                f"relay {safe_url(relay)} answers under epoch "
                f"{'(none)' if epoch is None else epoch}, below the required {required};"
                " its windows are refused",
                epoch=epoch,
                required=required,
            )

    async def _sink(self, raw: RawWindow, relay: str) -> None:
        if self._min_epoch is not None:
            self._fence(relay)  # a leader deposed during a long follow answer
        h = raw.headers
        mask = h["op"] < FIRST_CONTROL_OP
        if mask.any():
            keys = np.unique(
                (h["source_id"][mask].astype(np.int64) << 16) | h["schema_version"][mask]
            ).tolist()
            ids = {(k >> 16, k & 0xFFFF) for k in keys}
            if not ids <= self._schemas.ids:
                # rows of schemas the upstream registered out of band after this stream read
                # its registry (its own start or fall-off mirrored them, with no
                # SCHEMA_CHANGE in the stream): learned again now, or this relay served
                # rows its readers could not decode (found by review)
                self._pending += await self._learn_schemas(relay)
                announced = {
                    (c.source_id, c.version)
                    for c in schema_changes(raw.body, raw.offsets, h["op"], h["total_length"])
                }
                missing = ids - self._schemas.ids - announced
                if missing:
                    # (marked known all the same before: a lagging upstream's registry
                    # without them, and the window was appended with rows no reader here
                    # could decode, for good; review) fetched again, retriably
                    raise SourceError(
                        f"partition {self.name}: the upstream registries do not hold "
                        f"{', '.join(f'source {i} v{v}' for i, v in sorted(missing)[:5])} "
                        "that its rows use; trying again"
                    )
                self._schemas.ids |= ids
        window = Window(
            raw.scn, raw.timestamp_ns, raw.body, len(raw.offsets), schemas=self._pending
        )
        await self._queue.put(window)
        self._pending = ()
        self.position = raw.scn
        self._newest_ts = raw.timestamp_ns
        self.windows_received += 1

    async def _fell_off(self, exc: FellOffRelayError) -> None:
        """The upstream evicted what follows our position: one DATA_LOSS window, then on."""
        lost_to = exc.prev_scn
        if lost_to <= self.position:
            raise SourceError(
                f"partition {self.name}: the upstream refused position {self.position} but"
                f" says it is complete after {lost_to}"
            ) from exc
        lost_from = self.position + 1
        assert self._queries is not None
        lost_to, prev_position, where = await loss_end(
            self._queries,
            self.name,
            self.upstream_partition,
            self.config.upstream,
            self.position,
            exc,
        )
        reason = (
            f"this relay fell off its upstream relay {exc.relay}: SCNs after {self.position}"
            f" were evicted there (complete after {lost_to} on {where})"
        )
        if self.config.on_fell_off == "restart":
            raise RestartBufferError(reason, scn=lost_to, position=prev_position)
        log.error(
            "partition %s: %s; recorded as data loss %d..%d", self.name, reason, lost_from, lost_to
        )
        pending = self._pending + await self._learn_schemas()  # schemas of the lost windows
        ts = time.time_ns()
        loss = encode_control(
            DataLoss(lost_from, lost_to, reason), lost_to, 0, ts, partition=self.partition_id
        )
        end = encode_control(
            EndOfWindow(0, prev_position), lost_to, 1, ts, partition=self.partition_id
        )
        window = Window(
            lost_to, ts, loss + end, 2, event_sizes=(len(loss), len(end)), schemas=pending
        )
        await self._queue.put(window)
        self._pending = ()
        self.data_loss_windows += 1
        self.lost_scns += lost_to - lost_from + 1
        self.position = lost_to


def make_fetcher_factory(*, min_epoch: Callable[[], int] | None = None) -> FetcherFactory:
    """A factory of ``relay`` fetchers that fence their upstreams with ``min_epoch``.

    Register it in process (``register_fetcher("relay", make_fetcher_factory(
    min_epoch=...))``) so that relay configs naming the kind get the check.
    An in-process ``auth`` option (a :class:`ClientAuth`: the relay passes
    its ``[upstream]`` table so) is the default TLS and token setting, which
    the fetcher's own ``ca_file``, ``token_file``, ... options refine.
    """

    def factory(name: str, partition_id: int, options: Mapping[str, Any]) -> Fetcher:
        check = options.get("min_epoch", min_epoch)
        if check is not None and not callable(check):
            raise ConfigError("options.min_epoch must be a callable returning an int")
        auth = options.get("auth")
        if auth is not None and not isinstance(auth, ClientAuth):
            raise ConfigError("options.auth must be a changebus.schemas.security.ClientAuth")
        plain = {k: v for k, v in options.items() if k not in ("min_epoch", "auth")}
        config = load_config_dict(ChainConfig, plain, "fetcher")
        return ChainFetcher(name, partition_id, config, min_epoch=check, auth=auth)

    return factory


#: the ``relay`` kind's factory (declared under ``changebus.fetchers``); an
#: in-process ``min_epoch`` callable may be passed in the options table
fetcher_factory: FetcherFactory = make_fetcher_factory()
