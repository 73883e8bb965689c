"""Relay configuration (``changebus relay --config relay.toml``).

Example::

    data_dir = "var/relay"

    [http]
    host = "127.0.0.1"
    port = 8470
    # keepalive_timeout_s = 75, header_timeout_s = 10, max_connections = 1024,
    # max_connections_per_ip = -1 (half of max_connections, loopback exempt): changebus.schemas.server.ConnectionLimits

    [[partitions]]
    name = "pgmain"
    id = 1
    capacity_bytes = "256MiB"
    durability = "fsync"           # or "page_cache" (the default): docs/operations.md

    [partitions.fetcher]
    kind = "postgres"              # or "synthetic", "mysql", "none"
    options = { dsn = "postgresql://..." }

Environment overrides use the prefix ``CHANGEBUS_RELAY_`` (for example
``CHANGEBUS_RELAY_HTTP__PORT=9000``); ``--set http.port=9000`` on the command
line wins over both. Sizes are bytes (``"64MiB"`` accepted), durations seconds.

A ``[metrics]`` table (:class:`MetricsConfig`) bounds ``/metrics``:
``max_consumer_series`` (default 50) consumer label values per partition
in the consumer lag metrics (docs/metrics.md).

A ``[cluster]`` table (:class:`changebus.cluster.ClusterConfig`) makes the
relay a member of a relay cluster (``docs/cluster.md``): per partition it
stands for election, leads with the configured fetcher (the *source*) or
follows the leader by chaining. ``advertised_url`` defaults to the relay's
own URL (``https://`` when the relay serves TLS) and ``member_id`` is then
required. Without the table the relay works alone, as always.

An ``[upstream]`` table (:class:`changebus.schemas.security.ClientAuth`)
says how this relay connects to other relays: the cluster's followers
chaining to the leader, and the default of every ``relay`` fetcher (whose
own options may override it per partition)::

    [upstream]
    ca_file = "/etc/changebus/ca.pem"
    cert_file = "/etc/changebus/relay-client.pem"   # mTLS (optional)
    key_file = "/etc/changebus/relay-client.key"
    token_file = "/etc/changebus/relay.token"       # or CHANGEBUS_RELAY_UPSTREAM__TOKEN

A ``[security]`` table (:class:`changebus.schemas.security.SecurityConfig`:
TLS, principals with their partitions, sources and scopes, open endpoints)
secures the HTTP API; without it the relay is open and listens on loopback
only (``docs/security.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from changebus.cluster import ClusterConfig
from changebus.schemas import ConfigError
from changebus.schemas.config import redacted, size_field
from changebus.schemas.files import NAME_RULE, safe_name
from changebus.schemas.security import ClientAuth, SecurityConfig
from changebus.schemas.server import ConnectionLimits, check_copy_budget

from ._bufconfig import BufferConfig, Durability, check_durability

__all__ = ["FetcherConfig", "HttpConfig", "MetricsConfig", "PartitionConfig", "RelayConfig"]


@dataclass(frozen=True)
class HttpConfig(ConnectionLimits):
    """The HTTP listener and request limits.

    The connection limits (``keepalive_timeout_s``, ``header_timeout_s``,
    ``max_connections``, ``max_connections_per_ip``) are the server frame's
    :class:`~changebus.schemas.server.ConnectionLimits`.
    """

    host: str = "127.0.0.1"
    port: int = 8470
    #: longest long-poll: a request asking for a longer ``wait`` is held this long
    max_wait_s: float = 60.0
    #: response size when the client does not say
    default_max_bytes: int = size_field(1 << 20)
    #: largest response size a client may ask for
    max_response_bytes: int = size_field(64 << 20)
    #: largest selection a ``format=ndjson`` response decodes (larger requests get less)
    max_ndjson_bytes: int = size_field(4 << 20)
    #: a client that accepts no part of a response for this long is cut off
    send_timeout_s: float = 30.0
    #: bytes of small responses kept per partition to share with identical requests
    response_cache_bytes: int = size_field(16 << 20)
    #: bytes of response copies (follow pushes, ndjson answers) held for clients at once
    max_copy_bytes: int = size_field(256 << 20)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"http.port must be 0..65535, got {self.port}")
        if (
            self.max_wait_s < 0
            or self.default_max_bytes <= 0
            or self.max_response_bytes <= 0
            or self.max_ndjson_bytes <= 0
            or self.send_timeout_s <= 0
        ):
            raise ConfigError("http limits must be positive")
        if self.response_cache_bytes < 0:
            raise ConfigError("http.response_cache_bytes must not be negative")
        if self.default_max_bytes > self.max_response_bytes:
            # (a request without max_bytes got the default unclamped: the cap was lifted)
            raise ConfigError(
                f"http.default_max_bytes ({self.default_max_bytes}) must not exceed"
                f" http.max_response_bytes ({self.max_response_bytes})"
            )
        check_copy_budget(self.max_copy_bytes, self.max_connections)


@dataclass(frozen=True)
class FetcherConfig:
    """Which fetcher feeds a partition, and its own options table.

    Its ``repr`` shows the options redacted: they hold DSNs, passwords and keys
    (a traceback's locals, a debugger or a ``%r`` printed them whole: review).
    """

    kind: str = "none"
    options: dict[str, Any] = field(default_factory=dict, repr=False)
    #: first delay before restarting a failed fetcher (doubles up to max)
    retry_initial_s: float = 0.5
    retry_max_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_initial_s <= self.retry_max_s:
            # (0 restarted a failing fetcher in a tight loop: a connection storm on the source)
            raise ConfigError(
                "fetcher: retry_initial_s must be above 0 and at most retry_max_s, got"
                f" {self.retry_initial_s} and {self.retry_max_s}"
            )

    def __repr__(self) -> str:
        return (
            f"FetcherConfig(kind={self.kind!r}, options={redacted(self.options)!r},"
            f" retry_initial_s={self.retry_initial_s!r}, retry_max_s={self.retry_max_s!r})"
        )


@dataclass(frozen=True)
class PartitionConfig:
    """One physical partition: one buffer, one fetcher."""

    name: str
    id: int = 0
    capacity_bytes: int = size_field(64 << 20)
    event_slots: int = 0
    block_bytes: int = 0
    max_window_bytes: int = size_field(0)
    pin_timeout_s: float = 2.0
    #: a reader whose pace says it needs longer than this to finish is overrun
    #: at once (the writer does not wait for it; see :mod:`._evict`)
    slow_reader_s: float = 0.25
    fetcher: FetcherConfig = field(default_factory=FetcherConfig)
    #: when the source is acknowledged: once a window is in the page cache
    #: ("page_cache": survives a relay crash) or once it is synced to disk
    #: ("fsync": survives an OS crash too); see :mod:`._syncer`
    durability: Durability = "page_cache"

    def __post_init__(self) -> None:
        if not safe_name(self.name):  # it names the buffer's directory
            raise ConfigError(f"partition name {self.name[:140]!r} must match {NAME_RULE}")
        if not 0 <= self.id <= 65535:
            raise ConfigError(f"partition {self.name}: id must be 0..65535")
        check_durability(self.durability, f"partition {self.name}")
        try:
            self.buffer  # noqa: B018 - its rules, at load (and --check), not at start only
        except ConfigError as exc:
            raise ConfigError(f"partition {self.name}: {exc.message}") from None

    @property
    def buffer(self) -> BufferConfig:
        return BufferConfig(
            capacity_bytes=self.capacity_bytes,
            event_slots=self.event_slots,
            block_bytes=self.block_bytes,
            max_window_bytes=self.max_window_bytes,
            pin_timeout_s=self.pin_timeout_s,
            slow_reader_s=self.slow_reader_s,
            durability=self.durability,
        )


@dataclass(frozen=True)
class MetricsConfig:
    """The ``[metrics]`` table: bounds of ``/metrics`` (docs/metrics.md)."""

    #: consumer label values per partition in ``changebus_relay_consumer_lag_*``: the
    #: most lagging consumers; the others are folded into ``consumer="_other"``
    max_consumer_series: int = 50

    def __post_init__(self) -> None:
        if not 1 <= self.max_consumer_series <= 10000:
            raise ConfigError("metrics.max_consumer_series must be within 1..10000")


@dataclass(frozen=True)
class RelayConfig:
    """The whole relay daemon."""

    data_dir: Path = Path("var/relay")
    http: HttpConfig = field(default_factory=HttpConfig)
    partitions: tuple[PartitionConfig, ...] = ()
    #: how often buffers are msync'ed to disk (0 = only on shutdown)
    flush_interval_s: float = 5.0
    #: the daemon's GIL switch interval (seconds); short keeps latency low
    gil_switch_interval_s: float = 0.0005
    log_format: Literal["text", "json"] = "text"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    #: membership of a relay cluster (None: a stand-alone relay)
    cluster: ClusterConfig | None = None
    #: TLS, principals and open endpoints (default: open, loopback only)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    #: TLS and token of this relay's connections to other relays (chaining)
    upstream: ClientAuth = field(default_factory=ClientAuth)
    #: bounds of /metrics (label cardinality)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    #: a partition whose buffer files hold other sizes than configured starts empty, its
    #: old files moved to a ``resized-<time>`` subdirectory (else the start is refused);
    #: meant for one start (``changebus relay --resize-buffers``), not for the file
    resize_buffers: bool = False

    def __post_init__(self) -> None:
        if self.cluster is not None and not self.cluster.member_id:
            raise ConfigError("cluster.member_id is required for a relay in a cluster")
        if self.cluster is not None:
            self.cluster.check_listen_host(self.http.host)
        names = [p.name for p in self.partitions]
        ids = [p.id for p in self.partitions]
        if len(set(names)) != len(names) or len(set(ids)) != len(ids):
            raise ConfigError("partition names and ids must be unique")
        if self.flush_interval_s < 0:
            raise ConfigError("flush_interval_s must not be negative")
        if not 0 < self.gil_switch_interval_s <= 0.1:
            raise ConfigError("gil_switch_interval_s must be within (0, 0.1]")
