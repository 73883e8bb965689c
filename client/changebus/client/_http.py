"""The client's HTTP boundary: error answers to exceptions, transport failures, JSON bodies.

Everything the client learns from a relay or a bootstrap server over HTTP
passes through here, so that the rest of the client decides by data:

* :func:`response_error` -- the one mapping of an error answer (any status
  but 200/204) to an exception of the :mod:`changebus.schemas.errors` tree:
  :meth:`~changebus.schemas.ChangebusError.from_json` chooses the class by
  the body's ``code`` (falling back on the status) and keeps the server's
  ``retriable`` verdict. The client's own cases on top: a relay's 410 on a
  stream request becomes :class:`~._errors.FellOffRelayError` with its
  figures (``kind="stream"``); a bootstrap server's 410 means "run the
  snapshot again" on a catch-up page (:class:`RestartBootstrap`) and
  :class:`~changebus.schemas.BootstrapFailedError` elsewhere
  (``kind="bootstrap"``, ``"catchup"``).
* :func:`transport_errors` -- aiohttp, timeout and connection errors become
  :class:`~changebus.schemas.TransportError` (retriable), so a retry loop
  needs no tuple of foreign exception types (:mod:`._failover`).
  A TLS failure that another attempt cannot cure -- the server's
  certificate does not verify (wrong CA, wrong name, expired), the server
  refused ours, or TLS spoken to a plain HTTP port -- is a
  :class:`~changebus.schemas.TransportError` with ``retriable=False`` and a
  message saying what to check: like Kafka's ``SslAuthenticationException``
  it stops the caller at once instead of retrying the same handshake for
  ever (the relay's fetcher restart and the failover loop both read
  ``retriable``). A cut connection during a handshake stays retriable.
* :func:`json_body` -- the JSON document of an answer; a body that is not
  JSON is a retriable :class:`~changebus.schemas.ProtocolError` (whatever
  its content type), never a bare ``ValueError``.
* :func:`open_session` -- the one way to open an :class:`aiohttp.ClientSession`
  for changebus servers: its connections use a
  :class:`~changebus.schemas.security.ClientAuth`'s TLS settings, its
  requests carry the bearer token.

The JSON queries built on these are in :mod:`._info`. URLs in messages pass
through :func:`safe_url` (no user name or password). Stateless; safe on any
event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import ssl
from collections.abc import Iterator
from typing import Any, Literal

import aiohttp
import yarl

from changebus.schemas import (
    BootstrapFailedError,
    ChangebusError,
    ProtocolError,
    ScnNotFoundError,
    TransportError,
)
from changebus.schemas.config import scrub_exception
from changebus.schemas.security import ClientAuth

from ._assembler import too_large
from ._errors import FellOffRelayError

__all__ = [
    "CatchupPruned",
    "RestartBootstrap",
    "json_body",
    "open_session",
    "response_error",
    "safe_url",
    "tls_failure",
    "transport_errors",
]

log = logging.getLogger(__name__)


def safe_url(url: str) -> str:
    """``url`` without user name and password (for logs and messages)."""
    try:
        return str(yarl.URL(url).with_user(None))
    except (ValueError, TypeError):
        return "<unparsable url>"


class RestartBootstrap(ChangebusError):
    """A bootstrap server pruned the catch-up log a bootstrap needs: run the snapshot again.

    Not an error the application sees: the bootstrap loop handles it (it has
    no wire ``code`` of its own, so no server answer maps to it).
    """

    retriable = True


class CatchupPruned(RestartBootstrap):
    """A catch-up page's 410: the server's log no longer holds the windows after the
    position (pruned, or moved past a gap). Unlike a snapshot position of another
    store (a plain :class:`RestartBootstrap`), the rows the consumer holds may all
    be this server's own (:class:`~._bootstrap.Bootstrapper` decides)."""


