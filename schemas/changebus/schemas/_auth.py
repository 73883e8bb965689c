"""Who sent a request, and what it may read: principals, tokens, the authentication middleware.

A :class:`Principal` is an authenticated caller and its grant: partition
names and source names it may read (``None``: all), and its scopes
(``read``; ``admin`` for mutating endpoints, which implies ``read``).

:func:`auth_middleware` (installed by
:func:`~._server_app.server_app` when principals are configured, inside the
error middleware) finds each request's principal:

1. a bearer token (``Authorization: Bearer <token>``), looked up by its
   SHA-256 (the config holds only hashes; tokens shorter than
   :data:`MIN_TOKEN_CHARS` never match);
2. else a client certificate (mTLS) whose subject has every attribute of one
   of a principal's ``cert_subjects`` (the most specific match wins);
3. else nobody: 401 ``UnauthorizedError`` JSON with ``WWW-Authenticate:
   Bearer``. Presented but unknown credentials are 401 too.

Routes listed in ``open_endpoints`` (matched on the route that serves the
request, so no path spelling reaches another route) need no credentials:
a request without valid ones there gets the :data:`PUBLIC` principal (read
everything, no ``admin``). Then every request needs scope ``read``, and any
method other than GET/HEAD/OPTIONS scope ``admin`` (so a later mutating
endpoint is guarded by default). Handlers ask :func:`principal_of` for the
rest (partitions, sources); without security there is no middleware and
:func:`principal_of` answers :data:`ANONYMOUS`, which grants everything.

Logs name principals, never tokens: refusals (401, 403) are logged at
warning, at most one line per kind and :data:`WARN_INTERVAL_S` (the count
of those left out follows in the next line).

Thread-safety: the middleware and principals are used on the event loop;
principals are immutable.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web

from ._redact import printable
from ._security_config import SCOPES, SecurityConfig, Subject
from ._tls_server import CURRENT_SINCE, RETIRED
from .errors import ConfigError, ForbiddenError, NotYetError, UnauthorizedError

__all__ = [
    "ANONYMOUS",
    "MIN_TOKEN_CHARS",
    "PUBLIC",
    "Principal",
    "auth_middleware",
    "hash_token",
    "new_token",
    "principal_of",
]

log = logging.getLogger("changebus.server.auth")

#: shortest token accepted (by :func:`hash_token`, and by the server)
MIN_TOKEN_CHARS: Final = 32
_MAX_TOKEN_CHARS: Final = 4096
WARN_INTERVAL_S: Final = 10.0
_SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller and what it was granted (module docstring).

    ``partitions`` / ``sources``: the names it may read, ``None`` for all;
    ``scopes``: a subset of :data:`~._security_config.SCOPES`.
    """

    name: str
    partitions: frozenset[str] | None = None
    sources: frozenset[str] | None = None
    scopes: frozenset[str] = frozenset(SCOPES)

    @classmethod
    def from_grant(
        cls, name: str, partitions: Iterable[str], sources: Iterable[str], scopes: Iterable[str]
    ) -> Principal:
        """A principal from config lists, where ``"*"`` means all."""
        parts, srcs = frozenset(partitions), frozenset(sources)
        return cls(
            name,
            None if "*" in parts else parts,
            None if "*" in srcs else srcs,
            frozenset(scopes),
        )

    def has_scope(self, scope: str) -> bool:
        """Whether the grant holds ``scope`` (``admin`` implies ``read``)."""
        return scope in self.scopes or (scope == "read" and "admin" in self.scopes)

    def check_scope(self, scope: str) -> None:
        """Raise :class:`ForbiddenError` (403) unless :meth:`has_scope`."""
        if not self.has_scope(scope):
            raise ForbiddenError(f"principal {self.name!r} does not have scope {scope!r}")

    def allows_partition(self, name: str) -> bool:
        """Whether partition ``name`` is granted."""
        return self.partitions is None or name in self.partitions

    def check_partition(self, name: str) -> None:
        """Raise :class:`ForbiddenError` (403) unless partition ``name`` is granted."""
        if self.partitions is not None and name not in self.partitions:
            raise ForbiddenError(f"principal {self.name!r} may not read partition {name[:128]!r}")

    def allows_source(self, name: str) -> bool:
        """Whether source ``name`` (``schema.table``) is granted."""
        return self.sources is None or name in self.sources

    def restrict_sources(
        self,
        requested: Collection[str] | None,
        available: Iterable[str] | Callable[[str], bool],
    ) -> frozenset[str] | None:
        """The source names a request must be limited to, or None when no limit is needed.

        * every source granted: None (the request stands as it is);
        * ``requested`` given: :class:`ForbiddenError` when one is not
          granted, else None (the request is within the grant);
        * nothing requested, some sources granted: the granted ones among
          ``available`` (possibly empty: then only control events pass).
          ``available`` may be the names, or a test of one name: then only
          the grant is walked, not every source the partition has.

        So a ``sources=`` parameter, or a key filter applied on top of this,
        can narrow what a principal reads, never widen it.
        """
        granted = self.sources
        if granted is None:
            return None
        if requested is not None:
            refused = sorted(s for s in requested if s not in granted)
            if refused:
                shown = ", ".join(repr(s[:128]) for s in refused[:5])
                raise ForbiddenError(f"principal {self.name!r} may not read source(s) {shown}")
            return None
        if callable(available):
            return frozenset(s for s in granted if available(s))
        return frozenset(s for s in available if s in granted)


