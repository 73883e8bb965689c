"""``changebus group status|list|delete``: inspect and remove consumer groups in ZooKeeper.

* ``status NAME`` prints one screen: the group's partitions and buckets, its
  leader, its live members (id, name, host, unit counts) and one line per
  unit (owner, state, generation, checkpoint SCN, lag in SCN and seconds
  behind the relay head of its partition). The heads come from ``--relay
  URL`` (repeatable) or from the relays of ``--cluster C`` (the cluster's
  routing table in the same ZooKeeper); without either the lag is not shown.
  The checkpoints are read from the group's store: ZooKeeper by default,
  ``--store-dir D`` for a ``FileUnitStore``, ``--store-sqlite FILE`` for a
  ``SqliteReplica``'s unit table, ``--store-dsn [DSN]`` for a
  ``PostgresUnitStore`` (or a ``PostgresReplica``'s table; without a value the
  DSN is read from ``$CHANGEBUS_STORE_DSN``, so no password shows in ``ps``).
  ``--json`` prints one JSON object; ``--watch S`` repeats every S seconds.
* ``list`` prints every group under ``/changebus/groups``.
* ``delete NAME`` removes a group's tree (meta, assignment, ZooKeeper
  checkpoints); it refuses while members are live unless ``--force``.
  Checkpoints kept in another store are not touched.

Exit status: 0 done; 2 bad arguments or an unknown group; 1 ZooKeeper (or
the store) unreachable, or a live group that ``delete`` refused. Errors are
one line on stderr, never a traceback; a DSN's password never appears.

ZooKeeper requests run in the :class:`~changebus.cluster.ZkSession`'s own
threads and the stores work in threads of their own: the event loop of the
command never blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
from kazoo.exceptions import KazooException, NoNodeError, NotEmptyError

from changebus.cluster import (
    GROUPS_ROOT,
    ClusterConfig,
    CoordinationError,
    GroupState,
    ZkSession,
    ZkUnitStore,
    group_root,
    read_group,
)
from changebus.schemas import ChangebusError, ConfigError, UnitStore, check_group_name
from changebus.schemas.cli import command_group, setup_logging
from changebus.schemas.config import scrub

from ._cli import add_tls_arguments, auth_from_args
from ._cli_group_status import GroupReport, build_report, relay_heads, render_text

__all__ = ["STORE_DSN_ENV", "register"]

#: the environment variable holding the Postgres store's DSN (``--store-dsn`` without a value)
STORE_DSN_ENV = "CHANGEBUS_STORE_DSN"

#: ANSI: cursor home and clear the screen (``--watch`` on a terminal)
_CLEAR = "\x1b[H\x1b[2J"


class _Exit(Exception):
    """Ends a subcommand with ``status`` after printing ``message`` on stderr."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``group`` command and its subcommands."""
    cmds = command_group(
        sub,
        "group",
        help="inspect and manage consumer groups in ZooKeeper",
        description="Inspect and manage changebus consumer groups (members, units, "
        "checkpoints, lag) coordinated through ZooKeeper.",
    )

    status = cmds.add_parser(
        "status",
        help="members, units, checkpoints and lag of a group",
        description="Print a consumer group's leader, members and units: each unit's owner, "
        "generation, checkpoint SCN and lag (SCN and seconds behind the relay head).",
    )
    status.add_argument("name", help="the group's name")
    _zookeeper_arguments(status)
    heads = status.add_mutually_exclusive_group()
    heads.add_argument(
        "--relay",
        action="append",
        default=[],
        metavar="URL",
        help="a relay to ask for the partitions' heads (repeatable)",
    )
    heads.add_argument(
        "--cluster", default="", metavar="NAME", help="ask the relays of this relay cluster"
    )
    store = status.add_mutually_exclusive_group()
    store.add_argument(
        "--store-dir", type=Path, metavar="DIR", help="checkpoints in a FileUnitStore directory"
    )
    store.add_argument(
        "--store-sqlite",
        type=Path,
        metavar="FILE",
        help="checkpoints in a SQLite replica's unit table (changebus replicate --sqlite)",
    )
    store.add_argument(
        "--store-dsn",
        nargs="?",
        const="",
        metavar="DSN",
        help="checkpoints in a Postgres table (PostgresUnitStore, PostgresReplica); without"
        f" a value the DSN is read from ${STORE_DSN_ENV}",
    )
    status.add_argument(
        "--store-table",
        default="changebus_unit_checkpoints",
        metavar="TABLE",
        help="the unit table of --store-dsn / --store-sqlite (changebus_unit_checkpoints)",
    )
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.add_argument(
        "--watch", type=float, metavar="S", help="print again every S seconds (Ctrl-C stops)"
    )
    add_tls_arguments(status)
    status.set_defaults(func=lambda args: _run(_status, args, "status"))

    listing = cmds.add_parser(
        "list",
        help="the groups in ZooKeeper",
        description="Print every consumer group under /changebus/groups with its "
        "partitions, bucket count, live members and leader.",
    )
    _zookeeper_arguments(listing)
    listing.add_argument("--json", action="store_true", help="print one JSON object")
    listing.set_defaults(func=lambda args: _run(_list, args, "list"))

    delete = cmds.add_parser(
        "delete",
        help="remove a group's znodes (refused while members are live)",
        description="Remove a consumer group's tree from ZooKeeper: meta, assignment and the "
        "checkpoints kept there. Refused while members are registered, unless --force "
        "(live members then register again and start over from their stores).",
    )
    delete.add_argument("name", help="the group's name")
    _zookeeper_arguments(delete)
    delete.add_argument("--force", action="store_true", help="delete even with live members")
    delete.set_defaults(func=lambda args: _run(_delete, args, "delete"))


