"""Driver-side relay queries of the Spark source: bounds, schemas, row-limited ends.

The Spark driver plans micro-batches; it never reads rows. It needs three
answers from the relays, each a short HTTP exchange:

* :func:`partition_bounds` -- per physical partition the newest window SCN
  (``max_scn``, the end of "everything available"), the oldest kept window
  (``min_scn``) and the position just before it (``prev_scn``: where an
  ``earliest`` start resolves to, so that the first batch names a concrete
  range that replays identically or fails loudly once evicted);
* :func:`table_schemas` -- the newest schema version of each subscribed
  source (the Spark schema is derived from these);
* :func:`end_after_rows` -- the SCN at which a batch starting after ``since``
  holds at most ``max_events`` change events, ending on a window boundary
  (admission control). It reads the range's binary events once and counts
  the data events per window from the headers alone (no row decoding).

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
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import aiohttp
import numpy as np

from changebus.schemas import (
    FIRST_CONTROL_OP,
    Op,
    TableSchema,
    UnknownSourceError,
    parse_stream,
)

from .._errors import RelayUnavailableError
from .._http import open_session, response_error
from .._info import RelayInfo, RelayQueries
from ._options import SourceOptions

__all__ = [
    "PartitionBounds",
    "bootstrap_target",
    "end_after_rows",
    "partition_bounds",
    "position_at_time",
    "run_sync",
    "table_schemas",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
_EOW = int(Op.END_OF_WINDOW)


@dataclass(frozen=True, slots=True)
class PartitionBounds:
    """What one relay partition holds now: ``(prev_scn, max_scn]`` in windows.

    ``max_scn`` is -1 when the buffer is empty; ``newest_timestamp_ns`` the
    commit time of ``max_scn``.
    """

    name: str
    min_scn: int
    max_scn: int
    prev_scn: int
    newest_timestamp_ns: int


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on a private event loop (for the Spark driver's blocking calls)."""
    return asyncio.run(coro)


async def _with_relays(
    opts: SourceOptions,
    call: Callable[[RelayInfo], Awaitable[T]],
    urls: tuple[str, ...] = (),
) -> T:
    """``call(info)`` on the first of ``urls`` (default: the relays) that answers, each once.

    With ``opts.zookeeper`` the relays are read from the routing table first
    (then the ones ``opts`` holds, in case the table lists nobody now).
    """
    timeout = aiohttp.ClientTimeout(total=opts.request_timeout_s)
    what = "bootstrap server" if urls else "relay"
    if not urls:
        urls = opts.relays
        if opts.zookeeper:
            urls = tuple(dict.fromkeys(await cluster_urls(opts, "relay") + opts.relays))
        if not urls:
            raise _no_relay(opts)
    async with await open_session(opts.auth, timeout=timeout) as session:
        return await RelayQueries(session, urls, what=what, timeout=timeout).first(call)


