"""The bootstrap server's HTTP API (aiohttp); documented in docs/protocol.md section 7.

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

The server frame (:mod:`changebus.schemas.server`) gives the app its error
middleware (every error leaves as JSON ``{"error": code, "message": ...,
"retriable": ...}`` with the status of its :class:`ChangebusError` class:
400 bad input, 404 unknown partition, 410 a position the server cannot
serve, 503 not able *yet*; an unexpected exception is logged and answered
with 500, never a crash), the query-parameter parsers (a malformed parameter
is always 400, never retried) and ``/healthz``, ``/readyz`` and
``/metrics``; this module adds the bootstrap routes.

Authorization (``[security]`` with principals, as on the relay): every
partition-taking request is 403 for a partition not granted; ``sources=``
naming a source not granted is 403, and a principal granted only some
sources gets only those (snapshot pages and catch-up windows) when it names
none; ``/v1/sources``, ``/v1/schemas`` and ``/v1/status`` show only what is
granted; ``POST /v1/seed`` and ``POST /v1/snapshot`` (:mod:`._http_admin`)
need scope ``admin``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

from aiohttp import web

from changebus.schemas import (
    MAX_SCN,
    UNATTACHED,
    BadRequestError,
    NotYetError,
    PartitionFilter,
    ScnNotFoundError,
    TableSchema,
    UnknownSourceError,
    event_mask,
    held_until_done,
    parse_stream,
)
from changebus.schemas.files import NAME_RULE, safe_name
from changebus.schemas.security import principal_of
from changebus.schemas.server import (
    MAX_DIGITS,
    CopyBudget,
    check_params,
    json_response,
    query_int,
    query_parsed,
    server_app,
)

from ._chunks import SnapshotScope
from ._http_admin import add_admin_routes
from ._metrics import BootstrapMetrics
from ._pagesend import BUDGET, PIECE_TIMEOUT, send_page
from ._plan import check_position, plan_bootstrap
from ._service import BootstrapService
from ._store import Store

__all__ = ["build_app"]

log = logging.getLogger("changebus.bootstrap.http")

SERVICE: web.AppKey[BootstrapService] = web.AppKey("service", BootstrapService)
METRICS: web.AppKey[BootstrapMetrics] = web.AppKey("metrics", BootstrapMetrics)
#: plans counted at once (each may count up to a million snapshot rows and twice as
#: many log events on a store reader thread): a few hundred concurrent ``start``
#: requests queued on the two readers, and every page, status and schema read waited
#: behind them (found by review). The rest wait here, on the loop, at most
#: :data:`PLAN_WAIT_S`, then get a retriable 503.
PLANS: web.AppKey[asyncio.Semaphore] = web.AppKey("plans", asyncio.Semaphore)
PLAN_WAIT_S = 10.0


_PARAMS = {
    "start": {"partition", "since", "mode"},
    "status": {"partition"},
    "snapshot": {"partition", "since", "start", "position", "max_bytes", "sources", "filter"},
    "catchup": {"partition", "after", "target", "max_bytes", "sources", "filter"},
}


def _check_params(request: web.Request, kind: str) -> None:
    check_params(request.query, _PARAMS[kind])


def _partition(request: web.Request) -> str:
    """The ``partition`` parameter (may be left out when there is one); 403 when not granted."""
    return partition_named(request, request.query.get("partition"))


def partition_named(request: web.Request, name: str | None) -> str:
    """Partition ``name`` (None: the only one); 400 malformed, 403 not granted, 404 unknown."""
    workers = request.app[SERVICE].workers
    principal = principal_of(request)

    def granted() -> str:
        # (errors name only the partitions the principal may read: the others cannot be probed)
        return ", ".join(sorted(w for w in workers if principal.allows_partition(w))) or "none"

    if name is None:
        if len(workers) == 1:
            name = next(iter(workers))
            principal.check_partition(name)
            return name
        raise BadRequestError(f"name the partition: one of {granted()}")
    if not safe_name(name):
        raise BadRequestError(f"partition name {name[:128]!r} must match {NAME_RULE}")
    principal.check_partition(name)  # before the lookup: 403 whether it exists or not
    if name not in workers:
        raise UnknownSourceError(f"no partition {name[:128]!r} here; known: {granted()}")
    return name


def _scn(request: web.Request, name: str, default: int | None = -1) -> int:
    """An SCN parameter (-1: none yet); required when ``default`` is None."""
    return query_int(request.query, name, default=default, lo=-1, hi=MAX_SCN)


def _max_bytes(request: web.Request) -> int:
    http = request.app[SERVICE].config.http
    return query_int(
        request.query, "max_bytes", default=http.default_page_bytes, lo=1, hi=http.max_page_bytes
    )


def _filter(request: web.Request) -> PartitionFilter | None:
    if not request.query.get("filter"):
        return None
    return query_parsed(request.query, "filter", PartitionFilter.parse)


async def _source_ids(request: web.Request, part: str) -> list[int] | None:
    """Ids of the ``sources`` parameter (None: all), limited to the principal's grant."""
    text = request.query.get("sources")
    principal = principal_of(request)
    wanted: set[str] | frozenset[str] = {s.strip() for s in (text or "").split(",") if s.strip()}
    if text is not None and not wanted:  # (as the relay: not "every source")
        raise BadRequestError("sources= names no source: name some, or leave sources out")
    if text is None and principal.sources is None:
        return None
    ids = await request.app[SERVICE].stores.read(lambda s: s.source_names(part))
    granted = principal.restrict_sources(wanted if text is not None else None, ids)
    if granted is not None:
        wanted = granted
    missing = sorted(wanted - set(ids))
    if missing:
        raise UnknownSourceError(f"partition {part} has no source(s) {', '.join(missing)}")
    return sorted(ids[n] for n in wanted)


