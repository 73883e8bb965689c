"""The aiohttp application of a changebus daemon: errors as JSON, health and metrics.

:func:`server_app` builds the :class:`aiohttp.web.Application` every daemon
(relay, bootstrap server) starts from; the daemon then adds its own routes
and its start-up/shutdown steps (``app.cleanup_ctx``, see
:mod:`._server`). The frame gives every daemon the same:

* **errors** -- one middleware, outermost: a :class:`ChangebusError` leaves
  as ``to_json()`` with its ``http_status``; an aiohttp HTTP error (404 no
  route, 405 method, 413 body too large) as ``{"error": "http", ...}`` with
  its status; anything else is logged with its traceback and answered 500
  ``{"error": "internal", ...}`` whose message holds nothing of the
  exception (no internals, no secrets). An error after the handler's own
  (streamed) response has begun cannot be answered any more: the connection
  is cut, so the client sees a body without its end. Every answer is counted
  by route and status (``changebus_<daemon>_http_requests_total``); a
  request whose client went away (its handler cancelled, or a
  ``ConnectionError`` while the connection is closed) is counted as status
  499 and not logged. ``changebus_<daemon>_http_requests_in_flight`` is the
  number of handlers running; the connection counters are
  :class:`~._server_limits.ConnectionStats`.
* ``GET /healthz`` (the process answers), ``GET /readyz`` (the daemon's
  ``readiness()``: 200 ready / 503 not, with each partition's state) and
  ``GET /metrics`` (Prometheus text of the app's own registry: the request
  counter plus the daemon's collectors; nothing global, so several daemons
  live in one process).
* **authentication** -- given a ``security`` config with principals, the
  middleware of :mod:`._auth` runs first inside the error middleware (401
  with ``WWW-Authenticate: Bearer``, scopes by method; handlers ask
  :func:`~._auth.principal_of`). TLS is the ``security`` of
  :class:`~._server.Server`.
* **extension points** for the next layers: ``middlewares`` run inside the
  error middleware (so a limit middleware raises a ``ChangebusError`` and
  gets a JSON answer).

Thread-safety: everything here runs on the event loop; the counters are
plain dicts touched only by the loop (a Prometheus scrape reads them on the
loop as well).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ._auth import auth_middleware
from ._jsonable import json_text, jsonable
from ._redact import printable
from ._security_config import SecurityConfig
from ._server_limits import CLIENT_CLOSED, client_gone
from ._server_stats import CONNECTION_STATS, ConnectionStats
from .errors import ChangebusError

__all__ = [
    "HTTP_METRICS",
    "PROMETHEUS_CONTENT_TYPE",
    "REGISTRY",
    "Collector",
    "Handler",
    "HttpMetrics",
    "Readiness",
    "json_response",
    "json_text",
    "server_app",
]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: ``() -> (ready, {partition: state})`` for ``/readyz``
Readiness = Callable[[], tuple[bool, Mapping[str, str]]]
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_INTERNAL = {
    "error": "internal",
    "message": "internal server error (logged by the server)",
    "retriable": True,
}


class Collector(Protocol):
    """What a Prometheus ``CollectorRegistry`` accepts: an object with ``collect()``."""

    def collect(self) -> Iterator[Any]: ...


def _dumps(data: Any) -> str:
    return json.dumps(data, default=jsonable)


def json_response(
    data: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    """A JSON answer; decoded Avro values (bytes, decimals, dates) as :func:`jsonable` says."""
    return web.json_response(data, status=status, headers=headers, dumps=_dumps)


class HttpMetrics:
    """HTTP answers by route and status: ``changebus_<daemon>_http_requests_total``.

    ``requests`` maps ``(route, status)`` to a count; the route is the
    matched resource's pattern (``/v1/schemas/{source}``), or
    ``"unmatched"``, so the label set stays small whatever clients ask for.
    ``in_flight`` is the number of requests being handled now.
    """

    def __init__(self, daemon: str) -> None:
        self.daemon = daemon
        self.requests: Counter[tuple[str, int]] = Counter()
        self.in_flight = 0

    def collect(self) -> Iterator[Any]:
        family = CounterMetricFamily(
            f"changebus_{self.daemon}_http_requests",
            "HTTP requests by route and status",
            labels=["route", "status"],
        )
        for (route, status), count in sorted(self.requests.items()):
            family.add_metric([route, str(status)], float(count))
        yield family
        yield GaugeMetricFamily(
            f"changebus_{self.daemon}_http_requests_in_flight",
            "HTTP requests being handled",
            value=self.in_flight,
        )


HTTP_METRICS: web.AppKey[HttpMetrics] = web.AppKey("changebus_http_metrics", HttpMetrics)
REGISTRY: web.AppKey[CollectorRegistry] = web.AppKey("changebus_registry", CollectorRegistry)
_READINESS: web.AppKey[Readiness] = web.AppKey("changebus_readiness")


def _route(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def _error_answer(
    request: web.Request, body: Mapping[str, Any], status: int, headers: Mapping[str, str] | None
) -> web.StreamResponse:
    if request.writer.output_size > 0:
        # the handler's own response has begun: no second one can follow on
        # this connection. Cut it, so the client sees a body without its end
        # (and discards it); the stand-in below meets the closed connection,
        # which aiohttp takes quietly.
        if request.transport is not None:
            request.transport.abort()
        return web.Response(status=status)
    return json_response(body, status=status, headers=headers)


def _error_middleware(metrics: HttpMetrics, log: logging.Logger) -> Any:
    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        metrics.in_flight += 1
        try:
            response = await handler(request)
        except ChangebusError as exc:
            response = _error_answer(request, exc.to_json(), exc.http_status, None)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise  # a redirect is an answer, not an error
            headers = {k: v for k, v in exc.headers.items() if k.lower() != "content-type"}
            headers.pop("Content-Length", None)
            body = {"error": "http", "message": exc.reason, "retriable": False}
            response = _error_answer(request, body, exc.status, headers)
        except asyncio.CancelledError:
            if client_gone(request):  # its handler is cancelled: nobody to answer
                metrics.requests[(_route(request), CLIENT_CLOSED)] += 1
            raise  # (or the server stops)
        except ConnectionError:
            if client_gone(request):  # nobody to answer, nothing to report
                metrics.requests[(_route(request), CLIENT_CLOSED)] += 1
                raise
            # the server's own connection (e.g. to an upstream) failed: an internal error
            log.exception("unexpected error serving %s %s", request.method, printable(request.path))
            response = _error_answer(request, _INTERNAL, 500, None)
        except Exception:
            log.exception("unexpected error serving %s %s", request.method, printable(request.path))
            response = _error_answer(request, _INTERNAL, 500, None)
        finally:
            metrics.in_flight -= 1
        metrics.requests[(_route(request), response.status)] += 1
        return response

    return errors


async def _healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    ready, states = request.app[_READINESS]()
    return json_response({"ready": ready, "partitions": dict(states)}, status=200 if ready else 503)


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})


def server_app(
    daemon: str,
    *,
    readiness: Readiness,
    collectors: Sequence[Collector] = (),
    middlewares: Sequence[Any] = (),
    client_max_size: int = 64 * 1024,
    logger: logging.Logger | None = None,
    security: SecurityConfig | None = None,
) -> web.Application:
    """A new application with the frame's middleware and routes (module docstring).

    ``daemon`` names the metric prefix (``changebus_<daemon>_...``);
    ``collectors`` join the app's Prometheus registry; ``middlewares`` run
    inside the error middleware, outermost first; unexpected errors are
    logged to ``logger`` (default ``changebus.<daemon>.http``); with
    ``security`` principals, requests are authenticated first. The caller
    adds its routes and ``cleanup_ctx`` steps before the app starts.
    """
    log = logger or logging.getLogger(f"changebus.{daemon}.http")
    metrics = HttpMetrics(daemon)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics)
    connections = ConnectionStats(daemon)
    registry.register(connections)
    for collector in collectors:
        registry.register(collector)
    app = web.Application(
        middlewares=[
            _error_middleware(metrics, log),
            *([auth_middleware(security)] if security and security.authenticates else []),
            *middlewares,
        ],
        client_max_size=client_max_size,
    )
    app[HTTP_METRICS] = metrics
    app[REGISTRY] = registry
    app[CONNECTION_STATS] = connections
    app[_READINESS] = readiness
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    return app
