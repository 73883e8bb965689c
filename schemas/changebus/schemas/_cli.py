"""The ``changebus`` console command: one entry point, one subcommand per component.

Each slice contributes its subcommands through a ``register(subparsers)``
function of its own, declared in the entry-point group ``changebus.commands``
(see :mod:`changebus.schemas.plugins`: changebus declares ``relay``,
``bootstrap``, ``client`` and ``cluster`` in its pyproject.toml, which an uninstalled
checkout reads directly; a third-party distribution adds commands the same
way). Nothing above this slice is imported when this module is: providers are
imported while the parser is built, and one whose own module is absent (a
slice left out of a build) is skipped, so ``changebus --help`` still works.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Protocol

from ._version import __version__
from .plugins import Plugin, declared_plugins

__all__ = ["GROUP", "build_parser", "main", "providers"]

#: the entry-point group of subcommand providers
GROUP = "changebus.commands"


class _Register(Protocol):
    def __call__(self, subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None: ...


def providers() -> tuple[Plugin, ...]:
    """The declared subcommand providers, in ``--help`` order."""
    return declared_plugins(GROUP)


def build_parser() -> argparse.ArgumentParser:
    """Build the full argument parser, asking each declared provider for its subcommands."""
    parser = argparse.ArgumentParser(
        prog="changebus",
        description="changebus: change data capture from Postgres and MySQL/MariaDB, "
        "served by a relay and a bootstrap server to consumers and Spark.",
    )
    parser.add_argument("--version", action="version", version=f"changebus {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for plugin in providers():
        try:
            register: _Register = plugin.load()
        except ModuleNotFoundError as exc:
            if exc.name is not None and _is_prefix(exc.name, plugin.module):
                continue  # the provider's slice is not part of this installation
            raise
        register(sub)
    return parser


def _is_prefix(package: str, module: str) -> bool:
    return module == package or module.startswith(package + ".")


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