async def start(request: web.Request) -> web.Response:
    """``GET /v1/bootstrap/start``: the snapshot SCN and whether a snapshot is needed."""
    _check_params(request, "start")
    part = _partition(request)
    since = _scn(request, "since")
    mode = request.query.get("mode", "auto")
    if mode not in ("auto", "catchup"):
        raise BadRequestError(f"mode {mode[:32]!r} must be auto or catchup")
    config = request.app[SERVICE].config
    ratio, seeding = config.catchup_ratio, request.app[SERVICE].seeds(part)
    w = request.app[SERVICE].workers.get(part)
    running = (
        w.seed_tables if w is not None and w.seeding is not None and not w.seeding.done() else None
    )
    visible = principal_of(request).allows_source
    plans = request.app[PLANS]
    try:
        async with asyncio.timeout(PLAN_WAIT_S):
            await plans.acquire()
    except TimeoutError:
        raise NotYetError(
            f"the bootstrap server is busy planning other bootstraps (more than"
            f" {PLAN_WAIT_S:g} s waiting); retry soon"
        ) from None
    # (a client that went away cancels this handler, not the plan in its reader thread:
    # the slot stays taken until that ends; review)
    plan = await held_until_done(
        request.app[SERVICE].stores.read(
            lambda s: plan_bootstrap(
                s, part, since, ratio, seeding, running, visible, catchup_only=mode == "catchup"
            )
        ),
        plans.release,
    )
    plans.release()
    return json_response(plan)


async def status(request: web.Request) -> web.Response:
    """``GET /v1/bootstrap/status``: the partition's positions (``producer_scn`` = target)."""
    _check_params(request, "status")
    part = _partition(request)
    st, lost, purged = await request.app[SERVICE].stores.read(
        lambda s: (s.state(part), s.lost_ranges(part), s.tomb_scn(part))
    )
    w = request.app[SERVICE].workers[part]
    return json_response(
        {
            "partition": part,
            "producer_scn": st.producer_scn,
            "applier_scn": st.applier_scn,
            "log_min_scn": st.log_min_scn,
            # every change after it is here, deletes included (old tombstones are purged)
            "base_scn": max(st.base_scn, purged),
            "tomb_scn": purged,
            "lost_ranges": [list(r) for r in lost],
            "state": w.current_state(),
        }
    )


