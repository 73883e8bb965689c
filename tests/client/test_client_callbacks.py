"""Callback API: dispatch order, rollback and replay, unrecoverable errors, budgets, data loss."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest

from changebus.client import (
    AsyncCallbacks,
    CallbackResult,
    Callbacks,
    ChangeEvent,
    Consumer,
    ConsumerAbortedError,
    ConsumerConfig,
    DataLossDetectedError,
    MemoryCheckpointPersister,
    SyncConsumer,
    Window,
)
from changebus.relay import Relay
from changebus.schemas import Checkpoint, Column, DataLoss, Op, TableSchema

MakeRelay = Callable[..., AbstractAsyncContextManager[Relay]]


def config(url: str, **kw: Any) -> ConsumerConfig:
    return ConsumerConfig(
        relays=(url,), partition="syn", wait_s=0.3, rollback_backoff_s=0.001, **kw
    )


class Recorder(Callbacks):
    """Records calls; fails as told by ``plan`` {(callback, scn): [result or exception, ...]}."""

    def __init__(self, stop_after: int, consumer: list[Consumer]) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.applied: list[int] = []  # windows whose end was reached and checkpointed
        self.plan: dict[tuple[str, int], list[Any]] = {}
        self.stop_after = stop_after
        self.consumer = consumer
        self.scn = -1
        self.errors: list[BaseException] = []

    def _step(self, name: str, scn: int) -> CallbackResult | None:
        todo = self.plan.get((name, scn))
        if todo:
            action = todo.pop(0)
            if isinstance(action, BaseException):
                raise action
            if isinstance(action, float):
                time.sleep(action)
                return None
            assert isinstance(action, CallbackResult)
            return action
        return None

    def on_start_window(self, window: Window) -> CallbackResult | None:
        self.scn = window.scn
        self.calls.append(("start_window", window.scn))
        return self._step("on_start_window", window.scn)

    def on_start_source(self, window: Window, table: str) -> CallbackResult | None:
        self.calls.append(("start_source", table))
        return None

    def on_event(self, event: ChangeEvent) -> CallbackResult | None:
        self.calls.append(("event", event.dedupe_key))
        return self._step("on_event", event.scn)

    def on_end_source(self, window: Window, table: str) -> CallbackResult | None:
        self.calls.append(("end_source", table))
        return None

    def on_end_window(self, window: Window) -> CallbackResult | None:
        self.calls.append(("end_window", window.scn))
        return self._step("on_end_window", window.scn)

    def on_checkpoint(self, checkpoint: Checkpoint) -> CallbackResult | None:
        scn = checkpoint.get("syn").window_scn
        self.calls.append(("checkpoint", scn))
        result = self._step("on_checkpoint", scn)
        if result is None:
            self.applied.append(scn)
            if len(self.applied) >= self.stop_after:
                self.consumer[0].stop()
        return result

    def on_rollback(self, checkpoint: Checkpoint) -> CallbackResult | None:
        self.calls.append(("rollback", checkpoint.get("syn").window_scn))
        return None

    def on_error(self, error: BaseException) -> None:
        self.errors.append(error)


async def run(relay: Relay, rec: Recorder, **kw: Any) -> Consumer:
    persister = MemoryCheckpointPersister()
    consumer = Consumer(config(relay.url, **kw), persister=persister)
    rec.consumer.append(consumer)
    async with consumer:
        await consumer.run(rec)
    return consumer


async def test_dispatch_order_follows_databus(make_relay: MakeRelay) -> None:
    async with make_relay(max_windows=20) as relay:
        rec = Recorder(20, [])
        consumer = await run(relay, rec)
    first = rec.calls[: rec.calls.index(("checkpoint", 1000)) + 1]
    names = [c[0] for c in first]
    assert names[0] == "start_window" and names[-2:] == ["end_window", "checkpoint"]
    # sources are bracketed: start_source, events, end_source
    for i, name in enumerate(names):
        if name == "event":
            assert "start_source" in names[:i] and "end_source" in names[i:]
    assert names.count("event") == 3
    assert rec.applied == list(range(1000, 1020))
    assert consumer.committed.get("syn").window_scn == 1019


async def test_recoverable_errors_roll_back_and_replay_the_window(make_relay: MakeRelay) -> None:
    async with make_relay(max_windows=20) as relay:
        rec = Recorder(20, [])
        rec.plan[("on_event", 1005)] = [CallbackResult.ERROR]
        rec.plan[("on_end_window", 1010)] = [RuntimeError("db down"), RuntimeError("db down")]
        rec.plan[("on_checkpoint", 1012)] = [CallbackResult.ERROR]
        await run(relay, rec)
    rollbacks = [c for c in rec.calls if c[0] == "rollback"]
    # back to the window before each failing one, every time
    assert rollbacks == [
        ("rollback", 1004),
        ("rollback", 1009),
        ("rollback", 1009),
        ("rollback", 1011),
    ]
    starts = [c[1] for c in rec.calls if c[0] == "start_window"]
    assert starts.count(1005) == 2 and starts.count(1010) == 3 and starts.count(1012) == 2
    assert starts.count(1004) == 1  # checkpointed windows are never replayed
    assert rec.applied == list(range(1000, 1020))  # each window applied exactly once
    assert rec.errors == []


async def test_unrecoverable_error_stops_with_a_clear_report(make_relay: MakeRelay) -> None:
    async with make_relay(max_windows=20) as relay:
        rec = Recorder(100, [])
        rec.plan[("on_event", 1007)] = [CallbackResult.FATAL]
        with pytest.raises(ConsumerAbortedError) as info:
            await run(relay, rec)
    err = info.value
    assert err.scn == 1007 and err.callback == "on_event" and not err.retriable
    assert rec.errors == [err]
    assert rec.applied == list(range(1000, 1007))
    assert rec.consumer[0].committed.get("syn").window_scn == 1006
    assert not [c for c in rec.calls if c[0] == "rollback"]


async def test_rollbacks_are_bounded(make_relay: MakeRelay) -> None:
    async with make_relay(max_windows=5) as relay:
        rec = Recorder(100, [])
        rec.plan[("on_event", 1002)] = [ValueError("bad row")] * 10
        with pytest.raises(ConsumerAbortedError) as info:
            await run(relay, rec, max_rollbacks=3)
    assert "gave up after 3 rollbacks" in info.value.message
    assert isinstance(info.value.__cause__, ValueError)
    assert [c[1] for c in rec.calls if c[0] == "rollback"] == [1001] * 3


async def test_time_budget_exceeded_rolls_back_sync(make_relay: MakeRelay) -> None:
    async with make_relay(max_windows=5) as relay:
        rec = Recorder(5, [])
        rec.plan[("on_end_window", 1003)] = [0.5]
        await run(relay, rec, callback_time_budget_s=0.15)
    assert ("rollback", 1002) in rec.calls
    assert rec.applied == list(range(1000, 1005))


class SlowAsync(AsyncCallbacks):
    def __init__(self) -> None:
        self.ends: list[int] = []
        self.rollbacks: list[int] = []
        self.slow_once = True
        self.consumer: Consumer | None = None

    async def on_end_window(self, window: Window) -> CallbackResult | None:
        if window.scn == 1002 and self.slow_once:
            self.slow_once = False
            await asyncio.sleep(5)  # cancelled by the budget
        self.ends.append(window.scn)
        if window.scn == 1004 and self.consumer is not None:
            self.consumer.stop()
        return None

    async def on_rollback(self, checkpoint: Checkpoint) -> CallbackResult | None:
        self.rollbacks.append(checkpoint.get("syn").window_scn)
        return None


async def test_time_budget_exceeded_rolls_back_async(make_relay: MakeRelay) -> None:
    async with make_relay(max_windows=5) as relay:
        cb = SlowAsync()
        t0 = time.monotonic()
        async with Consumer(config(relay.url, callback_time_budget_s=0.15)) as c:
            cb.consumer = c
            await c.run(cb)
    assert time.monotonic() - t0 < 3
    assert cb.rollbacks == [1001]
    assert cb.ends == [1000, 1001, 1002, 1003, 1004]


TABLE = TableSchema(
    "app.items", (Column("id", "long", nullable=False), Column("v", "string")), ("id",), 1
)


async def test_data_loss_is_never_silent(scripted_relay: Any, window_type: Any) -> None:
    ScriptedWindow = window_type
    script = [
        ScriptedWindow(
            10, rows=[(TABLE, 1, Op.INSERT, {"id": 1, "v": "a"}, None)], announce=[(1, TABLE)]
        ),
        ScriptedWindow(20, loss=DataLoss(11, 19, "slot lost")),
        ScriptedWindow(30, rows=[(TABLE, 1, Op.INSERT, {"id": 2, "v": "b"}, None)]),
    ]
    async with scripted_relay(script) as relay:
        # iterator: raises, and keeps raising
        async with Consumer(config(relay.url)) as c:
            first = await c.__anext__()
            assert first.scn == 10
            with pytest.raises(DataLossDetectedError) as info:
                await c.__anext__()
            assert (info.value.from_scn, info.value.to_scn, info.value.window_scn) == (11, 19, 20)
            with pytest.raises(DataLossDetectedError):
                await c.__anext__()
        # iterator asked to deliver it as a signal
        async with Consumer(config(relay.url, on_data_loss="deliver")) as c:
            windows = [await c.__anext__() for _ in range(3)]
        assert windows[1].data_loss == DataLoss(11, 19, "slot lost")
        assert windows[2].events[0].after == {"id": 2, "v": "b"}
        # callbacks: the default on_data_loss stops consumption
        rec = Recorder(100, [])
        with pytest.raises(DataLossDetectedError):
            await run(relay, rec)
        assert rec.applied == [10] and isinstance(rec.errors[0], DataLossDetectedError)


async def test_each_async_call_gets_its_own_budget() -> None:
    """Two calls of 0.1 s within a 0.15 s budget pass; a call of 0.3 s is cut and named."""
    from changebus.client._dispatch import _LoopRunner

    class Paced(AsyncCallbacks):
        async def on_start_window(self, window: Window) -> None:
            await asyncio.sleep(0.1)

        async def on_end_window(self, window: Window) -> None:
            await asyncio.sleep(0.1)

        async def on_checkpoint(self, checkpoint: Checkpoint) -> None:
            await asyncio.sleep(0.3)

    runner = _LoopRunner(Paced(), 0.15)
    ok = await runner.run([("on_start_window", (None,)), ("on_end_window", (None,))] * 2)
    assert ok.ok and not ok.timed_out
    t0 = time.monotonic()
    cut = await runner.run([("on_end_window", (None,)), ("on_checkpoint", (None,))])
    assert cut.timed_out and cut.callback == "on_checkpoint"
    assert 0.2 < time.monotonic() - t0 < 0.3  # 0.1 s, then cut 0.15 s into the second call
    # the task is usable afterwards: the scope's cancellation did not leak
    again = await runner.run([("on_end_window", (None,))])
    assert again.ok


async def test_inherited_no_op_callbacks_are_not_called_and_the_rest_are() -> None:
    """Callbacks left as AsyncCallbacks has them are skipped; overrides and instance ones run."""
    from changebus.client._dispatch import _inherited_noops, _LoopRunner

    calls: list[str] = []

    class Base(AsyncCallbacks):
        async def on_event(self, event: Any) -> None:
            calls.append("on_event")

    class Child(Base):
        async def on_end_window(self, window: Window) -> CallbackResult:
            calls.append("on_end_window")
            return CallbackResult.SKIP_CHECKPOINT

    cb = Child()

    async def on_checkpoint(checkpoint: Checkpoint) -> None:
        calls.append("on_checkpoint")

    cb.on_checkpoint = on_checkpoint  # type: ignore[method-assign]
    skipped = _inherited_noops(cb)
    assert "on_event" not in skipped and "on_end_window" not in skipped
    assert "on_checkpoint" not in skipped and "on_start_window" in skipped
    assert "on_data_loss" not in skipped
    plan = [
        ("on_start_window", (None,)),
        ("on_event", (None,)),
        ("on_end_window", (None,)),
        ("on_checkpoint", (None,)),
    ]
    outcome = await _LoopRunner(cb, 1.0).run(plan)
    assert calls == ["on_event", "on_end_window", "on_checkpoint"]
    assert outcome.ok
    # the default on_data_loss still stops the consumer
    lost = await _LoopRunner(AsyncCallbacks(), 1.0).run([("on_data_loss", (None, None))])
    assert lost.result is CallbackResult.FATAL


class Stuck(Callbacks):
    """on_event of window 1001 blocks until ``release`` is set (a call that never returns)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.errors: list[BaseException] = []

    def on_event(self, event: ChangeEvent) -> CallbackResult | None:
        if event.scn == 1001:
            self.release.wait(60)
        return None

    def on_error(self, error: BaseException) -> None:
        self.errors.append(error)


