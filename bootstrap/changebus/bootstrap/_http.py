"""The bootstrap server's HTTP API (aiohttp); documented in docs/protocol.md section 8.

A consumer that fell off the relays (or starts from nothing) asks:

1. ``GET /v1/bootstrap/start?partition=P&since=SCN`` -- the plan: the
   snapshot SCN ``start_scn`` and whether a snapshot is needed at all (a
   consumer still covered by the log gets catch-up only when that is
   cheaper);
2. ``GET /v1/bootstrap/snapshot?...&since=&start=&position=`` -- pages of
   rows changed after ``since`` at their latest version, in a stable
   order; each page names the position to resume from;
3. ``GET /v1/bootstrap/status?partition=P`` -- ``producer_scn``: the
   catch-up target once the snapshot is done;
4. ``GET /v1/bootstrap/catchup?...&after=&target=`` -- whole log windows in
   ``(after, target]``;

then it returns to the relay after ``target``. The server keeps nothing per
consumer: every request carries its position. ``/v1/sources`` and
``/v1/schemas/{source}`` answer like the relay's (the relay's source ids),
so a consumer decodes pages exactly as relay responses.

Every error leaves as JSON ``{"error": code, "message": ..., "retriable":
...}`` with the status of its :class:`ChangebusError` class (400 bad input,
404 unknown partition, 410 a position the server cannot serve, 503 not able
*yet*); an unexpected exception is logged and answered with 500, never a
crash.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from changebus.schemas import (
    BadRequestError,
    ChangebusError,
    NotYetError,
    PartitionFilter,
    ScnNotFoundError,
    TableSchema,
    UnknownSourceError,
    event_mask,
    parse_stream,
)

from ._service import BootstrapService
from ._store import Store

__all__ = ["build_app"]

log = logging.getLogger("changebus.bootstrap.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class BootstrapMetrics:
    """Request counters plus a collector over the partition workers."""

    def __init__(self, service: BootstrapService) -> None:
        self._service = service
        self.requests: Counter[tuple[str, int]] = Counter()
        self.rows_served: Counter[str] = Counter()
        self.catchup_events: Counter[str] = Counter()
        self.bytes_served: Counter[str] = Counter()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def render(self) -> bytes:
        body: bytes = generate_latest(self.registry)
        return body

    def collect(self) -> Iterator[Any]:
        gauges = {
            "producer_scn": "Newest window SCN in the log",
            "applier_scn": "Newest window SCN folded into the snapshot",
            "applier_lag_events": "Log events not yet folded into the snapshot",
            "applier_lag_scn": "producer_scn - applier_scn",
            "log_min_scn": "Windows after this SCN are all in the log",
        }
        fams = {
            n: GaugeMetricFamily(f"changebus_bootstrap_{n}", h, labels=["partition"])
            for n, h in gauges.items()
        }
        counters = {
            "windows_appended": "Windows appended to the log",
            "events_appended": "Events appended to the log",
            "events_applied": "Log events folded into the snapshot",
            "producer_fell_off": "Times the producer fell off the relay",
        }
        cfams = {
            n: CounterMetricFamily(f"changebus_bootstrap_{n}", h, labels=["partition"])
            for n, h in counters.items()
        }
        ready = GaugeMetricFamily(
            "changebus_bootstrap_partition_ready",
            "1 when the partition's producer streams from the relay",
            labels=["partition", "state"],
        )
        for w in self._service.workers.values():
            st = w.status()
            st["applier_lag_scn"] = max(w.producer_scn - w.applier_scn, 0)
            for n in gauges:
                fams[n].add_metric([w.name], float(st[n]))
            st["producer_fell_off"] = w.fell_off
            for n in counters:
                cfams[n].add_metric([w.name], float(st[n]))
            ready.add_metric([w.name, w.state], 1.0 if w.state == "streaming" else 0.0)
        served = CounterMetricFamily(
            "changebus_bootstrap_served",
            "Snapshot rows, catch-up events and bytes sent",
            labels=["partition", "what"],
        )
        for name in self._service.workers:
            served.add_metric([name, "snapshot_rows"], float(self.rows_served[name]))
            served.add_metric([name, "catchup_events"], float(self.catchup_events[name]))
            served.add_metric([name, "bytes"], float(self.bytes_served[name]))
        requests = CounterMetricFamily(
            "changebus_bootstrap_http_requests",
            "HTTP requests by route and status",
            labels=["route", "status"],
        )
        for (route, code), count in sorted(self.requests.items()):
            requests.add_metric([route, str(code)], float(count))
        yield from fams.values()
        yield from cfams.values()
        yield from (ready, served, requests)


SERVICE: web.AppKey[BootstrapService] = web.AppKey("service", BootstrapService)
METRICS: web.AppKey[BootstrapMetrics] = web.AppKey("metrics", BootstrapMetrics)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    resource = request.match_info.route.resource
    route = resource.canonical if resource else "unmatched"
    try:
        response = await handler(request)
    except ChangebusError as exc:
        response = web.json_response(exc.to_json(), status=exc.http_status)
    except web.HTTPException as exc:
        response = web.json_response(
            {"error": "http", "message": exc.reason, "retriable": False}, status=exc.status
        )
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as exc:
        log.exception("unexpected error serving %s", request.path)
        response = web.json_response(
            {"error": "internal", "message": type(exc).__name__, "retriable": True}, status=500
        )
    request.app[METRICS].requests[(route, response.status)] += 1
    return response


_PARAMS = {
    "start": {"partition", "since"},
    "status": {"partition"},
    "snapshot": {"partition", "since", "start", "position", "max_bytes", "sources", "filter"},
    "catchup": {"partition", "after", "target", "max_bytes", "sources", "filter"},
    "seed": {"partition", "tables"},
}


def _check_params(request: web.Request, kind: str) -> None:
    unknown = sorted(set(request.query) - _PARAMS[kind])
    if unknown:
        raise BadRequestError(f"unknown parameter(s): {', '.join(unknown)}")


def _partition(request: web.Request) -> str:
    workers = request.app[SERVICE].workers
    name = request.query.get("partition")
    if name is None:
        if len(workers) == 1:
            return next(iter(workers))
        raise BadRequestError(f"name the partition: one of {', '.join(sorted(workers))}")
    if name not in workers:
        raise UnknownSourceError(f"no partition {name!r} here; known: {', '.join(sorted(workers))}")
    return name


def _int(request: web.Request, name: str, default: int | None, lo: int, hi: int) -> int:
    text = request.query.get(name)
    if text is None:
        if default is None:
            raise BadRequestError(f"parameter {name} is required")
        return default
    try:
        value = int(text)
    except ValueError:
        raise BadRequestError(f"parameter {name} must be an integer, got {text[:40]!r}") from None
    if not lo <= value <= hi:
        raise BadRequestError(f"parameter {name} must be within {lo}..{hi}, got {value}")
    return value


_MAX = 2**63 - 1


def _max_bytes(request: web.Request) -> int:
    http = request.app[SERVICE].config.http
    return _int(request, "max_bytes", http.default_page_bytes, 1, http.max_page_bytes)


def _filter(request: web.Request) -> PartitionFilter | None:
    text = request.query.get("filter")
    return PartitionFilter.parse(text) if text else None


async def _source_ids(request: web.Request, part: str) -> list[int] | None:
    """Ids of the ``sources`` parameter (None: all)."""
    text = request.query.get("sources")
    if not text:
        return None
    wanted = {s.strip() for s in text.split(",") if s.strip()}
    rows = await request.app[SERVICE].stores.read(lambda s: s.schemas(part))
    ids = {name: sid for sid, _v, name, _j in rows}
    missing = sorted(wanted - set(ids))
    if missing:
        raise UnknownSourceError(f"partition {part} has no source(s) {', '.join(missing)}")
    return sorted(ids[n] for n in wanted)


def _check_gap(store: Store, part: str, since: int) -> None:
    gap = store.gap(part)
    if gap is not None and since < gap:
        raise NotYetError(
            f"this server missed changes up to {gap} (its producer fell off the relay) and is "
            "seeding its snapshot again from the source; retry soon"
        )


def _plan(store: Store, part: str, since: int, ratio: float) -> dict[str, Any]:
    st = store.state(part)
    if 0 <= since < st.base_scn:
        raise ScnNotFoundError(
            f"position {since} is older than this bootstrap server's history (it holds every "
            f"change after {st.base_scn}); the consumer must start again from nothing",
            base_scn=st.base_scn,
        )
    if st.producer_scn < 0:
        raise NotYetError("the bootstrap server has no windows yet; retry soon")
    _check_gap(store, part, since)
    if since > st.producer_scn:
        raise NotYetError(
            f"the bootstrap server's log ends at {st.producer_scn}, before position {since}"
        )
    snapshot = True
    start = st.applier_scn
    if since >= st.log_min_scn:
        log_events = store.changed_since(part, since, st.producer_scn)
        rows = store.snapshot_changed(part, since, st.applier_scn)
        if log_events <= ratio * rows or st.applier_scn <= since:
            snapshot, start = False, since
            if start < 0:  # from nothing: just before the log's first window (an SCN >= 0)
                start = max(store.first_log_scn(part) - 1, 0)
    if snapshot and start < since:
        raise NotYetError(f"the snapshot is at {start}, before position {since}; retry soon")
    return {
        "partition": part,
        "since_scn": since,
        "start_scn": start,
        "snapshot": snapshot,
        "producer_scn": st.producer_scn,
        "applier_scn": st.applier_scn,
        "log_min_scn": st.log_min_scn,
        "base_scn": st.base_scn,
    }


async def start(request: web.Request) -> web.Response:
    """``GET /v1/bootstrap/start``: the snapshot SCN and whether a snapshot is needed."""
    _check_params(request, "start")
    part = _partition(request)
    since = _int(request, "since", -1, -1, _MAX)
    ratio = request.app[SERVICE].config.catchup_ratio
    plan = await request.app[SERVICE].stores.read(lambda s: _plan(s, part, since, ratio))
    return web.json_response(plan)


async def status(request: web.Request) -> web.Response:
    """``GET /v1/bootstrap/status``: the partition's positions (``producer_scn`` = target)."""
    _check_params(request, "status")
    part = _partition(request)
    st = await request.app[SERVICE].stores.read(lambda s: s.state(part))
    w = request.app[SERVICE].workers[part]
    return web.json_response(
        {
            "partition": part,
            "producer_scn": st.producer_scn,
            "applier_scn": st.applier_scn,
            "log_min_scn": st.log_min_scn,
            "base_scn": st.base_scn,
            "state": w.state,
        }
    )


