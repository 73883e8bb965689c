"""Logging set-up for the command line (libraries never configure logging).

``setup_logging("info", "json")`` writes one JSON object per record to stderr
(time, level, logger, message, and exception text when present); ``"text"``
writes a plain line. Only ``changebus`` subcommands call this. ``secrets``
(the daemon's config values: :func:`changebus.schemas.config.secret_values`)
are scrubbed from every formatted line, tracebacks included: a last guard
behind the components, which scrub their own error texts.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence

from ._redact import scrub

__all__ = ["setup_logging"]


class _TextFormatter(logging.Formatter):
    def __init__(self, secrets: Sequence[str]) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.secrets = tuple(secrets)

    def format(self, record: logging.LogRecord) -> str:
        return scrub(super().format(record), self.secrets)


class _JsonFormatter(logging.Formatter):
    def __init__(self, secrets: Sequence[str]) -> None:
        super().__init__()
        self.secrets = tuple(secrets)

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": scrub(record.getMessage(), self.secrets),
        }
        if record.exc_info:
            entry["exception"] = scrub(self.formatException(record.exc_info), self.secrets)
        return json.dumps(entry, default=str)


def setup_logging(level: str = "info", fmt: str = "text", secrets: Sequence[str] = ()) -> None:
    """Configure the root logger for a changebus command (``secrets`` never printed)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter(secrets))
    else:
        handler.setFormatter(_TextFormatter(secrets))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
