"""The ``changebus`` console command: one entry point, one subcommand per component.

Each component contributes its subcommand from a module of its own slice that
defines ``register(subparsers)``; the table below names those modules so that
an uninstalled checkout (plain ``python -m changebus.schemas``) still finds
them. Modules are imported lazily, only when present, so a slice whose extra is
not installed does not break ``changebus --help``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Protocol

from ._version import __version__

__all__ = ["build_parser", "main"]

# subcommand provider modules, in the order they appear in --help
_PROVIDERS: tuple[str, ...] = (
    "changebus.relay._cli",
    "changebus.bootstrap._cli",
    "changebus.client._cli",
    "changebus.fetchers._cli",
    "changebus.schemas._cli_schemas",
)


class _Provider(Protocol):
    def register(self, subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None: ...


def build_parser() -> argparse.ArgumentParser:
    """Build the full argument parser, asking each present slice for its subcommands."""
    parser = argparse.ArgumentParser(
        prog="changebus",
        description="changebus: change data capture from Postgres and MySQL/MariaDB, "
        "served by a relay and a bootstrap server to consumers and Spark.",
    )
    parser.add_argument("--version", action="version", version=f"changebus {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _PROVIDERS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and name.startswith(exc.name):
                continue  # the slice does not provide a CLI (yet)
            raise
        provider: _Provider = module
        provider.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``changebus`` command; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    result = func(args)
    return int(result or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