@contextlib.contextmanager
def transport_errors(where: str) -> Iterator[None]:
    """Inside: aiohttp, timeout and connection errors raise :class:`TransportError`.

    ``where`` (``"relay http://h:8470"``, already safe) heads the message;
    the original exception is the ``__cause__``. aiohttp may quote the URL
    (``InvalidURL``): passwords in it are masked (:func:`~changebus.schemas.config.scrub`).
    """
    try:
        yield
    except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
        tls = tls_failure(exc)
        if tls is not None:
            raise TransportError(
                f"{where}: TLS failed: {tls}; check the CA file (ca_file, --ca-file), the"
                " server's certificate and name, and the client certificate; not retried",
                retriable=False,
            ) from exc
        raise TransportError(f"{where}: {scrub_exception(exc)}") from exc


#: OpenSSL reasons that say the TLS settings of one side do not fit the other's
_CONFIG_REASONS = ("WRONG_VERSION_NUMBER", "HTTP_REQUEST", "UNKNOWN_PROTOCOL")


def tls_failure(exc: BaseException) -> str | None:
    """What went wrong when ``exc`` is a TLS failure another attempt cannot cure, else None.

    A certificate that does not verify, an alert from the peer (it refused
    our certificate or has none we accept), or TLS against a plain port.
    """
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, aiohttp.ClientConnectorCertificateError):
            e = e.certificate_error  # (it is an ssl.CertificateError itself, without the details)
        if isinstance(e, ssl.SSLCertVerificationError):
            why = getattr(e, "verify_message", "") or getattr(e, "reason", "") or str(e)
            return f"the server's certificate was not accepted ({why})"
        if isinstance(e, ssl.SSLError):
            reason = str(e.reason or "")
            if "ALERT" in reason:
                return f"the server refused the handshake ({reason.lower()})"
            if reason in _CONFIG_REASONS:
                return f"the server does not speak TLS there ({reason.lower()})"
        if isinstance(e, aiohttp.ClientConnectorError):
            todo.append(e.os_error)
        todo.extend((e.__cause__, e.__context__))
    return None


async def open_session(auth: ClientAuth | None = None, **kwargs: Any) -> aiohttp.ClientSession:
    """A new :class:`aiohttp.ClientSession` for changebus servers, using ``auth``.

    ``https://`` connections use ``auth``'s SSL context (its CA file, client
    certificate and host name check); every request carries its bearer
    token (``Authorization``). Without ``auth`` (or with an empty one) a
    plain session, as before. ``kwargs`` go to the session (``timeout``,
    ...). The files are read in a worker thread, not on the event loop; a
    file that cannot be read raises :class:`~changebus.schemas.ConfigError`.
    The token is read once: a session keeps it until it is closed.
    """
    if auth is None or not auth.enabled:
        return aiohttp.ClientSession(**kwargs)
    await asyncio.to_thread(auth.load)
    ctx = auth.ssl_context()
    headers = {**auth.headers(), **dict(kwargs.pop("headers", None) or {})}
    connector = aiohttp.TCPConnector(ssl=ctx if ctx is not None else True)

    warned: set[str] = set()

    async def token_in_clear(
        request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
    ) -> aiohttp.ClientResponse:
        # the token goes over TLS, or to this host: never in clear over a network (a
        # member URL read from ZooKeeper), where anyone on the path reads it. (aiohttp
        # itself drops it on a redirect to another origin.)
        if "Authorization" in request.headers and not _may_carry_token(request.url):
            del request.headers["Authorization"]
            host = str(request.url.host)
            if host not in warned and len(warned) < 64:
                warned.add(host)
                log.warning(
                    "not sending the bearer token to %s over plain http (anyone on the path "
                    "would read it): use https://, or expect 401 from a server that wants it",
                    safe_url(str(request.url.origin())),
                )
        return await handler(request)

    return aiohttp.ClientSession(
        connector=connector, headers=headers, middlewares=(token_in_clear,), **kwargs
    )