def _parse_position(text: str | None) -> tuple[int, int]:
    if not text:
        return (0, 0)
    sid, sep, rid = text.partition(":")
    try:
        if not sep:
            raise ValueError
        pos = (int(sid), int(rid))
    except ValueError:
        raise BadRequestError(f"position must be SOURCE:ROW, got {text[:40]!r}") from None
    if pos[0] < 0 or pos[1] < 0:
        raise BadRequestError("position numbers must not be negative")
    return pos


def _binary(data: bytes, headers: dict[str, str]) -> web.Response:
    return web.Response(body=data, headers=headers, content_type="application/vnd.changebus.events")


async def snapshot(request: web.Request) -> web.Response:
    """``GET /v1/bootstrap/snapshot``: one page of rows changed after ``since``."""
    _check_params(request, "snapshot")
    service = request.app[SERVICE]
    part = _partition(request)
    since = _int(request, "since", -1, -1, _MAX)
    start_scn = _int(request, "start", None, -1, _MAX)
    position = _parse_position(request.query.get("position"))
    max_bytes = _max_bytes(request)
    key_filter = _filter(request)
    wanted = await _source_ids(request, part)

    def page(store: Store) -> Any:
        st = store.state(part)
        if 0 <= since < st.base_scn:
            raise ScnNotFoundError(
                f"position {since} is older than this bootstrap server's history "
                f"(after {st.base_scn})",
                base_scn=st.base_scn,
            )
        _check_gap(store, part, since)
        if start_scn > st.applier_scn:
            raise BadRequestError(
                f"snapshot SCN {start_scn} is not one this server gave (applier at {st.applier_scn})"
            )
        ids = wanted if wanted is not None else store.source_ids(part)
        return store.snapshot_page(
            part,
            ids,
            since_scn=since,
            start_scn=start_scn,
            position=position,
            max_bytes=max_bytes,
            key_filter=key_filter,
        )

    result = await service.stores.read(page)
    metrics = request.app[METRICS]
    metrics.rows_served[part] += result.events
    metrics.bytes_served[part] += len(result.data)
    return _binary(
        result.data,
        {
            "X-Changebus-Partition": part,
            "X-Changebus-Events": str(result.events),
            "X-Changebus-Snapshot-Position": f"{result.position[0]}:{result.position[1]}",
            "X-Changebus-Snapshot-Complete": "1" if result.complete else "0",
        },
    )


