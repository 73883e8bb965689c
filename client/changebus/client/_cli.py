"""``changebus tail``: print a relay stream as JSON lines, following it live.

One line per row change: ``{"scn", "seq", "op", "table", "key", "before",
"after", "not_sent"}``, plus ``"phase"`` (``"snapshot"`` or ``"catchup"``)
on lines read from a bootstrap server: SCNs increase (and are unique per
``(scn, seq)``) only on the other lines. With ``--checkpoint FILE`` the position is kept in
``FILE`` (atomically replaced after each window), so a second run continues
where the first stopped. Ctrl-C (or SIGTERM) stops cleanly with status 0.
A gap in the stream or a position the relays no longer keep ends the command
with a message on stderr and status 3.

``--progress`` (also on ``changebus replicate``; :mod:`._progress`) shows a
catch-up bar on stderr -- SCN distance to the relay's newest SCN, windows/s,
ETA; a bootstrap's snapshot rows -- which closes once caught up.

Where the stream comes from (shared with ``changebus replicate``, one
mechanism: :func:`add_route_arguments` and :func:`route_options`):
``--relay URL`` (repeatable) or ``--zookeeper HOSTS --cluster NAME``, and
``--bootstrap URL`` (repeatable): the bootstrap servers a consumer that fell
off the relays (or starts ``--from earliest`` with no checkpoint) reads a
snapshot and the catch-up log from before it returns to the relays. Without
``--bootstrap`` a ``--cluster`` consumer uses the bootstrap servers
registered in the cluster, and any other consumer that falls off ends with
status 3. Works with ``--group`` too (each lane bootstraps on its own).

TLS and authentication (shared with ``changebus replicate``):
``--ca-file``, ``--cert-file``/``--key-file`` (mTLS),
``--insecure-no-hostname-check`` and ``--token-file``; the token itself is
taken from ``$CHANGEBUS_TOKEN``, never from a flag (command lines are
visible to every user of the machine). A 401/403 answer or a failed TLS
verification ends the command with a message and status 3.

With ``--group NAME --zookeeper HOSTS`` (and ``--partitions``,
``--buckets``, ``--member-name``, ``--commit-interval``: see
:func:`add_group_arguments`) the command is a member of a consumer group: it
prints the events of the units the group gives it, each line with the
window's ``"unit"`` (``<partition>.<bucket>``); the units' checkpoints live
in ZooKeeper, or in files under ``--checkpoint-dir DIR``.
``changebus group status|list|delete`` (:mod:`._cli_group`) inspect groups.

It is built on :class:`~._sync.SyncConsumer`: the consumer's event loop runs
in a background thread and this thread does the (blocking) printing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from changebus.schemas import ChangebusError, ConfigError, check_group_name
from changebus.schemas.cli import setup_logging
from changebus.schemas.security import ClientAuth

__all__ = [
    "TOKEN_ENV",
    "add_group_arguments",
    "add_progress_argument",
    "add_route_arguments",
    "add_tls_arguments",
    "auth_from_args",
    "check_progress",
    "group_options",
    "register",
    "route_options",
    "route_text",
]

#: the environment variable holding the bearer token (never a command-line flag)
TOKEN_ENV = "CHANGEBUS_TOKEN"


def add_route_arguments(p: argparse.ArgumentParser) -> None:
    """``--relay URL`` (repeatable) or ``--zookeeper HOSTS --cluster NAME [--prefer-followers]``.

    Also ``--bootstrap URL`` (repeatable) and the TLS flags; :func:`route_options`
    turns them into :class:`ConsumerConfig` keyword arguments.
    """
    p.add_argument(
        "--relay",
        action="append",
        default=[],
        metavar="URL",
        help="relay base URL; repeat for failover relays (tried in order)",
    )
    p.add_argument(
        "--zookeeper",
        default="",
        metavar="HOSTS",
        help="instead of --relay: ZooKeeper connect string of a relay cluster"
        " (host:port[,host:port]); the relays come from its routing table (needs --cluster"
        " and --partition). With --group: the ZooKeeper of the consumer group",
    )
    p.add_argument("--cluster", default="", metavar="NAME", help="the relay cluster's name")
    p.add_argument(
        "--prefer-followers",
        action="store_true",
        help="with --zookeeper: read from followers first, the leader last",
    )
    p.add_argument(
        "--bootstrap",
        action="append",
        default=[],
        metavar="URL",
        help="bootstrap server base URL; repeat for failover servers (tried in order). A"
        " consumer that fell off the relays (or starts --from earliest without a checkpoint)"
        " reads a snapshot and the catch-up log from it, then returns to the relays. With"
        " --cluster the default is the bootstrap servers registered in the cluster",
    )
    p.add_argument(
        "--wait-s",
        type=float,
        default=None,
        metavar="S",
        help="how long one pull may wait at the relay for new events (default 10)",
    )
    p.add_argument(
        "--read-margin-s",
        type=float,
        default=None,
        metavar="S",
        help="a connection silent for wait + this long is dead: fail over (default 10;"
        " lower finds a half-open connection sooner)",
    )
    add_tls_arguments(p)


def add_progress_argument(p: argparse.ArgumentParser) -> None:
    """``--progress``: a catch-up bar on stderr (:mod:`._progress`)."""
    p.add_argument(
        "--progress",
        action="store_true",
        help="show catching up on stderr (tqdm: SCN distance to the relay's newest SCN,"
        " windows/s, ETA; a bootstrap's snapshot rows); the bar closes when caught up",
    )


def check_progress(args: argparse.Namespace) -> None:
    """ConfigError when ``--progress`` is combined with ``--group`` (lanes have no one head)."""
    if args.progress and getattr(args, "group", None):
        raise ConfigError(
            "--progress: not with --group (a group's lag is in 'changebus group status')"
        )


def add_tls_arguments(p: argparse.ArgumentParser) -> None:
    """``--ca-file``, ``--cert-file``/``--key-file``, ``--insecure-no-hostname-check``, ``--token-file``."""
    tls = p.add_argument_group("TLS and authentication")
    tls.add_argument(
        "--ca-file",
        type=Path,
        metavar="PEM",
        help="CA certificates that verify https:// servers (default: the system store)",
    )
    tls.add_argument(
        "--cert-file", type=Path, metavar="PEM", help="client certificate (mTLS), PEM chain"
    )
    tls.add_argument(
        "--key-file", type=Path, metavar="PEM", help="the client certificate's private key"
    )
    tls.add_argument(
        "--insecure-no-hostname-check",
        action="store_true",
        help="do not compare the server's certificate name with the URL's host"
        " (the certificate chain is still verified)",
    )
    tls.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help=f"file holding the bearer token (or set ${TOKEN_ENV}; never give it on the"
        " command line)",
    )


def add_group_arguments(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add ``--group NAME`` and its options; returns their argument group (for more).

    The options: ``--partitions``, ``--buckets``, ``--member-name`` and
    ``--commit-interval`` (see :func:`group_options`); the consumer joins a
    consumer group coordinated in ``--zookeeper``.
    """
    g = p.add_argument_group("consumer group (with --zookeeper)")
    g.add_argument(
        "--group",
        metavar="NAME",
        help="join this consumer group: the partitions' key buckets are shared among its"
        " live members, each with its own checkpoint (needs --zookeeper; relays from --relay"
        " or --cluster)",
    )
    g.add_argument(
        "--partitions",
        metavar="A,B",
        help="the partitions the group reads, comma-separated (default: --partition)",
    )
    g.add_argument(
        "--buckets", type=int, metavar="N", help="key buckets per partition (64; fixed per group)"
    )
    g.add_argument(
        "--member-name",
        metavar="NAME",
        help="this member's name in 'changebus group status' (default: host:pid)",
    )
    g.add_argument(
        "--commit-interval",
        type=float,
        metavar="S",
        help="write a unit's checkpoint at most every S seconds (1; always on revoke and exit)",
    )
    return g