async def test_a_sync_callback_that_never_returns_ends_the_consumer(make_relay: MakeRelay) -> None:
    """Plans queued behind a stuck call reset their budget on every pass and waited for
    ever: run() never returned, whatever max_rollbacks said. Now each plan after it times
    out within one budget and the rollback limit ends the consumer."""
    async with make_relay(max_windows=5) as relay:
        cb = Stuck()
        t0 = time.monotonic()
        try:
            async with Consumer(
                config(relay.url, callback_time_budget_s=0.3, max_rollbacks=2)
            ) as c:
                with pytest.raises(ConsumerAbortedError, match="gave up after 2 rollbacks"):
                    await asyncio.wait_for(c.run(cb), 20)
            elapsed = time.monotonic() - t0
        finally:
            cb.release.set()
    assert elapsed < 10, elapsed


class Exits(Callbacks):
    def on_event(self, event: ChangeEvent) -> CallbackResult | None:
        if event.scn == 1001:
            sys.exit(3)
        return None


async def test_sys_exit_in_a_sync_callback_ends_run_and_close(make_relay: MakeRelay) -> None:
    """SystemExit left the worker thread and then the sync wrapper's loop thread: run()
    and close() waited for ever. It ends the consumer like a FATAL result now."""
    async with make_relay(max_windows=5) as relay:
        cfg = config(relay.url)

        def blocking() -> BaseException | None:
            consumer = SyncConsumer(cfg)
            try:
                consumer.run(Exits())
            except ConsumerAbortedError as exc:
                return exc
            finally:
                consumer.close()
            return None

        error = await asyncio.wait_for(asyncio.to_thread(blocking), 30)
    assert isinstance(error, ConsumerAbortedError) and isinstance(error.__cause__, SystemExit)
    assert error.scn == 1001


