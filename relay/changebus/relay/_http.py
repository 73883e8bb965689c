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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import time
from typing import Any

from aiohttp import web

from changebus.schemas import (
    MAX_SCN,
    BadRequestError,
    ChangebusError,
    ChangeDecoder,
    Checkpoint,
    CheckpointError,
    Op,
    OverwrittenError,
    PartitionCheckpoint,
    PartitionFilter,
    UnknownSchemaError,
    UnknownSourceError,
    decode_control,
    decode_header,
    event_at,
    parse_stream,
)
from changebus.schemas.files import NAME_RULE, safe_name
from changebus.schemas.server import (
    check_params,
    json_response,
    json_text,
    query_choice,
    query_float,
    query_int,
    query_parsed,
    server_app,
)

from ._buffer import Selection
from ._config import RelayConfig
from ._host import CachedResponse, PartitionHost
from ._metrics import RelayMetrics

__all__ = ["HOSTS", "build_app"]

log = logging.getLogger("changebus.relay.http")

HOSTS: web.AppKey[dict[str, PartitionHost]] = web.AppKey("hosts", dict)
CONFIG: web.AppKey[RelayConfig] = web.AppKey("config", RelayConfig)
METRICS: web.AppKey[RelayMetrics] = web.AppKey("metrics", RelayMetrics)

_ZERO_COPY_SAFE = sys.version_info < (3, 12)  # 3.11 transports copy unsent bytes


def _host(request: web.Request, name: str | None) -> PartitionHost:
    hosts = request.app[HOSTS]
    if name is None:
        if len(hosts) == 1:
            return next(iter(hosts.values()))
        raise BadRequestError(f"name the partition: one of {', '.join(sorted(hosts))}")
    if not safe_name(name):
        raise BadRequestError(f"partition name {name[:128]!r} must match {NAME_RULE}")
    try:
        return hosts[name]
    except KeyError:
        raise UnknownSourceError(
            f"no partition {name[:128]!r} here; known: {', '.join(sorted(hosts))}"
        ) from None


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
    cfg = request.app[CONFIG].http
    host = _host(request, query.get("partition"))
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
    wait = query_float(query, "wait", default=0.0, lo=0.0, hi=cfg.max_wait_s)
    fmt = query_choice(query, "format", ("binary", "ndjson"), default="binary")
    key_filter = query_parsed(query, "filter", PartitionFilter.parse)
    sources = _source_ids(host, query.get("sources"))
    client = query.get("client", "")[:128] or (request.remote or "unknown")

    if query_choice(query, "follow", ("0", "1"), default="0") == "1":
        if fmt != "binary":
            raise BadRequestError("follow=1 needs format=binary")
        budget = query_int(query, "follow_bytes", default=64 << 20, lo=1, hi=1 << 40)
        return await _follow(
            request, host, scn, offset, max_bytes, key_filter, sources, wait, budget, client
        )
    deadline = time.monotonic() + wait
    filter_text = query.get("filter")
    selection: Selection | CachedResponse | None
    while True:
        cache_key = (scn, offset, max_bytes, filter_text, sources, host.buffer.meta.tail_event)
        selection = host.cached_response(cache_key)
        if selection is None:
            selection = host.buffer.select(
                scn, offset, max_bytes, key_filter=key_filter, sources=sources
            )
        if selection is not None:
            break
        left = deadline - time.monotonic()
        if left <= 0:
            host.saw_consumer(client, scn, 0, request.remote or "")
            headers = _next_headers(host, scn, offset, checkpoint)
            return web.Response(status=204, headers=headers)
        await host.wait_for_window(left)

    metrics = request.app[METRICS]
    m = host.buffer.meta
    host.saw_consumer(client, scn, m.tail_pos - m.head_pos, request.remote or "")
    if isinstance(selection, Selection) and (fmt == "ndjson" or selection.nbytes <= _COPY_BYTES):
        # small, or for people: one copy, checked against the pin (OverwrittenError
        # when the writer overran it), shared with identical requests when small
        selection = _copy_out(
            host, selection, cache_key if selection.nbytes <= _COPY_BYTES else None, metrics
        )
    if isinstance(selection, CachedResponse):
        if fmt == "ndjson":
            return _ndjson_response(host, selection, checkpoint)
        return _small_response(host, selection, checkpoint, metrics)
    headers = _next_headers(host, selection.next_scn, selection.next_offset, checkpoint)
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
    ok = False
    try:
        await resp.prepare(request)
        for chunk in _coalesce(selection.views):
            await resp.write(chunk)
        if not _ZERO_COPY_SAFE and request.transport is not None:
            # newer asyncio transports keep references to unsent memoryviews:
            # wait until everything left the process before the pin goes
            request.transport.set_write_buffer_limits(high=0)
            await request.writer.drain()
    finally:
        ok = host.buffer.release(selection)
    if not ok:
        # the bytes may have been overwritten while being sent (the status is
        # gone already): end the body without its last chunk so the client
        # discards it
        metrics.overrun(host.name)
        if request.transport is not None:
            request.transport.abort()
        return resp
    await resp.write_eof()
    metrics.streamed(host.name, selection.nbytes, selection.events)
    return resp


