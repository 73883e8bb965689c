"""``changebus replicate``: keep tables of a SQLite or Postgres database equal to a stream.

It runs a :class:`~._apply_sqlite.SqliteReplica` or
:class:`~._apply_pg.PostgresReplica` over one relay partition: every window
is applied in one database transaction together with the checkpoint, so the
command can be killed at any moment (even with ``kill -9``) and started again:
it continues after the last window it committed, applying nothing twice.

The Postgres target's connection string is read from the environment
variable ``CHANGEBUS_REPLICA_DSN`` when ``--postgres`` is given without a
value, so that a password need not appear on the command line (where ``ps``
shows it); it is never logged. SIGTERM or Ctrl-C stop after the current
window with status 0; a gap in the stream, or a position the relays no longer
keep when no bootstrap server is known (``--bootstrap URL``, or the ones
registered in ``--cluster``), or the replica's database failing (unreachable,
refusing a write), ends the command with a message on stderr and status 3. ``--progress`` shows catching up on stderr (:mod:`._progress`).
With a bootstrap server the replica goes through a snapshot and a
catch-up and is not transactionally consistent until the catch-up ends (see
docs/guarantees.md).

With ``--group NAME --zookeeper HOSTS`` the command is a member of a
consumer group: the group's units (partition x key bucket) are shared among
its live members, and the replica itself is the units' checkpoint store (each
unit's position is written, fenced, in the transaction that applies its
rows), so several ``replicate`` processes writing into one database (or each
into its own) stay effectively-once across rebalances and crashes.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from changebus.schemas import ChangebusError
from changebus.schemas.cli import setup_logging
from changebus.schemas.config import scrub_exception

from ._cli import (
    add_group_arguments,
    add_progress_argument,
    add_route_arguments,
    check_progress,
    group_options,
    route_options,
    route_text,
)

if TYPE_CHECKING:
    from ._apply import Replica

__all__ = ["register"]

log = logging.getLogger("changebus.client.replicate")

_DSN_ENV = "CHANGEBUS_REPLICA_DSN"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``replicate`` subcommand."""
    p = sub.add_parser(
        "replicate",
        help="apply a relay's change stream to tables of SQLite or Postgres",
        description="Keep tables of a SQLite file or a Postgres database equal to the source "
        "tables of a relay partition (idempotent upserts, checkpoint in the same transaction; "
        "safe to kill and restart).",
    )
    add_route_arguments(p)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--sqlite", metavar="FILE", help="target SQLite database file")
    target.add_argument(
        "--postgres",
        nargs="?",
        const="",
        metavar="DSN",
        help=f"target Postgres; without a value the DSN is read from ${_DSN_ENV}",
    )
    p.add_argument(
        "--source", action="append", default=[], metavar="NAME", help="source to apply (all)"
    )
    p.add_argument("--partition", help="physical partition name (needed when several)")
    p.add_argument("--filter", help="partition filter on the key hash, e.g. mod:3:0")
    p.add_argument(
        "--from",
        dest="start",
        default="earliest",
        metavar="POSITION",
        help="earliest (default), latest or an SCN, when the target has no checkpoint yet",
    )
    p.add_argument("--consumer-name", default="default", help="key of the stored checkpoint")
    p.add_argument(
        "--on-unservable",
        choices=("stop", "reset"),
        default="stop",
        help="when no bootstrap server can serve the replica's position: stop with the error "
        "(default), or reset the replica (delete its rows and checkpoint) and bootstrap from "
        "nothing; not with --filter or --group",
    )
    add_group_arguments(p)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--log-format", default="text", choices=("text", "json"))
    add_progress_argument(p)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, args.log_format)
    try:
        return asyncio.run(_run(args))
    except KeyboardInterrupt:
        return 0


async def _run(args: argparse.Namespace) -> int:
    from ._apply_pg import PostgresReplica
    from ._apply_sqlite import SqliteReplica
    from ._config import ConsumerConfig

    sources = tuple(s.strip() for item in args.source for s in item.split(",") if s.strip())
    try:
        group = group_options(args)
        check_progress(args)
        config = ConsumerConfig(
            partition=args.partition,
            sources=sources,
            filter=args.filter,
            start=args.start,
            client_id=f"changebus-replicate-{args.consumer_name}",
            **route_options(args),
            **group,
        )
    except ChangebusError as exc:
        print(f"changebus replicate: {exc.message}", file=sys.stderr)
        return 2
    replica: Replica
    dsn = ""
    if args.sqlite is not None:
        replica = SqliteReplica(args.sqlite, consumer_name=args.consumer_name)
    else:
        dsn = args.postgres or os.environ.get(_DSN_ENV, "")
        if not dsn:
            print(f"changebus replicate: give --postgres DSN or set ${_DSN_ENV}", file=sys.stderr)
            return 2
        replica = PostgresReplica(dsn, consumer_name=args.consumer_name)
    replica.reset_unservable = args.on_unservable == "reset"
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, replica.stop)
    log.info("replicating %s into %r", route_text(args), replica)
    progress = asyncio.create_task(_progress(replica)) if args.progress else None
    try:
        await replica.run(config)
    except ChangebusError as exc:
        print(f"changebus replicate: {exc.message}", file=sys.stderr)
        return 3
    except Exception as exc:
        if not _target_error(exc):
            raise
        # (a traceback, status 1 and no JSON log line before: review)
        text = scrub_exception(exc, (dsn,) if dsn else ())
        print(f"changebus replicate: the replica's database failed: {text}", file=sys.stderr)
        return 3
    finally:
        if progress is not None:
            progress.cancel()
            await asyncio.gather(progress, return_exceptions=True)
        await replica.close()
    log.info(
        "stopped: %d windows applied, %d skipped", replica.windows_applied, replica.windows_skipped
    )
    return 0


def _target_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the replica database driver's own (not a bug of changebus)."""
    import sqlite3

    if isinstance(exc, sqlite3.Error):
        return True
    psycopg = sys.modules.get("psycopg")
    return psycopg is not None and isinstance(exc, psycopg.Error)


async def _progress(replica: Replica) -> None:
    """``--progress``: sample the replica's consumer until caught up (terminal writes in a thread)."""
    from ._progress import SAMPLE_EVERY_S, CatchUpProgress

    bar = CatchUpProgress()
    try:
        while True:
            await asyncio.sleep(SAMPLE_EVERY_S)
            stats = replica.stats()
            if not stats:
                continue  # not started yet
            done: bool = await asyncio.to_thread(bar.update, stats)
            if done:
                return
    finally:
        bar.close()
