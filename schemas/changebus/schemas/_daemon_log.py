"""Where a daemon's fatal errors go: its log on stderr, never stdout.

A daemon's log lines go to stderr (:func:`~._logsetup.setup_logging`, one
JSON object per line with ``log_format = "json"``); its fatal errors are log
lines too (:func:`log_fatal`), so a log collector reading the stream sees
them with the rest, in the same format. stdout is only for what a command
was asked to print (``--check``'s ``config OK`` and summary).

A config that does not load has no ``log_format`` to obey:
:func:`early_log_format` reads what it asked for as far as it can --
``--log-format``, the last ``--set log_format=...``, the environment
variable, the file's top-level ``log_format`` (in that priority) -- and
falls back to ``text``.

Before a daemon has configured logging for good (a config that does not
load, a ``--check`` that fails), :func:`log_fatal` configures it for the
one line and restores the previous root handlers and level afterwards: the
process is about to exit, but ``main()`` is also called in-process (tests,
tools), whose logging must not keep a handler on a stream it does not own.
"""

from __future__ import annotations

import argparse
import logging
import os
import tomllib
from collections.abc import Sequence

from ._config_env import parse_text
from ._logsetup import setup_logging

__all__ = ["early_log_format", "log_fatal"]

_FORMATS = ("text", "json")


def _format(value: object) -> str | None:
    return value if isinstance(value, str) and value in _FORMATS else None


def early_log_format(args: argparse.Namespace, env_prefix: str) -> str:
    """The log format a config that did not load asked for (module docstring)."""
    if _format(getattr(args, "log_format", None)):
        return str(args.log_format)
    for item in reversed(getattr(args, "overrides", [])):
        key, sep, text = item.partition("=")
        if sep and key.strip() == "log_format":
            return _format(parse_text(text.strip())) or "text"
    for name, text in os.environ.items():
        if name.upper() == f"{env_prefix}LOG_FORMAT".upper():
            return _format(parse_text(text)) or "text"
    path = getattr(args, "config", None)
    if path is not None:
        try:
            with open(path, "rb") as fh:
                return _format(tomllib.load(fh).get("log_format")) or "text"
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            pass
    return "text"


def log_fatal(
    logger: logging.Logger,
    message: str,
    *,
    configure: tuple[str, str] | None = None,
    secrets: Sequence[str] = (),
    exc: BaseException | None = None,
) -> None:
    """Log ``message`` as an error on ``logger`` (with ``exc``'s traceback, if given).

    ``configure=(level, format)``: logging is not configured yet; set it up
    for this line (``secrets`` scrubbed) and restore it afterwards.
    """
    if configure is None:
        logger.error("%s", message, exc_info=exc)
        return
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    setup_logging(configure[0], configure[1], secrets)
    try:
        logger.error("%s", message, exc_info=exc)
    finally:
        for handler in root.handlers:
            handler.flush()
        root.handlers[:] = handlers
        root.setLevel(level)
