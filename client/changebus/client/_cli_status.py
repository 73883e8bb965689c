"""``changebus status URL... [--zookeeper HOSTS --cluster NAME] [--json] [--watch [S]]``.

One screen of every relay and bootstrap server named (and, with
``--zookeeper``/``--cluster``, of every member of the cluster's routing
table): each server's ``/v1/status`` and ``/readyz`` are read concurrently
(:func:`read_server`), the role is told from the status body, and
:mod:`._status_render` draws the result (``--json``: one JSON object).
``--watch`` redraws every few seconds (2 by default; the screen is cleared
on a terminal) until Ctrl-C.

A server that cannot be reached, or answers with an error or something that
is not changebus, is one line saying so, never a traceback. Exit status: 0
when every server answered and is ready, 1 when one is unreachable or not
ready (with ``--watch``: as of the last screen), 2 for bad arguments or
when the cluster's ZooKeeper cannot be read. TLS flags and the token are
those of the other client commands (:func:`._cli.add_tls_arguments`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import aiohttp

from changebus.schemas import ChangebusError, ConfigError
from changebus.schemas.cli import setup_logging

from ._cli import add_tls_arguments, auth_from_args
from ._http import json_body, open_session, response_error, safe_url, transport_errors
from ._status_render import ServerReport, render_text, report_json

__all__ = ["read_server", "register"]

_CLEAR = "\x1b[H\x1b[2J"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``status`` subcommand."""
    p = sub.add_parser(
        "status",
        help="one screen of relays and bootstrap servers: partitions, SCNs, consumers, lag",
        description="Print the state of relays and bootstrap servers on one screen: per server "
        "its role and readiness; per relay partition its state, fetcher, SCN range, newest "
        "window and the consumers with their lag; per bootstrap partition its producer and "
        "applier SCNs and snapshot progress. Exit status 1 when a server is unreachable or "
        "not ready.",
    )
    p.add_argument("urls", nargs="*", metavar="URL", help="relay or bootstrap server base URL")
    p.add_argument(
        "--zookeeper",
        default="",
        metavar="HOSTS",
        help="also every member of the cluster --cluster in this ZooKeeper (host:port[,...])",
    )
    p.add_argument("--cluster", default="", metavar="NAME", help="the cluster's name")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        default=None,
        metavar="S",
        help="redraw every S seconds (2) until Ctrl-C",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds to wait for each server and ZooKeeper (5)",
    )
    add_tls_arguments(p)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    setup_logging("error", "text")  # kazoo's reconnect warnings: not on the screen
    last = [2]
    try:
        _check_args(args)
        asyncio.run(_run(args, last))
    except KeyboardInterrupt:
        pass
    except ChangebusError as exc:
        print(f"changebus status: {exc.message}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    return last[0]


def _check_args(args: argparse.Namespace) -> None:
    if bool(args.zookeeper) != bool(args.cluster):
        raise ConfigError("--zookeeper and --cluster go together")
    if not args.urls and not args.zookeeper:
        raise ConfigError("give server URLs, or --zookeeper HOSTS --cluster NAME")
    for url in args.urls:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"{safe_url(url)!r} is not an http:// or https:// URL")
    if args.watch is not None and not args.watch > 0:
        raise ConfigError("--watch needs a positive number of seconds")
    if not args.timeout > 0:
        raise ConfigError("--timeout must be positive")


async def _run(args: argparse.Namespace, last: list[int]) -> None:
    http = await open_session(
        auth_from_args(args), timeout=aiohttp.ClientTimeout(total=args.timeout)
    )
    tty = sys.stdout.isatty()
    try:
        while True:
            reports = await collect(http, args)
            last[0] = 0 if all(r.ok for r in reports) else 1
            now = time.time()
            if args.json:
                doc = report_json(reports, now)
                text = json.dumps(doc) if args.watch else json.dumps(doc, indent=2)
            else:
                text = render_text(reports, now)
                if args.watch:
                    text = _CLEAR + text if tty else text + "\n"
            print(text, flush=True)
            if not args.watch:
                return
            await asyncio.sleep(args.watch)
    finally:
        await http.close()