_POSITION = re.compile(
    rf"([0-9]{{1,{MAX_DIGITS}}}):([0-9]{{1,{MAX_DIGITS}}})(?::([0-9a-f]{{16}}))?"
)


def _parse_position(text: str | None) -> tuple[tuple[int, int], str]:
    """``SOURCE:ROW[:STORE]`` of a snapshot page (two numbers in ``0..MAX_SCN``, the
    store's id); absent: the start. Returns the position and the store id ("": none)."""
    if not text:
        return (0, 0), ""
    m = _POSITION.fullmatch(text)
    if m is None:
        raise BadRequestError(f"position must be SOURCE:ROW[:STORE], got {text[:40]!r}")
    pos = (int(m[1]), int(m[2]))
    if max(pos) > MAX_SCN:
        raise BadRequestError(f"position numbers must be within 0..{MAX_SCN}")
    return pos, m[3] or ""


async def snapshot(request: web.Request) -> web.StreamResponse:
    """``GET /v1/bootstrap/snapshot``: one page of rows changed after ``since``."""
    _check_params(request, "snapshot")
    service = request.app[SERVICE]
    part = _partition(request)
    since = _scn(request, "since")
    start_scn = _scn(request, "start", None)
    position, of_store = _parse_position(request.query.get("position"))
    max_bytes = _max_bytes(request)
    key_filter = _filter(request)
    wanted = await _source_ids(request, part)

    def page(store: Store, limit: int) -> Any:
        if of_store and of_store != store.store_id:
            # row ids are a store's own: another store (a server behind the same URL,
            # a rebuilt one) would skip rows it never sent
            raise ScnNotFoundError(
                "the snapshot position is another store's (another server behind this "
                "URL, or a rebuilt store): run the snapshot again",
                restart_snapshot=True,
            )
        st = check_position(store, part, since, service.seeds(part))
        if start_scn > st.applier_scn:
            # another server behind this URL planned it, or this store is older (restored
            # from a backup): this one gets there, or the client's next try goes elsewhere
            raise NotYetError(
                f"snapshot SCN {start_scn} is past this server's snapshot (at "
                f"{st.applier_scn}): another server planned it; retry soon"
            )
        ids = wanted if wanted is not None else store.source_ids(part)
        found = store.snapshot_page(
            part,
            ids,
            since_scn=since,
            start_scn=start_scn,
            position=position,
            max_bytes=limit,
            key_filter=key_filter,
        )
        # the purge may delete tombstones while the page is read (statements of their own):
        # a page that may lack some of the deletes after ``since`` must not go out (the last
        # page would be taken as whole, and the catch-up after it never sends them)
        check_position(store, part, since, service.seeds(part))
        return found

    async def build(limit: int) -> tuple[bytes, dict[str, str]]:
        result, store_id = await service.stores.read(
            lambda store: (page(store, limit), store.store_id)
        )
        metrics = request.app[METRICS]
        metrics.rows_served[part] += result.events
        metrics.bytes_served[part] += len(result.data)
        return result.data, {
            "X-Changebus-Partition": part,
            "X-Changebus-Events": str(result.events),
            "X-Changebus-Snapshot-Position": (
                f"{result.position[0]}:{result.position[1]}:{store_id}"
            ),
            "X-Changebus-Snapshot-Complete": "1" if result.complete else "0",
        }

    return await send_page(request, max_bytes, build)


