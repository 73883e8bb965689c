"""Stopping tasks without swallowing the caller's own cancellation (changebus.schemas.stop_task)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from changebus.schemas import ended, held_until_done, stop_task


async def _slow_to_stop(stopped: asyncio.Event) -> None:
    try:
        await asyncio.sleep(60)
    finally:
        await asyncio.sleep(0.2)  # (a fetcher closing its connection, say)
        stopped.set()


async def test_a_stop_cancelled_while_it_waits_is_cancelled() -> None:
    """``task.cancel(); with suppress(CancelledError): await task`` swallowed the caller's
    cancellation too: a relay's stop() cancelling the ingest while it stopped its fetcher
    went on waiting while the ingest restarted the fetcher (review)."""
    stopped = asyncio.Event()
    task = asyncio.create_task(_slow_to_stop(stopped))
    await asyncio.sleep(0)
    stopper = asyncio.create_task(stop_task(task))
    await asyncio.sleep(0.05)
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    await asyncio.wait_for(stopped.wait(), 5)  # the task itself still ended

    # the old pattern, for contrast: the caller's cancellation was lost
    async def old(t: asyncio.Task[None]) -> str:
        t.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
        return "went on"

    stopped.clear()
    task = asyncio.create_task(_slow_to_stop(stopped))
    await asyncio.sleep(0)
    caller = asyncio.create_task(old(task))
    await asyncio.sleep(0.05)
    caller.cancel()
    assert await caller == "went on"


async def test_the_task_s_own_outcome_is_not_raised() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(fails())
    await ended(task)  # (its failure is retrieved, not raised)
    assert isinstance(task.exception(), RuntimeError)
    await stop_task(asyncio.create_task(asyncio.sleep(60)))
    await stop_task(None)


async def test_held_until_done_releases_when_abandoned_work_ends() -> None:
    """The caller is cancelled while the work runs: the work goes on, and what it holds is
    released once it ended, not at the cancellation (a bootstrap plan's slot, a page's
    budget: the next request ran beside work still going; review)."""
    released: list[str] = []
    go = asyncio.Event()

    async def work() -> int:
        await go.wait()
        return 7

    caller = asyncio.create_task(held_until_done(work(), lambda: released.append("late")))
    await asyncio.sleep(0.01)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert released == []  # still running
    go.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert released == ["late"]

    # done: what it holds is the caller's (not released here)
    assert await held_until_done(work(), lambda: released.append("no")) == 7
    assert released == ["late"]

    async def fails() -> int:
        raise ValueError("x")

    # failed: released once, the error raised
    with pytest.raises(ValueError, match="x"):
        await held_until_done(fails(), lambda: released.append("failed"))
    assert released == ["late", "failed"]
