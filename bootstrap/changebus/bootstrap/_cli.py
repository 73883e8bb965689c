"""``changebus bootstrap``: run the bootstrap server daemon."""

from __future__ import annotations

import argparse

from changebus.schemas.server import add_daemon_parser, run_daemon

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


def _main(args: argparse.Namespace) -> int:
    return run_daemon(args, "bootstrap", BootstrapConfig, run)