async def test_run_with_until_scn_returns_after_the_last_window(make_relay: MakeRelay) -> None:
    """The iterator stopped at until_scn; run(callbacks) waited for ever after it."""
    async with make_relay(max_windows=20) as relay:
        rec = Recorder(100, [])
        async with Consumer(config(relay.url, until_scn=1009)) as c:
            await asyncio.wait_for(c.run(rec), 20)
            checkpoint = c.checkpoint
    assert rec.applied == list(range(1000, 1010))
    assert checkpoint.get("syn").window_scn == 1009


class SkipsCheckpoints(Callbacks):
    def __init__(self) -> None:
        self.windows = 0

    def on_end_window(self, window: Window) -> CallbackResult | None:
        self.windows += 1
        return None

    def on_checkpoint(self, checkpoint: Checkpoint) -> CallbackResult | None:
        return CallbackResult.SKIP_CHECKPOINT


async def test_windows_kept_for_replay_are_bounded(make_relay: MakeRelay) -> None:
    """Every window since the last stored checkpoint is kept (a rollback replays them):
    an on_checkpoint that always skips grew that list without bound."""
    async with make_relay(max_windows=100, events_per_window=4, row_bytes=2000) as relay:
        cb = SkipsCheckpoints()
        cfg = config(
            relay.url, max_bytes=64 << 10, max_window_bytes=64 << 10, max_replay_bytes=64 << 10
        )
        async with Consumer(cfg) as c:
            with pytest.raises(ConsumerAbortedError, match="past max_replay_bytes"):
                await asyncio.wait_for(c.run(cb), 20)
    # about 8 KB a window: the eighth or so passes 64 KiB
    assert 5 <= cb.windows <= 9, cb.windows


