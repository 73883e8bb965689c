"""changebus.relay.chain: the ``relay`` fetcher kind, a relay following another relay.

A partition configured with ``fetcher = {kind = "relay", options = {upstream
= ["http://leader:8470"]}}`` reads its upstream's ``/v1/stream`` and appends
the windows as they are (same SCNs, timestamps and bytes, every CRC checked
again), mirrors the upstream's schema registry (same source ids and
versions), resumes after its own newest SCN, records a gap it cannot fill
as one DATA_LOSS window, and can refuse a deposed upstream by its
``X-Changebus-Epoch`` (``min_epoch``). Details: :mod:`changebus.relay._chain`.

* :data:`fetcher_factory` -- the kind's factory (declared under the
  ``changebus.fetchers`` entry-point group as ``relay``);
* :func:`make_fetcher_factory` -- the same with an in-process ``min_epoch``;
* :class:`ChainFetcher`, :class:`ChainConfig` -- the fetcher and its options;
* :class:`StaleUpstreamError` -- an answer refused for its epoch;
* :data:`EPOCH_HEADER` -- the header a relay names its partition's epoch in.
"""

from ._chain import (
    EPOCH_HEADER as EPOCH_HEADER,
    ChainFetcher as ChainFetcher,
    StaleUpstreamError as StaleUpstreamError,
    fetcher_factory as fetcher_factory,
    make_fetcher_factory as make_fetcher_factory,
)
from ._chainconfig import ChainConfig as ChainConfig

__all__ = [
    "EPOCH_HEADER",
    "ChainConfig",
    "ChainFetcher",
    "StaleUpstreamError",
    "fetcher_factory",
    "make_fetcher_factory",
]