async def collect(http: aiohttp.ClientSession, args: argparse.Namespace) -> list[ServerReport]:
    """Every server's report: the URLs given, then the cluster's members (each URL once)."""
    targets: dict[str, tuple[str, str]] = {u.rstrip("/"): ("", "") for u in args.urls}
    if args.zookeeper:
        for url, member, kind in await _members(args.zookeeper, args.cluster, args.timeout):
            targets.setdefault(url, (member, kind))
    return list(
        await asyncio.gather(
            *(read_server(http, url, member=m, kind=k) for url, (m, k) in targets.items())
        )
    )


async def _members(zookeeper: str, cluster: str, connect_s: float) -> list[tuple[str, str, str]]:
    """``(url, member id, kind)`` of every member in the cluster's routing table."""
    from changebus.cluster import ClusterConfig, CoordinationError, RoutingTable, ZkSession

    config = ClusterConfig(zookeeper=zookeeper, name=cluster, connect_timeout_s=connect_s)
    session = ZkSession(config)
    try:
        await session.start()
        try:
            table = RoutingTable(session, create_paths=False)  # a status read writes nothing
            await table.start()
            await table.stop()
        finally:
            await session.stop()
    except CoordinationError as exc:
        raise ConfigError(f"cluster {cluster!r}: {exc.message}") from None
    members = table.snapshot().members
    return [
        (m.url.rstrip("/"), member_id, m.kind)
        for member_id, m in sorted(members.items())
        if m.url.startswith(("http://", "https://"))
    ]


async def read_server(
    http: aiohttp.ClientSession, url: str, *, member: str = "", kind: str = ""
) -> ServerReport:
    """What ``url`` says of itself (``/v1/status``, ``/readyz``); never raises a ChangebusError."""
    safe = safe_url(url)
    where = f"server {safe}"
    status, ready = await asyncio.gather(
        _get(http, f"{url}/v1/status", where), _get(http, f"{url}/readyz", where, (200, 503))
    )
    ready_body = ready[1] if isinstance(ready[1], dict) else {}
    if not status[0] and not ready[0]:  # no HTTP answer at all
        assert isinstance(status[1], ChangebusError)
        return ServerReport(url=safe, member=member, error=_said(status[1], where))
    error = ""
    partitions: list[dict[str, Any]] = []
    if isinstance(status[1], ChangebusError):
        error = f"/v1/status: {_said(status[1], where)}"
    elif isinstance(status[1], dict) and isinstance(status[1].get("partitions"), list):
        partitions = [p for p in status[1]["partitions"] if isinstance(p, dict)]
    else:
        error = "/v1/status is not a changebus status document"
    role = _role(partitions, kind)
    if role == "unknown" and not error:
        role = await _role_by_metrics(http, url)
    readiness = ready_body.get("partitions")
    return ServerReport(
        url=safe,
        role=role,
        reachable=True,
        ready=ready_body.get("ready") if isinstance(ready_body.get("ready"), bool) else None,
        error=error,
        readiness={str(k): str(v) for k, v in readiness.items()}
        if isinstance(readiness, dict)
        else {},
        partitions=partitions,
        member=member,
    )


async def _get(
    http: aiohttp.ClientSession, url: str, where: str, ok: tuple[int, ...] = (200,)
) -> tuple[int, Any]:
    """``(status, JSON body)``, or ``(0, the ChangebusError)`` when it failed."""
    try:
        with transport_errors(where):
            async with http.get(url) as resp:
                if resp.status not in ok:
                    return resp.status, await response_error(resp, where)
                return resp.status, await json_body(resp, where)
    except ChangebusError as exc:
        return 0, exc


def _said(exc: ChangebusError, where: str) -> str:
    """The error's message without the ``server URL:`` its head line already shows."""
    return exc.message.removeprefix(f"{where}: ")


def _role(partitions: list[dict[str, Any]], kind: str) -> str:
    """``relay`` or ``bootstrap`` from the status body, else the cluster's word, else unknown."""
    for p in partitions:
        if "producer_scn" in p:
            return "bootstrap"
        if "max_scn" in p:
            return "relay"
    return kind if kind in ("relay", "bootstrap") else "unknown"


async def _role_by_metrics(http: aiohttp.ClientSession, url: str) -> str:
    """A server with no partition yet: its metric names say what it is."""
    try:
        async with http.get(f"{url}/metrics") as resp:
            if resp.status != 200:
                return "unknown"
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return "unknown"
    for role in ("bootstrap", "relay"):
        if f"changebus_{role}_" in text:
            return role
    return "unknown"
