"""``changebus bootstrap``: run the bootstrap server daemon."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from changebus.schemas import ChangebusError
from changebus.schemas._logsetup import setup_logging
from changebus.schemas.config import load_config

from ._config import BootstrapConfig
from ._daemon import run

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bootstrap",
        help="run the bootstrap server daemon",
        description="Run the changebus bootstrap server: log + snapshot of the relay's stream, "
        "served to consumers that fell off the relays or start from nothing.",
    )
    p.add_argument("--config", type=Path, help="bootstrap TOML file (see docs/operations.md)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set http.port=9000 (repeatable)",
    )
    p.add_argument("--log-format", choices=("text", "json"), help="log line format")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.log_format:
        overrides.append(f"log_format={args.log_format}")
    if args.log_level:
        overrides.append(f"log_level={args.log_level}")
    try:
        config = load_config(
            BootstrapConfig, args.config, env_prefix="CHANGEBUS_BOOTSTRAP_", overrides=overrides
        )
    except ChangebusError as exc:
        print(f"changebus bootstrap: {exc.message}")
        return 2
    setup_logging(config.log_level, config.log_format)
    try:
        asyncio.run(run(config))
    except ChangebusError as exc:
        print(f"changebus bootstrap: {exc.message}")
        return 2
    return 0
