"""changebus.schemas.security: TLS, authentication and authorization of changebus servers.

Server side (the relay and the bootstrap server, through the server frame
:mod:`changebus.schemas.server`):

* :class:`SecurityConfig` -- the ``[security]`` table of a server's config:
  :class:`TlsConfig` (certificate, key, client CA for mTLS),
  :class:`PrincipalConfig` entries (who: token hashes and certificate
  subjects; what: partitions, sources, scopes), ``open_endpoints`` and
  ``allow_insecure``; :func:`check_bind` refuses a non-loopback address
  without TLS and principals;
* :class:`Principal` / :func:`principal_of` -- the caller of a request and
  its grant, for handlers: ``check_scope``, ``check_partition``,
  ``allows_source``, ``restrict_sources`` (a filter never widens a grant);
* :func:`new_token` / :func:`hash_token` -- bearer tokens and the
  ``sha256:`` hashes a config holds (``changebus token new|hash``);
* :func:`server_ssl_context` / :class:`ServerTls` -- the listening context,
  reloadable on SIGHUP (:func:`reload_all`).

Client side: :class:`ClientAuth` -- how an outgoing changebus connection
(consumer, CLI, Spark source, bootstrap -> relay, relay -> relay) verifies
the server (CA file, host name check), presents a client certificate (mTLS)
and a bearer token (:mod:`changebus.schemas._client_auth`);
:func:`client_ssl_context` -- the verifying context it builds, also used for
connections to source databases (the MySQL fetcher's ``tls_*`` options).

This module imports aiohttp (for the request type); ``changebus.schemas``
itself does not import it.
"""

from ._auth import (
    ANONYMOUS as ANONYMOUS,
    MIN_TOKEN_CHARS as MIN_TOKEN_CHARS,
    PUBLIC as PUBLIC,
    Principal as Principal,
    auth_middleware as auth_middleware,
    hash_token as hash_token,
    new_token as new_token,
    principal_of as principal_of,
)
from ._client_auth import ClientAuth as ClientAuth, client_ssl_context as client_ssl_context
from ._security_config import (
    SCOPES as SCOPES,
    PrincipalConfig as PrincipalConfig,
    SecurityConfig as SecurityConfig,
    TlsConfig as TlsConfig,
    check_bind as check_bind,
    is_loopback as is_loopback,
    parse_subject as parse_subject,
)
from ._tls_server import (
    ServerTls as ServerTls,
    reload_all as reload_all,
    server_ssl_context as server_ssl_context,
)

__all__ = [
    "ANONYMOUS",
    "MIN_TOKEN_CHARS",
    "PUBLIC",
    "SCOPES",
    "ClientAuth",
    "Principal",
    "PrincipalConfig",
    "SecurityConfig",
    "ServerTls",
    "TlsConfig",
    "auth_middleware",
    "check_bind",
    "client_ssl_context",
    "hash_token",
    "is_loopback",
    "new_token",
    "parse_subject",
    "principal_of",
    "reload_all",
    "server_ssl_context",
]
