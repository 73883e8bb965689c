"""The relay's HTTP API (aiohttp); documented in docs/protocol.md section 6.

Every error leaves as JSON ``{"error": code, "message": ..., "retriable": ...}``
with the status of the :class:`ChangebusError` subclass (400 bad input, 404
unknown partition or source, 410 checkpoint too old, 500 otherwise); an
unexpected exception is logged and answered with 500, never a crash.

``GET /v1/stream`` is the hot path. It selects events with the vectorised
buffer scan, then writes memoryview slices of the mmapped ring straight to
the socket (no copy), with chunked transfer encoding: the terminating chunk
is sent only after the buffer confirms that the writer did not overrun the
slices meanwhile. A client that sees a body end without it must discard it.

Authorization (``[security]`` with principals; see
:mod:`changebus.schemas.security`): each handler asks the request's
principal once per request -- a partition not granted is 403, a ``sources=``
naming a source not granted is 403, and a principal granted only some
sources that names none gets the granted ones as its source filter (so a
key ``filter=`` only ever narrows the grant). ``/v1/sources``,
``/v1/schemas`` and ``/v1/status`` show only what is granted; consumer ids
and peers in ``/v1/status`` only to ``admin``. Without security every
principal check passes at once (the anonymous principal grants all).
A client that stops reading is cut off after ``http.send_timeout_s`` and
never holds up the buffer's writer (:mod:`._send`). Small responses are
copies, shared by identical requests through a per-partition cache bounded
by bytes (:mod:`._respcache`); follow mode lives in :mod:`._follow`,
``format=ndjson`` in :mod:`._ndjson`.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import HttpVersion11, web

from changebus.schemas import (
    MAX_SCN,
    UNATTACHED,
    BadRequestError,
    Checkpoint,
    CheckpointError,
    PartitionFilter,
    ScnNotFoundError,
    UnknownSchemaError,
    UnknownSourceError,
)
from changebus.schemas.files import NAME_RULE, safe_name
from changebus.schemas.security import ANONYMOUS, Principal, principal_of
from changebus.schemas.server import (
    MIN_FLOOR,
    CopyBudget,
    check_params,
    json_response,
    printable,
    query_choice,
    query_float,
    query_int,
    query_parsed,
    server_app,
)

from ._broadcast import TailBroadcast
from ._buffer import Selection
from ._config import RelayConfig
from ._follow import FollowRequest, follow
from ._host import MAX_CLIENT_ID, PartitionHost
from ._metrics import RelayMetrics
from ._ndjson import PIECE_BYTES as NDJSON_PIECE_BYTES, NdjsonEncoder
from ._respcache import CachedResponse, ResponseCache
from ._respond import copy_headers, copy_out, next_headers
from ._send import send_body, send_selection

__all__ = ["HOSTS", "RESPONSES", "build_app"]

log = logging.getLogger("changebus.relay.http")

HOSTS: web.AppKey[dict[str, PartitionHost]] = web.AppKey("hosts", dict)
CONFIG: web.AppKey[RelayConfig] = web.AppKey("config", RelayConfig)
METRICS: web.AppKey[RelayMetrics] = web.AppKey("metrics", RelayMetrics)
#: the response cache of each partition, by partition name (see _responses)
RESPONSES: web.AppKey[dict[str, ResponseCache]] = web.AppKey("responses", dict)
BROADCASTS: web.AppKey[dict[str, TailBroadcast]] = web.AppKey("broadcasts", dict)
NDJSON: web.AppKey[NdjsonEncoder] = web.AppKey("ndjson", NdjsonEncoder)
#: the relay-wide budget of response copies (follow pushes, ndjson answers)
COPIES: web.AppKey[CopyBudget] = web.AppKey("copies", CopyBudget)

#: results up to this size are copied once (and shared), larger ones streamed zero-copy
_COPY_BYTES = 256 * 1024
#: the longest ``wait`` a request may name at all; a wait above ``http.max_wait_s``
#: (but within this) is shortened to ``max_wait_s``: a client cannot know the relay's
#: limit, and refusing it (400, not retriable) would stop a follower or consumer whose
#: own wait is longer for good
_WAIT_LIMIT_S = 24 * 3600.0


def _host(request: web.Request, name: str | None) -> PartitionHost:
    hosts = request.app[HOSTS]

    def granted() -> str:
        # (errors name only the partitions the principal may read: the others cannot be probed)
        principal = principal_of(request)
        return ", ".join(sorted(h for h in hosts if principal.allows_partition(h))) or "none"

    if name is None:
        if len(hosts) == 1:
            return next(iter(hosts.values()))
        raise BadRequestError(f"name the partition: one of {granted()}")
    if not safe_name(name):
        raise BadRequestError(f"partition name {name[:128]!r} must match {NAME_RULE}")
    try:
        return hosts[name]
    except KeyError:
        raise UnknownSourceError(f"no partition {name[:128]!r} here; known: {granted()}") from None


def _responses(request: web.Request, host: PartitionHost) -> ResponseCache:
    """The partition's response cache (made on first use; partitions keep their names)."""
    caches = request.app[RESPONSES]
    cache = caches.get(host.name)
    if cache is None:
        budget = request.app[CONFIG].http.response_cache_bytes
        cache = caches[host.name] = ResponseCache(budget, _COPY_BYTES)
    return cache


