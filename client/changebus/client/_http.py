"""The client's HTTP boundary: error answers to exceptions, transport failures, schemas.

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
* :class:`RelaySchemas` -- the schema look-ups of one relay (or bootstrap
  server), the :class:`~._decode.SchemaSource` of a schema cache.

URLs in messages pass through :func:`safe_url` (no user name or password).
Stateless apart from :class:`RelaySchemas`' session; safe on any event loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import aiohttp
import yarl

from changebus.schemas import (
    BootstrapFailedError,
    ChangebusError,
    ScnNotFoundError,
    TableSchema,
    TransportError,
    UnknownSourceError,
)

from ._errors import FellOffRelayError

__all__ = [
    "RelaySchemas",
    "RestartBootstrap",
    "response_error",
    "safe_url",
    "transport_errors",
]


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


@contextlib.contextmanager
def transport_errors(where: str) -> Iterator[None]:
    """Inside: aiohttp, timeout and connection errors raise :class:`TransportError`.

    ``where`` (``"relay http://h:8470"``, already safe) heads the message;
    the original exception is the ``__cause__``.
    """
    try:
        yield
    except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
        raise TransportError(f"{where}: {type(exc).__name__}: {exc}".rstrip(": ")) from exc


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
    try:
        body = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        body = None
    if not isinstance(body, dict):
        body = {"message": resp.reason or ""}
    exc = ChangebusError.from_json(body, status=resp.status, where=where)
    if not isinstance(exc, ScnNotFoundError):
        return exc
    if kind == "stream":
        return _fell_off(body, where, partition, requested_scn)
    if kind == "catchup":
        return RestartBootstrap(f"{exc.message}; running the snapshot again")
    if kind == "bootstrap":
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
    )


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


class RelaySchemas:
    """Schema look-ups on one relay (the :class:`~._decode.SchemaSource` of a cache).

    ``partition`` narrows the answers to one physical partition (None: the
    server must have exactly one). Errors are those of :func:`response_error`
    and :func:`transport_errors`.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        partition: str | None,
        timeout: aiohttp.ClientTimeout | None = None,
    ) -> None:
        self.url = url
        self._session = session
        self._url = yarl.URL(url)
        self._where = f"relay {safe_url(url)}"
        self._partition = partition
        self._timeout = timeout or aiohttp.ClientTimeout(total=30)

    async def _get(self, url: yarl.URL, params: dict[str, str]) -> Any:
        with transport_errors(self._where):
            async with self._session.get(url, params=params, timeout=self._timeout) as resp:
                if resp.status != 200:
                    raise await response_error(resp, self._where)
                return await resp.json()

    async def source_names(self) -> dict[int, str]:
        """``{source_id: name}`` of the partition."""
        data = await self._get(self._url / "v1" / "sources", {})
        parts = data.get("partitions", [])
        if self._partition is not None:
            parts = [p for p in parts if p.get("partition") == self._partition]
        if len(parts) != 1:
            raise UnknownSourceError(f"{self._where} lacks this partition")
        return {int(s["id"]): str(s["name"]) for s in parts[0]["sources"]}

    async def source_schemas(self, name: str) -> list[tuple[int, TableSchema]]:
        """Every ``(source_id, schema)`` version of source ``name`` in the partition."""
        params = {"partition": self._partition} if self._partition else {}
        data = await self._get(self._url / "v1" / "schemas" / name, params)
        out: list[tuple[int, TableSchema]] = []
        for part in data.get("partitions", []):
            sid = int(part["source_id"])
            out.extend((sid, TableSchema.from_json(v["schema"])) for v in part["versions"])
        return out
