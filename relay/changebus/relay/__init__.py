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
)
from ._buffer import (
    EventBuffer as EventBuffer,
)
from ._buffer import (
    Selection as Selection,
)
from ._config import (
    FetcherConfig as FetcherConfig,
)
from ._config import (
    HttpConfig as HttpConfig,
)
from ._config import (
    PartitionConfig as PartitionConfig,
)
from ._config import (
    RelayConfig as RelayConfig,
)
from ._daemon import Relay as Relay
from ._daemon import run as run

__all__ = [
    "BufferConfig",
    "EventBuffer",
    "FetcherConfig",
    "HttpConfig",
    "PartitionConfig",
    "Relay",
    "RelayConfig",
    "Selection",
    "run",
]
