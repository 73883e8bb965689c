"""``changebus relay``: run the relay daemon (``--check``: validate its config and exit).

The relay's own part of ``--check`` (:func:`check_fetchers`): every
partition's fetcher is built from its options as a start would build it
(unknown or bad options, an unknown kind, a ``relay`` fetcher's TLS and
token files), and dropped unstarted: nothing connects.
"""

from __future__ import annotations

import argparse
import sys

from changebus.fetchers import create_fetcher
from changebus.schemas import ChangebusError, ConfigError
from changebus.schemas.security import ClientAuth
from changebus.schemas.server import add_daemon_parser, run_daemon

from ._config import RelayConfig
from ._daemon import run, with_upstream

__all__ = ["check_fetchers", "register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_daemon_parser(
        sub, "relay", help="run the relay daemon", description="Run the changebus relay daemon."
    )
    p.add_argument(
        "--resize-buffers",
        action="store_true",
        help="start a partition whose buffer files hold other sizes than configured empty,"
        " moving its old files to a resized-<time> subdirectory (without it such a start is"
        " refused); the same as --set resize_buffers=true",
    )
    p.set_defaults(func=_main)


def _switch_interval(config: RelayConfig) -> None:
    # The relay runs its writer and fetcher threads beside the event loop; a
    # short GIL switch interval keeps a waiting loop from stalling up to the
    # default 5 ms behind them (the process is ours: this is not library code).
    sys.setswitchinterval(config.gil_switch_interval_s)


def check_fetchers(config: RelayConfig) -> None:
    """Build (never start) each partition's fetcher; ConfigError naming the partition."""
    for part in config.partitions:
        fetcher = with_upstream(part, config.upstream).fetcher
        if fetcher.kind == "none":
            continue
        try:
            built = create_fetcher(fetcher.kind, part.name, part.id, fetcher.options)
            auth = getattr(built, "auth", None)
            if isinstance(auth, ClientAuth):
                auth.load()  # a relay fetcher's TLS files and token file
        except ChangebusError as exc:
            raise ConfigError(f"partition {part.name}: {exc.message}") from None


def _main(args: argparse.Namespace) -> int:
    if getattr(args, "resize_buffers", False):
        args.overrides = [*args.overrides, "resize_buffers=true"]
    return run_daemon(
        args, "relay", RelayConfig, run, prepare=_switch_interval, check=check_fetchers
    )