async def catchup(request: web.Request) -> web.Response:
    """``GET /v1/bootstrap/catchup``: whole log windows in ``(after, target]``."""
    _check_params(request, "catchup")
    service = request.app[SERVICE]
    part = _partition(request)
    after = _int(request, "after", None, -1, _MAX)
    target = _int(request, "target", None, -1, _MAX)
    if after > target:
        raise BadRequestError(f"after ({after}) must not be past target ({target})")
    max_bytes = _max_bytes(request)
    key_filter = _filter(request)
    wanted = await _source_ids(request, part)

    def page(store: Store) -> Any:
        st = store.state(part)
        if after < st.log_min_scn:
            raise ScnNotFoundError(
                f"catch-up from {after} needs log windows this server pruned (it keeps those "
                f"after {st.log_min_scn}); run the snapshot again",
                log_min_scn=st.log_min_scn,
            )
        if target > st.producer_scn:
            raise BadRequestError(
                f"target {target} is past this server's log (it ends at {st.producer_scn})"
            )
        return store.catchup_page(part, after_scn=after, target_scn=target, max_bytes=max_bytes)

    result = await service.stores.read(page)
    data = result.data
    if data and (key_filter is not None or wanted is not None):
        data = _select(data, key_filter, wanted)
    metrics = request.app[METRICS]
    metrics.catchup_events[part] += result.events
    metrics.bytes_served[part] += len(data)
    return _binary(
        data,
        {
            "X-Changebus-Partition": part,
            "X-Changebus-Events": str(result.events),
            "X-Changebus-Last-Scn": str(result.last_scn),
            "X-Changebus-Complete": "1" if result.complete else "0",
        },
    )