#: the group options and their flags, for "only with --group" errors
_GROUP_FLAGS = {
    "partitions": "--partitions",
    "buckets": "--buckets",
    "member_name": "--member-name",
    "commit_interval": "--commit-interval",
}


def group_options(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`ConsumerConfig` keyword arguments of the group flags (ConfigError when bad)."""
    if args.group is None:
        given = [flag for attr, flag in _GROUP_FLAGS.items() if getattr(args, attr) is not None]
        if given:
            raise ConfigError(f"{', '.join(given)}: only with --group NAME")
        return {}
    check_group_name(args.group)
    if not args.zookeeper:
        raise ConfigError(f"--group {args.group}: a consumer group needs --zookeeper HOSTS")
    partitions = tuple(s.strip() for s in (args.partitions or "").split(",") if s.strip())
    if args.partitions is not None and not partitions:
        raise ConfigError("--partitions: give partition names, comma-separated")
    options: dict[str, Any] = {"group": args.group, "partitions": partitions}
    if args.buckets is not None:
        options["buckets"] = args.buckets
    if args.member_name is not None:
        options["member_name"] = args.member_name
    if args.commit_interval is not None:
        options["commit_interval_s"] = args.commit_interval
    return options


def auth_from_args(args: argparse.Namespace) -> ClientAuth:
    """The :class:`ClientAuth` of the TLS flags and ``$CHANGEBUS_TOKEN`` (raises ConfigError)."""
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token and args.token_file is not None:
        token = ""  # the explicit flag wins over the environment
    return ClientAuth(
        ca_file=args.ca_file,
        cert_file=args.cert_file,
        key_file=args.key_file,
        check_hostname=not args.insecure_no_hostname_check,
        token=token,
        token_file=args.token_file,
    )


def route_options(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`ConsumerConfig` keyword arguments of :func:`add_route_arguments`' flags.

    ``relays``, ``zookeeper``, ``cluster``, ``prefer_followers``,
    ``bootstrap_servers`` (``--bootstrap``; empty: none, or the cluster's),
    ``auth`` (:func:`auth_from_args`) and, when given, ``wait_s`` and
    ``read_margin_s``. The config validates the values.
    """
    options: dict[str, Any] = {
        "relays": tuple(args.relay),
        "zookeeper": args.zookeeper,
        "cluster": args.cluster,
        "prefer_followers": args.prefer_followers,
        "bootstrap_servers": tuple(args.bootstrap),
        "auth": auth_from_args(args),
    }
    for name in ("wait_s", "read_margin_s"):
        if getattr(args, name, None) is not None:
            options[name] = getattr(args, name)
    return options


def route_text(args: argparse.Namespace) -> str:
    """Where the stream comes from, for log lines (no credentials)."""
    from ._http import safe_url

    relays = ", ".join(safe_url(u) for u in args.relay)
    if args.zookeeper and args.cluster:
        relays = f"cluster {args.cluster!r} (ZooKeeper {args.zookeeper})"
    if args.bootstrap:
        relays += f" (bootstrap: {', '.join(safe_url(u) for u in args.bootstrap)})"
    group = getattr(args, "group", None)
    return f"{relays} as member of group {group!r}" if group else relays


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``tail``, ``replicate``, ``group``, ``status``, ``spark`` and ``demo`` subcommands."""
    from . import _cli_group, _cli_replicate, _cli_status, _sparkzip

    p = sub.add_parser(
        "tail",
        help="print a relay's change stream as JSON lines",
        description="Print every row change of a relay partition as one JSON line, "
        "following new transactions as they commit (Ctrl-C stops).",
    )
    add_route_arguments(p)
    p.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="NAME",
        help="logical source (table) to show; repeatable or comma-separated (default: all)",
    )
    p.add_argument(
        "--from",
        dest="start",
        default="latest",
        metavar="POSITION",
        help="earliest, latest (default) or an SCN to continue after; a stored --checkpoint wins",
    )
    p.add_argument("--checkpoint", metavar="FILE", help="keep the position in FILE")
    p.add_argument(
        "--partition", help="physical partition name (needed when the relay has several)"
    )
    p.add_argument("--filter", help="partition filter on the key hash, e.g. mod:3:0")
    p.add_argument("--limit", type=int, default=0, help="stop after this many events (0: never)")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    add_progress_argument(p)
    group = add_group_arguments(p)
    group.add_argument(
        "--checkpoint-dir",
        type=Path,
        metavar="DIR",
        help="with --group: keep the units' checkpoints in files under DIR (FileUnitStore)"
        " instead of ZooKeeper",
    )
    p.set_defaults(func=_main)
    _cli_replicate.register(sub)
    _cli_group.register(sub)
    _cli_status.register(sub)
    _sparkzip.register(sub)
    d = sub.add_parser(
        "demo",
        help="run the whole pipeline on a private Postgres and print live changes",
        description="Start a private PostgreSQL server, a relay with the Postgres fetcher and "
        "consumers; run a small shop workload and print every transaction as it commits, then a "
        "summary and a row-by-row check of a replica against the source (Ctrl-C stops).",
    )
    d.add_argument("--seconds", type=float, default=20.0, help="how long the workload runs")
    d.add_argument("--rate", type=float, default=5.0, help="workload transactions per second")
    d.add_argument("--json", action="store_true", help="print changes as JSON lines")
    d.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    import asyncio

    from ._demo import run_demo

    setup_logging("warning", "text")
    return asyncio.run(run_demo(args.seconds, args.rate, as_json=args.json))


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _main(args: argparse.Namespace) -> int:
    from changebus.schemas import UnitStore

    from ._config import ConsumerConfig
    from ._json import event_json
    from ._persist import CheckpointPersister, FileCheckpointPersister
    from ._progress import ProgressThread
    from ._sync import SyncConsumer
    from ._unitstore_file import FileUnitStore

    setup_logging(args.log_level, "text")
    sources = tuple(s.strip() for item in args.source for s in item.split(",") if s.strip())
    persister: CheckpointPersister | UnitStore | None = None
    try:
        group = group_options(args)
        config = ConsumerConfig(
            partition=args.partition,
            sources=sources,
            filter=args.filter,
            start=args.start,
            client_id="changebus-tail",
            yield_empty_windows=False,
            **route_options(args),
            **group,
        )
        if group and args.checkpoint:
            raise ConfigError(
                "--checkpoint: a group member keeps one checkpoint per unit;"
                " give --checkpoint-dir DIR (or none: ZooKeeper keeps them)"
            )
        if not group and args.checkpoint_dir is not None:
            raise ConfigError("--checkpoint-dir: only with --group NAME (else --checkpoint FILE)")
        check_progress(args)
        if args.checkpoint_dir is not None:
            persister = FileUnitStore(args.checkpoint_dir)
        elif args.checkpoint:
            persister = FileCheckpointPersister(args.checkpoint)
    except ChangebusError as exc:
        print(f"changebus tail: {exc.message}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    printed = 0
    out = sys.stdout
    consumer = SyncConsumer(config, persister=persister)
    progress = ProgressThread(consumer.stats) if args.progress else None
    try:
        for window in consumer:
            unit, phase = window.unit, window.phase
            for event in window.events:
                out.write(event_json(event, unit=unit, phase=phase) + "\n")
                printed += 1
                if args.limit and printed >= args.limit:
                    out.flush()
                    return 0
            out.flush()
    except KeyboardInterrupt:
        return 0
    except ChangebusError as exc:
        print(f"changebus tail: {exc.message}", file=sys.stderr)
        return 3
    except BrokenPipeError:
        return 0
    finally:
        with contextlib.suppress(KeyboardInterrupt):
            if progress is not None:
                progress.stop()
            consumer.close()
    return 0