class Gated(Callbacks):
    """Holds the first window's end on ``gate``; records the calls and when they were made."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.calls: list[tuple[str, float]] = []

    def on_end_window(self, window: Window) -> CallbackResult | None:
        self.calls.append(("end_window", time.monotonic()))
        self.entered.set()
        self.gate.wait(20)
        return None

    def on_checkpoint(self, checkpoint: Checkpoint) -> CallbackResult | None:
        self.calls.append(("checkpoint", time.monotonic()))
        return None


async def test_close_waits_for_the_window_a_run_is_in(make_relay: MakeRelay) -> None:
    """close() from another task returned at once while run() went on with the window's
    callbacks and checkpoint after it (the application's sink closed under them; review).
    It now returns once run() finished that window and ended."""
    async with make_relay(max_windows=20) as relay:
        cb = Gated()
        consumer = Consumer(config(relay.url))
        run = asyncio.create_task(consumer.run(cb))
        await asyncio.to_thread(cb.entered.wait, 20)
        closing = asyncio.create_task(consumer.close())
        await asyncio.sleep(0.5)
        assert not closing.done()  # the window's end is still under way
        cb.gate.set()
        await asyncio.wait_for(closing, 20)
        closed_at = time.monotonic()
        assert run.done()
        await run
        assert [name for name, _ in cb.calls] == ["end_window", "checkpoint"]
        assert all(at <= closed_at for _, at in cb.calls)


async def test_a_sync_close_ends_a_run_in_another_thread(make_relay: MakeRelay) -> None:
    """SyncConsumer.close() stopped the loop under a run() that then never returned
    (review); from inside a callback it is refused (it would wait for itself)."""
    async with make_relay(max_windows=20) as relay:
        cb = Gated()
        sync = SyncConsumer(config(relay.url))
        done = threading.Event()

        def running() -> None:
            try:
                sync.run(cb)
            finally:
                done.set()

        thread = threading.Thread(target=running)
        thread.start()
        try:
            await asyncio.to_thread(cb.entered.wait, 20)
            closer = asyncio.create_task(asyncio.to_thread(sync.close))
            await asyncio.sleep(0.3)
            cb.gate.set()
            await asyncio.wait_for(closer, 20)
            assert await asyncio.to_thread(done.wait, 10)
        finally:
            cb.gate.set()
            await asyncio.to_thread(thread.join, 10)
        assert not thread.is_alive()

        class ClosesItself(Callbacks):
            error: BaseException | None = None

            def on_end_window(self, window: Window) -> CallbackResult | None:
                try:
                    own.close()
                except RuntimeError as exc:
                    self.error = exc
                own.stop()
                return None

        own = SyncConsumer(config(relay.url))
        me = ClosesItself()
        try:
            await asyncio.wait_for(asyncio.to_thread(own.run, me), 20)
        finally:
            await asyncio.to_thread(own.close)
        assert isinstance(me.error, RuntimeError) and "stop()" in str(me.error)


async def test_close_from_an_async_callback_does_not_wait_for_itself(
    make_relay: MakeRelay,
) -> None:
    """close() waits for run() to finish its window; from inside that window's callback
    (even through a task of its own, as wait_for makes on Python 3.11) it must not."""
    async with make_relay(max_windows=20) as relay:
        consumer = Consumer(config(relay.url))
        closed: list[float] = []

        class Closes(AsyncCallbacks):
            async def on_end_window(self, window: Window) -> CallbackResult | None:
                await asyncio.wait_for(consumer.close(), 5)
                closed.append(time.monotonic())
                return None

        started = time.monotonic()
        await asyncio.wait_for(consumer.run(Closes()), 20)
        assert closed and closed[0] - started < 5


async def test_cancelling_run_does_not_wait_for_a_blocked_callback(
    make_relay: MakeRelay,
) -> None:
    """A cancelled run() (a shutdown, a wait_for) waited, in its close, for a sync
    callback still within its time budget, however long it stayed blocked (review)."""
    async with make_relay(max_windows=20) as relay:
        gate = threading.Event()
        entered = threading.Event()

        class Blocks(Callbacks):
            def on_end_window(self, window: Window) -> CallbackResult | None:
                entered.set()
                gate.wait(30)
                return None

        consumer = Consumer(config(relay.url, callback_time_budget_s=60))
        task = asyncio.create_task(consumer.run(Blocks()))
        try:
            await asyncio.to_thread(entered.wait, 20)
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=3)
            assert task in done  # ended at once, the callback still blocked
        finally:
            gate.set()
            await consumer.close()


async def test_a_close_from_a_task_a_callback_left_running_waits_for_the_run(
    make_relay: MakeRelay,
) -> None:
    """A callback starts a shutdown task and returns (a detached close). The task used to
    inherit the callbacks' exemption from waiting for good: its close() returned at once
    while run() went on with later windows' callbacks. Once the window that made it
    ended, it waits like any other task."""
    async with make_relay(max_windows=20) as relay:
        consumer = Consumer(config(relay.url))
        calls: list[float] = []
        closed: list[float] = []
        tasks: list[asyncio.Task[None]] = []

        async def shutdown() -> None:
            await asyncio.sleep(0.3)  # (after the window that made it ended)
            await consumer.close()
            closed.append(time.monotonic())

        class Detaches(AsyncCallbacks):
            async def on_end_window(self, window: Window) -> CallbackResult | None:
                if not tasks:
                    tasks.append(asyncio.create_task(shutdown()))
                await asyncio.sleep(0.2)  # (the windows after it are still under way)
                calls.append(time.monotonic())
                return None

        await asyncio.wait_for(consumer.run(Detaches()), 20)
        await asyncio.wait_for(tasks[0], 20)
        assert closed and calls
        assert all(at <= closed[0] for at in calls)  # no callback after close() returned


async def test_a_close_from_run_s_own_task_does_not_wait_for_itself(
    make_relay: MakeRelay,
) -> None:
    """A checkpoint persister (run()'s own task, outside any callback) that closes the
    consumer on a storage failure: its close must not wait for the run it is part of."""
    async with make_relay(max_windows=20) as relay:
        consumer: Consumer

        class ClosesOnStore(MemoryCheckpointPersister):
            async def store(self, checkpoint: Checkpoint) -> None:
                await super().store(checkpoint)
                await consumer.close()

        consumer = Consumer(config(relay.url, callback_time_budget_s=30), persister=ClosesOnStore())
        started = time.monotonic()
        await asyncio.wait_for(consumer.run(AsyncCallbacks()), 20)
        assert time.monotonic() - started < 10
