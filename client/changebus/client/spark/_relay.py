"""Driver-side relay queries of the Spark source: bounds, schemas, row-limited ends.

The Spark driver plans micro-batches; it never reads rows. It needs four
answers from the relays, each a short HTTP exchange:

* :func:`partition_bounds` -- per physical partition the newest window SCN
  (``max_scn``, the end of "everything available"), the oldest kept window
  (``min_scn``) and the position just before it (``prev_scn``: where an
  ``earliest`` start resolves to, so that the first batch names a concrete
  range that replays identically or fails loudly once evicted);
* :func:`table_schemas` -- the newest schema version of each subscribed
  source (the Spark schema is derived from these);
* :func:`split_points` -- SCNs that cut a batch's range into sub-ranges
  of similar volume for ``splitBy=scn`` (counted by the relay, one short
  request per partition);
* :func:`end_within` -- the SCN at which a batch starting after ``since``
  holds at most ``max_events`` change events and ``max_bytes`` event bytes,
  ending on a window boundary (admission control; also how many events are
  available, for ``minRowsPerTrigger``). It reads the range's binary events
  once and counts the data events per window from the headers alone (no row
  decoding).

Each call tries the relays in the configured order, once each, through
:class:`~changebus.client.RelayQueries` (the client's one failover
mechanism: retriable errors -- connection failures, 5xx, an answer that is
not JSON -- move to the next relay, others end the call); when none answers
it raises :class:`~changebus.client.RelayUnavailableError`. The JSON
questions are :class:`~changebus.client.RelayInfo`'s; error answers of
stream requests are mapped by :func:`~.._http.response_error` (a 410 is
:class:`~changebus.client.FellOffRelayError`). The functions are
coroutines; :func:`run_sync` runs one to completion from blocking code (the
Spark driver's Python runner has no event loop of its own). Nothing is kept
between calls, so there is nothing to share between threads.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import aiohttp
import numpy as np

from changebus.schemas import (
    FIRST_CONTROL_OP,
    ChangebusError,
    Op,
    TableSchema,
    UnknownSourceError,
    parse_stream,
)

from .._errors import RelayUnavailableError
from .._http import open_session, read_body, response_error
from .._info import RelayInfo, RelayQueries
from ._options import SourceOptions

__all__ = [
    "Extent",
    "PartitionBounds",
    "bootstrap_target",
    "end_within",
    "partition_bounds",
    "planner_params",
    "position_at_time",
    "run_sync",
    "split_points",
    "table_schemas",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
#: requests to one relay made at a time for a list of sources or partitions (:func:`_each`)
PARALLEL_REQUESTS = 16
_EOW = int(Op.END_OF_WINDOW)


@dataclass(frozen=True, slots=True)
class PartitionBounds:
    """What one relay partition holds now: ``(prev_scn, max_scn]`` in windows.

    ``max_scn`` is -1 when the buffer is empty; ``newest_timestamp_ns`` the
    commit time of ``max_scn``; ``evicted``: windows before ``prev_scn`` were
    evicted or lost (false: ``prev_scn`` is where the relay began; a relay
    that does not say counts as evicted once it has a ``prev_scn``), and
    ``evicted_timestamp_ns`` the commit time of the window at ``prev_scn``
    (0: not known).
    """

    name: str
    min_scn: int
    max_scn: int
    prev_scn: int
    newest_timestamp_ns: int
    evicted: bool = True
    evicted_timestamp_ns: int = 0

    @property
    def reached(self) -> int:
        """The newest SCN the relay is complete to: ``max_scn``, or ``prev_scn`` while its
        buffer is empty (a relay just started, or all evicted)."""
        return self.max_scn if self.max_scn >= 0 else self.prev_scn


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on a private event loop (for the Spark driver's blocking calls)."""
    return asyncio.run(coro)


