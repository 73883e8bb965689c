"""Drives the callbacks: windows in, rollback and replay on recoverable errors.

State kept by :class:`Dispatcher`:

* ``replay`` -- the windows after the last persisted checkpoint, in order.
  They stay in memory until a checkpoint succeeds, so a rollback replays
  them without asking the relay again (as Databus keeps them in its client
  buffer). With ``checkpoint_every_windows = 1`` that is one window.
  A replayed window is first offered to ``readmit`` when one is given (a
  consumer group: the member must still hold its unit and its lease; a
  process frozen past its session must not deliver it again on waking).
* the :class:`~._position.PositionTracker` -- ``current`` advances after
  each window's ``on_end_window``; a rollback resets it to ``committed``.
* ``rollbacks`` -- consecutive rollbacks since the last successful
  checkpoint; over ``max_rollbacks`` the dispatcher gives up.

The callback sequence of a window is a *plan* (a list of method names and
arguments, :func:`window_plan`); a :class:`_Runner` executes plans for sync
:class:`~._callbacks.Callbacks` (one worker thread, one hop per window) or
:class:`~._callbacks.AsyncCallbacks` (on the loop), enforcing the time
budget of each call.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

from ._callbacks import AsyncCallbacks, CallbackResult, Callbacks
from ._config import ConsumerConfig
from ._errors import ConsumerAbortedError, DataLossDetectedError
from ._model import Window
from ._position import Positions
from ._queue import QueueClosed

__all__ = ["Dispatcher", "in_async_callback", "in_callback", "window_plan"]

log = logging.getLogger(__name__)

#: ``active`` is True in a callback thread while it runs a plan (:func:`in_callback`)
_CALLBACK = threading.local()


def in_callback() -> bool:
    """Whether this thread is running a consumer's sync callback now."""
    return bool(getattr(_CALLBACK, "active", False))


class _Plan:
    """A plan of async callbacks under way (``active`` until it ends); see
    :func:`in_async_callback`."""

    __slots__ = ("active",)

    def __init__(self) -> None:
        self.active = True


#: the plan of async callbacks the current task runs in, or was made in (a task a
#: callback created inherits it, and with it the plan's ``active`` flag)
_PLAN: contextvars.ContextVar[_Plan | None] = contextvars.ContextVar("changebus_plan", default=None)


def in_async_callback() -> bool:
    """Whether the current task runs inside a plan of async callbacks that is still under
    way: a callback itself, or a task it made (and maybe awaits). A task a callback made
    and left running (a detached shutdown, say) is in none once that window's callbacks
    ended."""
    plan = _PLAN.get()
    return plan is not None and plan.active


Plan = list[tuple[str, tuple[Any, ...]]]


def window_plan(window: Window) -> Plan:
    """The callbacks of one window, in order (see :mod:`._callbacks`)."""
    plan: Plan = [("on_start_window", (window,))]
    plan.extend(("on_control", (window, c)) for c in window.schema_changes)
    plan.extend(("on_control", (window, m)) for m in window.messages)
    if window.data_loss is not None:
        plan.append(("on_data_loss", (window, window.data_loss)))
    current: str | None = None
    for event in window.events:
        if event.table != current:
            if current is not None:
                plan.append(("on_end_source", (window, current)))
            current = event.table
            plan.append(("on_start_source", (window, current)))
        plan.append(("on_event", (event,)))
    if current is not None:
        plan.append(("on_end_source", (window, current)))
    plan.append(("on_end_window", (window,)))
    return plan


@dataclass(frozen=True, slots=True)
class _Outcome:
    """How a plan went: the worst result, the callback that gave it, and why."""

    result: CallbackResult
    callback: str = ""
    error: BaseException | None = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.result in (CallbackResult.SUCCESS, CallbackResult.SKIP_CHECKPOINT)


_OK = _Outcome(CallbackResult.SUCCESS)


class _Runner(Protocol):
    async def run(self, plan: Plan) -> _Outcome: ...

    async def close(self) -> None: ...

    @property
    def calls(self) -> int: ...