def _broadcast(request: web.Request, host: PartitionHost, cache: ResponseCache) -> TailBroadcast:
    """The partition's tail broadcast for follow streams (made on first use)."""
    broadcasts = request.app[BROADCASTS]
    broadcast = broadcasts.get(host.name)
    if broadcast is None:
        broadcast = broadcasts[host.name] = TailBroadcast(
            host, cache, request.app[COPIES], request.app[METRICS]
        )
    return broadcast


_STREAM_PARAMS = frozenset(
    {
        "partition",
        "checkpoint",
        "scn",
        "offset",
        "from",
        "sources",
        "filter",
        "max_bytes",
        "wait",
        "format",
        "client",
        "follow",
        "follow_bytes",
    }
)


async def stream(request: web.Request) -> web.StreamResponse:
    """``GET /v1/stream``: events after a checkpoint, long-polling when none."""
    query = request.query
    check_params(query, _STREAM_PARAMS)
    if request.version < HttpVersion11:
        # its answers may be chunked: in a close-delimited HTTP/1.0 body a cut would
        # look like a whole answer (aiohttp refuses chunks to HTTP/1.0, a 500 before)
        raise BadRequestError("GET /v1/stream needs HTTP/1.1")
    cfg = request.app[CONFIG].http
    host = _granted_host(request, query.get("partition"))
    if sum(query.get(x) is not None for x in ("from", "checkpoint", "scn")) > 1:
        raise BadRequestError("give only one of checkpoint, scn/offset and from")
    checkpoint = query_parsed(query, "checkpoint", Checkpoint.parse)
    if checkpoint is not None:
        pc = checkpoint.get(host.name)
        if pc.mode.value != "online":
            raise CheckpointError(
                f"partition {host.name} is in {pc.mode.value} mode: read it from the bootstrap server"
            )
        scn, offset = pc.window_scn, pc.window_offset
    elif "from" in query:
        start = query_choice(query, "from", ("earliest", "latest"), default="earliest")
        scn, offset = (-1, -1) if start == "earliest" else (host.buffer.meta.last_scn, -1)
    else:
        scn = query_int(query, "scn", default=-1, lo=-1, hi=MAX_SCN)
        offset = query_int(query, "offset", default=-1, lo=-1, hi=2**31)
    max_bytes = query_int(
        query, "max_bytes", default=cfg.default_max_bytes, lo=1, hi=cfg.max_response_bytes
    )
    wait = min(query_float(query, "wait", default=0.0, lo=0.0, hi=_WAIT_LIMIT_S), cfg.max_wait_s)
    fmt = query_choice(query, "format", ("binary", "ndjson"), default="binary")
    if fmt == "ndjson":
        max_bytes = min(max_bytes, cfg.max_ndjson_bytes)  # decoding is slow: less per request
    key_filter = query_parsed(query, "filter", PartitionFilter.parse)
    sources = _source_ids(request, host, query.get("sources"))
    # (escaped: it reaches log lines, /v1/status and /metrics)
    client = printable(query.get("client", "")[:MAX_CLIENT_ID])
    if client and principal_of(request) is not ANONYMOUS:
        # (per principal: one may not take over another's row of /v1/status and /metrics,
        # to hide a lagging consumer, say: review)
        client = f"{principal_of(request).name}/{client}"
    else:
        # ("/" names the principal that owns an id, which the consumer table counts:
        # an anonymous "a1/x", "a2/x", ... posed as owners of their own; review)
        client = client.replace("/", "_")
    client = client or request.remote or "unknown"
    # (the filter as parsed, not as sent: a key of the response cache and of the
    # follow broadcast, where padded variants of one filter would each make an entry)
    filter_text = None if key_filter is None else str(key_filter)
    cache = _responses(request, host)
    metrics = request.app[METRICS]

    if query_choice(query, "follow", ("0", "1"), default="0") == "1":
        if fmt != "binary":
            raise BadRequestError("follow=1 needs format=binary")
        budget = query_int(query, "follow_bytes", default=64 << 20, lo=1, hi=1 << 40)
        ask = FollowRequest(
            scn, offset, max_bytes, key_filter, filter_text, sources, wait, budget, client
        )
        copies = request.app[COPIES]
        broadcast = _broadcast(request, host, cache)
        return await follow(
            request, host, ask, cache, copies, metrics, cfg.send_timeout_s, broadcast
        )
    deadline = time.monotonic() + wait
    selection: Selection | CachedResponse | None
    resume = -1  # (where this request's scan of a window longer than a scan got to)
    while True:
        want = max_bytes
        if fmt == "ndjson":
            # the answer must fit the copy budget as it is now: long-polls woken by one
            # window each see the grants taken before them (the selection, its copy and
            # its grant follow without a pause), not the budget before they waited
            spare = request.app[COPIES].spare() - NDJSON_PIECE_BYTES
            want = min(max_bytes, max(spare, MIN_FLOOR))
        key = (scn, offset, want, filter_text, sources)
        tail = host.buffer.meta.tail_event
        selection = cache.get(tail, key, host.buffer.meta.head_pos)
        if selection is None:
            try:
                selection = host.buffer.select(
                    scn, offset, want, key_filter=key_filter, sources=sources, skip_to=resume
                )
            except ScnNotFoundError:
                metrics.fell_off(host.name)  # answered 410
                raise
        if isinstance(selection, Selection) and selection.resume_at >= 0:
            resume = selection.resume_at
            host.buffer.release(selection)  # a window longer than a scan: go on from there
            await asyncio.sleep(0)
            continue
        if selection is not None:
            break
        left = deadline - time.monotonic()
        if left <= 0:
            host.saw_consumer(client, scn, request.remote or "")
            headers = next_headers(host, scn, offset, checkpoint)
            return web.Response(status=204, headers=headers)
        await host.wait_for_window(left)

    size = selection.nbytes if isinstance(selection, Selection) else len(selection.body)
    # (an answer that reached the tail: caught up, also when a filter skipped most of it)
    reached = -1 if selection.to_tail or selection.start_pos < 0 else selection.start_pos + size
    host.saw_consumer(client, scn, request.remote or "", reached)
    if isinstance(selection, Selection) and (fmt == "ndjson" or selection.nbytes <= _COPY_BYTES):
        # small, or for people: one copy, checked against the pin (OverwrittenError
        # when the writer overran it), shared with identical requests when small
        selection = copy_out(host, selection, metrics)
        cache.put(tail, key, selection)
    if isinstance(selection, CachedResponse):
        if fmt == "ndjson":
            return await _ndjson_response(request, host, selection, checkpoint)
        metrics.streamed(host.name, len(selection.body), selection.events)
        return web.Response(
            body=selection.body,
            headers=copy_headers(host, selection, checkpoint),
            content_type="application/vnd.changebus.events",
        )
    try:  # the selection is pinned: whatever fails before the send lets it go
        headers = next_headers(host, selection.next_scn, selection.next_offset, checkpoint)
        headers.update(
            {
                "X-Changebus-Events": str(selection.events),
                "X-Changebus-Windows": str(selection.windows),
                "X-Changebus-Partial": "1" if selection.partial else "0",
            }
        )
        resp = web.StreamResponse(status=200, headers=headers)
        resp.content_type = "application/vnd.changebus.events"
        resp.enable_chunked_encoding()
        await resp.prepare(request)
    except BaseException:
        host.buffer.release(selection)
        raise
    outcome = await send_selection(
        request, resp, host.buffer, selection, cfg.send_timeout_s, request.app[COPIES]
    )
    if outcome != "sent":
        # the bytes may have been overwritten while being sent, or the client
        # stopped reading (the status is gone already): the connection was cut
        # before the body's last chunk, so the client discards it
        if outcome == "overrun":
            metrics.overrun(host.name)
        else:
            metrics.aborted(host.name)
        return resp
    await resp.write_eof()
    metrics.streamed(host.name, selection.nbytes, selection.events)
    return resp


