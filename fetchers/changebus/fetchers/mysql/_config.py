"""Options of the ``mysql`` fetcher kind (docs/mysql.md has the table)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from changebus.schemas import ConfigError
from changebus.schemas.config import secret, size_field

from .._policy import ColumnPolicyOptions

__all__ = ["SYSTEM_DATABASES", "MySQLConfig"]

#: never captured
SYSTEM_DATABASES = frozenset(("mysql", "information_schema", "performance_schema", "sys"))


@dataclass(frozen=True)
class MySQLConfig(ColumnPolicyOptions):
    """Options of the ``mysql`` fetcher kind (seconds for durations, bytes for sizes)."""

    host: str = "127.0.0.1"
    port: int = 3306
    user: str = "changebus"
    password: str = secret()
    #: databases to capture; empty = every database except the system ones
    databases: tuple[str, ...] = ()
    #: this reader's replication server id; 0 = derived from the partition (see server_id_for)
    server_id: int = 0
    #: the server sends a heartbeat after this long without events (idle detection, shutdown)
    heartbeat_interval_s: float = 1.0
    #: a transaction with no captured change (other databases, DDL) becomes a HEARTBEAT
    #: window at most this often: the relay's resume position keeps up (a purged
    #: binlog behind a quiet database is no false data loss) without a window for each
    idle_window_interval_s: float = 5.0
    connect_timeout_s: float = 10.0
    #: reconnects from the last emitted window before the error goes to the relay
    reconnect_attempts: int = 3
    reconnect_backoff_s: float = 0.5
    #: a transaction whose events pass this size is refused or skipped (0 = no limit)
    max_transaction_bytes: int = size_field(128 << 20)
    #: "fail" (stop with a clear error) or "skip" (a DATA_LOSS event replaces it)
    on_oversized_transaction: str = "fail"
    #: the binlog file to resume from was purged: "data_loss" (a DATA_LOSS window, then
    #: go on from the oldest binlog kept) or "fail"
    on_binlog_purged: str = "data_loss"
    #: the relay's last window came from another server that does not hold its GTID
    #: (or the GTID cannot be placed exactly): "fail" or "data_loss" (a DATA_LOSS
    #: window, then go on from this server's binlog end)
    on_divergent_server: str = "fail"
    #: where a relay holding nothing starts: "current" (the binlog's end) or "earliest"
    start_at: str = "current"
    #: processes that transcode row events next to the stream thread (order kept);
    #: 0 = the stream thread does it. A second core makes the drain of a backlog faster
    decode_workers: int = 0
    #: how often the binlog list is read for the relay's binlog distance metric
    #: (``changebus_relay_source_binlog_distance_bytes``); 0 = never
    binlog_stats_interval_s: float = 10.0
    #: map tinyint(1) to Avro boolean instead of int
    tinyint1_as_boolean: bool = False

    def __post_init__(self) -> None:
        self.column_rules()  # checked at start
        choices = {
            "on_oversized_transaction": ("fail", "skip"),
            "on_binlog_purged": ("data_loss", "fail"),
            "on_divergent_server": ("fail", "data_loss"),
            "start_at": ("current", "earliest"),
        }
        for option, allowed in choices.items():
            if getattr(self, option) not in allowed:
                raise ConfigError(
                    f"fetcher option {option} must be one of {', '.join(allowed)}, "
                    f"not {getattr(self, option)!r}"
                )
        for option in ("heartbeat_interval_s", "connect_timeout_s"):
            if getattr(self, option) <= 0:
                raise ConfigError(f"fetcher option {option} must be positive")
        for option in (
            "reconnect_attempts",
            "reconnect_backoff_s",
            "max_transaction_bytes",
            "idle_window_interval_s",
            "decode_workers",
            "binlog_stats_interval_s",
        ):
            if getattr(self, option) < 0:
                raise ConfigError(f"fetcher option {option} must not be negative")
        if not 0 <= self.server_id < 2**32:
            raise ConfigError("fetcher option server_id must be within 0..2**32-1")
        if not 0 < self.port < 65536:
            raise ConfigError("fetcher option port must be within 1..65535")

    @property
    def read_timeout_s(self) -> float:
        """Reads and writes of the fetcher's connections give up after this long.

        ``max(10 s, 5 heartbeat intervals)``: the server sends a heartbeat
        every ``heartbeat_interval_s`` on the binlog stream, so this much
        silence means a frozen server or a broken path (TCP keepalives do not
        notice a peer whose kernel still answers).
        """
        return max(10.0, self.heartbeat_interval_s * 5)

    def server_id_for(self, partition_name: str, partition_id: int) -> int:
        """The replication server id: configured, else derived from the partition.

        Derived ids lie in ``0x4342_0000 .. 0x4342_FFFF`` ("CB"), from the
        partition id and a CRC of its name, so two fetchers of one relay (or of
        relays with distinct partitions) never share one: a second reader with
        an id already connected makes the server drop the first (error 4052).
        """
        if self.server_id:
            return self.server_id
        mixed = (partition_id * 0x9E37 ^ zlib.crc32(partition_name.encode())) & 0xFFFF
        return 0x4342_0000 | mixed or 0x4342_0001