def _select(data: bytes, key_filter: PartitionFilter | None, wanted: list[int] | None) -> bytes:
    """Keep control events and the data events the consumer subscribed to (as the relay)."""
    offsets, headers = parse_stream(data)
    keep = event_mask(headers, key_filter, wanted)
    mv = memoryview(data)
    return b"".join(
        mv[o : o + n]
        for o, n, k in zip(
            offsets.tolist(), headers["total_length"].tolist(), keep.tolist(), strict=True
        )
        if k
    )


async def seed(request: web.Request) -> web.Response:
    """``POST /v1/seed?partition=P&tables=a,b``: (re-)seed tables from the source (202)."""
    _check_params(request, "seed")
    part = _partition(request)
    tables = [t.strip() for t in request.query.get("tables", "").split(",") if t.strip()]
    progress = request.app[SERVICE].start_seed(part, tables, again=True)
    return web.json_response({"partition": part, "seed": progress.as_dict()}, status=202)


async def sources(request: web.Request) -> web.Response:
    """``GET /v1/sources``: as the relay's, from the schemas copied from it."""
    service = request.app[SERVICE]
    out = []
    for part in service.workers:
        rows = await service.stores.read(lambda s, p=part: s.schemas(p))  # type: ignore[misc]
        by: dict[int, tuple[str, list[int]]] = {}
        for sid, version, name, _j in rows:
            by.setdefault(sid, (name, []))[1].append(version)
        out.append(
            {
                "partition": part,
                "sources": [
                    {"id": sid, "name": name, "versions": versions}
                    for sid, (name, versions) in sorted(by.items())
                ],
            }
        )
    return web.json_response({"partitions": out})


async def schemas(request: web.Request) -> web.Response:
    """``GET /v1/schemas/{source}``: every version of a source's table schema."""
    name = request.match_info["source"]
    service = request.app[SERVICE]
    wanted = request.query.get("partition")
    found = []
    for part in service.workers:
        if wanted is not None and part != wanted:
            continue
        rows = await service.stores.read(lambda s, p=part: s.schemas(p))  # type: ignore[misc]
        versions = [(sid, v, j) for sid, v, n, j in rows if n == name]
        if not versions:
            continue
        found.append(
            {
                "partition": part,
                "source_id": versions[0][0],
                "versions": [
                    {
                        "version": v,
                        "fingerprint": f"{TableSchema.from_json(json.loads(j)).fingerprint:016x}",
                        "schema": json.loads(j),
                    }
                    for _sid, v, j in versions
                ],
            }
        )
    if not found:
        raise UnknownSourceError(f"no source {name!r} on this bootstrap server")
    return web.json_response({"source": name, "partitions": found})


async def status_all(request: web.Request) -> web.Response:
    """``GET /v1/status``: every partition's producer and applier."""
    service = request.app[SERVICE]
    return web.json_response({"partitions": [w.status() for w in service.workers.values()]})


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    states = {w.name: w.state for w in service.workers.values()}
    ready = service.ready
    return web.json_response({"ready": ready, "partitions": states}, status=200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(
        body=request.app[METRICS].render(),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


def build_app(service: BootstrapService) -> web.Application:
    """The aiohttp application of ``service`` (started and stopped by the caller)."""
    app = web.Application(middlewares=[_errors], client_max_size=64 * 1024)
    app[SERVICE] = service
    app[METRICS] = BootstrapMetrics(service)
    app.router.add_get("/v1/bootstrap/start", start)
    app.router.add_get("/v1/bootstrap/status", status)
    app.router.add_get("/v1/bootstrap/snapshot", snapshot)
    app.router.add_get("/v1/bootstrap/catchup", catchup)
    app.router.add_post("/v1/seed", seed)
    app.router.add_get("/v1/sources", sources)
    app.router.add_get("/v1/schemas/{source}", schemas)
    app.router.add_get("/v1/status", status_all)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app