async def _ndjson_response(
    request: web.Request, host: PartitionHost, cached: CachedResponse, checkpoint: Checkpoint | None
) -> web.StreamResponse:
    """The selection as JSON lines, made and sent piece by piece (:mod:`._ndjson`).

    The copy budget is charged the binary selection plus the piece in hand;
    JSON may be many times the binary, so the answer is never held whole.
    """
    copies = request.app[COPIES]
    base = len(cached.body)
    charged = copies.grant(base + NDJSON_PIECE_BYTES)
    try:
        resp = web.StreamResponse(status=200, headers=copy_headers(host, cached, checkpoint))
        resp.content_type = "application/x-ndjson"
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        timeout = request.app[CONFIG].http.send_timeout_s
        metrics = request.app[METRICS]
        async for piece in request.app[NDJSON].pieces(host.registry, cached.body):
            charged = copies.resize(charged, base + len(piece))
            if not await send_body(
                request, resp, piece, timeout, lambda: metrics.aborted(host.name)
            ):
                return resp
        await resp.write_eof()
        return resp
    finally:
        copies.release(charged)


def _granted_host(request: web.Request, name: str | None) -> PartitionHost:
    """:func:`_host`, refused (403) when the principal may not read the partition."""
    principal = principal_of(request)
    if name is not None:
        principal.check_partition(name)  # before the lookup: 403 whether it exists or not
    host = _host(request, name)
    principal.check_partition(host.name)
    return host