def _result(value: object, name: str) -> _Outcome:
    if value is None or value is CallbackResult.SUCCESS:
        return _OK
    if isinstance(value, CallbackResult):
        return _Outcome(value, name)
    return _Outcome(
        CallbackResult.ERROR, name, TypeError(f"{name} returned {value!r}, not a CallbackResult")
    )


class _CallState:
    """The call in progress of one plan: ``(name, monotonic start)``, or, between
    calls, ``("", when the last one ended)`` (the plan's submission at first).

    Written by the worker thread, read by the loop; a tuple swap is atomic.
    """

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current: tuple[str, float] = ("", time.monotonic())


class _ThreadRunner:
    """Runs plans of sync callbacks in one worker thread (module docstring).

    A call past its budget is abandoned, not interrupted (threads cannot be):
    the worker finishes it before it takes another plan. The next plan first
    waits up to one budget for that (``_stuck``); a call that never returns
    thus times out every plan after it, each within one budget, and the
    dispatcher's rollback limit ends the consumer instead of queueing plans
    behind it for ever.
    """

    def __init__(self, callbacks: Callbacks, budget_s: float) -> None:
        self._cb = callbacks
        self._budget = budget_s
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="changebus-callbacks")
        #: the plan of an abandoned call the worker is still in, and that call's name
        self._stuck: tuple[asyncio.Future[_Outcome], str] | None = None
        #: callbacks started so far (the worker thread counts; others only read it)
        self.calls = 0

    def _run_plan(self, plan: Plan, abandon: threading.Event, state: _CallState) -> _Outcome:
        _CALLBACK.active = True
        try:
            return self._run_calls(plan, abandon, state)
        finally:
            _CALLBACK.active = False

    def _run_calls(self, plan: Plan, abandon: threading.Event, state: _CallState) -> _Outcome:
        last = CallbackResult.SUCCESS
        for name, args in plan:
            if abandon.is_set():
                return _Outcome(CallbackResult.ERROR, name, timed_out=True)
            started = time.monotonic()
            state.current = (name, started)
            self.calls += 1
            try:
                value = getattr(self._cb, name)(*args)
            except Exception as exc:  # noqa: BLE001 - a failed callback is a recoverable error
                return _Outcome(CallbackResult.ERROR, name, exc)
            except BaseException as exc:  # noqa: BLE001 - SystemExit, KeyboardInterrupt: stop
                return _Outcome(CallbackResult.FATAL, name, exc)
            finally:
                state.current = ("", time.monotonic())
            if time.monotonic() - started > self._budget:
                return _Outcome(CallbackResult.ERROR, name, timed_out=True)
            outcome = _result(value, name)
            if not outcome.ok:
                return outcome
            last = outcome.result
        return _Outcome(last) if last is not CallbackResult.SUCCESS else _OK

    async def run(self, plan: Plan) -> _Outcome:
        if self._stuck is not None:
            future, name = self._stuck
            done, _ = await asyncio.wait({future}, timeout=self._budget)
            if not done:
                return _Outcome(CallbackResult.ERROR, name, timed_out=True)
            self._stuck = None
        loop = asyncio.get_running_loop()
        abandon = threading.Event()
        state = _CallState()
        future = loop.run_in_executor(self._executor, self._run_plan, plan, abandon, state)
        try:
            while True:
                name, since = state.current
                left = since + self._budget - time.monotonic()
                if left <= 0:
                    abandon.set()  # the worker stops after the call it is stuck in
                    self._stuck = (future, name)
                    return _Outcome(CallbackResult.ERROR, name, timed_out=True)
                done, _ = await asyncio.wait({future}, timeout=left)
                if done:
                    return future.result()
        except asyncio.CancelledError:
            abandon.set()
            name, _since = state.current
            if not future.done():
                # cancelled (a shutdown, a wait_for): the call still running is not waited
                # for, within its budget or not; close() waited for a call blocked on I/O
                # for ever before, and the cancellation with it (review)
                self._stuck = (future, name)
            raise

    async def close(self) -> None:
        if self._stuck is not None and not self._stuck[0].done():
            # a callback that overran its budget, or whose run was cancelled, is still
            # running: do not wait for it
            log.warning("callback %s is still running; not waiting for it", self._stuck[1])
            self._executor.shutdown(wait=False, cancel_futures=True)
            return
        await asyncio.to_thread(self._executor.shutdown, True)