def _no_relay(opts: SourceOptions) -> RelayUnavailableError:
    return RelayUnavailableError(
        f"no relay of cluster {opts.cluster!r} (ZooKeeper {opts.zookeeper}) serves"
        f" {', '.join(opts.partitions) or 'any partition'}; start one or check the"
        " options cluster and partitions"
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
    """Bounds of the partitions ``opts`` reads (all of the relay's when none are named)."""

    status = await _with_relays(opts, RelayInfo.status)
    found = {
        name: PartitionBounds(name, p.min_scn, p.max_scn, p.prev_scn, p.newest_timestamp_ns)
        for name, p in status.items()
    }
    if not opts.partitions:
        if not found:
            raise UnknownSourceError("the relay serves no partitions")
        return dict(sorted(found.items()))
    missing = [p for p in opts.partitions if p not in found]
    if missing:
        raise UnknownSourceError(
            f"option partitions: the relay has no partition(s) {missing}; it has {sorted(found)}"
        )
    return {p: found[p] for p in opts.partitions}


async def table_schemas(opts: SourceOptions, partitions: list[str]) -> dict[str, TableSchema]:
    """The newest schema of every source read, by source name, in the relay's order."""

    async def call(info: RelayInfo) -> dict[str, TableSchema]:
        names: list[str] = []
        for part in (await info.sources()).values():
            if part.name in partitions:
                names.extend(s.name for s in part.sources)
        names = list(dict.fromkeys(names))
        if opts.sources:
            missing = [s for s in opts.sources if s not in names]
            if missing:
                raise UnknownSourceError(
                    f"option sources: the relay has no source(s) {missing} in partitions"
                    f" {partitions}; it has {names}"
                )
            names = list(opts.sources)
        out: dict[str, TableSchema] = {}
        for name in names:
            newest: TableSchema | None = None
            for found in (await info.schemas(name)).values():
                if found.partition not in partitions or not found.schemas:
                    continue
                if newest is None or found.newest.version > newest.version:
                    newest = found.newest
            if newest is not None:
                out[name] = newest
        return out

    return await _with_relays(opts, call)


async def end_after_rows(
    opts: SourceOptions, partition: str, since: int, until: int, max_events: int
) -> int:
    """The last window SCN in ``(since, until]`` keeping the batch at ``max_events``.

    Counts the data events of ``opts.sources`` and ``opts.key_filter`` window by
    window from ``since`` on. The first window is always taken whole, even when
    it alone is larger (a transaction is never split); the batch then ends
    before the first window that would exceed the limit. Returns ``until`` when
    the whole range fits, and ``since`` only when the range holds no window.
    """
    if until <= since:
        return since

    async def call(info: RelayInfo) -> int:
        scn, offset = since, -1
        count = 0
        end = since
        window_events = 0
        while True:
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
            async with info.session.get(f"{info.url}/v1/stream", params=params) as resp:
                if resp.status == 204:
                    return end
                if resp.status != 200:
                    raise await response_error(
                        resp, info.where, kind="stream", partition=partition, requested_scn=scn
                    )
                body_bytes = await resp.read()
                next_scn = int(resp.headers["X-Changebus-Next-Scn"])
                next_offset = int(resp.headers["X-Changebus-Next-Offset"])
            if not body_bytes:
                return end
            _, headers = parse_stream(body_bytes, verify_payload=False)
            ops = headers["op"]
            scns = headers["scn"]
            data = ops < FIRST_CONTROL_OP
            ends = np.flatnonzero(ops == _EOW)
            start = 0
            for e in ends.tolist():
                window_events += int(np.count_nonzero(data[start : e + 1]))
                wscn = int(scns[e])
                if wscn > until:
                    return end
                if end != since and count + window_events > max_events:
                    return end
                count += window_events
                window_events = 0
                end = wscn
                start = e + 1
                if count >= max_events or end >= until:
                    return end
            window_events += int(np.count_nonzero(data[start:]))  # a window cut by max_bytes
            scn, offset = next_scn, next_offset

    return await _with_relays(opts, call)


async def position_at_time(
    opts: SourceOptions, bounds: PartitionBounds, time_ns: int, *, inclusive: bool
) -> int:
    """The position before the first window committed at/after ``time_ns`` (binary search).

    With ``inclusive`` false the result ``p`` is the last window committed
    before ``time_ns`` (a start: the stream continues at the first window at
    or after it); with ``inclusive`` true the last window committed at or
    before it (an end). Bounded by the relay's buffer: before the oldest kept
    window gives ``prev_scn``, after the newest ``max_scn``. Commit times
    follow commit order, so each probe (the first event after a position,
    ``max_bytes=1``) halves the SCN interval; about 40 probes for Postgres LSNs.
    """

    def passes(ts: int) -> bool:
        return ts > time_ns if inclusive else ts >= time_ns

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
                body = await resp.read()
            _, headers = parse_stream(body, verify_payload=False)
            first_scn = int(headers["scn"][0])
            if passes(int(headers["timestamp_ns"][0])):
                hi = mid
            else:
                lo = max(first_scn, mid + 1)
        return lo

    return await _with_relays(opts, call)


async def bootstrap_target(opts: SourceOptions, partition: str) -> int:
    """The newest SCN a bootstrap server holds for ``partition`` (its catch-up target now).

    Tries ``opts.bootstrap`` in order, like the relays; raises
    :class:`~changebus.client.RelayUnavailableError` when none answers.
    """

    async def call(info: RelayInfo) -> int:
        return (await info.bootstrap_status(partition)).producer_scn

    return await _with_relays(opts, call, urls=opts.bootstrap)
