"""Options of the ``mysql`` fetcher kind (docs/mysql.md has the table).

Connection secrets and TLS (one set of options for every connection the
fetcher, ``changebus check-source`` and the bootstrap's MariaDB seeder open:
:mod:`._connect`):

* ``password`` or ``password_file`` (never both): the file is read when the
  fetcher starts (:meth:`MySQLConfig.resolved`), with
  :func:`~changebus.schemas.config.read_secret_file` like every ``*_file``
  secret of the project (surrounding whitespace stripped; errors name the
  path, never the content).
* ``require_tls`` or any ``tls_*_file``: every connection speaks TLS and
  verifies the server's certificate (against ``tls_ca_file``, else the
  system's CA store; its names against ``host`` unless
  ``tls_check_hostname = false``); ``tls_cert_file`` / ``tls_key_file``
  present a client certificate. Without them the connection is whatever
  PyMySQL does by default (1.2: encrypted when the server offers it, the
  certificate not checked; 1.1: plain): no protection against a network
  attacker.

A ``mysql://user:password@host:port[/db,...][?option=value&...]`` DSN
(:func:`dsn_options`: ``changebus check-source``, the seeder's
``seed.dsn``) takes these options (not ``password``) as query parameters.
"""

from __future__ import annotations

import dataclasses
import urllib.parse
import zlib
from dataclasses import dataclass
from typing import Any, Final

from changebus.schemas import ConfigError
from changebus.schemas.config import load_config_dict, read_secret_file, secret, size_field

from .._policy import ColumnPolicyOptions

__all__ = ["DSN_QUERY_OPTIONS", "SYSTEM_DATABASES", "MySQLConfig", "dsn_options"]

#: never captured
SYSTEM_DATABASES = frozenset(("mysql", "information_schema", "performance_schema", "sys"))


@dataclass(frozen=True)
class MySQLConfig(ColumnPolicyOptions):
    """Options of the ``mysql`` fetcher kind (seconds for durations, bytes for sizes)."""

    host: str = "127.0.0.1"
    port: int = 3306
    user: str = "changebus"
    password: str = secret()
    #: a file holding the password instead (read at start, whitespace around it stripped)
    password_file: str = ""
    #: TLS with the server's certificate verified, even without tls_ca_file (system CA store)
    require_tls: bool = False
    #: the CA the server's certificate is verified against (turns TLS on)
    tls_ca_file: str = ""
    #: a client certificate and its key (PEM; the key unencrypted), for REQUIRE X509 users
    tls_cert_file: str = ""
    tls_key_file: str = ""
    #: compare the certificate's names with ``host`` (the chain is verified either way)
    tls_check_hostname: bool = True
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
        if self.password and self.password_file:
            raise ConfigError("give fetcher option password or password_file, not both")
        if self.tls_key_file and not self.tls_cert_file:
            raise ConfigError(
                "fetcher option tls_key_file needs tls_cert_file (the certificate it belongs to)"
            )
        if not self.tls_check_hostname and not self.tls:
            raise ConfigError(
                "fetcher option tls_check_hostname = false needs TLS: set tls_ca_file "
                "(or require_tls)"
            )

    @property
    def tls(self) -> bool:
        """Whether every connection must speak TLS and verify the server (module docstring)."""
        return self.require_tls or bool(self.tls_ca_file or self.tls_cert_file)

    def resolved(self) -> MySQLConfig:
        """This config with ``password_file`` read into ``password`` (blocking: at start).

        The copy is what the connections use; it has no ``password_file``, so
        it reads nothing again. A file that cannot be read or is empty is a
        :class:`ConfigError` naming the path (never the content).
        """
        if not self.password_file:
            return self
        password = read_secret_file(self.password_file, "fetcher option password_file")
        return dataclasses.replace(self, password=password, password_file="")

    @classmethod
    def from_dsn(cls, dsn: str, where: str = "the MySQL/MariaDB DSN") -> MySQLConfig:
        """A config from a ``mysql://`` DSN (:func:`dsn_options`; ``where`` names it in errors)."""
        options = dsn_options(dsn, where)
        try:
            return load_config_dict(cls, options, where)
        except ConfigError as exc:
            if exc.message.startswith(where):
                raise
            raise ConfigError(f"{where}: {exc.message}") from None

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


#: the options a DSN may carry as query parameters (the connection's, not ``password``)
DSN_QUERY_OPTIONS: Final = (
    "password_file",
    "require_tls",
    "tls_ca_file",
    "tls_cert_file",
    "tls_key_file",
    "tls_check_hostname",
)


def dsn_options(dsn: str, where: str = "the MySQL/MariaDB DSN") -> dict[str, Any]:
    """Options from ``mysql://user:password@host:port[/db,db...][?option=value&...]``.

    ``mariadb://`` is accepted too; user and password are percent-decoded; the
    path, when given, names the databases to capture; query parameters are
    the connection options of :data:`DSN_QUERY_OPTIONS`
    (``?password_file=/etc/changebus/mysql.pw&tls_ca_file=/etc/changebus/db-ca.pem``).
    Errors name ``where``, never the DSN (it may hold the password).
    """
    parts = urllib.parse.urlsplit(dsn.strip())
    if parts.scheme.lower() not in ("mysql", "mariadb") or not parts.hostname:
        raise ConfigError(f"{where} must be a mysql://user:password@host:port URL")
    try:
        port = parts.port or 3306
    except ValueError:
        raise ConfigError(f"{where} has a bad port") from None
    options: dict[str, Any] = {
        "host": parts.hostname,
        "port": port,
        "user": urllib.parse.unquote(parts.username or "changebus"),
        "password": urllib.parse.unquote(parts.password or ""),
    }
    databases = [d for d in urllib.parse.unquote(parts.path).strip("/").split(",") if d]
    if databases:
        options["databases"] = databases
    try:
        query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        raise ConfigError(f"{where} has a malformed query (option=value&...)") from None
    for key, value in query:
        if key not in DSN_QUERY_OPTIONS:
            shown = key if key.isidentifier() and len(key) <= 40 else "(not shown)"
            raise ConfigError(
                f"{where}: query parameter {shown} is not one of {', '.join(DSN_QUERY_OPTIONS)}"
            )
        if key in options:
            raise ConfigError(f"{where}: query parameter {key} is given twice")
        options[key] = value
    return options