def _zookeeper_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--zookeeper", required=True, metavar="HOSTS", help="connect string host:port[,...]"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds to wait for ZooKeeper and each relay (10)",
    )
    p.add_argument("--log-level", default="error", choices=("debug", "info", "warning", "error"))


def _secrets(args: argparse.Namespace) -> list[str]:
    """The DSNs of this command (scrubbed from every message)."""
    found = [getattr(args, "store_dsn", None), os.environ.get(STORE_DSN_ENV)]
    return [s for s in found if s]


def _run(command: Callable[[argparse.Namespace], Any], args: argparse.Namespace, name: str) -> int:
    """Run ``command`` on a new event loop; errors become one line on stderr and a status."""
    secrets = _secrets(args)
    setup_logging(args.log_level, "text", secrets)  # kazoo's reconnect warnings: not by default
    try:
        status: int = asyncio.run(command(args))
        return status
    except KeyboardInterrupt:
        return 0
    except _Exit as exc:
        print(f"changebus group {name}: {scrub(exc.message, secrets)}", file=sys.stderr)
        return exc.status
    except ConfigError as exc:
        print(f"changebus group {name}: {scrub(exc.message, secrets)}", file=sys.stderr)
        return 2
    except ChangebusError as exc:
        print(f"changebus group {name}: {scrub(exc.message, secrets)}", file=sys.stderr)
        return 1
    except KazooException as exc:  # a refusal (no permission, ...): one line as well
        print(f"changebus group {name}: ZooKeeper refused: {type(exc).__name__}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0


@contextlib.asynccontextmanager
async def _zookeeper(args: argparse.Namespace) -> AsyncIterator[ZkSession]:
    """A started :class:`ZkSession` on ``--zookeeper`` (stopped on exit)."""
    if args.timeout <= 0:
        raise ConfigError("--timeout must be positive")
    config = ClusterConfig(zookeeper=args.zookeeper, name="groups", connect_timeout_s=args.timeout)
    session = ZkSession(config)
    try:
        await session.start()
    except ChangebusError as exc:
        raise _Exit(1, f"cannot reach ZooKeeper: {exc.message}") from None
    try:
        yield session
    finally:
        await session.stop()


async def _group_names(session: ZkSession) -> list[str]:
    try:
        names: list[str] = await session.op("get_children", GROUPS_ROOT)
    except NoNodeError:
        return []
    return sorted(names)


async def _require_group(session: ZkSession, group: str, zookeeper: str) -> GroupState:
    """The group's state, or exit status 2 naming the groups that exist."""
    if await session.op("exists", f"{group_root(group)}/meta") is None:
        known = await _group_names(session)
        more = f" and {len(known) - 10} more" if len(known) > 10 else ""
        hint = f" (groups: {', '.join(known[:10])}{more})" if known else " (no group exists)"
        raise _Exit(2, f"no group {group!r} in ZooKeeper {zookeeper}{hint}")
    return await read_group(session, group)


async def _open_store(args: argparse.Namespace, session: ZkSession) -> UnitStore:
    if args.store_dir is not None:
        from ._unitstore_file import FileUnitStore

        return FileUnitStore(args.store_dir)
    if args.store_sqlite is not None:
        from ._apply_sqlite import SqliteReplica

        if not await asyncio.to_thread(args.store_sqlite.is_file):
            raise ConfigError(f"--store-sqlite: {args.store_sqlite} is not a file")
        return SqliteReplica(args.store_sqlite, unit_table=args.store_table)
    if args.store_dsn is not None:
        from ._unitstore_pg import PostgresUnitStore

        dsn = args.store_dsn or os.environ.get(STORE_DSN_ENV, "")
        if not dsn:
            raise ConfigError(f"give --store-dsn DSN or set ${STORE_DSN_ENV}")
        return PostgresUnitStore(dsn, table=args.store_table)
    return ZkUnitStore(session)


async def _relay_urls(args: argparse.Namespace, partitions: tuple[str, ...]) -> tuple[str, ...]:
    if args.cluster:
        from ._cluster import read_route

        return await read_route(args.zookeeper, args.cluster, partitions)
    return tuple(args.relay)


async def _report(
    args: argparse.Namespace, session: ZkSession, store: UnitStore, http: aiohttp.ClientSession
) -> GroupReport:
    state = await _require_group(session, args.name, args.zookeeper)
    stored = await store.read(args.name)
    where = ""
    heads = {}
    if args.relay or args.cluster:
        where = f"cluster {args.cluster}" if args.cluster else ", ".join(map(_safe, args.relay))
        try:
            urls = await _relay_urls(args, tuple(state.partitions))
            heads = await relay_heads(http, urls, state.partitions)
        except ChangebusError as exc:
            print(f"changebus group status: relay heads: {exc.message}", file=sys.stderr)
    return build_report(
        group=args.name,
        buckets=state.buckets,
        partitions=state.partitions,
        leader=state.leader,
        generation=state.generation,
        members=state.members,
        assignment=state.assignment,
        owners=state.owners,
        stored=stored,
        heads=heads,
        relays=where,
    )


def _safe(url: str) -> str:
    from ._http import safe_url

    return safe_url(url)


async def _status(args: argparse.Namespace) -> int:
    from ._http import open_session

    check_group_name(args.name)
    if args.watch is not None and not args.watch > 0:
        raise ConfigError("--watch needs a positive number of seconds")
    for url in args.relay:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--relay: {_safe(url)!r} is not an http:// or https:// URL")
    async with _zookeeper(args) as session:
        store = await _open_store(args, session)
        http = await open_session(
            auth_from_args(args), timeout=aiohttp.ClientTimeout(total=args.timeout)
        )
        try:
            tty = sys.stdout.isatty()
            while True:
                try:
                    report = await _report(args, session, store, http)
                except ChangebusError as exc:
                    if not (args.watch and exc.retriable):
                        raise
                    # ZooKeeper or the store away for a while: say so, keep watching
                    text = scrub(exc.message, _secrets(args))
                    print(f"changebus group status: {text}", file=sys.stderr, flush=True)
                    await asyncio.sleep(args.watch)
                    continue
                if args.json:
                    doc = report.to_json()
                    text = json.dumps(doc) if args.watch else json.dumps(doc, indent=2)
                else:
                    text = render_text(report)
                if args.watch and tty:
                    text = _CLEAR + text
                elif args.watch and not args.json:
                    text += "\n"
                print(text, flush=True)
                if not args.watch:
                    return 0
                await asyncio.sleep(args.watch)
        finally:
            await http.close()
            await store.close()


async def _list(args: argparse.Namespace) -> int:
    async with _zookeeper(args) as session:
        groups: list[dict[str, Any]] = []
        for name in await _group_names(session):
            if await session.op("exists", f"{group_root(name)}/meta") is None:
                groups.append({"group": name, "partitions": None, "buckets": None})
                continue
            try:
                state = await read_group(session, name)
            except CoordinationError as exc:
                if exc.retriable:
                    raise
                # one damaged group must not hide the others: listed, marked unreadable
                groups.append(
                    {"group": name, "partitions": None, "buckets": None, "error": exc.message}
                )
                continue
            groups.append(
                {
                    "group": name,
                    "partitions": list(state.partitions),
                    "buckets": state.buckets,
                    "members": len(state.members),
                    "leader": state.leader,
                }
            )
    if args.json:
        print(json.dumps({"groups": groups}, indent=2))
        return 0
    if not groups:
        print("no consumer group")
        return 0
    rows = [
        (
            g["group"],
            ",".join(g["partitions"]) if g["partitions"] else "-",
            str(g["buckets"] or "-"),
            str(g.get("members", "-")),
            g.get("leader") or ("unreadable: " + g["error"] if g.get("error") else "-"),
        )
        for g in groups
    ]
    head = ("GROUP", "PARTITIONS", "BUCKETS", "MEMBERS", "LEADER")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0


async def _delete(args: argparse.Namespace) -> int:
    check_group_name(args.name)
    root = group_root(args.name)
    async with _zookeeper(args) as session:
        if await session.op("exists", root) is None:
            raise _Exit(2, f"no group {args.name!r} in ZooKeeper {args.zookeeper}")
        try:
            members: list[str] = await session.op("get_children", f"{root}/members")
        except NoNodeError:
            members = []
        if members and not args.force:
            raise _Exit(
                1,
                f"group {args.name!r} has {len(members)} live member(s) "
                f"({', '.join(sorted(members))}): stop them first, or give --force",
            )
        removed = await session.call(lambda zk: _delete_tree(zk, root, session.op_timeout_s))
    print(f"deleted group {args.name} ({removed} znode(s))")
    return 0


def _delete_tree(zk: Any, root: str, timeout: float) -> int:
    """Delete ``root`` and everything under it, children first (in a session thread).

    Nodes created meanwhile (a member registering again) are deleted too: a
    ``NotEmpty`` answer walks the node again, a few times at most.
    """
    removed = 0

    def walk(path: str) -> None:
        nonlocal removed
        for _ in range(5):
            try:
                children = zk.get_children_async(path).get(timeout=timeout)
            except NoNodeError:
                return
            for child in children:
                walk(f"{path}/{child}")
            try:
                zk.delete_async(path).get(timeout=timeout)
                removed += 1
                return
            except NoNodeError:
                return
            except NotEmptyError:
                continue
        raise CoordinationError(f"{path}: children keep being created; try again")

    walk(root)
    return removed
