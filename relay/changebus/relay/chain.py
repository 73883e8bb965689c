"""changebus.relay.chain: the ``relay`` fetcher kind, a relay following another relay.

A partition configured with ``fetcher = {kind = "relay", options = {upstream
= ["http://leader:8470"]}}`` reads its upstream's ``/v1/stream`` and appends
the windows as they are (same SCNs, timestamps and bytes, every CRC checked
again), mirrors the upstream's schema registry (same source ids and
versions), resumes after its own newest SCN, records a gap it cannot fill
as one DATA_LOSS window (or, as a cluster's follower, starts its buffer again
where the upstream's is complete), and can refuse a deposed upstream by its
``X-Changebus-Epoch`` (``min_epoch``). Details: :mod:`changebus.relay._chain`.

* :data:`fetcher_factory` -- the kind's factory (declared under the
  ``changebus.fetchers`` entry-point group as ``relay``);
* :func:`make_fetcher_factory` -- the same with an in-process ``min_epoch``;
* :class:`ChainFetcher`, :class:`ChainConfig` -- the fetcher and its options;
* :class:`StaleUpstreamError` -- an answer refused for its epoch;
* :class:`RestartBufferError` -- fell off with ``on_fell_off = "restart"``: the
  relay restarts its buffer at the upstream's ``prev_scn``;
* :data:`EPOCH_HEADER` -- the header a relay names its partition's epoch in.
"""

from ._chain import (
    EPOCH_HEADER as EPOCH_HEADER,
    ChainFetcher as ChainFetcher,
    RestartBufferError as RestartBufferError,
    StaleUpstreamError as StaleUpstreamError,
    fetcher_factory as fetcher_factory,
    make_fetcher_factory as make_fetcher_factory,
)
from ._chainconfig import ChainConfig as ChainConfig

__all__ = [
    "EPOCH_HEADER",
    "ChainConfig",
    "ChainFetcher",
    "RestartBufferError",
    "StaleUpstreamError",
    "fetcher_factory",
    "make_fetcher_factory",
]