_COALESCE_BYTES = 256 * 1024
_FOLLOW_SNDBUF = 64 * 1024
#: results up to this size are copied once (and shared), larger ones streamed zero-copy
_COPY_BYTES = 256 * 1024


def _copy_out(
    host: PartitionHost,
    selection: Selection,
    key: tuple[Any, ...] | None,
    metrics: RelayMetrics,
) -> CachedResponse:
    """Copy a selection out of the ring, release its pin, and cache the copy under ``key``.

    Raises :class:`OverwrittenError` (409, retriable) when the writer overran
    the pin while copying: the copy may be torn and is dropped. Every path
    that answers from a copy (small binary responses, ``format=ndjson``,
    follow pushes) goes through here.
    """
    try:
        body = b"".join(selection.views)
    finally:
        ok = host.buffer.release(selection)
    if not ok:
        metrics.overrun(host.name)
        raise OverwrittenError(
            f"partition {host.name}: the buffer's writer overran this response; repeat the request"
        )
    cached = CachedResponse(
        body,
        selection.next_scn,
        selection.next_offset,
        selection.events,
        selection.windows,
        selection.partial,
    )
    if key is not None:
        host.cache_response(key, cached)
    return cached


def _copy_headers(
    host: PartitionHost, cached: CachedResponse, checkpoint: Checkpoint | None
) -> dict[str, str]:
    headers = _next_headers(host, cached.next_scn, cached.next_offset, checkpoint)
    headers["X-Changebus-Events"] = str(cached.events)
    headers["X-Changebus-Windows"] = str(cached.windows)
    headers["X-Changebus-Partial"] = "1" if cached.partial else "0"
    return headers


def _small_response(
    host: PartitionHost,
    cached: CachedResponse,
    checkpoint: Checkpoint | None,
    metrics: RelayMetrics,
) -> web.Response:
    headers = _copy_headers(host, cached, checkpoint)
    metrics.streamed(host.name, len(cached.body), cached.events)
    return web.Response(
        body=cached.body, headers=headers, content_type="application/vnd.changebus.events"
    )


def _ndjson_response(
    host: PartitionHost, cached: CachedResponse, checkpoint: Checkpoint | None
) -> web.Response:
    return web.Response(
        body=_ndjson(host, cached.body),
        headers=_copy_headers(host, cached, checkpoint),
        content_type="application/x-ndjson",
    )


def _coalesce(views: list[memoryview]) -> list[memoryview | bytes]:
    """Runs to write: large runs as they are (zero copy), small ones joined.

    A filtered selection is many short runs; one write per run would cost a
    system call and an HTTP chunk each, so runs shorter than 64 KiB are
    gathered (one copy) into writes of about 256 KiB.
    """
    out: list[memoryview | bytes] = []
    pending: list[memoryview] = []
    pending_bytes = 0
    for view in views:
        if len(view) >= 64 * 1024:
            if pending:
                out.append(b"".join(pending))
                pending, pending_bytes = [], 0
            out.append(view)
            continue
        pending.append(view)
        pending_bytes += len(view)
        if pending_bytes >= _COALESCE_BYTES:
            out.append(b"".join(pending))
            pending, pending_bytes = [], 0
    if pending:
        out.append(pending[0] if len(pending) == 1 else b"".join(pending))
    return out