async def _with_relays(
    opts: SourceOptions,
    call: Callable[[RelayInfo], Awaitable[T]],
    urls: tuple[str, ...] = (),
    *,
    partition: str | None = None,
) -> T:
    """``call(info)`` on the first of ``urls`` (default: the relays) that answers, each once.

    With ``opts.zookeeper`` the relays are read from the routing table first:
    those serving ``partition`` (every partition's when None), then the ones
    ``opts`` holds, in case the table lists nobody now.
    """
    what = "bootstrap server" if urls else "relay"
    if not urls:
        urls = await relay_urls(opts, partition)
    return await _ask(opts, urls, call, what)


async def _ask(
    opts: SourceOptions,
    urls: tuple[str, ...],
    call: Callable[[RelayInfo], Awaitable[T]],
    what: str = "relay",
) -> T:
    timeout = aiohttp.ClientTimeout(total=opts.request_timeout_s)
    async with await open_session(opts.auth, timeout=timeout) as session:
        return await RelayQueries(session, urls, what=what, timeout=timeout).first(call)


async def relay_urls(opts: SourceOptions, partition: str | None = None) -> tuple[str, ...]:
    """The relays to ask about ``partition`` (any partition: None), in order."""
    if not opts.zookeeper:
        return opts.relays
    return _with_configured(opts, await cluster_routes(opts), partition)


def _with_configured(
    opts: SourceOptions, routes: Mapping[str, tuple[str, ...]], partition: str | None
) -> tuple[str, ...]:
    if partition is None:
        table = [url for urls in routes.values() for url in urls]
    else:
        table = list(routes.get(partition, ()))
    urls = tuple(dict.fromkeys([*table, *opts.relays]))
    if not urls:
        raise _no_relay(opts, partition)
    return urls


async def _by_relays(
    opts: SourceOptions, partitions: list[str]
) -> list[tuple[tuple[str, ...], list[str]]]:
    """``partitions`` grouped by the relays to ask about them (one group without a cluster)."""
    if not opts.zookeeper:
        return [(opts.relays, partitions)] if partitions else []
    routes = await cluster_routes(opts)
    groups: dict[tuple[str, ...], list[str]] = {}
    for part in partitions:
        groups.setdefault(_with_configured(opts, routes, part), []).append(part)
    return list(groups.items())


def _no_relay(opts: SourceOptions, partition: str | None = None) -> RelayUnavailableError:
    which = partition if partition is not None else ", ".join(opts.partitions) or "any partition"
    return RelayUnavailableError(
        f"no relay of cluster {opts.cluster!r} (ZooKeeper {opts.zookeeper}) serves"
        f" {which}; start one or check the options cluster and partitions"
    )


async def cluster_routes(opts: SourceOptions) -> dict[str, tuple[str, ...]]:
    """Per partition read (every one the table knows without ``opts.partitions``), its relays."""
    from .._cluster import read_routes  # kazoo only for queries of a cluster

    return await read_routes(
        opts.zookeeper,
        opts.cluster,
        opts.partitions,
        kind="relay",
        prefer_followers=opts.prefer_followers,
    )


async def cluster_urls(opts: SourceOptions, kind: str) -> tuple[str, ...]:
    """The URLs of ``kind`` serving ``opts.partitions``, from the cluster's routing table."""
    from .._cluster import read_route  # kazoo only for queries of a cluster

    return await read_route(
        opts.zookeeper,
        opts.cluster,
        opts.partitions,
        kind=kind,
        prefer_followers=opts.prefer_followers,
    )


async def resolve_cluster(opts: SourceOptions) -> SourceOptions:
    """``opts`` with the relays (and bootstrap servers) of its cluster filled in.

    Planning time, on the driver: without ``zookeeper`` ``opts`` as it is.
    The table's relays come first, the configured ones after them; the
    configured bootstrap servers win over the table's.
    """
    if not opts.zookeeper:
        return opts
    relays = tuple(dict.fromkeys(await cluster_urls(opts, "relay") + opts.relays))
    if not relays:
        raise _no_relay(opts)
    bootstrap = opts.bootstrap or await cluster_urls(opts, "bootstrap")
    return replace(opts, relays=relays, bootstrap=bootstrap)