async def catchup(request: web.Request) -> web.StreamResponse:
    """``GET /v1/bootstrap/catchup``: whole log windows in ``(after, target]``."""
    _check_params(request, "catchup")
    service = request.app[SERVICE]
    part = _partition(request)
    after = _scn(request, "after", None)
    target = _scn(request, "target", None)
    if after > target:
        raise BadRequestError(f"after ({after}) must not be past target ({target})")
    max_bytes = _max_bytes(request)
    key_filter = _filter(request)
    wanted = await _source_ids(request, part)
    if wanted is not None and principal_of(request).sources is None:
        wanted = [UNATTACHED, *wanted]  # (a consumer's own choice: messages too)

    def pruned(store: Store) -> None:
        log_min = store.state(part).log_min_scn
        if after < log_min:
            raise ScnNotFoundError(
                f"catch-up from {after} needs log windows this server pruned (it keeps those "
                f"after {log_min}); run the snapshot again",
                log_min_scn=log_min,
            )

    def page(store: Store, limit: int) -> Any:
        pruned(store)
        st = store.state(part)
        if target > st.producer_scn:
            raise NotYetError(  # (as above: another server planned it)
                f"target {target} is past this server's log (it ends at {st.producer_scn}): "
                "another server planned it; retry soon"
            )
        found = store.catchup_page(part, after_scn=after, target_scn=target, max_bytes=limit)
        # the applier may prune while the page is read (statements of their own): a
        # page missing pruned windows must not go out as if it were whole
        pruned(store)
        data, events = found.data, found.events
        if data and (key_filter is not None or wanted is not None):
            # (here: a page's checks take long); the count is of what is sent: a count
            # of the whole page would tell a restricted principal of other sources
            data, events = _select(data, key_filter, wanted)
        return found, data, events

    async def build(limit: int) -> tuple[bytes, dict[str, str]]:
        result, data, events = await service.stores.read(lambda store: page(store, limit))
        metrics = request.app[METRICS]
        metrics.catchup_events[part] += events
        metrics.bytes_served[part] += len(data)
        return data, {
            "X-Changebus-Partition": part,
            "X-Changebus-Events": str(events),
            "X-Changebus-Last-Scn": str(result.last_scn),
            "X-Changebus-Complete": "1" if result.complete else "0",
        }

    return await send_page(request, max_bytes, build)


def _select(
    data: bytes, key_filter: PartitionFilter | None, wanted: list[int] | None
) -> tuple[bytes, int]:
    """Keep control events and the data events the consumer subscribed to (as the relay);
    with how many were kept."""
    offsets, headers = parse_stream(data)
    keep = event_mask(headers, key_filter, wanted)
    mv = memoryview(data)
    kept = b"".join(
        mv[o : o + n]
        for o, n, k in zip(
            offsets.tolist(), headers["total_length"].tolist(), keep.tolist(), strict=True
        )
        if k
    )
    return kept, int(keep.sum())


async def sources(request: web.Request) -> web.Response:
    """``GET /v1/sources``: as the relay's, from the schemas copied from it (those granted)."""
    service = request.app[SERVICE]
    principal = principal_of(request)
    out = []
    for part in service.workers:
        if not principal.allows_partition(part):
            continue
        rows = await service.stores.read(lambda s, p=part: s.schemas(p))  # type: ignore[misc]
        by: dict[int, tuple[str, list[int]]] = {}
        for sid, version, name, _j in rows:
            if not principal.allows_source(name):
                continue
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
    return json_response({"partitions": out})


async def schemas(request: web.Request) -> web.Response:
    """``GET /v1/schemas/{source}``: every version of a source's table schema."""
    name = request.match_info["source"]
    service = request.app[SERVICE]
    wanted = request.query.get("partition")
    principal = principal_of(request)
    principal.restrict_sources((name,), ())  # 403 when the source is not granted
    if wanted is not None:
        principal.check_partition(wanted)
    found = []
    for part in service.workers:
        if (wanted is not None and part != wanted) or not principal.allows_partition(part):
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
    return json_response({"source": name, "partitions": found})