async def _follow(
    request: web.Request,
    host: PartitionHost,
    scn: int,
    offset: int,
    max_bytes: int,
    key_filter: PartitionFilter | None,
    sources: frozenset[int] | None,
    wait: float,
    budget: int,
    client: str,
) -> web.StreamResponse:
    """Follow mode: one held response; each new batch of windows is pushed as a chunk.

    The response ends when ``wait`` seconds pass with nothing new, when
    ``budget`` bytes were sent, or when the client goes away. Every push is a
    copy taken under a pin and checked before it is written, so every byte
    on the wire is valid; the client tracks its position from the
    END_OF_WINDOW events it reads (see docs/protocol.md 6.1).
    """
    metrics = request.app[METRICS]
    filter_text = request.query.get("filter")
    # fail before the 200 when the checkpoint is already too old
    host.buffer.locate(scn, offset)
    resp = web.StreamResponse(status=200, headers=_next_headers(host, scn, offset, None))
    resp.headers["X-Changebus-Follow"] = "1"
    resp.content_type = "application/vnd.changebus.events"
    resp.enable_chunked_encoding()
    transport = request.transport
    if transport is not None:
        # self-clocking: a small send buffer, and the next push only once the
        # previous one has left the process, so new windows gather here into
        # one larger push instead of queueing in socket buffers
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _FOLLOW_SNDBUF)
        transport.set_write_buffer_limits(high=0)
    await resp.prepare(request)
    sent = 0
    idle_until = time.monotonic() + wait
    while sent < budget:
        m = host.buffer.meta
        key = (scn, offset, max_bytes, filter_text, sources, m.tail_event)
        cached = host.cached_response(key)
        if cached is None:
            try:
                selection = host.buffer.select(
                    scn, offset, max_bytes, key_filter=key_filter, sources=sources
                )
            except ChangebusError as exc:  # e.g. evicted meanwhile: end the stream, client re-asks
                log.info("follow stream for %s ends: %s", client, exc.message)
                break
            if selection is None:
                left = idle_until - time.monotonic()
                if left <= 0:
                    break
                await host.wait_for_window(left)
                continue
            try:
                cached = _copy_out(host, selection, key, metrics)
            except OverwrittenError as exc:  # nothing torn was sent: end, the client re-asks
                log.info("follow stream for %s ends: %s", client, exc.message)
                break
        try:
            await resp.write(cached.body)
            await request.writer.drain()  # limits are 0: returns once the push left the process
        except ConnectionResetError:  # the consumer went away: nothing to report
            log.debug("follow stream for %s: the consumer disconnected", client)
            return resp
        # write and drain often complete without suspending; yield so that a
        # stream that always finds new windows cannot starve the others
        await asyncio.sleep(0)
        metrics.streamed(host.name, len(cached.body), cached.events)
        sent += len(cached.body)
        scn, offset = cached.next_scn, cached.next_offset
        host.saw_consumer(client, scn, m.tail_pos - m.head_pos, request.remote or "")
        idle_until = time.monotonic() + wait
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    return resp


def _next_headers(
    host: PartitionHost, scn: int, offset: int, current: Checkpoint | None
) -> dict[str, str]:
    m = host.buffer.meta
    headers = {
        "X-Changebus-Partition": host.name,
        "X-Changebus-Next-Scn": str(scn),
        "X-Changebus-Next-Offset": str(offset),
        "X-Changebus-Last-Scn": str(m.last_scn),
        "X-Changebus-Min-Scn": str(m.min_scn),
    }
    if host.epoch is not None:
        headers["X-Changebus-Epoch"] = str(host.epoch)
    if current is not None:
        pc = current.get(host.name)
        updated = (
            PartitionCheckpoint(
                window_scn=scn,
                window_offset=offset,
                prev_scn=scn if offset < 0 else pc.prev_scn,
                timestamp_ns=pc.timestamp_ns,
            )
            if scn >= 0
            else pc
        )
        headers["X-Changebus-Checkpoint"] = current.with_partition(host.name, updated).to_token()
    return headers