_PRINCIPAL: Final = web.RequestKey("changebus_principal", Principal)

#: the principal of a server without security: everything, including ``admin``
ANONYMOUS: Final = Principal("anonymous")
#: the principal of a request without credentials on an open endpoint
PUBLIC: Final = Principal("public", scopes=frozenset({"read"}))


def principal_of(request: web.Request) -> Principal:
    """The request's principal (:data:`ANONYMOUS` on a server without security)."""
    principal: Principal = request.get(_PRINCIPAL, ANONYMOUS)
    return principal


def new_token() -> str:
    """A fresh random bearer token (256 bits, URL-safe base64: 43 characters)."""
    return secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """``sha256:<hex>`` of ``token``: what a config's ``tokens`` list holds.

    Raises :class:`ConfigError` for a token shorter than
    :data:`MIN_TOKEN_CHARS` (a plain hash protects only random tokens).
    """
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"a token must have at least {MIN_TOKEN_CHARS} characters (use `changebus token new`)"
        )
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


class _RateLimitedWarnings:
    """At most one warning per key and interval; the next one says how many were left out.

    Keys are few by construction (a refusal kind, a configured principal's name).
    """

    def __init__(self, logger: logging.Logger, interval_s: float) -> None:
        self._log = logger
        self._interval = interval_s
        self._state: dict[str, tuple[float, int]] = {}

    def warning(self, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        last, skipped = self._state.get(key, (-math.inf, 0))
        if now - last < self._interval:
            self._state[key] = (last, skipped + 1)
            return
        self._state[key] = (now, 0)
        if skipped:
            self._log.warning(msg + " (%d more like it not logged)", *args, skipped)
        else:
            self._log.warning(msg, *args)


#: certificate subjects whose principal :class:`_Authenticator` remembers
_SUBJECTS_KEPT: Final = 4096


class _Authenticator:
    """Credentials -> principal, from the configured principals (module docstring)."""

    def __init__(self, security: SecurityConfig) -> None:
        self.by_token: dict[str, Principal] = {}
        subjects: list[tuple[Subject, Principal]] = []
        for cfg in security.principals:
            principal = Principal.from_grant(cfg.name, cfg.partitions, cfg.sources, cfg.scopes)
            self.by_token.update(dict.fromkeys(cfg.tokens, principal))
            subjects.extend((subject, principal) for subject in cfg.subjects)
        # the most specific subject first, so it wins over a shorter one it contains
        subjects.sort(key=lambda item: -len(item[0]))
        self.subjects = tuple(subjects)
        #: certificate subjects already matched (the walk of :attr:`subjects` is linear
        #: in the principals; a client sends the same certificate with every request),
        #: at most :data:`_SUBJECTS_KEPT`, cleared when full (None: no principal)
        self._matched: dict[frozenset[tuple[str, str]], Principal | None] = {}
        self.open = frozenset(security.open_endpoints)

    def authenticate(self, request: web.Request) -> Principal:
        """The principal of ``request``; :class:`UnauthorizedError` when there is none."""
        header = request.headers.get("Authorization")
        if header is not None:
            scheme, _, token = header.strip().partition(" ")
            token = token.strip()
            if scheme.lower() != "bearer" or not token:
                raise UnauthorizedError("the Authorization header must be 'Bearer <token>'")
            if MIN_TOKEN_CHARS <= len(token) <= _MAX_TOKEN_CHARS:
                # (bytes that are not UTF-8 arrive as surrogates: they match no token)
                raw = token.encode("utf-8", "surrogateescape")
                digest = "sha256:" + hashlib.sha256(raw).hexdigest()
                found = self.by_token.get(digest)
                if found is not None:
                    return found
            raise UnauthorizedError("unknown bearer token")
        if self.subjects and request.transport is not None:
            cert = request.transport.get_extra_info("peercert")
            if cert:
                tls = request.transport.get_extra_info("ssl_object")
                if getattr(getattr(tls, "context", None), RETIRED, False) or _resumed_from_before(
                    tls
                ):
                    # set up before a TLS reload: its certificate was checked against
                    # the client CA of then, which the reload may have dropped
                    raise NotYetError(
                        "this TLS connection predates a reload of the server's"
                        " certificates: connect again"
                    )
                have = _subject_attributes(cert)
                try:
                    found = self._matched[have]
                except KeyError:
                    found = next((p for subject, p in self.subjects if subject <= have), None)
                    if len(self._matched) >= _SUBJECTS_KEPT:
                        self._matched.clear()
                    self._matched[have] = found
                if found is not None:
                    return found
                raise UnauthorizedError("no principal has this client certificate's subject")
        raise UnauthorizedError("credentials required: a bearer token or a client certificate")


def _resumed_from_before(tls: Any) -> bool:
    """Whether ``tls`` (an SSL object) resumed a session set up before its context became
    current (a TLS 1.2 session from the cache, from before a reload: its certificate was
    checked against the client CA of then)."""
    if not getattr(tls, "session_reused", False):
        return False
    since = getattr(getattr(tls, "context", None), CURRENT_SINCE, None)
    session = getattr(tls, "session", None)
    return since is not None and session is not None and session.time <= since


def _subject_attributes(cert: Mapping[str, Any]) -> frozenset[tuple[str, str]]:
    """``{(name, value)}`` of a ``getpeercert()`` dict's subject (RDNs flattened)."""
    return frozenset(
        (str(name), str(value)) for rdn in cert.get("subject", ()) for name, value in rdn
    )


def _route(request: web.Request) -> str | None:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else None


def auth_middleware(security: SecurityConfig) -> Any:
    """The authentication middleware for ``security`` (module docstring)."""
    auth = _Authenticator(security)
    warnings = _RateLimitedWarnings(log, WARN_INTERVAL_S)

    @web.middleware
    async def authenticate(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            principal = auth.authenticate(request)
        except NotYetError as exc:  # (a connection of a retired TLS context: reconnect)
            stale = web.json_response(exc.to_json(), status=exc.http_status)
            stale.force_close()
            await stale.prepare(request)
            await stale.write_eof()
            if request.transport is not None:
                # cut without a TLS close_notify: OpenSSL then drops the session from
                # its cache, which a clean close left resumable, and a client resuming
                # it got this 503 again and again for the cache's 300 s (review)
                request.transport.abort()
            return stale
        except UnauthorizedError as exc:
            if _route(request) in auth.open:
                principal = PUBLIC
            else:
                warnings.warning(
                    "401",
                    "refused %s %s from %s: %s",
                    request.method,
                    printable(request.path),
                    request.remote,
                    exc.message,
                )
                refused = web.json_response(
                    exc.to_json(),
                    status=exc.http_status,
                    headers={"WWW-Authenticate": 'Bearer realm="changebus"'},
                )
                refused.force_close()  # (an idle kept-alive socket would hold a slot)
                return refused
        request[_PRINCIPAL] = principal
        try:
            principal.check_scope("read" if request.method in _SAFE_METHODS else "admin")
            response: web.StreamResponse = await handler(request)
            if principal is PUBLIC and not response.prepared:
                # an unauthenticated client (an open endpoint) keeps no connection
                # open: idle, it would hold one of its address' connection slots
                response.force_close()
        except ForbiddenError as exc:
            warnings.warning(
                f"403 {principal.name}",
                "refused %s %s to principal %s: %s",
                request.method,
                printable(request.path),
                principal.name,
                exc.message,
            )
            raise
        log.debug("%s %s by principal %s", request.method, printable(request.path), principal.name)
        return response

    return authenticate