async def partition_bounds(opts: SourceOptions) -> dict[str, PartitionBounds]:
    """Bounds of the partitions ``opts`` reads (all of the relays' when none are named).

    In a cluster every partition is asked of the relays serving it (the
    routing table's partitions when none are named): members may serve
    different partitions.
    """
    if opts.zookeeper:
        routes = await cluster_routes(opts)
        names = list(opts.partitions) or sorted(routes)
        # one status request per set of relays (each answers for all its partitions):
        # one per partition cost a trigger what the partitions are many, squared
        by: dict[tuple[str, ...], list[str]] = {}
        for name in names:
            by.setdefault(_with_configured(opts, routes, name), []).append(name)
        groups = list(by.items())
    else:
        names = list(opts.partitions)
        groups = [(opts.relays, names)]
    found: dict[str, PartitionBounds] = {}
    for urls, parts in groups:
        status = await _ask(opts, urls, RelayInfo.status)
        for name, p in status.items():
            if not parts or name in parts:
                found[name] = PartitionBounds(
                    name,
                    p.min_scn,
                    p.max_scn,
                    p.prev_scn,
                    p.newest_timestamp_ns,
                    bool(p.raw.get("evicted", p.prev_scn >= 0)),
                    int(p.raw.get("evicted_timestamp_ns") or 0),
                )
    if not names:
        if not found:
            raise UnknownSourceError("the relay serves no partitions")
        return dict(sorted(found.items()))
    missing = [p for p in names if p not in found]
    if missing:
        raise UnknownSourceError(
            f"option partitions: the relay has no partition(s) {missing}; it has {sorted(found)}"
        )
    return {p: found[p] for p in names}


async def _each(ask: Callable[[str], Awaitable[T]], names: list[str]) -> list[T]:
    """``ask(name)`` for every name, :data:`PARALLEL_REQUESTS` at a time, in ``names``'
    order; a failure is raised as itself (the others are cancelled)."""
    gate = asyncio.Semaphore(PARALLEL_REQUESTS)

    async def one(name: str) -> T:
        async with gate:
            return await ask(name)

    try:
        async with asyncio.TaskGroup() as group:
            asked = [group.create_task(one(name)) for name in names]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [task.result() for task in asked]


async def table_schemas(opts: SourceOptions, partitions: list[str]) -> dict[str, TableSchema]:
    """The newest schema of every source read, by source name, in the relays' order."""

    async def call(info: RelayInfo, parts: list[str]) -> list[tuple[str, TableSchema | None]]:
        names: list[str] = []
        for part in (await info.sources()).values():
            if part.name in parts:
                names.extend(s.name for s in part.sources)
        names = list(dict.fromkeys(names))
        if opts.sources:
            names = [n for n in opts.sources if n in names]

        async def newest_of(name: str) -> tuple[str, TableSchema | None]:
            newest: TableSchema | None = None
            for found in (await info.schemas(name)).values():
                if found.partition not in parts or not found.schemas:
                    continue
                if newest is None or found.newest.version > newest.version:
                    newest = found.newest
            return name, newest

        # (one after the other, a query of 3,000 tables waited 3,000 round trips)
        return await _each(newest_of, names)

    seen: list[str] = []
    out: dict[str, TableSchema] = {}
    for urls, parts in await _by_relays(opts, partitions):
        for name, newest in await _ask(opts, urls, functools.partial(call, parts=parts)):
            seen.append(name)
            have = out.get(name)
            if newest is not None and (have is None or newest.version > have.version):
                out[name] = newest
    if opts.sources:
        missing = [s for s in opts.sources if s not in seen]
        if missing:
            raise UnknownSourceError(
                f"option sources: the relay has no source(s) {missing} in partitions"
                f" {partitions}; it has {list(dict.fromkeys(seen))}"
            )
        return {n: out[n] for n in opts.sources if n in out}
    return {n: out[n] for n in dict.fromkeys(seen) if n in out}


