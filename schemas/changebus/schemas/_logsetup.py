"""Logging set-up for the command line (libraries never configure logging).

``setup_logging("info", "json")`` writes one JSON object per record to stderr
(time, level, logger, message, and exception text when present); ``"text"``
writes a plain line. Only ``changebus`` subcommands call this.
"""

from __future__ import annotations

import json
import logging
import sys
import time

__all__ = ["setup_logging"]


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    """Configure the root logger for a changebus command."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
