"""A ``changebus`` command that only groups subcommands (``cluster``, ``group``, ``spark``).

:func:`command_group` adds the command and returns its subcommand action.
Given without a subcommand, the command prints its help and exits with
status 2, the same for every group.
"""

from __future__ import annotations

import argparse

__all__ = ["command_group"]


def command_group(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    *,
    help: str,
    description: str,
) -> argparse._SubParsersAction[argparse.ArgumentParser]:
    """Add command ``name`` to ``sub``; its subcommands go on the returned action."""
    parser = sub.add_parser(name, help=help, description=description)

    def usage(_args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=usage)
    return parser.add_subparsers(dest=f"{name}_command", metavar="SUBCOMMAND")
