"""Options of the ``relay`` fetcher kind: a relay following another relay (chaining)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from changebus.schemas import ConfigError
from changebus.schemas.config import secret, size_field
from changebus.schemas.security import ClientAuth

__all__ = ["ChainConfig"]


@dataclass(frozen=True)
class ChainConfig:
    """Options of the ``relay`` fetcher kind (seconds for durations, bytes for sizes).

    ``upstream`` lists the relays to follow, tried in order (failover: the
    next one on a failure or a refused answer); a single URL may be given
    as a string. They must all serve the same partition with the same SCNs
    (a leader and its followers). ``partition`` is the upstream partition's
    name (empty: the local partition's name); its numeric id must equal the
    local one, since the events carry it and are appended unchanged.

    The transfer settings are those of :class:`changebus.client.StreamConfig`
    (``follow``, ``wait_s``, ``max_bytes``, ``follow_bytes``, timeouts,
    backoff, ``max_attempts``: 0 retries for ever). ``queue_windows`` and
    ``queue_bytes`` bound the windows received but not yet taken by the
    relay's ingest (beyond them the HTTP read stops: back-pressure reaches
    the upstream through TCP). ``client_id`` names this follower in the
    upstream's ``/v1/status`` (empty: ``relay-chain-<partition>``).

    TLS and authentication towards the upstream: the relay config's
    ``[upstream]`` table (a :class:`~changebus.schemas.security.ClientAuth`)
    is the default; ``ca_file``, ``cert_file``, ``key_file``,
    ``check_hostname``, ``token_file`` and ``token`` given here replace its
    fields of the same names for this partition (:meth:`client_auth`).
    ``token`` is a secret: prefer ``token_file`` (or the ``[upstream]``
    table, whose token an environment variable can set).
    """

    upstream: tuple[str, ...] = ()
    partition: str = ""
    client_id: str = ""
    follow: bool = True
    wait_s: float = 10.0
    max_bytes: int = size_field(1 << 20)
    follow_bytes: int = size_field(64 << 20)
    connect_timeout_s: float = 5.0
    read_margin_s: float = 10.0
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0
    backoff_multiplier: float = 2.0
    max_attempts: int = 0
    queue_windows: int = 1024
    queue_bytes: int = size_field(8 << 20)
    #: the largest window taken from the upstream (as the client's ``max_window_bytes``;
    #: a bigger one stops the partition with a clear error: raise this, up to the
    #: upstream's own window limit)
    max_window_bytes: int = size_field(512 << 20)  # (the client's default)
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    check_hostname: bool | None = None
    token_file: Path | None = None
    token: str = secret("")
    #: when the upstream evicted what follows our position: "data_loss" (one DATA_LOSS
    #: window for the gap, then on) or "restart" (this relay's buffer starts again
    #: where the upstream's is complete: a cluster's follower, whose gap is no loss
    #: of the source -- its consumers find the windows on other members or bootstrap)
    on_fell_off: str = "data_loss"

    def __post_init__(self) -> None:
        upstream: object = self.upstream
        if isinstance(upstream, str):
            upstream = (upstream,)
        if not isinstance(upstream, tuple | list) or not upstream:
            raise ConfigError("the relay fetcher needs options.upstream (one or more relay URLs)")
        if any(
            not isinstance(u, str) or not u.startswith(("http://", "https://")) for u in upstream
        ):
            raise ConfigError("options.upstream: every relay must be an http:// or https:// URL")
        object.__setattr__(self, "upstream", tuple(u.rstrip("/") for u in upstream))
        if self.queue_windows < 1 or self.queue_bytes < 1:
            raise ConfigError("queue_windows and queue_bytes must be positive")
        if self.on_fell_off not in ("data_loss", "restart"):
            raise ConfigError(
                f"options.on_fell_off must be data_loss or restart, not {self.on_fell_off!r}"
            )

    def client_auth(self, default: ClientAuth) -> ClientAuth:
        """``default`` (the relay's ``[upstream]``) with the settings given here instead.

        A token or token file given here replaces both of the default's.
        """
        given: dict[str, object] = {
            name: getattr(self, name)
            for name in ("ca_file", "cert_file", "key_file", "check_hostname", "token_file")
            if getattr(self, name) is not None
        }
        if self.token:
            given["token"] = self.token
        if "token" in given or "token_file" in given:
            given.setdefault("token", "")
            given.setdefault("token_file", None)
        if "cert_file" in given and "key_file" not in given:
            given["key_file"] = None  # the default's key belongs to the default's certificate
        return replace(default, **given) if given else default  # type: ignore[arg-type]
