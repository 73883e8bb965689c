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

__all__ = ["CONSUMER_TTL_S", "data_loss_events", "fetcher_losses", "partition_status"]

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


def partition_status(host: PartitionHost) -> dict[str, Any]:
    """The partition's ``/v1/status`` entry: buffer bounds, state, consumers, fetcher."""
    m = host.buffer.meta
    now = time.monotonic()
    consumers = [
        {
            "client": client,
            "peer": seen.peer,
            "scn": seen.scn,
            "lag_scn": max(m.last_scn - seen.scn, 0) if seen.scn >= 0 else None,
            "behind_bytes": seen.behind_bytes,
            "seconds_since_request": round(now - seen.last_seen, 3),
        }
        for client, seen in sorted(host.consumers.items())
        if now - seen.last_seen <= CONSUMER_TTL_S
    ]
    status: dict[str, Any] = {
        "name": host.name,
        "id": host.config.id,
        "state": host.state,
        "min_scn": m.min_scn,
        "max_scn": m.last_scn,
        "prev_scn": m.prev_scn,
        "bytes_used": m.tail_pos - m.head_pos,
        "capacity_bytes": m.capacity,
        "events": m.tail_event - m.head_event,
        "windows": m.windows,
        "oldest_timestamp_ns": m.first_ts,
        "newest_timestamp_ns": m.last_ts,
        "consumers": consumers,
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
