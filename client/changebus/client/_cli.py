"""``changebus tail``: print a relay stream as JSON lines, following it live.

One line per row change: ``{"scn", "seq", "op", "table", "key", "before",
"after", "not_sent"}``. With ``--checkpoint FILE`` the position is kept in
``FILE`` (atomically replaced after each window), so a second run continues
where the first stopped. Ctrl-C (or SIGTERM) stops cleanly with status 0.
A gap in the stream or a position the relays no longer keep ends the command
with a message on stderr and status 3.

TLS and authentication (shared with ``changebus replicate``):
``--ca-file``, ``--cert-file``/``--key-file`` (mTLS),
``--insecure-no-hostname-check`` and ``--token-file``; the token itself is
taken from ``$CHANGEBUS_TOKEN``, never from a flag (command lines are
visible to every user of the machine). A 401/403 answer or a failed TLS
verification ends the command with a message and status 3.

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

from changebus.schemas import ChangebusError
from changebus.schemas.cli import setup_logging
from changebus.schemas.security import ClientAuth

__all__ = ["TOKEN_ENV", "add_route_arguments", "auth_from_args", "register", "route_text"]

#: the environment variable holding the bearer token (never a command-line flag)
TOKEN_ENV = "CHANGEBUS_TOKEN"


def add_route_arguments(p: argparse.ArgumentParser) -> None:
    """``--relay URL`` (repeatable) or ``--zookeeper HOSTS --cluster NAME [--prefer-followers]``."""
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
        " and --partition)",
    )
    p.add_argument("--cluster", default="", metavar="NAME", help="the relay cluster's name")
    p.add_argument(
        "--prefer-followers",
        action="store_true",
        help="with --zookeeper: read from followers first, the leader last",
    )
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


def route_text(args: argparse.Namespace) -> str:
    """Where the stream comes from, for log lines (no credentials)."""
    from ._http import safe_url

    if args.zookeeper:
        return f"cluster {args.cluster!r} (ZooKeeper {args.zookeeper})"
    return ", ".join(safe_url(u) for u in args.relay)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``tail``, ``replicate`` and ``demo`` subcommands."""
    from . import _cli_replicate

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
    p.set_defaults(func=_main)
    _cli_replicate.register(sub)
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
    from ._config import ConsumerConfig
    from ._json import event_json
    from ._persist import FileCheckpointPersister
    from ._sync import SyncConsumer

    setup_logging(args.log_level, "text")
    sources = tuple(s.strip() for item in args.source for s in item.split(",") if s.strip())
    try:
        config = ConsumerConfig(
            relays=tuple(args.relay),
            zookeeper=args.zookeeper,
            cluster=args.cluster,
            prefer_followers=args.prefer_followers,
            partition=args.partition,
            sources=sources,
            filter=args.filter,
            start=args.start,
            client_id="changebus-tail",
            yield_empty_windows=False,
            auth=auth_from_args(args),
        )
    except ChangebusError as exc:
        print(f"changebus tail: {exc.message}", file=sys.stderr)
        return 2
    persister = FileCheckpointPersister(args.checkpoint) if args.checkpoint else None
    signal.signal(signal.SIGTERM, _interrupt)
    printed = 0
    out = sys.stdout
    consumer = SyncConsumer(config, persister=persister)
    try:
        for window in consumer:
            for event in window.events:
                out.write(event_json(event) + "\n")
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
            consumer.close()
    return 0