async def split_points(
    opts: SourceOptions, ranges: Mapping[str, tuple[int, int]], parts: int
) -> dict[str, list[int]]:
    """SCNs cutting each partition's range ``(since, until]`` into ``parts`` similar sub-ranges.

    The relay counts the range's events (exactly, or between its indexed
    windows for long ranges), so the cuts follow the volume even where SCNs
    do not (a source whose clock also
    moves for tables not captured). Empty when the relays cannot answer
    (an older relay without ``/v1/splits``, none reachable): the caller then
    cuts the SCN range evenly. A relay may return fewer cuts than asked.
    """
    if parts < 2 or not ranges:
        return {}

    async def call(info: RelayInfo, names: list[str]) -> dict[str, list[int]]:
        async def cuts(n: str) -> list[int]:
            return await info.splits(n, *ranges[n], parts, opts.sources)

        # (planned on every trigger: one after the other, 300 partitions were 300 round trips)
        return dict(zip(names, await _each(cuts, names), strict=True))

    try:
        out: dict[str, list[int]] = {}
        for urls, names in await _by_relays(opts, list(ranges)):
            out.update(await _ask(opts, urls, functools.partial(call, names=names)))
        return out
    except ChangebusError as exc:
        log.info("changebus: no split points from the relays (%s); cutting SCN ranges evenly", exc)
        return {}


@dataclass(frozen=True, slots=True)
class Extent:
    """How far a batch from some ``since`` goes: its last window ``end``, and what it holds.

    ``events`` counts the data events (change events) of the windows in
    ``(since, end]``, ``size`` their bytes (envelope: header, key and payload,
    as the relay sends them); control events count for neither.
    """

    end: int
    events: int
    size: int


def planner_params(opts: SourceOptions, partition: str, scn: int, offset: int) -> dict[str, str]:
    """The query of one driver-side ``/v1/stream`` scan step (no wait, the query's filters)."""
    params = {
        "partition": partition,
        "scn": str(scn),
        "offset": str(offset),
        "max_bytes": str(opts.max_bytes_per_request),
        "wait": "0",
        "client": "spark-planner",
    }
    if opts.sources:
        params["sources"] = ",".join(opts.sources)
    if opts.key_filter is not None:
        params["filter"] = str(opts.key_filter)
    return params


