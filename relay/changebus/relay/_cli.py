"""``changebus relay``: run the relay daemon."""

from __future__ import annotations

import argparse
import sys

from changebus.schemas.server import add_daemon_parser, run_daemon

from ._config import RelayConfig
from ._daemon import run

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_daemon_parser(
        sub, "relay", help="run the relay daemon", description="Run the changebus relay daemon."
    )
    p.set_defaults(func=_main)


def _switch_interval(config: RelayConfig) -> None:
    # The relay runs its writer and fetcher threads beside the event loop; a
    # short GIL switch interval keeps a waiting loop from stalling up to the
    # default 5 ms behind them (the process is ours: this is not library code).
    sys.setswitchinterval(config.gil_switch_interval_s)


def _main(args: argparse.Namespace) -> int:
    return run_daemon(args, "relay", RelayConfig, run, prepare=_switch_interval)