def _source_ids(
    request: web.Request, host: PartitionHost, text: str | None
) -> frozenset[int] | None:
    """Source ids of ``sources=`` (None: all), limited to the principal's grant.

    With :data:`~changebus.schemas.UNATTACHED` (messages pass) unless the
    principal is granted only some sources.
    """
    requested = None if text is None else [n for n in (s.strip() for s in text.split(",")) if n]
    if requested == []:
        # (it meant "messages only": a 200 whose position moved past every data event)
        raise BadRequestError("sources= names no source: name some, or leave sources out")
    principal = principal_of(request)
    # (a test per granted name: listing every source of the registry per request cost
    # what the partition's tables are many)
    granted = principal.restrict_sources(requested, host.registry.has)
    if granted is not None:
        requested = list(granted)
    if requested is None:
        return None
    ids = set()
    for name in requested:
        try:
            ids.add(host.registry.source_id(name))
        except UnknownSchemaError:
            raise UnknownSourceError(
                f"partition {host.name} has no source {name[:128]!r}"
            ) from None
    if principal.sources is None:
        ids.add(UNATTACHED)
    return frozenset(ids)


async def sources(request: web.Request) -> web.Response:
    """``GET /v1/sources``: partitions and the logical sources they carry (those granted)."""
    principal = principal_of(request)
    out = [
        {
            "partition": host.name,
            "id": host.config.id,
            "sources": [
                {
                    "id": sid,
                    "name": name,
                    "versions": [t.version for t in host.registry.versions(name)],
                }
                for sid, name in host.registry.sources()
                if principal.allows_source(name)
            ],
        }
        for host in request.app[HOSTS].values()
        if principal.allows_partition(host.name)
    ]
    return json_response({"partitions": out})


async def schemas(request: web.Request) -> web.Response:
    """``GET /v1/schemas/{source}``: every version of a source's table schema."""
    name = request.match_info["source"]
    hosts = request.app[HOSTS]
    wanted = request.query.get("partition")
    principal = _check_source(request, name, wanted)
    found = []
    for host in hosts.values():
        if (wanted is not None and host.name != wanted) or not principal.allows_partition(
            host.name
        ):
            continue
        try:
            versions = host.registry.versions(name)
        except UnknownSchemaError:
            continue
        found.append(
            {
                "partition": host.name,
                "source_id": host.registry.source_id(name),
                "versions": [
                    {
                        "version": t.version,
                        "fingerprint": f"{t.fingerprint:016x}",
                        "schema": t.to_json(),
                    }
                    for t in versions
                ],
            }
        )
    if not found:
        raise UnknownSourceError(f"no source {name!r} on this relay")
    return json_response({"source": name, "partitions": found})


def _check_source(request: web.Request, source: str, partition: str | None) -> Principal:
    """The principal, once checked that it may read ``source`` (and ``partition``): else 403."""
    principal = principal_of(request)
    principal.restrict_sources((source,), ())
    if partition is not None:
        principal.check_partition(partition)
    return principal


