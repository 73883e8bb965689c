"""Bootstrap server configuration (``changebus bootstrap --config bootstrap.toml``).

Example::

    relays = ["http://127.0.0.1:8470"]
    partitions = []                  # empty: every partition of the first relay

    [store]
    kind = "sqlite"                  # or "postgres"
    path = "var/bootstrap/bootstrap.db"
    # dsn = "postgresql://..."       # kind = "postgres" (never logged)

    [http]
    host = "127.0.0.1"
    port = 8471
    # keepalive_timeout_s = 75, header_timeout_s = 10, max_connections = 1024,
    # max_connections_per_ip = -1 (half of max_connections, loopback exempt): changebus.schemas.server.ConnectionLimits

In a relay cluster (``docs/cluster.md``) a ``[cluster]`` table
(:class:`changebus.cluster.ClusterConfig`: ``zookeeper``, ``name``,
``member_id``, ``advertised_url``, ...) registers the server in the routing
table (kind ``bootstrap``) and, when ``relays`` is empty, takes the relays
from the table and follows it::

    [cluster]
    zookeeper = "127.0.0.1:2181"
    name = "prod"
    member_id = "bootstrap-1"        # required
    advertised_url = ""              # default: http(s)://<http.host>:<port>

An ``[upstream]`` table (:class:`changebus.schemas.security.ClientAuth`)
says how the server connects to its relays (TLS, client certificate, bearer
token)::

    [upstream]
    ca_file = "/etc/changebus/ca.pem"
    token_file = "/etc/changebus/bootstrap.token"   # or CHANGEBUS_BOOTSTRAP_UPSTREAM__TOKEN

A ``[security]`` table (:class:`changebus.schemas.security.SecurityConfig`)
secures the HTTP API as the relay's does: TLS, principals (``POST /v1/seed``
needs scope ``admin``), open endpoints; without it the server is open and
listens on loopback only.

Environment overrides use the prefix ``CHANGEBUS_BOOTSTRAP_`` (for example
``CHANGEBUS_BOOTSTRAP_HTTP__PORT=9000``); ``--set http.port=9000`` on the
command line wins over both. Sizes are bytes (``"64MiB"`` accepted),
durations seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from changebus.cluster import ClusterConfig
from changebus.fetchers import ColumnPolicyOptions
from changebus.schemas import ConfigError
from changebus.schemas.config import secret, size_field, url_without_user
from changebus.schemas.files import NAME_RULE, safe_name
from changebus.schemas.security import ClientAuth, SecurityConfig
from changebus.schemas.server import ConnectionLimits, check_copy_budget

from ._seedtypes import table_name_problem

__all__ = [
    "ApplierConfig",
    "BootstrapConfig",
    "HttpConfig",
    "ProducerConfig",
    "SeedConfig",
    "StoreConfig",
]


@dataclass(frozen=True)
class StoreConfig:
    """Where the log and snapshot stores live (one database for both)."""

    kind: Literal["sqlite", "postgres"] = "sqlite"
    #: SQLite file (default: ``<data_dir>/bootstrap.db``)
    path: Path | None = None
    #: Postgres connection string (secret: never logged)
    dsn: str = secret("")
    #: Postgres: a store call without an answer this long makes the server be asked on a
    #: new connection; when that gets no answer either (a frozen server, a dead network
    #: path), the call's connection is cut and the call retried (0: never)
    io_timeout_s: float = 60.0
    #: on stop, seconds store calls in progress may take before their connections are cut
    stop_grace_s: float = 5.0

    def __post_init__(self) -> None:
        if self.kind == "postgres" and not self.dsn:
            raise ConfigError("store.dsn is needed when store.kind = 'postgres'")
        if self.io_timeout_s < 0 or self.stop_grace_s < 0:
            raise ConfigError("store.io_timeout_s and store.stop_grace_s must not be negative")


@dataclass(frozen=True)
class HttpConfig(ConnectionLimits):
    """The HTTP listener and page limits.

    The connection limits (``keepalive_timeout_s``, ``header_timeout_s``,
    ``max_connections``, ``max_connections_per_ip``) are the server frame's
    :class:`~changebus.schemas.server.ConnectionLimits`.
    """

    host: str = "127.0.0.1"
    port: int = 8471
    #: page size when the client does not say
    default_page_bytes: int = size_field(1 << 20)
    #: largest page a client may ask for
    max_page_bytes: int = size_field(16 << 20)
    #: the most bytes of pages held at once for clients still taking them (every
    #: request may always have a floor of it; pages get smaller when it is busy)
    max_copy_bytes: int = size_field(256 << 20)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"http.port must be 0..65535, got {self.port}")
        if not 0 < self.default_page_bytes <= self.max_page_bytes:
            raise ConfigError("http: need 0 < default_page_bytes <= max_page_bytes")
        check_copy_budget(self.max_copy_bytes, self.max_connections)


@dataclass(frozen=True)
class ProducerConfig:
    """How the producer reads the relay."""

    #: bytes per relay response (or follow push)
    max_bytes: int = size_field(4 << 20)
    #: long-poll / idle follow time
    wait_s: float = 5.0
    #: windows appended to the log in one transaction at most
    batch_windows: int = 500
    #: bytes of windows appended to the log in one transaction, at most (whole windows:
    #: one bigger window goes alone); the queue before the log holds twice this at most
    batch_bytes: int = size_field(64 << 20)
    #: delay before retrying after the relay said the producer fell off
    fell_off_retry_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_bytes <= 0 or self.batch_windows <= 0 or self.batch_bytes <= 0:
            raise ConfigError(
                "producer.max_bytes, producer.batch_windows and producer.batch_bytes must be "
                "positive"
            )
        if self.wait_s < 0 or self.fell_off_retry_s <= 0:
            raise ConfigError("producer.wait_s must be >= 0 and fell_off_retry_s > 0")


@dataclass(frozen=True)
class ApplierConfig:
    """How the applier folds the log into the snapshot."""

    #: log events folded in one transaction (about: whole windows)
    batch_events: int = 20_000
    #: bytes of log events folded in one transaction, at most (about: whole windows;
    #: all of them are held at once: 20,000 events of 1 MB were 20 GB)
    batch_bytes: int = size_field(64 << 20)
    #: longest sleep when there is nothing to apply
    idle_s: float = 0.5
    #: log events kept (about: whole windows); older applied windows are pruned
    #: (0: keep the whole log). Consumers behind the kept log get a snapshot.
    log_keep_events: int = 0
    #: tombstones (deleted rows) are kept this long after their delete, then purged
    #: once the log no longer holds them either (0: kept for ever). A consumer whose
    #: position is older than the purged deletes must start again from nothing.
    tombstone_keep_s: float = 7 * 86_400.0
    #: how often the applier purges old tombstones
    purge_interval_s: float = 60.0

    def __post_init__(self) -> None:
        if self.batch_events <= 0 or self.idle_s <= 0 or self.batch_bytes <= 0:
            raise ConfigError(
                "applier.batch_events, applier.batch_bytes and applier.idle_s must be positive"
            )
        if self.log_keep_events < 0:
            raise ConfigError("applier.log_keep_events must not be negative")
        if self.tombstone_keep_s < 0 or self.purge_interval_s <= 0:
            raise ConfigError(
                "applier.tombstone_keep_s must be >= 0 and applier.purge_interval_s > 0"
            )


@dataclass(frozen=True)
class SeedConfig(ColumnPolicyOptions):
    """Seeding the snapshot from the source (see :mod:`._seeders`).

    ``kind`` -- ``postgres`` (a libpq DSN) or ``mysql`` (MySQL/MariaDB: a
    ``mysql://user:password@host:port`` URL whose query may carry the mysql
    fetcher's ``password_file`` and TLS options instead of the password, e.g.
    ``mysql://changebus@db:3306?password_file=/etc/changebus/db.pw&tls_ca_file=/etc/db-ca.pem``;
    checked here, the files read when a seed starts). ``dsn`` -- the source
    database (secret: never logged); empty: no seeding. ``tables`` --
    ``schema.table`` names (empty: every source of the partition the relay
    has seen). ``on_start`` -- seed once at start-up
    (tables already seeded are skipped; ``POST /v1/seed`` re-seeds on
    demand). ``partition`` -- the partition the source feeds (empty: the
    only one). ``column_policy`` / ``column_policy_file``,
    ``column_hash_key`` (secret) / ``column_hash_key_env`` -- the fetcher's
    column policy (docs/column-policy.md), which seeded rows must follow
    too: give the same values as the fetcher's options (a shared
    ``column_policy_file`` and ``column_hash_key_env`` say it once). A seed
    whose policy does not match the relay's schemas is refused.
    ``schema_wait_s`` -- a seed waits this long for the relay's
    schemas of its tables (the relay must have seen a change of each), then
    fails with a clear error.

    Chunked snapshots (docs/bootstrap.md): ``chunk_rows`` -- rows per chunk
    (one short source transaction and one store transaction each);
    ``max_rows_per_s`` -- rows a second at most (0: no limit);
    ``source_time_budget`` -- the share of wall time the seed may keep the
    source busy reading (1: no limit; 0.25: it rests three times as long as
    each chunk took); ``watermark_wait_s`` -- how long a Postgres chunk waits
    for the transactions that hold back its watermark (a long-running
    transaction on the source) before the seed fails, retriably;
    ``log_every_chunks`` -- a progress line in the log every so many chunks;
    ``max_chunk_txn_s`` -- seconds a chunk's source transaction should stay
    under: chunks that take longer make the next ones smaller (default 0.5;
    0: off, every chunk reads ``chunk_rows``; MariaDB only, Postgres does not time them);
    ``max_chunk_bytes`` -- bytes a chunk's rows should stay under: the seeder
    holds a few chunks at once, so wide rows (large text, json or blobs) make
    chunks of fewer rows (0: off). A table's first chunks start at 256 rows and
    grow at most 2x a chunk.
    """

    kind: Literal["postgres", "mysql"] = "postgres"
    dsn: str = secret("")
    tables: tuple[str, ...] = ()
    on_start: bool = False
    partition: str = ""
    chunk_rows: int = 5000
    #: how long a seed waits for the relay's schemas of its tables before it fails
    schema_wait_s: float = 60.0
    max_rows_per_s: float = 0.0
    source_time_budget: float = 1.0
    watermark_wait_s: float = 300.0
    log_every_chunks: int = 100
    max_chunk_txn_s: float = 0.5
    max_chunk_bytes: int = size_field(64 << 20)

    def __post_init__(self) -> None:
        self.column_rules()  # checked at start
        if self.max_chunk_bytes < 0:
            raise ConfigError("seed.max_chunk_bytes must not be negative (0: off)")
        if self.chunk_rows <= 0:
            raise ConfigError("seed.chunk_rows must be positive")
        if self.max_chunk_txn_s < 0:
            raise ConfigError("seed.max_chunk_txn_s must not be negative (0: off)")
        if self.max_rows_per_s < 0:
            raise ConfigError("seed.max_rows_per_s must not be negative (0: no limit)")
        if not 0 < self.source_time_budget <= 1:
            raise ConfigError("seed.source_time_budget must be in (0, 1] (1: no limit)")
        if self.watermark_wait_s <= 0 or self.log_every_chunks < 0:
            raise ConfigError(
                "seed.watermark_wait_s must be positive and seed.log_every_chunks >= 0"
            )
        if self.schema_wait_s <= 0:
            raise ConfigError("seed.schema_wait_s must be positive")
        if self.partition and not safe_name(self.partition):
            raise ConfigError(f"seed.partition {self.partition[:140]!r} must match {NAME_RULE}")
        for table in self.tables:
            problem = table_name_problem(table)
            if problem is not None:
                raise ConfigError(f"seed.tables: {problem}")
        if self.on_start and not self.dsn:
            raise ConfigError("seed.on_start needs seed.dsn")
        if (
            self.kind == "mysql"
            and self.dsn
            and not self.dsn.startswith(("mysql://", "mariadb://"))
        ):
            raise ConfigError(
                "seed.dsn must be a mysql://user:password@host:port URL for kind mysql"
            )
        if self.kind == "mysql" and self.dsn:
            from changebus.fetchers.mysql import MySQLConfig

            # its query options (password_file, tls_*) checked now, the files read at start
            MySQLConfig.from_dsn(self.dsn, "seed.dsn")


@dataclass(frozen=True)
class BootstrapConfig:
    """The whole bootstrap daemon.

    ``catchup_ratio``: a consumer whose position is still in the log gets
    catch-up only (no snapshot) when the log holds at most this many events
    per snapshot row it would otherwise receive (replaying a short log is
    cheaper than a scan; Databus's rule of thumb).
    """

    relays: tuple[str, ...] = ()
    partitions: tuple[str, ...] = ()
    data_dir: Path = Path("var/bootstrap")
    store: StoreConfig = field(default_factory=StoreConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    producer: ProducerConfig = field(default_factory=ProducerConfig)
    applier: ApplierConfig = field(default_factory=ApplierConfig)
    seed: SeedConfig = field(default_factory=SeedConfig)
    catchup_ratio: float = 2.0
    log_format: Literal["text", "json"] = "text"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    #: membership of a relay cluster (None: relays from ``relays`` only)
    cluster: ClusterConfig | None = None
    #: TLS, principals and open endpoints (default: open, loopback only)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    #: TLS and token of the connections to the relays
    upstream: ClientAuth = field(default_factory=ClientAuth)

    def __post_init__(self) -> None:
        if not self.relays and self.cluster is None:
            raise ConfigError(
                'relays: give at least one relay URL (relays = ["http://..."]) or a [cluster]'
            )
        if self.cluster is not None and not self.cluster.member_id:
            raise ConfigError("cluster.member_id is required for a bootstrap server in a cluster")
        if self.cluster is not None:
            self.cluster.check_listen_host(self.http.host)
        for url in self.relays:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(
                    f"relays: {url_without_user(url)!r} is not an http:// or https:// URL"
                )
        object.__setattr__(self, "relays", tuple(u.rstrip("/") for u in self.relays))
        for name in self.partitions:
            if not safe_name(name):
                raise ConfigError(f"partition name {name[:140]!r} must match {NAME_RULE}")
        if len(set(self.partitions)) != len(self.partitions):
            raise ConfigError("partitions must be unique")
        seed = self.seed
        if seed.dsn and not seed.partition and len(self.partitions) > 1:
            raise ConfigError(
                "seed.dsn feeds one partition: name it (seed.partition), one of "
                + ", ".join(self.partitions)
            )
        if seed.partition and self.partitions and seed.partition not in self.partitions:
            raise ConfigError(f"seed.partition {seed.partition!r} is not one of partitions")
        if self.catchup_ratio < 0:
            raise ConfigError("catchup_ratio must not be negative")

    @property
    def sqlite_path(self) -> Path:
        return self.store.path if self.store.path is not None else self.data_dir / "bootstrap.db"
