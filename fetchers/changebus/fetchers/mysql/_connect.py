"""Every PyMySQL connection to a MySQL/MariaDB source: login settings, TLS, and its failures.

:func:`connection_args` is what each connection of a :class:`MySQLConfig`
takes (host, port, user, password -- ``password_file`` read now when the
config was not :meth:`~MySQLConfig.resolved` at start -- and, with TLS,
``ssl``: a verifying context from
:func:`~changebus.schemas.security.client_ssl_context`). :func:`open_connection`
opens one; the fetcher's set-up, its binlog stream (control and stream
connections, through mysql-replication's ``pymysql_wrapper``), its binlog
distance reader, ``changebus check-source``, the snapshot helper and the
bootstrap's MariaDB seeder all go through it, so none of them can forget TLS.

Invariants of a connection of a config with :attr:`MySQLConfig.tls`:

* it is encrypted or it is refused: PyMySQL 1.2 refuses a server that does
  not offer TLS before logging in; 1.1 logs in in clear, so the socket is
  checked after the handshake as well, and the connection closed and
  refused when it is not a TLS socket;
* its server certificate was verified (chain, and host name unless
  ``tls_check_hostname = false``).

A TLS failure that waiting cannot fix (the certificate does not verify, the
server offers no TLS, the TLS handshake is refused) is a non-retriable
:class:`~changebus.schemas.SourceConfigError` saying what to check; a
connection cut mid-handshake stays a PyMySQL error for the caller's own
retry rules. No message holds the password: they are built from the host,
the port and the TLS library's reason only. Blocking (PyMySQL).
"""

from __future__ import annotations

import ssl
from typing import Any, Final

from changebus.schemas import SourceConfigError

from ._config import MySQLConfig

__all__ = ["connection_args", "open_connection", "tls_failure"]

#: PyMySQL's CR_SSL_CONNECTION_ERROR: TLS asked for, the server does not offer it
_CR_SSL_CONNECTION_ERROR: Final = 2026
#: TLS errors of a cut connection, not of a configuration: retried like any other cut
_TRANSIENT_TLS: Final = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)


def connection_args(cfg: MySQLConfig) -> dict[str, Any]:
    """``host``, ``port``, ``user``, ``password`` and, with TLS, ``ssl`` for ``pymysql.connect``.

    Reads ``password_file`` (when the config was not resolved at start) and
    the TLS files; their errors are :class:`~changebus.schemas.ConfigError`
    naming the option and the path.
    """
    login = cfg.resolved()
    args: dict[str, Any] = {
        "host": cfg.host,
        "port": cfg.port,
        "user": cfg.user,
        "password": login.password,
    }
    if cfg.tls:
        from changebus.schemas.security import client_ssl_context

        args["ssl"] = client_ssl_context(
            cfg.tls_ca_file,
            cfg.tls_cert_file,
            cfg.tls_key_file,
            check_hostname=cfg.tls_check_hostname,
            option_prefix="fetcher option tls_",
        )
    return args


def open_connection(cfg: MySQLConfig, **settings: Any) -> Any:
    """A PyMySQL connection with ``cfg``'s login and TLS (module docstring).

    ``settings`` are further ``pymysql.connect`` arguments (timeouts,
    autocommit, ...); given login settings win over ``cfg``'s (the binlog
    stream hands back what :func:`connection_args` made). TLS failures are a
    non-retriable :class:`SourceConfigError`; other PyMySQL errors are
    raised as they are, for the caller to classify.
    """
    import pymysql

    args = {**connection_args(cfg), **settings}
    try:
        conn = pymysql.connect(**args)
    except pymysql.err.MySQLError as exc:
        problem = tls_failure(cfg, exc)
        if problem is not None:
            raise problem from None
        raise
    if cfg.tls and not isinstance(getattr(conn, "_sock", None), ssl.SSLSocket):
        conn.close()
        raise _no_tls(cfg)
    return conn


def tls_failure(cfg: MySQLConfig, exc: BaseException) -> SourceConfigError | None:
    """The non-retriable error a failed connection of ``cfg`` is, when TLS is why; else None."""
    if not cfg.tls:
        return None
    args = getattr(exc, "args", ())
    if args and args[0] == _CR_SSL_CONNECTION_ERROR:
        return _no_tls(cfg)
    cause = getattr(exc, "original_exception", None) or exc.__cause__ or exc.__context__
    where = f"{cfg.host}:{cfg.port}"
    if isinstance(cause, ssl.SSLCertVerificationError):
        why = cause.verify_message or cause.reason or "not verified"
        return SourceConfigError(
            f"the MySQL server's TLS certificate at {where} is not trusted: {why}; check "
            "tls_ca_file (the CA that signed the server's certificate), the names in the "
            "certificate against host (tls_check_hostname) and its dates"
        )
    if isinstance(cause, ssl.SSLError) and not isinstance(cause, _TRANSIENT_TLS):
        why = cause.reason or type(cause).__name__
        return SourceConfigError(
            f"the TLS handshake with the MySQL server at {where} failed: {why}; check the "
            "server's TLS settings and, when it asks for one, the client certificate "
            "(tls_cert_file, tls_key_file)"
        )
    return None


def _no_tls(cfg: MySQLConfig) -> SourceConfigError:
    return SourceConfigError(
        f"the MySQL server at {cfg.host}:{cfg.port} does not offer TLS, which the fetcher "
        "options ask for (require_tls / tls_*): give the server ssl_cert and ssl_key "
        "(have_ssl = YES), or connect without the TLS options"
    )
