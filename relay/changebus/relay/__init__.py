"""changebus.relay: the relay daemon.

A relay hosts one :class:`EventBuffer` per physical partition (a
space-bounded, memory-mapped circular log of whole transactions with an SCN
index), fed by a fetcher, and serves it to any number of consumers over HTTP
long-poll. It keeps no state per consumer: each request carries the
consumer's checkpoint. Run it with ``changebus relay --config relay.toml`` or
embed it with ``async with Relay(config)``.
"""

from ._buffer import (
    BufferConfig as BufferConfig,
    EventBuffer as EventBuffer,
    Selection as Selection,
)
from ._config import (
    FetcherConfig as FetcherConfig,
    HttpConfig as HttpConfig,
    MetricsConfig as MetricsConfig,
    PartitionConfig as PartitionConfig,
    RelayConfig as RelayConfig,
)
from ._daemon import Relay as Relay, run as run

__all__ = [
    "BufferConfig",
    "EventBuffer",
    "FetcherConfig",
    "HttpConfig",
    "MetricsConfig",
    "PartitionConfig",
    "Relay",
    "RelayConfig",
    "Selection",
    "run",
]
