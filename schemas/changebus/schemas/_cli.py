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
import os
import signal
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
    hangup = _HangupWhileLoading.install()
    parser = build_parser()
    args = parser.parse_args(argv)
    if hangup is not None and not getattr(args, "daemon", False):
        hangup.restore()
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    result = func(args)
    return int(result or 0)


class _HangupWhileLoading:
    """SIGHUP held back while the command's modules load (about two seconds).

    For a daemon (``args.daemon``, set by ``add_daemon_parser``) SIGHUP asks
    for a reload, so one that arrives while the daemon is still loading must
    not end it (the default action): :func:`~._daemon_cli.run_daemon` then
    ignores SIGHUP until :func:`~._server.serve` handles it, and there is
    nothing loaded yet to reload. Any other command gets the default back,
    and a hangup that came meanwhile is delivered again (a closed terminal
    still ends it).
    """

    def __init__(self) -> None:
        self.seen = False

    @classmethod
    def install(cls) -> _HangupWhileLoading | None:
        if signal.getsignal(signal.SIGHUP) is not signal.SIG_DFL:
            return None  # ignored already (nohup) or someone's handler: left as it is
        held = cls()
        try:
            signal.signal(signal.SIGHUP, held._record)
        except ValueError:  # not the main thread (main() called from a thread)
            return None
        return held

    def _record(self, _signum: int, _frame: object) -> None:
        self.seen = True

    def restore(self) -> None:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        if self.seen:
            os.kill(os.getpid(), signal.SIGHUP)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
