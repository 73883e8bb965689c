"""The ``changebus check-source`` subcommand: a preflight of a Postgres or MariaDB source.

(Work in progress for issue 21: the checks themselves land next.)
"""

from __future__ import annotations

import argparse

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``check-source`` subcommand."""
    p = sub.add_parser(
        "check-source",
        help="check that a Postgres or MariaDB source is ready for changebus",
        description="Check that a Postgres or MariaDB source is ready for changebus.",
    )

    def run(_args: argparse.Namespace) -> int:
        print("changebus check-source: not available yet")
        return 2

    p.set_defaults(func=run)
