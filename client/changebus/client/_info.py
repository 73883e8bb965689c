"""The small JSON queries to relays and bootstrap servers, and asking several in order.

Everything but the stream is a short ``GET`` answered with one JSON object:
a relay's ``/v1/status``, ``/v1/sources`` and ``/v1/schemas/{source}``
(a bootstrap server answers the last two alike) and a bootstrap server's
``/v1/bootstrap/status``. :class:`RelayInfo` asks one server, one request
per call, and returns typed answers::

    info = RelayInfo(session, "http://relay:8470")
    bounds = (await info.status())["orders"].prev_scn

:class:`RelayQueries` asks a list of servers in order through the client's
one failover mechanism (:class:`~._failover.Failover`)::

    relays = RelayQueries(session, config.relays)
    sources = await relays.first(RelayInfo.sources)       # the first that answers
    found = await relays.search(lambda info: has_it(info))  # the first that has it

Errors are decided once, by data. A transport failure is a retriable
:class:`~changebus.schemas.TransportError` (:func:`~._http.transport_errors`);
an error answer is the exception of its ``code`` with the server's
``retriable`` verdict (:func:`~._http.response_error`: a 404 unknown
partition or source is not retriable, a 5xx is); a body that is not JSON
(:func:`~._http.json_body`) or a JSON document without the fields a query
needs is a retriable :class:`~changebus.schemas.ProtocolError` (a proxy's
error page, a server of another version: another server may answer
properly). :meth:`RelayQueries.first` moves to the next server on a
retriable error and raises any other at once.

The answers (:class:`PartitionStatus`, :class:`PartitionSources`,
:class:`SourceSchemas`, :class:`BootstrapStatus`) are frozen snapshots of one
response: plain data, no live references. :class:`RelaySchemas` is the
:class:`~._decode.SchemaSource` of a schema cache on top of :class:`RelayInfo`.

Instances hold an :class:`aiohttp.ClientSession` they do not own and keep
no other state: use them on the session's event loop; they are not
thread-safe, but any number of tasks may query through one.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import aiohttp
import yarl

from changebus.schemas import ProtocolError, TableSchema, UnknownSourceError

from ._backoff import Backoff
from ._failover import Failover, is_retriable
from ._http import json_body, response_error, safe_url, transport_errors

__all__ = [
    "BootstrapStatus",
    "PartitionSources",
    "PartitionStatus",
    "RelayInfo",
    "RelayQueries",
    "RelaySchemas",
    "SourceInfo",
    "SourceSchemas",
    "malformed_answer",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: per request, unless the caller gives its own
DEFAULT_TIMEOUT = aiohttp.ClientTimeout(total=30)


@dataclass(frozen=True, slots=True)
class PartitionStatus:
    """One partition of a relay's ``/v1/status``.

    Windows ``(prev_scn, max_scn]`` are in the buffer (``min_scn`` the
    oldest; ``max_scn`` -1 when it is empty); ``newest_timestamp_ns`` is the
    commit time of ``max_scn`` (0: none). ``fetcher`` is the fetcher's own
    status (None when the relay reports none); ``raw`` the whole entry as
    answered (consumers, stats, ...), not to be modified.
    """

    name: str
    id: int
    state: str
    min_scn: int
    max_scn: int
    prev_scn: int
    newest_timestamp_ns: int
    fetcher: Mapping[str, Any] | None
    raw: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class SourceInfo:
    """One logical source of a partition: its id there, name and schema versions."""

    id: int
    name: str
    versions: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PartitionSources:
    """One partition of ``/v1/sources``: its id (None: a bootstrap server's) and sources."""

    name: str
    id: int | None
    sources: tuple[SourceInfo, ...]

    def names(self) -> dict[int, str]:
        """``{source_id: name}``, in the server's order."""
        return {s.id: s.name for s in self.sources}


@dataclass(frozen=True, slots=True)
class SourceSchemas:
    """The schema versions of one source in one partition (``/v1/schemas/{source}``).

    ``schemas`` are in the server's order (oldest version first).
    """

    partition: str
    source_id: int
    schemas: tuple[TableSchema, ...]

    @property
    def newest(self) -> TableSchema:
        """The schema of the highest version."""
        return max(self.schemas, key=lambda s: s.version)


@dataclass(frozen=True, slots=True)
class BootstrapStatus:
    """A bootstrap server's positions of one partition (``/v1/bootstrap/status``).

    ``producer_scn`` is the newest window in its log (a catch-up's target),
    ``applier_scn`` the snapshot's position, ``log_min_scn`` the oldest
    window kept and ``base_scn`` where its history starts; -1 when unknown.
    ``lost_ranges``: ``(after, upto)`` SCN ranges it never received (a
    position strictly inside one cannot be served there); empty from a
    server that does not say.
    """

    partition: str
    producer_scn: int
    applier_scn: int
    log_min_scn: int
    base_scn: int
    state: str
    lost_ranges: tuple[tuple[int, int], ...] = ()


@contextlib.contextmanager
def malformed_answer(where: str, path: str) -> Iterator[None]:
    """Inside: a JSON document lacking what a query reads is a retriable ProtocolError."""
    try:
        yield
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise ProtocolError(
            f"{where}: malformed answer to {path}: {type(exc).__name__}: {exc}", retriable=True
        ) from exc


def _entries(doc: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    items = doc[key]
    if not isinstance(items, list) or not all(isinstance(i, Mapping) for i in items):
        raise TypeError(f"{key!r} is not a list of objects")
    return items


class RelayInfo:
    """The JSON queries of one relay or bootstrap server (module docstring).

    ``what`` names the server in messages (``"relay"``, ``"bootstrap
    server"``); ``timeout`` bounds each request (default: 30 s in total).
    ``url``, ``session`` and ``where`` (the server as named in messages,
    without credentials) are public for callers that send requests of their
    own to the same server.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        *,
        what: str = "relay",
        timeout: aiohttp.ClientTimeout | None = None,
    ) -> None:
        self.session = session
        self.url = url.rstrip("/")
        self.where = f"{what} {safe_url(url)}"
        self._base = yarl.URL(self.url)  # keeps a base path: a server behind a prefix
        self._timeout = timeout or DEFAULT_TIMEOUT

    def __repr__(self) -> str:
        return f"RelayInfo({self.where!r})"

    async def get_json(
        self,
        path: str,
        params: Mapping[str, str] | None = None,
        *,
        kind: Literal["", "bootstrap"] = "",
    ) -> dict[str, Any]:
        """``GET path`` (e.g. ``"/v1/status"``): the JSON object answered with 200.

        Raises as the module docstring says; ``kind="bootstrap"`` maps a 410
        to :class:`~changebus.schemas.BootstrapFailedError`.
        """
        url = self._base.joinpath(*path.strip("/").split("/"))
        with transport_errors(self.where):
            async with self.session.get(url, params=params, timeout=self._timeout) as resp:
                if resp.status != 200:
                    raise await response_error(resp, self.where, kind=kind)
                doc = await json_body(resp, f"{self.where}{path}")
        if not isinstance(doc, dict):
            raise ProtocolError(
                f"{self.where}: the answer to {path} is JSON but not an object", retriable=True
            )
        return doc

    async def status(self) -> dict[str, PartitionStatus]:
        """``/v1/status``: every partition of the relay by name, in its order."""
        doc = await self.get_json("/v1/status")
        out: dict[str, PartitionStatus] = {}
        with malformed_answer(self.where, "/v1/status"):
            for p in _entries(doc, "partitions"):
                fetcher = p.get("fetcher")
                name = str(p["name"])
                out[name] = PartitionStatus(
                    name=name,
                    id=int(p.get("id", 0)),
                    state=str(p.get("state", "")),
                    min_scn=int(p["min_scn"]),
                    max_scn=int(p["max_scn"]),
                    prev_scn=int(p["prev_scn"]),
                    newest_timestamp_ns=int(p.get("newest_timestamp_ns") or 0),
                    fetcher=fetcher if isinstance(fetcher, Mapping) else None,
                    raw=p,
                )
        return out

    async def sources(self) -> dict[str, PartitionSources]:
        """``/v1/sources``: the sources of every partition by partition name, in order."""
        doc = await self.get_json("/v1/sources")
        out: dict[str, PartitionSources] = {}
        with malformed_answer(self.where, "/v1/sources"):
            for p in _entries(doc, "partitions"):
                name = str(p["partition"])
                pid = p.get("id")
                out[name] = PartitionSources(
                    name=name,
                    id=None if pid is None else int(pid),
                    sources=tuple(
                        SourceInfo(
                            int(s["id"]),
                            str(s["name"]),
                            tuple(int(v) for v in s.get("versions", ())),
                        )
                        for s in _entries(p, "sources")
                    ),
                )
        return out

    async def schemas(self, name: str, partition: str | None = None) -> dict[str, SourceSchemas]:
        """``/v1/schemas/{name}``: the versions of source ``name`` by partition.

        ``partition`` asks for that partition only. A source (or partition)
        the server does not have raises
        :class:`~changebus.schemas.UnknownSourceError` (404, not retriable).
        """
        path = f"/v1/schemas/{name}"
        doc = await self.get_json(path, {"partition": partition} if partition else None)
        out: dict[str, SourceSchemas] = {}
        with malformed_answer(self.where, path):
            for p in _entries(doc, "partitions"):
                part = str(p["partition"])
                out[part] = SourceSchemas(
                    partition=part,
                    source_id=int(p["source_id"]),
                    schemas=tuple(
                        TableSchema.from_json(v["schema"]) for v in _entries(p, "versions")
                    ),
                )
        return out

    async def splits(
        self, partition: str, since: int, until: int, parts: int, sources: Sequence[str] = ()
    ) -> list[int]:
        """``/v1/splits``: SCNs cutting the windows ``(since, until]`` into ``parts`` similar spans.

        The cuts lie strictly inside the range, in increasing order; there may
        be fewer than ``parts - 1`` (a relay keeps fewer indexed windows there).
        ``sources``: count only these sources' events (empty: every source).
        """
        params = {"partition": partition, "since": str(since), "until": str(until)}
        if sources:
            params["sources"] = ",".join(sources)
        doc = await self.get_json("/v1/splits", {**params, "parts": str(parts)})
        with malformed_answer(self.where, "/v1/splits"):
            cuts = [int(c) for c in doc["cuts"]]
        if any(not since < c < until for c in cuts) or cuts != sorted(set(cuts)):
            raise ProtocolError(
                f"{self.where}: /v1/splits answered cuts outside ({since}, {until}) or unordered",
                retriable=True,
            )
        return cuts

    async def bootstrap_status(self, partition: str | None = None) -> BootstrapStatus:
        """A bootstrap server's ``/v1/bootstrap/status`` of ``partition``.

        None: the server must serve exactly one partition (else 400).
        """
        path = "/v1/bootstrap/status"
        doc = await self.get_json(
            path, {"partition": partition} if partition else None, kind="bootstrap"
        )
        with malformed_answer(self.where, path):
            return BootstrapStatus(
                partition=str(doc["partition"]),
                producer_scn=int(doc["producer_scn"]),
                applier_scn=int(doc.get("applier_scn", -1)),
                log_min_scn=int(doc.get("log_min_scn", -1)),
                base_scn=int(doc["base_scn"]),
                state=str(doc.get("state", "")),
                lost_ranges=tuple(
                    (int(after), int(upto)) for after, upto in doc.get("lost_ranges", ())
                ),
            )


class RelayQueries:
    """Asks a list of servers in order: the first that answers, or every one (module docstring).

    ``max_attempts`` bounds the consecutive failures of :meth:`first`
    (default: each server once; 0: no limit, with backoff from
    ``backoff_initial_s`` to ``backoff_max_s`` after every failed round).
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        urls: tuple[str, ...],
        *,
        what: str = "relay",
        timeout: aiohttp.ClientTimeout | None = None,
        max_attempts: int | None = None,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 1.0,
    ) -> None:
        if not urls:
            raise ValueError(f"RelayQueries needs at least one {what} URL")
        self.urls = tuple(urls)
        self.what = what
        self._infos = {u: RelayInfo(session, u, what=what, timeout=timeout) for u in self.urls}
        self._max_attempts = len(self.urls) if max_attempts is None else max_attempts
        self._backoff = (backoff_initial_s, backoff_max_s)

    def info(self, url: str) -> RelayInfo:
        """The :class:`RelayInfo` of one of :attr:`urls`."""
        return self._infos[url]

    async def first(self, ask: Callable[[RelayInfo], Awaitable[T]]) -> T:
        """``await ask(info)`` on the first server that answers it.

        A retriable error moves to the next server; any other is raised at
        once; when ``max_attempts`` consecutive attempts failed,
        :class:`~changebus.client.RelayUnavailableError` (the last error is
        its ``__cause__``). ``ask`` may send requests of its own through
        ``info.session``: aiohttp errors there count as transport failures.
        """
        failover = Failover(
            self.urls, Backoff(*self._backoff), max_attempts=self._max_attempts, what=self.what
        )
        while True:
            info = self._infos[failover.url]
            try:
                with transport_errors(info.where):
                    return await ask(info)
            except Exception as exc:  # noqa: BLE001 - Failover decides, by data
                await failover.failed(exc)

    async def answers(self, ask: Callable[[RelayInfo], Awaitable[T]]) -> AsyncGenerator[T, None]:
        """``await ask(info)`` of every server in order, skipping those that fail retriably.

        A non-retriable error is raised (after the answers before it).
        """
        for url in self.urls:
            info = self._infos[url]
            try:
                with transport_errors(info.where):
                    answer = await ask(info)
            except Exception as exc:
                if not is_retriable(exc):
                    raise
                log.debug("%s does not answer: %s", info.where, exc)
                continue
            yield answer

    async def search(self, ask: Callable[[RelayInfo], Awaitable[T | None]]) -> T | None:
        """The first answer of :meth:`answers` that is not None (None: no server has it)."""
        async with contextlib.aclosing(self.answers(ask)) as answers:
            async for answer in answers:
                if answer is not None:
                    return answer
        return None


class RelaySchemas:
    """Schema look-ups on one relay or bootstrap server (the ``SchemaSource`` of a cache).

    ``partition`` narrows the answers to one physical partition (None: the
    server must have exactly one). Errors are those of :class:`RelayInfo`.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        partition: str | None,
        timeout: aiohttp.ClientTimeout | None = None,
        *,
        what: str = "relay",
    ) -> None:
        self.url = url
        self._info = RelayInfo(session, url, what=what, timeout=timeout)
        self._partition = partition

    async def source_names(self) -> dict[int, str]:
        """``{source_id: name}`` of the partition."""
        parts = await self._info.sources()
        if self._partition is not None:
            part = parts.get(self._partition)
        else:
            part = next(iter(parts.values())) if len(parts) == 1 else None
        if part is None:
            raise UnknownSourceError(f"{self._info.where} lacks this partition")
        return part.names()

    async def source_schemas(self, name: str) -> list[tuple[int, TableSchema]]:
        """Every ``(source_id, schema)`` version of source ``name`` in the partition."""
        found = await self._info.schemas(name, self._partition)
        return [(s.source_id, schema) for s in found.values() for schema in s.schemas]
