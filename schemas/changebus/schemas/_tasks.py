"""Stopping asyncio tasks without swallowing the caller's own cancellation.

``task.cancel()`` then ``with suppress(CancelledError): await task`` is the
usual way to stop a task, and it is wrong: when the *caller* is cancelled
while it waits (a daemon's stop during a fetcher restart, a service stop
during a re-seed), the caller's ``CancelledError`` is suppressed too, and
the caller goes on as if nothing happened -- a relay's ingest restarted its
fetcher for ever while ``stop()`` waited on it (found by review).
:func:`ended` waits with :func:`asyncio.wait`, which raises only the
caller's cancellation, never the task's outcome.

:func:`held_until_done` is the other side: work that cannot be stopped (a
call in a thread) keeps what it holds counted after its caller is cancelled
(an HTTP handler whose client went away).

Event loop only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["ended", "held_until_done", "stop_task"]

T = TypeVar("T")


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


async def held_until_done(work: Awaitable[T], release: Callable[[], None]) -> T:
    """``await work`` in a task of its own and return its result: what the work holds is
    then the caller's to release. When the work fails, ``release()`` runs and its error
    is raised; when the caller is cancelled first, the task goes on and ``release()``
    runs once it ended (its outcome dropped), and the caller's cancellation is raised.

    For work holding a slot or a budget's bytes that cancelling cannot stop (a
    store read in a thread): a handler that released them on its client's
    disconnect let the next request run beside the work still going (review).
    """
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if task.done():
            _settled(task, release)
        else:
            task.add_done_callback(lambda t: _settled(t, release))
        raise
    except BaseException:
        release()
        raise


def _settled(task: asyncio.Future[Any], release: Callable[[], None]) -> None:
    if not task.cancelled():
        task.exception()  # (retrieved: nobody awaits it any more)
    release()