def _may_carry_token(url: yarl.URL) -> bool:
    """https, or plain http to a loopback address (a daemon's default)."""
    if url.scheme == "https":
        return True
    host = (url.host or "").strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: the most a JSON answer (status, sources, schemas) may hold
MAX_JSON_BYTES = 64 << 20
#: the most of an error answer read (its JSON body is a few hundred bytes)
MAX_ERROR_BYTES = 1 << 20


async def read_body(resp: aiohttp.ClientResponse, limit: int, where: str) -> bytes:
    """The whole body of ``resp``, refused once it passes ``limit`` bytes.

    A server (broken, or hostile) cannot make the client hold more than
    ``limit``: a declared length past it is refused before a byte is read,
    an undeclared one as soon as it is passed (a non-retriable
    :class:`~changebus.schemas.ProtocolError` naming ``where``). A body that
    ends early raises as :meth:`aiohttp.ClientResponse.read` does.
    """
    declared = resp.content_length
    if declared is not None and declared > limit:
        raise too_large(f"{where}: an answer of {declared} bytes", limit)
    parts: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise too_large(f"{where}: an answer", limit)
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def json_body(resp: aiohttp.ClientResponse, where: str) -> Any:
    """The JSON document ``resp`` carries (read whole; call inside :func:`transport_errors`).

    A body that does not parse as JSON (an HTML page of a proxy, a cut or
    damaged body) raises a retriable :class:`ProtocolError` naming
    ``where``, the status, content type and size, not the body itself.
    """
    body = await read_body(resp, MAX_JSON_BYTES, where)
    try:
        return json.loads(body)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError alike
        raise ProtocolError(
            f"{where}: the answer ({resp.status}, {resp.content_type or 'no content type'},"
            f" {len(body)} bytes) is not JSON",
            retriable=True,
        ) from exc


async def response_error(
    resp: aiohttp.ClientResponse,
    where: str,
    *,
    kind: Literal["", "stream", "bootstrap", "catchup"] = "",
    partition: str = "",
    requested_scn: int = -1,
) -> ChangebusError:
    """The exception an error answer stands for (module docstring); never raises.

    ``kind="stream"`` (a relay's ``/v1/stream``) with ``partition`` and
    ``requested_scn`` turns a 410 into :class:`FellOffRelayError`.
    """
    try:  # (bounded: an error answer is a small JSON document)
        body = json.loads(await read_body(resp, MAX_ERROR_BYTES, where))
    except (aiohttp.ClientError, TimeoutError, ValueError, ChangebusError):
        body = None
    if not isinstance(body, dict):
        body = {"message": resp.reason or ""}
    exc = ChangebusError.from_json(body, status=resp.status, where=where)
    if not isinstance(exc, ScnNotFoundError):
        return exc
    if kind == "stream":
        return _fell_off(body, where, partition, requested_scn)
    if kind == "catchup":
        return CatchupPruned(f"{exc.message}; running the snapshot again")
    if kind == "bootstrap":
        if body.get("restart_snapshot") is True:  # a position of another store
            return RestartBootstrap(f"{exc.message}; running the snapshot again")
        return BootstrapFailedError(exc.message)
    return exc


def _fell_off(
    body: dict[str, Any], where: str, partition: str, requested_scn: int
) -> FellOffRelayError:
    oldest, prev = _int(body.get("oldest_scn")), _int(body.get("prev_scn"))
    return FellOffRelayError(
        f"{where}: position {requested_scn} is older than the relay keeps"
        f" (oldest window {oldest}, newest evicted {prev});"
        " catch up from a bootstrap server or restart from prev_scn",
        partition=partition,
        requested_scn=requested_scn,
        oldest_scn=oldest,
        prev_scn=prev,
        relay=where.removeprefix("relay "),
        prev_position=str(body.get("prev_position") or ""),
    )


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1
