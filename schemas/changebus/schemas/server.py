"""changebus.schemas.server: the HTTP server frame every changebus daemon runs in.

The relay and the bootstrap server are thin users of this module; the next
daemons (and TLS, authentication and limits, once) plug into it:

* :func:`server_app` -- a new aiohttp application with the JSON error
  middleware (``ChangebusError`` -> its status and ``to_json()``; anything
  unexpected -> a logged 500 that leaks nothing), request counting and
  ``/healthz``, ``/readyz``, ``/metrics``; :func:`json_response` for
  handlers;
* :class:`Server` -- runner, listening site (port 0: any free port), start-up
  and shutdown through the app's ``cleanup_ctx`` steps; :func:`serve` -- the
  daemon's main loop (SIGTERM/SIGINT, also during start-up);
* :class:`CopyBudget` -- the bytes of response copies held at once for
  clients that read slowly (relay pushes, bootstrap pages), bounded without
  making a request wait;
* :class:`ConnectionLimits` -- keep-alive and request-head timeouts, caps on
  open connections (all, per client IP), handlers cancelled when their client
  disconnects (the daemons' ``[http]`` tables inherit its fields);
* ``query_*`` / :func:`check_params` -- query-parameter parsing where every
  failure is a ``BadRequestError`` (400, not retriable); :func:`printable`
  -- a client's words with control characters escaped (for logs);
* :func:`add_daemon_parser` / :func:`run_daemon` -- a daemon's subcommand:
  the common options, the config from file, environment and ``--set``, the
  logging set-up and the exit statuses (0 after a signal, 2 for a bad config
  or a fatal start-up error).

This module imports aiohttp and prometheus_client; ``changebus.schemas``
itself does not import it, so the wire contract stays light for the
fetchers and clients.
"""

from ._copybudget import (
    MIN_FLOOR as MIN_FLOOR,
    CopyBudget as CopyBudget,
    check_copy_budget as check_copy_budget,
    copy_floor as copy_floor,
)
from ._daemon_cli import add_daemon_parser as add_daemon_parser, run_daemon as run_daemon
from ._redact import printable as printable
from ._server import Server as Server, Service as Service, serve as serve
from ._server_app import (
    HTTP_METRICS as HTTP_METRICS,
    PROMETHEUS_CONTENT_TYPE as PROMETHEUS_CONTENT_TYPE,
    REGISTRY as REGISTRY,
    Collector as Collector,
    Handler as Handler,
    HttpMetrics as HttpMetrics,
    Readiness as Readiness,
    json_response as json_response,
    json_text as json_text,
    server_app as server_app,
)
from ._server_limits import MAX_HEADERS as MAX_HEADERS, ConnectionLimits as ConnectionLimits
from ._server_query import (
    MAX_DIGITS as MAX_DIGITS,
    check_params as check_params,
    query_choice as query_choice,
    query_float as query_float,
    query_int as query_int,
    query_parsed as query_parsed,
)

__all__ = [
    "HTTP_METRICS",
    "MAX_DIGITS",
    "MAX_HEADERS",
    "MIN_FLOOR",
    "PROMETHEUS_CONTENT_TYPE",
    "REGISTRY",
    "Collector",
    "ConnectionLimits",
    "CopyBudget",
    "Handler",
    "HttpMetrics",
    "Readiness",
    "Server",
    "Service",
    "add_daemon_parser",
    "check_copy_budget",
    "check_params",
    "copy_floor",
    "json_response",
    "json_text",
    "printable",
    "query_choice",
    "query_float",
    "query_int",
    "query_parsed",
    "run_daemon",
    "serve",
    "server_app",
]
