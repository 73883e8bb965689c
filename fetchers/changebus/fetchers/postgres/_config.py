"""Options of the ``postgres`` fetcher kind (docs/postgres.md has the table)."""

from __future__ import annotations

from dataclasses import dataclass

from changebus.schemas import ConfigError
from changebus.schemas.config import secret

from .._policy import ColumnPolicyOptions

__all__ = ["PostgresConfig"]


@dataclass(frozen=True)
class PostgresConfig(ColumnPolicyOptions):
    """Options of the ``postgres`` fetcher kind (seconds for durations)."""

    dsn: str = secret()
    slot: str = "changebus"
    publication: str = "changebus"
    #: tables for a new publication ("schema.table"); empty = FOR ALL TABLES
    tables: tuple[str, ...] = ()
    create_slot: bool = True
    create_publication: bool = True
    #: "stream" (replication protocol) or "sql" (peek + advance, no replication connection)
    mode: str = "stream"
    status_interval_s: float = 1.0
    #: the replication connection counts as lost when the server sent nothing for this
    #: long -- a keepalive reply is asked for after a third of it -- (a half-open
    #: connection: a network that drops packets without a reset, a frozen server); its
    #: connections are cut and the fetcher starts again. 0 = never
    receive_timeout_s: float = 30.0
    #: emit a heartbeat message after this long without a window (0 = never)
    heartbeat_interval_s: float = 10.0
    #: how often the slot's retained WAL is read for /v1/status and /metrics
    slot_stats_interval_s: float = 5.0
    #: a transaction whose events pass this size is refused or skipped (0 = no limit)
    max_transaction_bytes: int = 128 << 20
    #: "fail" (stop with a clear error) or "skip" (a DATA_LOSS event replaces it)
    on_oversized_transaction: str = "fail"
    #: an invalidated or vanished slot: "recreate" (after a DATA_LOSS event) or "fail"
    on_slot_lost: str = "recreate"
    #: SQL mode: changes asked per peek, and the pause when nothing is new
    sql_batch_changes: int = 20_000
    sql_poll_interval_s: float = 0.05
    #: how the stream is read: "socket" (straight from the connection's socket),
    #: "libpq" (one PQgetCopyData per message) or "auto" (socket unless TLS/GSS)
    stream_reader: str = "auto"
    #: bytes asked per read of the socket reader
    socket_read_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if not self.dsn:
            raise ConfigError("the postgres fetcher needs options.dsn")
        self.column_rules()  # checked at start
        choices = {
            "mode": ("stream", "sql"),
            "on_oversized_transaction": ("fail", "skip"),
            "on_slot_lost": ("recreate", "fail"),
            "stream_reader": ("auto", "libpq", "socket"),
        }
        for option, allowed in choices.items():
            if getattr(self, option) not in allowed:
                raise ConfigError(
                    f"fetcher option {option} must be one of {', '.join(allowed)}, "
                    f"not {getattr(self, option)!r}"
                )
        for option in ("status_interval_s", "sql_poll_interval_s"):
            if getattr(self, option) <= 0:
                raise ConfigError(f"fetcher option {option} must be positive")
        for option in (
            "heartbeat_interval_s",
            "slot_stats_interval_s",
            "max_transaction_bytes",
            "receive_timeout_s",
        ):
            if getattr(self, option) < 0:
                raise ConfigError(f"fetcher option {option} must not be negative")
        if self.sql_batch_changes < 1:
            raise ConfigError("fetcher option sql_batch_changes must be at least 1")
        if self.socket_read_bytes < 1:
            raise ConfigError("fetcher option socket_read_bytes must be at least 1")
        for name in (self.slot, self.publication):
            if not name.replace("_", "").isalnum() or not name.islower():
                raise ConfigError(
                    f"slot and publication names must be lower-case [a-z0-9_], got {name!r}"
                )