class _LoopRunner:
    """Awaits plans of async callbacks on the loop, each call within its budget.

    One :func:`asyncio.timeout` scope per plan and one timer, armed lazily
    (:class:`_Budget`): an ``asyncio.timeout`` per call cost a timer handle
    made and cancelled for every event, most of a small window's dispatch.
    Callbacks the application left as :class:`AsyncCallbacks` has them (which
    do nothing and return None, i.e. success) are not called at all.
    """

    def __init__(self, callbacks: AsyncCallbacks, budget_s: float) -> None:
        self._cb = callbacks
        self._budget = budget_s
        self._skip = _inherited_noops(callbacks)
        #: callbacks started so far
        self.calls = 0

    async def run(self, plan: Plan) -> _Outcome:
        loop = asyncio.get_running_loop()
        last = CallbackResult.SUCCESS
        budget = _Budget(loop, self._budget)
        skip = self._skip
        plan_now = _Plan()
        token = _PLAN.set(plan_now)
        try:
            async with asyncio.timeout(None) as scope:
                budget.scope = scope
                for name, args in plan:
                    if name in skip:
                        continue
                    budget.start(name)
                    self.calls += 1
                    try:
                        value = await getattr(self._cb, name)(*args)
                    except Exception as exc:  # noqa: BLE001 - a failed callback is recoverable
                        return _Outcome(CallbackResult.ERROR, name, exc)
                    except (SystemExit, KeyboardInterrupt) as exc:
                        # (not out of the loop's thread: the sync wrapper would wait for ever)
                        return _Outcome(CallbackResult.FATAL, name, exc)
                    outcome = _result(value, name)
                    if not outcome.ok:
                        return outcome
                    last = outcome.result
        except TimeoutError:  # only the scope's expiry gets here (a callback's own is caught)
            return _Outcome(CallbackResult.ERROR, budget.name, timed_out=True)
        finally:
            plan_now.active = False
            _PLAN.reset(token)
            budget.stop()
        return _Outcome(last) if last is not CallbackResult.SUCCESS else _OK

    async def close(self) -> None:
        return None


def _inherited_noops(callbacks: Callbacks | AsyncCallbacks) -> frozenset[str]:
    """The callbacks of ``callbacks`` that are its base class's own no-ops
    (:class:`AsyncCallbacks` or :class:`Callbacks`).

    A method set on the instance, or overridden anywhere in its class's MRO,
    counts as the application's; ``on_data_loss`` (FATAL by default) is
    always called.
    """
    own = vars(callbacks) if hasattr(callbacks, "__dict__") else {}
    names = (
        "on_start_window",
        "on_start_source",
        "on_event",
        "on_end_source",
        "on_end_window",
        "on_control",
        "on_checkpoint",
        "on_rollback",
    )
    base: type[Callbacks | AsyncCallbacks] = (
        AsyncCallbacks if isinstance(callbacks, AsyncCallbacks) else Callbacks
    )
    return frozenset(
        name
        for name in names
        if name not in own and getattr(type(callbacks), name) is getattr(base, name)
    )


class _Budget:
    """The time budget of the call in progress of one plan, with one lazy timer.

    :meth:`start` notes the call's name and start; the timer, armed at the
    first call's deadline, checks when it fires whether the call then in
    progress has used its budget: if so it expires ``scope`` (the task is
    cancelled and the scope raises :class:`TimeoutError`), else it re-arms
    for that call's deadline. So a plan of many quick calls costs one timer,
    not one per call. Event loop only.
    """

    __slots__ = ("_budget", "_handle", "_loop", "_started", "name", "scope")

    def __init__(self, loop: asyncio.AbstractEventLoop, budget_s: float) -> None:
        self._loop = loop
        self._budget = budget_s
        self._handle: asyncio.TimerHandle | None = None
        self._started = 0.0
        self.name = ""
        self.scope: asyncio.Timeout | None = None

    def start(self, name: str) -> None:
        self.name = name
        self._started = self._loop.time()
        if self._handle is None:
            self._handle = self._loop.call_at(self._started + self._budget, self._check)

    def _check(self) -> None:
        due = self._started + self._budget
        if self._loop.time() < due:
            self._handle = self._loop.call_at(due, self._check)
            return
        self._handle = None
        if self.scope is not None:
            self.scope.reschedule(self._loop.time())

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def _describe(outcome: _Outcome) -> str:
    if outcome.timed_out:
        return f"{outcome.callback} exceeded its time budget"
    if outcome.error is not None:
        return f"{outcome.callback} raised {outcome.error!r}"
    return f"{outcome.callback} returned {outcome.result.name}"


