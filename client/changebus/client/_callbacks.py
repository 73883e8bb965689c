"""The callback API (after Databus' ``DatabusStreamConsumer``).

For each window the consumer calls, in this order::

    on_start_window(window)
        on_control(window, schema_change_or_message)   # per control signal
        on_data_loss(window, loss)                     # if the stream says so
        on_start_source(window, table)                 # per run of one table's events
            on_event(event) ...
        on_end_source(window, table)
        ...
    on_end_window(window)
    on_checkpoint(checkpoint)      # every ``checkpoint_every_windows`` windows

Windows with nothing in them get no callbacks except ``on_checkpoint``.

Every callback returns a :class:`CallbackResult` (``None`` means
``SUCCESS``). ``ERROR`` -- or an exception, or a call that takes longer
than ``callback_time_budget_s`` -- is recoverable: the consumer calls
``on_rollback(checkpoint)`` with the last persisted checkpoint and replays
every window after it. ``FATAL`` stops consumption: ``on_error`` is called
and :meth:`Consumer.run` raises :class:`ConsumerAbortedError` (or
:class:`DataLossDetectedError` from ``on_data_loss``, whose default is
``FATAL``: a gap is never silent). ``on_checkpoint`` may return
``SKIP_CHECKPOINT`` to keep the windows for a later checkpoint.

Two base classes, the same methods:

* :class:`Callbacks` -- plain methods, called one after another in **one
  worker thread** (they may block: database writes, HTTP calls); a call over
  its time budget is abandoned (a thread cannot be interrupted: the next
  call waits for it to return).
* :class:`AsyncCallbacks` -- ``async`` methods, awaited on the consumer's
  event loop (they must not block it); a call over budget is cancelled.
"""

from __future__ import annotations

import enum

from changebus.schemas import Checkpoint, DataLoss, LogicalMessage, SchemaChange

from ._model import ChangeEvent, Window

__all__ = ["AsyncCallbacks", "CallbackResult", "Callbacks", "ControlSignal"]

ControlSignal = SchemaChange | LogicalMessage


class CallbackResult(enum.Enum):
    """What a callback reports (Databus' ``ConsumerCallbackResult``)."""

    #: processed; go on
    SUCCESS = "success"
    #: (``on_checkpoint`` only) processed, but do not persist a checkpoint yet
    SKIP_CHECKPOINT = "skip_checkpoint"
    #: recoverable: roll back to the last checkpoint and replay
    ERROR = "error"
    #: unrecoverable: stop consuming
    FATAL = "fatal"


Result = CallbackResult | None


class Callbacks:
    """Blocking callbacks, run in a worker thread (see the module docstring).

    Override what you need; every default returns ``SUCCESS`` except
    :meth:`on_data_loss` (``FATAL``).
    """

    def on_start_window(self, window: Window) -> Result:
        """A window (one source transaction) begins."""
        return None

    def on_start_source(self, window: Window, table: str) -> Result:
        """A run of events of ``table`` begins."""
        return None

    def on_event(self, event: ChangeEvent) -> Result:
        """One row change."""
        return None

    def on_end_source(self, window: Window, table: str) -> Result:
        """The run of events of ``table`` ended."""
        return None

    def on_end_window(self, window: Window) -> Result:
        """The window ended: its changes form a consistent state of the source."""
        return None

    def on_control(self, window: Window, control: ControlSignal) -> Result:
        """A schema change or a logical message in the window."""
        return None

    def on_data_loss(self, window: Window, loss: DataLoss) -> Result:
        """The stream says SCNs were lost; ``SUCCESS`` accepts the gap."""
        return CallbackResult.FATAL

    def on_checkpoint(self, checkpoint: Checkpoint) -> Result:
        """The consumer is about to persist ``checkpoint``."""
        return None

    def on_rollback(self, checkpoint: Checkpoint) -> Result:
        """Undo everything after ``checkpoint``; its windows come again."""
        return None

    def on_error(self, error: BaseException) -> None:
        """Consumption stops because of ``error`` (raised by ``run`` next)."""
        return None


class AsyncCallbacks:
    """Async callbacks, awaited on the event loop (see the module docstring)."""

    async def on_start_window(self, window: Window) -> Result:
        """A window (one source transaction) begins."""
        return None

    async def on_start_source(self, window: Window, table: str) -> Result:
        """A run of events of ``table`` begins."""
        return None

    async def on_event(self, event: ChangeEvent) -> Result:
        """One row change."""
        return None

    async def on_end_source(self, window: Window, table: str) -> Result:
        """The run of events of ``table`` ended."""
        return None

    async def on_end_window(self, window: Window) -> Result:
        """The window ended: its changes form a consistent state of the source."""
        return None

    async def on_control(self, window: Window, control: ControlSignal) -> Result:
        """A schema change or a logical message in the window."""
        return None

    async def on_data_loss(self, window: Window, loss: DataLoss) -> Result:
        """The stream says SCNs were lost; ``SUCCESS`` accepts the gap."""
        return CallbackResult.FATAL

    async def on_checkpoint(self, checkpoint: Checkpoint) -> Result:
        """The consumer is about to persist ``checkpoint``."""
        return None

    async def on_rollback(self, checkpoint: Checkpoint) -> Result:
        """Undo everything after ``checkpoint``; its windows come again."""
        return None

    async def on_error(self, error: BaseException) -> None:
        """Consumption stops because of ``error`` (raised by ``run`` next)."""
        return None