#: status fields a principal granted only some sources does not see
_WHOLE_PARTITION = (
    "last_error",
    "applier_lag_events",
    "queued_bytes",
    "windows_appended",
    "events_appended",
    "events_applied",
    "tombstones_purged",
    "gap",
)


async def status_all(request: web.Request) -> web.Response:
    """``GET /v1/status``: every partition's producer, applier and seed.

    ``seed.jobs``: the chunked snapshots stored in progress (``cb_snapjob``):
    ``table``, ``scope`` (``table``, ``where`` or ``keys``), ``chunks`` and
    ``rows`` stored, ``first_tag`` (-1: none yet); a principal granted some
    sources sees only their jobs. A restarted server resumes them after
    their last chunk.
    """
    service = request.app[SERVICE]
    principal = principal_of(request)
    out = []
    for w in list(service.workers.values()):
        if not principal.allows_partition(w.name):
            continue
        st = w.status()
        if principal.sources is not None:
            # granted some sources only: the positions a consumer needs, not what tells of
            # the other sources (an error names their tables, the counts show their
            # traffic), as the relay's status does
            for key in _WHOLE_PARTITION:
                st.pop(key, None)
        seed = st["seed"]
        if principal.sources is not None and not seed.get("table"):
            seed["error"] = ""  # (between tables: an error may name any table or the source)
        if seed.get("table") and not principal.allows_source(seed["table"]):
            # a table not granted: its name, figures and error (a source's words) are hidden
            seed.update(
                table="",
                error="",
                rows=0,
                chunks=0,
                chunks_resumed=0,
                table_rows=0,
                table_estimate=-1,
                rows_per_s=0.0,
                eta_s=None,
            )
        # (a keys scope may be 1 MB of JSON: its kind is read without parsing the keys)
        jobs = await service.stores.read(
            lambda s, p=w.name: [  # type: ignore[misc]
                (j, SnapshotScope.kind_of_json(j.scope)) for j in s.snapshot_jobs(p)
            ]
        )
        st["seed"]["jobs"] = [
            {
                "table": j.table,
                "scope": kind,
                "chunks": j.chunks,
                "rows": j.rows,
                "first_tag": j.first_tag,
            }
            for j, kind in jobs
            if principal.allows_source(j.table)
        ]
        out.append(st)
    return json_response({"partitions": out})


def build_app(service: BootstrapService) -> web.Application:
    """The aiohttp application of ``service``.

    The caller starts and stops the service, e.g. as a ``cleanup_ctx`` step
    (:class:`~._daemon.BootstrapServer`).
    """
    metrics = BootstrapMetrics(service)
    app = server_app(
        "bootstrap",
        readiness=lambda: (
            service.ready,
            {w.name: w.current_state() for w in service.workers.values()},
        ),
        collectors=[metrics],
        logger=log,
        security=service.config.security,
    )
    app[SERVICE] = service
    app[METRICS] = metrics
    app[PLANS] = asyncio.Semaphore(1)  # (one of the two store readers; pages get the other)
    http = service.config.http
    app[BUDGET] = CopyBudget(http.max_copy_bytes, http.max_connections)
    app[PIECE_TIMEOUT] = http.write_timeout_s
    app.router.add_get("/v1/bootstrap/start", start)
    app.router.add_get("/v1/bootstrap/status", status)
    # (no HEAD: a streamed page would write its body anyway, and the next answer on the
    # connection would start inside it)
    app.router.add_get("/v1/bootstrap/snapshot", snapshot, allow_head=False)
    app.router.add_get("/v1/bootstrap/catchup", catchup, allow_head=False)
    add_admin_routes(app, service, partition_named)
    app.router.add_get("/v1/sources", sources)
    app.router.add_get("/v1/schemas/{source}", schemas)
    app.router.add_get("/v1/status", status_all)
    return app
