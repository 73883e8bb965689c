"""Pieces of ``/v1/stream`` responses shared by its one-shot and follow forms.

:func:`next_headers` builds the position headers every response carries;
:func:`copy_out` turns a pinned selection into an immutable
:class:`~._respcache.CachedResponse` (checked against the pin, so a copy is
never torn). Event loop only.
"""

from __future__ import annotations

from changebus.schemas import Checkpoint, OverwrittenError, PartitionCheckpoint

from ._buffer import Selection
from ._host import PartitionHost
from ._metrics import RelayMetrics
from ._respcache import CachedResponse

__all__ = ["copy_headers", "copy_out", "next_headers"]


def copy_out(host: PartitionHost, selection: Selection, metrics: RelayMetrics) -> CachedResponse:
    """Copy a selection out of the ring and release its pin.

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
    return CachedResponse(
        body,
        selection.next_scn,
        selection.next_offset,
        selection.events,
        selection.windows,
        selection.partial,
        selection.to_tail,
        selection.start_pos,
    )


def next_headers(
    host: PartitionHost, scn: int, offset: int, current: Checkpoint | None
) -> dict[str, str]:
    """The position headers: where to continue, the buffer's bounds, the updated checkpoint."""
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


def copy_headers(
    host: PartitionHost, cached: CachedResponse, checkpoint: Checkpoint | None
) -> dict[str, str]:
    """:func:`next_headers` plus the counts of a copied response."""
    headers = next_headers(host, cached.next_scn, cached.next_offset, checkpoint)
    headers["X-Changebus-Events"] = str(cached.events)
    headers["X-Changebus-Windows"] = str(cached.windows)
    headers["X-Changebus-Partial"] = "1" if cached.partial else "0"
    return headers