async def end_within(
    opts: SourceOptions,
    partition: str,
    since: int,
    until: int,
    *,
    max_events: int = 0,
    max_bytes: int = 0,
) -> Extent:
    """The last window SCN in ``(since, until]`` keeping a batch within both limits.

    A limit of 0 is no limit. Counts the data events of ``opts.sources`` and
    ``opts.key_filter`` and their bytes window by window from ``since`` on,
    from the event headers alone (no row decoding). The first window is
    always taken whole, even when it alone is larger (a transaction is never
    split); the batch then ends before the first window that would exceed a
    limit, or at the window that reaches one. The end is ``until`` when the
    whole range fits, and ``since`` only when the range holds no window.
    """
    if until <= since:
        return Extent(since, 0, 0)

    def over(events: int, size: int) -> bool:
        return (0 < max_events < events) or (0 < max_bytes < size)

    def full(events: int, size: int) -> bool:
        return (0 < max_events <= events) or (0 < max_bytes <= size)

    async def call(info: RelayInfo) -> Extent:
        scn, offset = since, -1
        count = size = 0
        end = since
        window_events = window_size = 0
        while True:
            params = planner_params(opts, partition, scn, offset)
            async with info.session.get(f"{info.url}/v1/stream", params=params) as resp:
                if resp.status == 204:
                    return Extent(end, count, size)
                if resp.status != 200:
                    raise await response_error(
                        resp, info.where, kind="stream", partition=partition, requested_scn=scn
                    )
                body_bytes = await read_body(resp, opts.max_window_bytes, info.where)
                next_scn = int(resp.headers["X-Changebus-Next-Scn"])
                next_offset = int(resp.headers["X-Changebus-Next-Offset"])
            if not body_bytes:
                return Extent(end, count, size)
            _, headers = parse_stream(body_bytes, verify_payload=False)
            ops = headers["op"]
            scns = headers["scn"]
            data = ops < FIRST_CONTROL_OP
            # running totals of data events and their bytes: a window's share is a difference
            events_upto = np.cumsum(data)
            bytes_upto = np.cumsum(np.where(data, headers["total_length"].astype(np.int64), 0))
            start = 0
            before_events = before_bytes = 0
            for e in np.flatnonzero(ops == _EOW).tolist():
                upto_events, upto_bytes = int(events_upto[e]), int(bytes_upto[e])
                window_events += upto_events - before_events
                window_size += upto_bytes - before_bytes
                before_events, before_bytes = upto_events, upto_bytes
                wscn = int(scns[e])
                if wscn > until:
                    return Extent(end, count, size)
                if end != since and over(count + window_events, size + window_size):
                    return Extent(end, count, size)
                count += window_events
                size += window_size
                window_events = window_size = 0
                end = wscn
                start = e + 1
                if full(count, size) or end >= until:
                    return Extent(end, count, size)
            if start < len(ops):  # a window cut by max_bytes: it continues in the next response
                window_events += int(events_upto[-1]) - before_events
                window_size += int(bytes_upto[-1]) - before_bytes
            scn, offset = next_scn, next_offset

    return await _with_relays(opts, call, partition=partition)


async def position_at_time(opts: SourceOptions, bounds: PartitionBounds, time_ns: int) -> int:
    """The position before the first window committed at/after ``time_ns`` (binary search).

    The result ``p`` is the last window committed before ``time_ns``: a
    start continues at the first window at or after it, an end includes the
    windows committed before it (Kafka's ``endingTimestamp`` is exclusive
    too; an inclusive end read a window committed exactly then twice when
    one read ended and the next began at that time: found by review).
    Bounded by the relay's buffer: before the oldest kept
    window gives ``prev_scn``, after the newest ``max_scn``. Commit times
    follow commit order, so each probe (the first event after a position,
    ``max_bytes=1``) halves the SCN interval; about 40 probes for Postgres LSNs.
    """

    def passes(ts: int) -> bool:
        return ts >= time_ns

    async def call(info: RelayInfo) -> int:
        lo, hi = bounds.prev_scn, max(bounds.max_scn, bounds.prev_scn)
        while lo < hi:
            mid = (lo + hi) // 2
            params = {
                "partition": bounds.name,
                "scn": str(mid),
                "offset": "-1",
                "max_bytes": "1",
                "wait": "0",
                "client": "spark-planner",
            }
            async with info.session.get(f"{info.url}/v1/stream", params=params) as resp:
                if resp.status == 204:
                    hi = mid
                    continue
                if resp.status != 200:
                    raise await response_error(
                        resp, info.where, kind="stream", partition=bounds.name, requested_scn=mid
                    )
                body = await read_body(resp, opts.max_window_bytes, info.where)
            _, headers = parse_stream(body, verify_payload=False)
            first_scn = int(headers["scn"][0])
            if passes(int(headers["timestamp_ns"][0])):
                hi = mid
            else:
                lo = max(first_scn, mid + 1)
        return lo

    return await _with_relays(opts, call, partition=bounds.name)


async def bootstrap_target(opts: SourceOptions, partition: str) -> int:
    """The newest SCN a bootstrap server holds for ``partition`` (its catch-up target now).

    Tries ``opts.bootstrap`` in order, like the relays; raises
    :class:`~changebus.client.RelayUnavailableError` when none answers.
    """

    async def call(info: RelayInfo) -> int:
        return (await info.bootstrap_status(partition)).producer_scn

    return await _with_relays(opts, call, urls=opts.bootstrap)
