"""``changebus bootstrap``: run the bootstrap server daemon; ``changebus bootstrap snapshot``.

``changebus bootstrap --config FILE`` runs the daemon; the sub-command
``snapshot`` (:mod:`._cli_snapshot`) asks a running server to snapshot a
table again and follows its progress.
"""

from __future__ import annotations

import argparse

from changebus.schemas.server import add_daemon_parser, run_daemon

from ._cli_snapshot import register_snapshot
from ._config import BootstrapConfig
from ._daemon import run

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_daemon_parser(
        sub,
        "bootstrap",
        help="run the bootstrap server daemon",
        description="Run the changebus bootstrap server: log + snapshot of the relay's stream, "
        "served to consumers that fell off the relays or start from nothing.",
    )
    p.set_defaults(func=_main)
    commands = p.add_subparsers(
        dest="bootstrap_command",
        metavar="{snapshot}",
        title="commands for a running bootstrap server (without one: run the daemon)",
    )
    register_snapshot(commands)


def _main(args: argparse.Namespace) -> int:
    return run_daemon(args, "bootstrap", BootstrapConfig, run)
