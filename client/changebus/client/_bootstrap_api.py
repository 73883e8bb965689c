"""A bootstrap server's HTTP API as :class:`~._bootstrap.Bootstrapper` asks it.

:class:`BootstrapApi` sends the requests of one bootstrap --
``/v1/bootstrap/status``, ``/v1/bootstrap/start`` (the plan),
``/v1/bootstrap/snapshot`` and ``/v1/bootstrap/catchup`` (pages) and the
schema queries -- to the server URL it is given, with the consumer's
partition, sources and key filter. Error answers are mapped by
:func:`~._http.response_error`, transport failures by
:func:`~._http.transport_errors`; which server to ask and what to do about a
failure is the caller's (its :class:`~._failover.Failover`).

:func:`snapshot_page` and :func:`check_events` validate a page before any of
it is used: every failure they raise is retriable (damage on the way, which
another attempt may cure).

The partition is passed to each call: the bootstrapper learns it from the
first server's status. Holds the :class:`aiohttp.ClientSession` it does not
own and no other state: use it on the session's event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Literal

import aiohttp

from changebus.schemas import (
    BadRequestError,
    BootstrapFailedError,
    CorruptEventError,
    Op,
    ProtocolError,
    parse_stream,
)

from ._assembler import RawWindow
from ._config import ConsumerConfig
from ._http import read_body, response_error, safe_url, transport_errors
from ._info import BootstrapStatus, RelayInfo, RelaySchemas, malformed_answer

__all__ = ["BootstrapApi", "check_events", "snapshot_page"]

log = logging.getLogger("changebus.client._bootstrap")


class BootstrapApi:
    """The requests of a bootstrap to one server at a time (module docstring).

    ``timeout``: the requests' timeouts (the relays', :class:`~._stream.StreamConfig`).
    """

    def __init__(
        self, config: ConsumerConfig, session: aiohttp.ClientSession, timeout: aiohttp.ClientTimeout
    ) -> None:
        self.config = config
        self._session = session
        self._timeout = timeout

    def _boot_params(self, extra: dict[str, str], partition: str | None) -> dict[str, str]:
        params = dict(extra)
        if partition is not None:
            params["partition"] = partition
        if self.config.sources:
            params["sources"] = ",".join(self.config.sources)
        if self.config.key_filter is not None:
            params["filter"] = str(self.config.key_filter)
        return params

    def _info(self, url: str) -> RelayInfo:
        return RelayInfo(self._session, url, what="bootstrap server", timeout=self._timeout)

    def schemas(self, url: str, partition: str | None) -> RelaySchemas:
        """The schema source of the windows ``url`` sends (source ids are a server's own)."""
        return RelaySchemas(self._session, url, partition, self._timeout, what="bootstrap server")

    async def status(self, url: str, partition: str | None) -> BootstrapStatus:
        """``/v1/bootstrap/status`` of ``partition`` (None: the server's only one)."""
        return await self._info(url).bootstrap_status(partition)

    async def start(self, url: str, since: int, partition: str | None) -> tuple[int, bool]:
        """``/v1/bootstrap/start``: the plan's ``(start_scn, snapshot)``."""
        params = {"since": str(since)}
        if partition is not None:
            params["partition"] = partition
        if self.config.bootstrap_catchup_only:
            params["mode"] = "catchup"
        info = self._info(url)
        try:
            plan = await info.get_json("/v1/bootstrap/start", params, kind="bootstrap")
        except BadRequestError as exc:
            if "mode" not in params:
                raise
            # an older server refuses the parameter (400, not retriable): the next
            # server may know it, so the failover goes on (found by review)
            raise BootstrapFailedError(
                f"{info.where}: cannot plan a catch-up only (an older version?): {exc.message}"
            ) from exc
        with malformed_answer(info.where, "/v1/bootstrap/start"):
            start, snapshot = int(plan["start_scn"]), bool(plan["snapshot"])
            unseeded = int(plan.get("unseeded_count", 0))
            names = [str(n) for n in plan.get("unseeded", [])][:5]
        if self.config.bootstrap_catchup_only and (snapshot or (since >= 0 and start != since)):
            # (a server that ignored mode=catchup: the next one may know it)
            raise BootstrapFailedError(
                f"{info.where}: asked for a catch-up only after SCN {since}, planned a"
                f" {'snapshot' if snapshot else 'catch-up'} at SCN {start}"
            )
        if unseeded:
            # the server says its snapshot lacks rows: not an error (an operator may
            # capture without seeding on purpose), but never silent
            log.warning(
                "%s: %d table(s) were never seeded (%s%s): the snapshot lacks any of their"
                " rows that existed before the server's history began and never changed"
                " since (none when a table was empty then); seed them (POST /v1/seed) for a"
                " complete snapshot",
                info.where,
                unseeded,
                ", ".join(names),
                ", ..." if unseeded > len(names) else "",
            )
        return start, snapshot

    async def page(
        self,
        url: str,
        what: Literal["snapshot", "catchup"],
        params: dict[str, str],
        partition: str | None,
    ) -> tuple[bytes, Mapping[str, str]]:
        """One snapshot or catch-up page: its body and the answer's headers."""
        where = f"bootstrap server {safe_url(url)}"
        with transport_errors(where):
            async with self._session.get(
                f"{url}/v1/bootstrap/{what}",
                params=self._boot_params(params, partition),
                timeout=self._timeout,
            ) as resp:
                if resp.status != 200:
                    kind: Literal["bootstrap", "catchup"] = (
                        "catchup" if what == "catchup" else "bootstrap"
                    )
                    raise await response_error(resp, where, kind=kind)
                # a page is up to its max_bytes and then one whole window more
                limit = self.config.bootstrap_page_bytes + self.config.max_window_bytes
                body = await read_body(resp, limit, where)
                return body, resp.headers  # (case-insensitive: proxies lower-case names)


def snapshot_page(body: bytes, start_scn: int, answer: Mapping[str, str]) -> RawWindow:
    """A snapshot page's events, validated (one raw window at the snapshot's SCN)."""
    try:
        offsets, headers = parse_stream(body)  # validates every event
    except CorruptEventError as exc:  # damaged on the way: another attempt may cure it
        raise CorruptEventError(exc.message, retriable=True) from exc
    check_events(answer, int(offsets.size), "snapshot")
    if offsets.size and int(headers["op"].max()) >= int(Op.END_OF_WINDOW):
        raise CorruptEventError("a snapshot page holds control events", retriable=True)
    return RawWindow(start_scn, 0, body, offsets, headers)


def check_events(headers: Mapping[str, str], got: int, what: str) -> None:
    """Refuse (retriably, before any of it is used) a page that holds other than the
    events its ``X-Changebus-Events`` header counts: a proxy that cut it at an event
    boundary. Its position header would skip the rows cut off, for good, and a last
    catch-up page would go online past the windows cut off (review)."""
    said = headers.get("X-Changebus-Events", "")
    if said.isdigit() and int(said) != got:
        raise ProtocolError(
            f"a {what} page holds {got} events, its header says {said} (cut on the way?)",
            retriable=True,
        )