def _source_ids(host: PartitionHost, text: str | None) -> frozenset[int] | None:
    if text is None:
        return None
    ids = set()
    for name in (s.strip() for s in text.split(",")):
        if not name:
            continue
        try:
            ids.add(host.registry.source_id(name))
        except UnknownSchemaError:
            raise UnknownSourceError(f"partition {host.name} has no source {name!r}") from None
    return frozenset(ids)


def _ndjson(host: PartitionHost, body: bytes) -> bytes:
    """Decode events to JSON lines (for people; slower than binary)."""
    offsets, headers = parse_stream(body)
    lines = []
    decoders: dict[tuple[int, int], ChangeDecoder] = {}
    for off, h in zip(offsets.tolist(), headers, strict=True):
        op = Op(int(h["op"]))
        record: dict[str, Any] = {
            "scn": int(h["scn"]),
            "seq": int(h["seq"]),
            "op": op.name.lower(),
            "timestamp_ns": int(h["timestamp_ns"]),
        }
        header = decode_header(body, off)
        key, payload = event_at(body, off, header)
        if op.is_control:
            record["control"] = _control_json(op, bytes(payload))
        else:
            sid, version = int(h["source_id"]), int(h["schema_version"])
            dec = decoders.get((sid, version))
            if dec is None:
                table = host.registry.get(host.registry.name_for_id(sid), version)
                dec = decoders[(sid, version)] = ChangeDecoder(table)
            change = dec.decode(payload)
            record.update(
                source=dec.writer.name,
                key=dec.decode_key(key) if len(key) else None,
                after=change.after,
                before=change.before,
            )
            if change.after_not_sent:
                record["after_not_sent"] = list(change.after_not_sent)
            if change.before_not_sent:
                record["before_not_sent"] = list(change.before_not_sent)
        lines.append(json_text(record))
    return ("\n".join(lines) + "\n").encode() if lines else b""


def _control_json(op: Op, payload: bytes) -> dict[str, Any]:
    info = decode_control(op, payload)
    return {name: getattr(info, name) for name in info.__slots__}


async def sources(request: web.Request) -> web.Response:
    """``GET /v1/sources``: partitions and the logical sources they carry."""
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
            ],
        }
        for host in request.app[HOSTS].values()
    ]
    return json_response({"partitions": out})


async def schemas(request: web.Request) -> web.Response:
    """``GET /v1/schemas/{source}``: every version of a source's table schema."""
    name = request.match_info["source"]
    hosts = request.app[HOSTS]
    wanted = request.query.get("partition")
    found = []
    for host in hosts.values():
        if wanted is not None and host.name != wanted:
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


async def status(request: web.Request) -> web.Response:
    """``GET /v1/status``: per-partition buffer bounds, fetcher and consumers."""
    return json_response({"partitions": [h.status() for h in request.app[HOSTS].values()]})


def _readiness(hosts: dict[str, PartitionHost]) -> tuple[bool, dict[str, str]]:
    states = {
        h.name: f"{h.state}: {h.last_error}" if h.state == "fenced" else h.state
        for h in hosts.values()
    }
    return all(h.ready for h in hosts.values()), states


def build_app(config: RelayConfig, hosts: dict[str, PartitionHost]) -> web.Application:
    """The aiohttp application serving ``hosts``.

    ``hosts`` is read live (the relay fills it at start-up); the caller
    starts and stops the partitions, e.g. as a ``cleanup_ctx`` step
    (:class:`~._daemon.Relay`).
    """
    metrics = RelayMetrics(hosts)
    app = server_app("relay", readiness=lambda: _readiness(hosts), collectors=[metrics], logger=log)
    app[CONFIG] = config
    app[HOSTS] = hosts
    app[METRICS] = metrics
    app.router.add_get("/v1/stream", stream)
    app.router.add_get("/v1/sources", sources)
    app.router.add_get("/v1/schemas/{source}", schemas)
    app.router.add_get("/v1/status", status)
    return app
