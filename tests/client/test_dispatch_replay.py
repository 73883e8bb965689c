"""The dispatcher's replay after a rollback, and its ``readmit`` hook (consumer groups).

No server: windows are made here and fed to :class:`Dispatcher` directly.
A failed window makes the dispatcher replay every window kept since the last
checkpoint; with ``readmit`` each replayed window is offered again first (a
consumer group's fence), and a refused one is dropped from the replay for
good, also when it is purged from the list while ``readmit`` waits.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from changebus.client import AsyncCallbacks, CallbackResult, ConsumerConfig, Window
from changebus.client._dispatch import Dispatcher
from changebus.client._queue import QueueClosed
from changebus.schemas import Checkpoint, LogicalMessage


def _window(scn: int, unit: str) -> Window:
    message = LogicalMessage("t", str(scn).encode(), True)
    return Window(scn=scn, timestamp_ns=scn, partition="p", messages=(message,), unit=unit)


class _Positions:
    """Counts advances; checkpoints are kept in memory."""

    def __init__(self) -> None:
        self.current = Checkpoint()
        self.committed = Checkpoint()
        self.advanced: list[int] = []
        self.rollbacks = 0

    def advance(self, window: Window) -> None:
        self.advanced.append(window.scn)

    async def persist(self) -> None:
        return None

    def rollback(self) -> None:
        self.rollbacks += 1


class _FailOnce(AsyncCallbacks):
    """Records every window started; fails window ``fail_scn`` once, at its end."""

    def __init__(self, fail_scn: int) -> None:
        self.fail_scn = fail_scn
        self.started: list[int] = []

    async def on_start_window(self, window: Window) -> None:
        self.started.append(window.scn)

    async def on_end_window(self, window: Window) -> CallbackResult:
        if window.scn == self.fail_scn:
            self.fail_scn = -1
            return CallbackResult.ERROR
        return CallbackResult.SUCCESS


Readmit = Callable[[Window], Awaitable[bool]]


def _feeder(windows: list[Window]) -> Callable[[], Awaitable[Window]]:
    items = list(windows)

    async def next_window() -> Window:
        if not items:
            raise QueueClosed
        return items.pop(0)

    return next_window


async def _run(
    windows: list[Window],
    callbacks: _FailOnce,
    readmit: Readmit | None = None,
    every: int = 4,
    holder: list[Dispatcher] | None = None,
) -> tuple[Dispatcher, _Positions]:
    config = ConsumerConfig(
        relays=("http://127.0.0.1:1",), checkpoint_every_windows=every, rollback_backoff_s=0.0
    )
    positions = _Positions()
    dispatcher = Dispatcher(callbacks, config, positions, _feeder(windows), readmit)
    if holder is not None:
        holder.append(dispatcher)
    with contextlib.suppress(QueueClosed):
        await dispatcher.run()
    return dispatcher, positions


async def test_without_readmit_a_rollback_replays_every_kept_window() -> None:
    windows = [_window(s, "p.0" if s % 2 else "p.1") for s in range(1, 4)]
    cb = _FailOnce(fail_scn=3)
    _dispatcher, positions = await _run(windows, cb)
    assert cb.started == [1, 2, 3, 1, 2, 3]
    assert positions.rollbacks == 1


async def test_a_replayed_window_refused_by_readmit_is_not_delivered_again() -> None:
    windows = [_window(s, "p.0" if s % 2 else "p.1") for s in range(1, 4)]
    cb = _FailOnce(fail_scn=3)
    offered: list[int] = []

    async def readmit(window: Window) -> bool:
        offered.append(window.scn)
        return window.unit != "p.1"  # unit p.1 was lost meanwhile

    dispatcher, positions = await _run(windows, cb, readmit)
    # first deliveries are not offered (the group engine fenced them already); the replay is
    assert offered == [1, 2, 3]
    assert cb.started == [1, 2, 3, 1, 3]
    assert 2 not in positions.advanced[3:]
    assert all(w.unit != "p.1" for w in dispatcher.replay)


async def test_windows_purged_while_readmit_waits_are_skipped() -> None:
    windows = [_window(s, "p.0" if s % 2 else "p.1") for s in range(1, 5)]
    cb = _FailOnce(fail_scn=4)
    holder: list[Dispatcher] = []

    async def readmit(window: Window) -> bool:
        await asyncio.sleep(0)  # meanwhile the engine purges the lost unit's windows
        replay = holder[0].replay
        replay[:] = [w for w in replay if w.unit != "p.1"]
        return window.unit != "p.1"

    dispatcher, positions = await _run(windows, cb, readmit, every=8, holder=holder)
    assert cb.started == [1, 2, 3, 4, 1, 3]
    assert positions.advanced[-2:] == [1, 3]  # (the replay: purged windows skipped)
    assert dispatcher.replay == []  # (checkpointed when the stream ended)


class _CountingPositions(_Positions):
    """Counts the checkpoints built (a consumer group's is every unit's position)."""

    def __init__(self) -> None:
        super().__init__()
        self.built = 0
        self.persisted = 0

    @property
    def current(self) -> Checkpoint:
        self.built += 1
        return Checkpoint()

    @current.setter
    def current(self, value: Checkpoint) -> None:
        pass

    async def persist(self) -> None:
        self.persisted += 1


class _Watching(AsyncCallbacks):
    def __init__(self) -> None:
        self.seen = 0

    async def on_checkpoint(self, checkpoint: Checkpoint) -> None:
        self.seen += 1


async def test_a_checkpoint_is_built_only_for_an_on_checkpoint_that_looks_at_it() -> None:
    config = ConsumerConfig(relays=("http://127.0.0.1:1",), checkpoint_every_windows=1)
    for callbacks, built in ((AsyncCallbacks(), 0), (_Watching(), 5)):
        positions = _CountingPositions()
        windows = [_window(s, "p.0") for s in range(1, 6)]
        with contextlib.suppress(QueueClosed):
            await Dispatcher(callbacks, config, positions, _feeder(windows)).run()
        assert positions.persisted == 5  # stored either way, once a window
        assert positions.built == built
        if isinstance(callbacks, _Watching):
            assert callbacks.seen == 5


async def test_the_windows_processed_before_the_stream_ends_are_checkpointed() -> None:
    """With ``checkpoint_every_windows`` above 1, the windows processed after the last
    checkpoint were not stored when the stream ended (``stop()``, a bounded read's end,
    a fetch error): the next run replayed them (review)."""
    config = ConsumerConfig(relays=("http://127.0.0.1:1",), checkpoint_every_windows=5)
    positions = _CountingPositions()
    windows = [_window(s, "p.0") for s in range(1, 4)]
    with contextlib.suppress(QueueClosed):
        await Dispatcher(_Watching(), config, positions, _feeder(windows)).run()
    assert positions.persisted == 1 and positions.built == 1

    positions = _CountingPositions()
    items = [_window(s, "p.0") for s in range(1, 3)]

    async def failing() -> Window:
        if not items:
            raise ConnectionError("the relay went away for good")
        return items.pop(0)

    with contextlib.suppress(ConnectionError):
        await Dispatcher(_Watching(), config, positions, failing).run()
    assert positions.persisted == 1


async def test_a_window_purged_while_its_callbacks_run_does_not_move_the_position() -> None:
    """A consumer group lost the unit of a window in its callbacks (session expiry) and
    may have claimed it again before they returned: the window moved the new claim's
    position, or failed the consumer with a CheckpointError (review)."""
    holder: list[Dispatcher] = []

    class _LoseUnit(_FailOnce):
        async def on_end_window(self, window: Window) -> CallbackResult:
            if window.scn == 2:  # the group purges the lost unit's windows meanwhile
                dispatcher = holder[0]
                dispatcher.replay[:] = [w for w in dispatcher.replay if w.unit != window.unit]
            return await super().on_end_window(window)

    windows = [_window(s, "p.0" if s % 2 else "p.1") for s in range(1, 5)]
    cb = _LoseUnit(fail_scn=-1)
    dispatcher, positions = await _run(windows, cb, every=100, holder=holder)
    assert cb.started == [1, 2, 3, 4]
    assert positions.advanced == [1, 3, 4]
    assert dispatcher.windows == 3
