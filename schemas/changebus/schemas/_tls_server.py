"""The server side of TLS: the listening context, and reloading it on SIGHUP.

:func:`server_ssl_context` builds an :class:`ssl.SSLContext` from a
:class:`~._security_config.TlsConfig` (TLS 1.2 or newer; with a client CA,
client certificates are asked for and checked: optional or required).

:class:`ServerTls` is what a :class:`~._server.Server` listens with. Its
``context`` is the listening socket's context for the server's whole life;
certificates are swapped underneath it: the context's SNI callback, which
OpenSSL calls in every handshake (with or without a server name), moves the
new connection onto the *current* context. :meth:`ServerTls.reload` builds a
complete new context from the files (in a thread: file reads stay off the
event loop) and makes it current only when it loaded without error; a
missing or bad file is logged and the previous certificate kept. Open
connections keep the certificate they were set up with (an SSL connection
copies it at its start), so nothing is dropped.

The verification mode (``client_cert``) is the listening context's and is
not changed by a reload (it is config, not a file); the client CA is
reloaded with the certificate. A reload is how an operator drops a client
CA (revoking the certificates it signed), so with a client CA:

* no session tickets are issued (``num_tickets = 0``, ``OP_NO_TICKET``): a
  resumed session skips the chain check and restores the peer certificate
  verified by the CA of its day (TLS 1.3 then never resumes; TLS 1.2 may
  resume from the listening context's session cache, whose entries expire
  after 300 s);
* the context a reload replaces is marked :data:`RETIRED` on it; a request
  on a connection set up under a retired context that authenticates by its
  certificate gets a retriable 503 and the connection is closed
  (:mod:`._auth`): the client reconnects and its certificate is checked
  against the current CA. A TLS 1.2 session resumed from the cache lands on
  the current context (the SNI callback moves it there), so the context made
  current also records when (:data:`CURRENT_SINCE`): a resumed session
  older than that gets the same 503 (review).

:func:`reload_all` reloads every started server's TLS in this process: the
daemon's SIGHUP handler (:func:`~._server.serve`).

Thread-safety: :meth:`ServerTls.reload` runs on the event loop (building in
a worker thread); the swap is one attribute assignment, which the SNI
callback (run by OpenSSL on the loop's thread during handshakes) reads.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import weakref

from ._security_config import TlsConfig
from .errors import ConfigError

__all__ = ["CURRENT_SINCE", "RETIRED", "ServerTls", "reload_all", "server_ssl_context"]

#: the attribute a reload sets (True) on the context it replaces
RETIRED = "changebus_retired"
#: the attribute a reload sets on the context it makes current: when (``time.time()``)
#: a TLS 1.2 session resumed onto it from before then was set up under the old CA
CURRENT_SINCE = "changebus_current_since"

log = logging.getLogger("changebus.server.tls")

_LIVE: weakref.WeakSet[ServerTls] = weakref.WeakSet()


def _no_password() -> bytes:
    return b""  # an encrypted key fails to load instead of prompting on the terminal


def server_ssl_context(tls: TlsConfig) -> ssl.SSLContext:
    """A new server context with ``tls``'s certificate (and client CA); ConfigError when a file is bad.

    The message names the file and the reason, never a key's content.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(tls.cert_file, tls.key_file, password=_no_password)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"security.tls: cannot load cert_file {tls.cert_file} with key_file {tls.key_file}: "
            f"{_reason(exc)}"
        ) from None
    if tls.client_ca_file is not None:
        try:
            ctx.load_verify_locations(cafile=tls.client_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"security.tls: cannot load client_ca_file {tls.client_ca_file}: {_reason(exc)}"
            ) from None
        ctx.verify_mode = ssl.CERT_REQUIRED if tls.client_cert == "required" else ssl.CERT_OPTIONAL
        ctx.options |= ssl.OP_NO_TICKET
        ctx.num_tickets = 0  # (module docstring: no resumption past a CA reload)
    return ctx


def _reason(exc: OSError | ssl.SSLError) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or "not a valid PEM certificate or key"
    return exc.strerror or type(exc).__name__


class ServerTls:
    """A listening context whose certificate can be reloaded (module docstring).

    ``context`` is given to the listening socket; ``current`` is the context
    new connections get (``context`` itself until the first reload).
    """

    def __init__(self, tls: TlsConfig) -> None:
        self.config = tls
        self.context = server_ssl_context(tls)
        self.current = self.context
        self.context.sni_callback = self._choose
        #: reloads done (successful ones), for tests and logs
        self.reloads = 0

    def _choose(self, conn: ssl.SSLObject, server_name: str | None, ctx: ssl.SSLContext) -> None:
        current = self.current
        if current is not ctx:
            conn.context = current

    async def reload(self) -> bool:
        """Reload the files; True when the new certificate is in use (module docstring)."""
        try:
            fresh = await asyncio.to_thread(server_ssl_context, self.config)
        except ConfigError as exc:
            log.warning("TLS reload failed, the previous certificate stays in use: %s", exc.message)
            return False
        setattr(fresh, CURRENT_SINCE, time.time())
        old, self.current = self.current, fresh
        setattr(old, RETIRED, True)  # (its connections' certificates: the old CA's)
        self.reloads += 1
        log.info("TLS certificate reloaded from %s", self.config.cert_file)
        return True

    def register(self) -> None:
        """Be reloaded by :func:`reload_all` (while the server listens)."""
        _LIVE.add(self)

    def unregister(self) -> None:
        _LIVE.discard(self)


async def reload_all() -> int:
    """Reload every registered server's TLS (SIGHUP); returns how many reloaded."""
    live = list(_LIVE)
    if not live:
        log.info("SIGHUP: no TLS certificate to reload")
        return 0
    done = await asyncio.gather(*(tls.reload() for tls in live))
    return sum(done)
