"""Command-line support shared by the slices' ``changebus`` subcommands.

The public face of the logging set-up (:func:`setup_logging`: text or JSON
lines on stderr), which only command-line entry points call -- libraries
never configure logging; and :func:`command_group`, a command that only
groups subcommands.
"""

from ._cligroup import command_group as command_group
from ._logsetup import setup_logging as setup_logging

__all__ = ["command_group", "setup_logging"]
