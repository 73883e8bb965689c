"""The Prometheus collector of a daemon's HTTP connections (:mod:`._server_limits`).

``changebus_<daemon>_http_connections`` open now,
``..._http_connections_refused_total{reason}``, ``..._http_header_timeouts_total``
and ``..._http_write_timeouts_total``; registered by
:func:`~._server_app.server_app` under :data:`CONNECTION_STATS`.

Thread-safety: the server's event loop writes the counts; a scrape reads them there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["CONNECTION_STATS", "ConnectionStats"]


class ConnectionStats:
    """Connections of one daemon's server: a Prometheus collector (module docstring).

    ``open`` is the number of admitted connections now; ``refused`` counts
    refusals by reason (``max_connections``, ``max_connections_per_ip``);
    ``header_timeouts`` the connections closed by the header watchdog;
    ``write_timeouts`` those dropped because their client read nothing for
    ``write_timeout_s``.
    """

    def __init__(self, daemon: str) -> None:
        self.daemon = daemon
        self.open = 0
        self.refused: Counter[str] = Counter()
        self.header_timeouts = 0
        self.write_timeouts = 0

    def collect(self) -> Iterator[Any]:
        prefix = f"changebus_{self.daemon}_http"
        yield GaugeMetricFamily(f"{prefix}_connections", "Open HTTP connections", value=self.open)
        refused = CounterMetricFamily(
            f"{prefix}_connections_refused",
            "HTTP connections refused (answered 503) by the connection caps",
            labels=["reason"],
        )
        for reason in ("max_connections", "max_connections_per_ip"):
            refused.add_metric([reason], float(self.refused[reason]))
        yield refused
        yield CounterMetricFamily(
            f"{prefix}_header_timeouts",
            "HTTP connections closed because no request head arrived in time",
            value=self.header_timeouts,
        )
        yield CounterMetricFamily(
            f"{prefix}_write_timeouts",
            "HTTP connections dropped because the client read nothing of its answers in time",
            value=self.write_timeouts,
        )


CONNECTION_STATS: web.AppKey[ConnectionStats] = web.AppKey(
    "changebus_connection_stats", ConnectionStats
)
