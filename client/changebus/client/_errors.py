"""The consumer's exceptions, all inside the :mod:`changebus.schemas.errors` tree.

Tree (client additions marked ``+``)::

    ChangebusError
    +-- ScnNotFoundError
    |   +-- FellOffRelayError +          every relay answered 410 scn_not_found
    +-- DataLossError
    |   +-- DataLossDetectedError +      the stream carried a DATA_LOSS window
    +-- TransportError
    |   +-- RelayUnavailableError +      retries exhausted, no relay (or bootstrap
    |                                    server) answered
    +-- ConsumerAbortedError +           a callback reported an unrecoverable error,
                                         or rollbacks of a window were exhausted

Each carries the figures a caller needs to decide what to do next as plain
attributes (and in ``details``, so :meth:`~ChangebusError.to_json` shows them).
None of them holds references to live objects; all pickle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Self

from changebus.schemas import (
    ChangebusError,
    DataLossError,
    ScnNotFoundError,
    TransportError,
)

if TYPE_CHECKING:
    from ._model import Window

__all__ = [
    "ConsumerAbortedError",
    "DataLossDetectedError",
    "FellOffRelayError",
    "RelayUnavailableError",
]


class FellOffRelayError(ScnNotFoundError):
    """The consumer's position is older than what every relay keeps (HTTP 410).

    ``oldest_scn`` is the oldest window a relay still has and ``prev_scn`` the
    newest one it evicted (``prev_position``: the source position at that
    window's end, "" when the relay did not say); ``requested_scn`` is where
    the consumer asked to continue. The consumer must catch up from a
    bootstrap server, or restart from ``prev_scn`` if the application accepts
    the gap.
    """

    def __init__(
        self,
        message: str,
        *,
        partition: str,
        requested_scn: int,
        oldest_scn: int,
        prev_scn: int,
        relay: str,
        retriable: bool | None = None,
        prev_position: str = "",
    ) -> None:
        super().__init__(
            message,
            retriable=retriable,
            partition=partition,
            requested_scn=requested_scn,
            oldest_scn=oldest_scn,
            prev_scn=prev_scn,
            relay=relay,
            prev_position=prev_position,
        )
        self.partition = partition
        self.requested_scn = requested_scn
        self.oldest_scn = oldest_scn
        self.prev_scn = prev_scn
        self.prev_position = prev_position
        self.relay = relay


class DataLossDetectedError(DataLossError):
    """The stream says SCNs ``from_scn..to_scn`` (inclusive) are lost.

    Raised (never skipped silently) when a DATA_LOSS control event arrives and
    the application did not ask to receive data loss as a window signal
    (``ConsumerConfig.on_data_loss = "deliver"``) or, with callbacks, did not
    accept it in :meth:`Callbacks.on_data_loss`. ``window_scn`` is the window
    that carried the signal; the checkpoint stays before it.
    """

    def __init__(
        self,
        message: str,
        *,
        from_scn: int,
        to_scn: int,
        reason: str,
        window_scn: int,
        retriable: bool | None = None,
    ) -> None:
        super().__init__(
            message,
            retriable=retriable,
            from_scn=from_scn,
            to_scn=to_scn,
            reason=reason,
            window_scn=window_scn,
        )
        self.from_scn = from_scn
        self.to_scn = to_scn
        self.reason = reason
        self.window_scn = window_scn

    @classmethod
    def reported_in(cls, window: Window, note: str = "") -> Self:
        """The error for the DATA_LOSS signal of ``window`` (which must carry one).

        The one place its message is written; ``note`` is appended (e.g. the
        option that made it an error).
        """
        loss = window.data_loss
        assert loss is not None, "the window carries no data loss signal"
        return cls(
            f"partition {window.partition}: SCNs {loss.from_scn}..{loss.to_scn} were lost"
            f" ({loss.reason}); reported in window {window.scn}{note}",
            from_scn=loss.from_scn,
            to_scn=loss.to_scn,
            reason=loss.reason,
            window_scn=window.scn,
        )


class RelayUnavailableError(TransportError):
    """No server answered usefully within ``max_attempts`` consecutive attempts.

    Raised by the one failover mechanism (:class:`~._failover.Failover`) for
    relays and bootstrap servers alike; the last failure is the ``__cause__``.
    """

    code = "relay_unavailable"


class ConsumerAbortedError(ChangebusError):
    """Consumption stopped for good: a callback failed unrecoverably.

    ``callback`` names the callback (``"on_event"``, ...) and ``scn`` the
    window being processed; the original exception, if any, is the
    ``__cause__``. The last persisted checkpoint is before ``scn``, so a
    restarted consumer replays that window.
    """

    code = "consumer_aborted"

    def __init__(
        self, message: str, *, callback: str, scn: int, retriable: bool | None = None
    ) -> None:
        super().__init__(message, retriable=retriable, callback=callback, scn=scn)
        self.callback = callback
        self.scn = scn