class Dispatcher:
    """Feeds windows to callbacks with rollback and replay (module docstring)."""

    @property
    def calls(self) -> int:
        """Callbacks started so far (progress, for a close waiting on the run)."""
        return self._runner.calls

    def __init__(
        self,
        callbacks: Callbacks | AsyncCallbacks,
        config: ConsumerConfig,
        position: Positions,
        next_window: Callable[[], Awaitable[Window]],
        readmit: Callable[[Window], Awaitable[bool]] | None = None,
    ) -> None:
        budget = config.callback_time_budget_s
        self._runner: _Runner = (
            _LoopRunner(callbacks, budget)
            if isinstance(callbacks, AsyncCallbacks)
            else _ThreadRunner(callbacks, budget)
        )
        self._config = config
        self._position = position
        #: ``on_checkpoint`` left as the base class has it: no checkpoint is built for it
        #: (a consumer group's is every unit's position, rebuilt at each checkpoint)
        self._checkpoint_unwatched = "on_checkpoint" in _inherited_noops(callbacks)
        self._next_window = next_window
        self._readmit = readmit
        self.replay: list[Window] = []
        self._replay_count = self._replay_bytes = 0  # (see _replay_size)
        self._max_replay = config.max_replay_bytes or 2 * config.max_window_bytes
        self.rollbacks = 0
        self.total_rollbacks = 0
        self.windows = 0

    async def run(self) -> None:
        """Process windows until ``next_window`` raises (closing or a fetch error)."""
        try:
            while True:
                try:
                    window = await self._next_window()
                except QueueClosed:
                    await self._last_checkpoint()
                    raise
                except (ConsumerAbortedError, DataLossDetectedError):
                    raise
                except Exception as exc:
                    await self._last_checkpoint()
                    await self._report(exc)
                    raise
                self.replay.append(window)
                replay_bytes = self._replay_size()
                if replay_bytes > self._max_replay:
                    await self._abort(
                        _Outcome(CallbackResult.ERROR, "on_checkpoint"),
                        window,
                        f"the {len(self.replay)} windows since the last stored checkpoint hold"
                        f" {replay_bytes} bytes, past max_replay_bytes ({self._max_replay}):"
                        " they are kept for a replay until a checkpoint is stored"
                        " (on_checkpoint returned SKIP_CHECKPOINT for too long, or"
                        " checkpoint_every_windows is too high for these windows)",
                    )
                await self._process()
        finally:
            await self._runner.close()

    async def call(self, name: str, *args: Any) -> None:
        """Call callback ``name`` between windows (a consumer group's rebalance callbacks).

        It runs where the window callbacks run (the worker thread of sync
        callbacks), within the time budget; a failure is logged, not raised.
        """
        outcome = await self._runner.run([(name, args)])
        if not outcome.ok:
            log.error("%s", _describe(outcome))

    def _replay_size(self) -> int:
        """Bytes of the windows in ``replay``, after one was appended.

        Kept as a running sum; recounted whenever ``replay`` changed in
        another way since (a checkpoint cleared it, a group purged windows).
        """
        n = len(self.replay)
        if n == self._replay_count + 1:
            self._replay_bytes += self.replay[-1].nbytes
        else:
            self._replay_bytes = sum(w.nbytes for w in self.replay)
        self._replay_count = n
        return self._replay_bytes

    async def _process(self) -> None:
        """Run the newest window of ``replay``; after a rollback, every window kept, again.

        A replayed window may leave ``replay`` meanwhile (a consumer group
        purges the windows of units it lost, also while ``readmit`` waits):
        the pass goes over a copy and skips what is no longer kept.
        """
        pending = deque(self.replay[-1:])
        replaying = False
        while pending:
            window = pending.popleft()
            if replaying:
                if not any(w is window for w in self.replay):
                    continue
                if self._readmit is not None and not await self._readmit(window):
                    self.replay[:] = [w for w in self.replay if w is not window]
                    continue
            outcome = _OK if window.is_empty else await self._runner.run(window_plan(window))
            if outcome.ok and not self._kept(window):
                # purged while its callbacks ran (a consumer group lost its unit): its
                # position belongs to a claim that is gone, maybe already replaced by a
                # new claim of the same unit, which it must not move (review)
                continue
            if outcome.ok:
                self._position.advance(window)
                self.windows += 1
                if pending or len(self.replay) < self._config.checkpoint_every_windows:
                    continue
                outcome = await self._checkpoint()
                if outcome.ok:
                    continue
            if outcome.result is CallbackResult.FATAL:
                await self._abort(outcome, window)
            await self._rollback(outcome, window)
            pending = deque(self.replay)
            replaying = True

    def _kept(self, window: Window) -> bool:
        """``window`` is still in ``replay`` (the newest one, but for a purge)."""
        replay = self.replay
        return (bool(replay) and replay[-1] is window) or any(w is window for w in replay)

    async def _last_checkpoint(self) -> None:
        """The stream ended (``stop()``, a bounded read's end, a fetch error): store the
        position of the windows processed since the last checkpoint, which are all
        whole (up to ``checkpoint_every_windows - 1`` of them were replayed by the next
        run, a bounded read's tail included: review)."""
        if not self.replay:
            return
        outcome = await self._checkpoint()
        if not outcome.ok:
            log.warning("the last checkpoint was not stored: %s", _describe(outcome))

    async def _checkpoint(self) -> _Outcome:
        outcome = _OK
        if not self._checkpoint_unwatched:
            checkpoint = self._position.current
            outcome = await self._runner.run([("on_checkpoint", (checkpoint,))])
            if not outcome.ok or outcome.result is CallbackResult.SKIP_CHECKPOINT:
                return outcome
        try:
            await self._position.persist()
        except Exception as exc:  # noqa: BLE001 - a failed store is recoverable: replay, store again
            return _Outcome(CallbackResult.ERROR, "persister.store", exc)
        self.replay.clear()
        self.rollbacks = 0
        return outcome

    async def _rollback(self, outcome: _Outcome, window: Window) -> None:
        """Count a recoverable failure, tell the application, wait a little."""
        while True:
            self.rollbacks += 1
            self.total_rollbacks += 1
            limit = self._config.max_rollbacks
            if 0 <= limit < self.rollbacks:
                await self._abort(
                    outcome, window, f"gave up after {limit} rollbacks; last: {_describe(outcome)}"
                )
            log.warning(
                "window %d: %s; rolling back to the last checkpoint (rollback %d)",
                window.scn,
                _describe(outcome),
                self.rollbacks,
            )
            self._position.rollback()
            delay = min(
                self._config.rollback_backoff_s * 2 ** min(self.rollbacks - 1, 30),
                self._config.backoff_max_s,
            )
            if delay > 0:
                await asyncio.sleep(delay)
            rolled = await self._runner.run([("on_rollback", (self._position.committed,))])
            if rolled.ok:
                return
            if rolled.result is CallbackResult.FATAL:
                await self._abort(rolled, window)
            outcome = rolled

    async def _abort(self, outcome: _Outcome, window: Window, message: str = "") -> NoReturn:
        error: Exception
        if outcome.callback == "on_data_loss" and window.data_loss is not None and not message:
            error = DataLossDetectedError.reported_in(window)
        else:
            error = ConsumerAbortedError(
                message or f"window {window.scn}: {_describe(outcome)}; consumption stops",
                callback=outcome.callback,
                scn=window.scn,
            )
            error.__cause__ = outcome.error
        await self._report(error)
        raise error

    async def _report(self, error: BaseException) -> None:
        """``on_error``; its own failure is logged, never raised."""
        outcome = await self._runner.run([("on_error", (error,))])
        if outcome.error is not None:
            log.error("on_error raised %r while reporting %r", outcome.error, error)
