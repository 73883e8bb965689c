"""The connection limits a daemon's HTTP server applies (the ``[http]`` fields).

:class:`ConnectionLimits` is the frozen config; the server frame
(:mod:`._server_limits`) enforces it. Immutable, so shareable across threads.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["ConnectionLimits", "client_of"]


@dataclass(frozen=True, kw_only=True)
class ConnectionLimits:
    """How long and how many connections a daemon's HTTP server keeps (module docstring).

    The daemons' ``[http]`` config tables inherit these fields (same names in
    the relay and the bootstrap server).
    """

    #: an idle kept-alive connection is closed after this many seconds
    keepalive_timeout_s: float = 75.0
    #: a new connection must send its first request head within this (and TLS handshake)
    header_timeout_s: float = 10.0
    #: open connections at most; more are answered 503 and closed
    max_connections: int = 1024
    #: open connections from one client IP at most: -1 (the default) half of
    #: ``max_connections`` from any address but loopback (a sidecar proxy or a
    #: local tool), 0 no per-IP cap, N at most N from any address
    max_connections_per_ip: int = -1
    #: a connection whose client reads nothing of what it is sent for this long is
    #: dropped (the socket's buffers full: any answer, authenticated or not)
    write_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.keepalive_timeout_s <= 86400:
            raise ConfigError("http.keepalive_timeout_s must be within (0, 86400]")
        if not 0 < self.header_timeout_s <= 3600:
            raise ConfigError("http.header_timeout_s must be within (0, 3600]")
        if self.max_connections < 1:
            raise ConfigError("http.max_connections must be at least 1")
        if self.max_connections_per_ip < -1:
            raise ConfigError(
                "http.max_connections_per_ip must be -1 (half of max_connections), "
                "0 (no cap) or a positive number"
            )
        if not 0 < self.write_timeout_s <= 86400:
            raise ConfigError("http.write_timeout_s must be within (0, 86400]")

    def cap_for(self, ip: str) -> int:
        """The per-IP cap that applies to a client at ``ip`` (0: none)."""
        cap = self.max_connections_per_ip
        if cap >= 0:
            return cap
        return 0 if _loopback(ip) else max(1, self.max_connections // 2)


def client_of(ip: str) -> str:
    """What a per-IP cap counts ``ip`` as: an IPv6 host by its /64 (one host may hold a
    whole /64 and pick a fresh address per connection), anything else by itself."""
    try:
        address = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return ip
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is None:
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return ip


def _loopback(ip: str) -> bool:
    try:
        address = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool((mapped or address).is_loopback)
