"""What a hosted partition reports: its ``/v1/status`` entry and its data-loss counts.

One job: read a :class:`~._host.PartitionHost`'s live state into plain
figures, for ``/v1/status`` and ``/metrics``. Nothing here runs on the
ingest or serving paths; event loop only (like the host's other readers).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from changebus.fetchers import Fetcher

    from ._host import PartitionHost

__all__ = [
    "CONSUMER_TTL_S",
    "consumer_lag_seconds",
    "data_loss_events",
    "fetcher_losses",
    "partition_status",
    "source_lag_seconds",
]

#: consumers seen this recently (seconds) count in /v1/status and /metrics
CONSUMER_TTL_S = 300


def fetcher_losses(fetcher: Fetcher) -> Mapping[str, int]:
    """A fetcher's data-loss windows by cause (its optional ``data_loss_events`` mapping)."""
    counts = getattr(fetcher, "data_loss_events", None)
    # a copy (one C call, atomic under the GIL): a fetcher's thread may add a cause meanwhile
    return dict(counts) if isinstance(counts, Mapping) else {}


def data_loss_events(host: PartitionHost) -> Counter[str]:
    """Data-loss windows by cause since start: the host's own and its retired fetchers'
    (:attr:`~._host.PartitionHost.losses`), the current fetcher's and the buffer's
    recovery."""
    total = Counter(host.losses)
    if host.fetcher is not None:
        total.update(fetcher_losses(host.fetcher))
    recovered = host.buffer.stats.get("recovery_data_loss", 0)
    if recovered:
        total["recovery"] += recovered
    return total


def source_lag_seconds(host: PartitionHost) -> float | None:
    """When the newest window was appended minus its source commit time (None: no window yet)."""
    last_ts = host.buffer.meta.last_ts
    if host.appended_at <= 0 or last_ts <= 0:
        return None
    return max(host.appended_at - last_ts / 1e9, 0.0)


def consumer_lag_seconds(host: PartitionHost, scn: int) -> float:
    """Source commit time of the newest window minus that of the first one after ``scn``.

    0 when nothing follows ``scn`` (caught up). One binary search in the
    buffer's SCN index (:meth:`~._buffer.EventBuffer.timestamp_after`).
    """
    m = host.buffer.meta
    ts = host.buffer.timestamp_after(scn) if scn < m.last_scn else None
    return 0.0 if ts is None else max((m.last_ts - ts) / 1e9, 0.0)


def partition_status(host: PartitionHost, *, consumers: bool = True) -> dict[str, Any]:
    """The partition's ``/v1/status`` entry: buffer bounds, state, consumers, fetcher.

    ``consumers`` False (``/metrics``): their number only, not the list
    with each one's lag (an index search per distinct position: clients
    choose how many there are).
    """
    m = host.buffer.meta
    now = time.monotonic()
    active = [
        (client, seen)
        for client, seen in sorted(host.consumers.items())
        if now - seen.last_seen <= CONSUMER_TTL_S
    ]
    lags: dict[int, float] = {}  # by position: followers share few

    def lag(scn: int) -> float:
        found = lags.get(scn)
        if found is None:
            found = lags[scn] = round(consumer_lag_seconds(host, scn), 3)
        return found

    listed = [
        {
            "client": client,
            "peer": seen.peer,
            "scn": seen.scn,
            "lag_scn": max(m.last_scn - seen.scn, 0) if seen.scn >= 0 else None,
            "lag_seconds": lag(seen.scn) if seen.scn >= 0 else None,
            "behind_bytes": seen.behind_bytes,
            "seconds_since_request": round(now - seen.last_seen, 3),
        }
        for client, seen in (active if consumers else ())
    ]
    status: dict[str, Any] = {
        "name": host.name,
        "id": host.config.id,
        "state": host.state,
        "min_scn": m.min_scn,
        "max_scn": m.last_scn,
        "prev_scn": m.prev_scn,
        # windows before prev_scn were evicted or lost (false: prev_scn is where it started)
        "evicted": bool(m.evicted),
        # the commit time of the window at prev_scn, when an eviction set it (0: not known)
        "evicted_timestamp_ns": m.prev_ts,
        # the source position at the end of the window at prev_scn ("": not known)
        "prev_position": m.prev_pos,
        "bytes_used": m.tail_pos - m.head_pos,
        "capacity_bytes": m.capacity,
        "events": m.tail_event - m.head_event,
        "windows": m.windows,
        "oldest_timestamp_ns": m.first_ts,
        "newest_timestamp_ns": m.last_ts,
        "consumers": listed,
        "consumer_count": len(active),
        "source_lag_seconds": _rounded(source_lag_seconds(host)),
        "source_idle_seconds": round(
            max(time.time() - (host.appended_at or host.started_at), 0.0), 3
        ),
        "stats": {**host.buffer.stats, **host.stats},
    }
    if host.role:
        status["role"] = host.role
    if host.epoch is not None:
        status["epoch"] = host.epoch
    if host.last_error:
        status["last_error"] = host.last_error
    if host.fetcher is not None:
        status["fetcher"] = host.fetcher.status()
    status["durability"] = (
        host.syncer.status()
        if host.syncer is not None
        else {"mode": "page_cache", "synced_scn": -1, "syncs": 0, "sync_seconds_total": 0.0}
    )
    return status


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
