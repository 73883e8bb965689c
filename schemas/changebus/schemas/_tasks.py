"""Stopping asyncio tasks without swallowing the caller's own cancellation.

``task.cancel()`` then ``with suppress(CancelledError): await task`` is the
usual way to stop a task, and it is wrong: when the *caller* is cancelled
while it waits (a daemon's stop during a fetcher restart, a service stop
during a re-seed), the caller's ``CancelledError`` is suppressed too, and
the caller goes on as if nothing happened -- a relay's ingest restarted its
fetcher for ever while ``stop()`` waited on it (found by review).
:func:`ended` waits with :func:`asyncio.wait`, which raises only the
caller's cancellation, never the task's outcome.

Event loop only.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["ended", "stop_task"]


async def ended(task: asyncio.Future[Any]) -> None:
    """Wait until ``task`` ended; its outcome (result, failure, cancellation) is not raised.

    A failure is retrieved (asyncio does not report it as never retrieved);
    the caller reports it if it cares. The caller's own cancellation is raised.
    """
    if not task.done():
        await asyncio.wait({task})
    if not task.cancelled():
        task.exception()


async def stop_task(task: asyncio.Future[Any] | None) -> None:
    """Cancel ``task`` (None: nothing) and wait until it ended (:func:`ended`)."""
    if task is None:
        return
    task.cancel()
    await ended(task)