_SPLITS_PARAMS = frozenset({"partition", "since", "until", "parts", "sources"})
#: the most sub-ranges one ``/v1/splits`` request may ask for
MAX_SPLIT_PARTS = 4096


async def splits(request: web.Request) -> web.Response:
    """``GET /v1/splits``: SCNs cutting ``(since, until]`` into ``parts`` similar sub-ranges."""
    query = request.query
    check_params(query, _SPLITS_PARAMS)
    host = _granted_host(request, query.get("partition"))
    since = query_int(query, "since", lo=-1, hi=MAX_SCN)
    until = query_int(query, "until", lo=-1, hi=MAX_SCN)
    parts = query_int(query, "parts", lo=1, hi=MAX_SPLIT_PARTS)
    if until < since:
        raise BadRequestError(f"until ({until}) is before since ({since})")
    # only what the principal may read counts: its grant narrows ``sources=``
    sources = _source_ids(request, host, query.get("sources"))
    cuts = host.buffer.split_points(since, until, parts, sources)
    return json_response({"partition": host.name, "since": since, "until": until, "cuts": cuts})


#: ``/v1/status`` figures of a whole partition, left out for a principal granted some of
#: its sources only (they show the other sources' traffic and name their tables)
_WHOLE_PARTITION = (
    "last_error",
    "stats",
    "events",
    "windows",
    "bytes_used",
    "source_lag_seconds",
    "source_idle_seconds",
)
#: the fetcher's figures such a principal still gets: which source server and SCN space
#: the partition reads (a bootstrap server seeding the granted tables needs them)
_FETCHER_IDENTITY = frozenset(
    {"kind", "server_id", "mysql_server_id", "scn_base", "system_identifier"}
)


async def status(request: web.Request) -> web.Response:
    """``GET /v1/status``: per-partition buffer bounds, fetcher and consumers."""
    principal = principal_of(request)
    hosts = request.app[HOSTS].values()
    out = [h.status() for h in hosts if principal.allows_partition(h.name)]
    if principal.sources is not None:
        # granted some sources of the partitions only: the buffer's bounds (what a
        # consumer needs), not what tells of the other sources (the fetcher's state
        # and errors name their tables; counts and other consumers show their traffic)
        for part in out:
            for key in _WHOLE_PARTITION:
                part.pop(key, None)
            fetcher = part.get("fetcher")
            if isinstance(fetcher, dict):  # (a seed of the granted tables needs its base)
                part["fetcher"] = {k: v for k, v in fetcher.items() if k in _FETCHER_IDENTITY}
            part["consumers"] = []
    elif not principal.has_scope("admin"):  # who reads is for admins only
        for part in out:
            part["consumers"] = [
                {k: v for k, v in c.items() if k not in ("client", "peer")}
                for c in part["consumers"]
            ]
    return json_response({"partitions": out})


def _readiness(hosts: dict[str, PartitionHost]) -> tuple[bool, dict[str, str]]:
    states = {
        h.name: f"{h.state}: {h.last_error}" if h.state == "fenced" else h.state
        for h in hosts.values()
    }
    for h in hosts.values():
        if h.syncer is not None and h.syncer.error:
            states[h.name] = f"sync failed: {h.syncer.error}"
    return all(h.ready for h in hosts.values()), states


def build_app(config: RelayConfig, hosts: dict[str, PartitionHost]) -> web.Application:
    """The aiohttp application serving ``hosts``.

    ``hosts`` is read live (the relay fills it at start-up); the caller
    starts and stops the partitions, e.g. as a ``cleanup_ctx`` step
    (:class:`~._daemon.Relay`).
    """
    copies = CopyBudget(config.http.max_copy_bytes, config.http.max_connections)
    metrics = RelayMetrics(hosts, config.metrics, lambda: _readiness(hosts)[0], copies)
    app = server_app(
        "relay",
        readiness=lambda: _readiness(hosts),
        collectors=[metrics],
        logger=log,
        security=config.security,
    )
    app[CONFIG] = config
    app[HOSTS] = hosts
    app[METRICS] = metrics
    app[RESPONSES] = {}
    app[BROADCASTS] = {}
    app[NDJSON] = NdjsonEncoder()
    app[COPIES] = copies
    # (no HEAD: a streamed answer would write its body anyway, and the next answer on
    # the connection would start inside it)
    app.router.add_get("/v1/stream", stream, allow_head=False)
    app.router.add_get("/v1/sources", sources)
    app.router.add_get("/v1/schemas/{source}", schemas)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/v1/splits", splits)
    return app
