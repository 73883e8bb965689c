"""The log of aiohttp's connection handler, as the server frame wants it.

aiohttp answers a request it cannot parse (a garbage request line, a header
without a colon, a line over 8,190 bytes, a bad ``Content-Length`` or chunk)
with ``400`` and logs it through its ``aiohttp.server`` logger at ERROR *with a
traceback*, one per request: anyone who can reach the port fills the log
with stack traces of their own mistakes (found by ``bench/fuzz_http.py``).
Such a request is the client's error, answered and done: :class:`ProtocolLog`
turns it into one DEBUG line naming the client and the kind of error (not
the bytes it sent: a malformed ``Authorization`` header must not reach the
log). The same for a client that went away before its answer could be
written (a ``ConnectionError`` in aiohttp's own code, e.g. the ``100
Continue`` of a request with ``Expect: 100-continue`` whose client already
closed): nobody is left to answer, and nothing is wrong with the server.
Every other record passes unchanged (an exception in aiohttp itself still
logs its traceback).

Thread-safety: a logger adapter holds no state of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from aiohttp.http_exceptions import HttpProcessingError

if TYPE_CHECKING:
    from logging import _ExcInfoType

__all__ = ["ProtocolLog", "protocol_log"]


class ProtocolLog(logging.LoggerAdapter[logging.Logger]):
    """``aiohttp.server`` with malformed requests and gone clients at DEBUG, no traceback."""

    def exception(
        self,
        msg: object,
        *args: object,
        exc_info: _ExcInfoType = True,
        stack_info: bool = False,
        stacklevel: int = 1,
        extra: Mapping[str, object] | None = None,
        **kwargs: object,
    ) -> None:
        # aiohttp: "Error handling request from %s", remote
        remote = args[0] if args else "?"
        if isinstance(exc_info, HttpProcessingError):
            self.logger.debug(
                "malformed request from %s answered %s (%s)",
                remote,
                exc_info.code,
                type(exc_info).__name__,
            )
            return
        if isinstance(exc_info, ConnectionError):
            self.logger.debug(
                "the client %s went away before its answer (%s)", remote, type(exc_info).__name__
            )
            return
        self.logger.exception(
            msg,
            *args,
            exc_info=exc_info,
            stack_info=stack_info,
            stacklevel=stacklevel,
            extra=extra,
        )


def protocol_log() -> ProtocolLog:
    """The adapter of aiohttp's own ``aiohttp.server`` logger (``web.AppRunner(logger=...)``)."""
    return ProtocolLog(logging.getLogger("aiohttp.server"), {})
