"""The callbacks a group member calls, and the report of a member loop that crashed.

A :class:`~._group.GroupMember` keeps its ``on_target`` / ``on_lost``
callbacks in lists (:func:`add_callback` returns the function removing one)
and calls them on the event loop (:func:`fire_callbacks`: a callback that
raises is logged, the others still run).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from changebus.schemas import Unit

__all__ = ["UnitsCallback", "add_callback", "fire_callbacks", "report_crash"]

log = logging.getLogger("changebus.cluster.group")

UnitsCallback = Callable[[frozenset[Unit]], None]


def add_callback(callbacks: list[UnitsCallback], callback: UnitsCallback) -> Callable[[], None]:
    """Add ``callback``; the function that removes it again."""
    callbacks.append(callback)

    def remove() -> None:
        with contextlib.suppress(ValueError):
            callbacks.remove(callback)

    return remove


def fire_callbacks(callbacks: list[UnitsCallback], units: frozenset[Unit], what: str) -> None:
    """Call every callback with ``units``; one that raises is logged (``what``: its kind)."""
    for callback in list(callbacks):
        try:
            callback(units)
        except Exception:
            log.exception("a group %s callback failed", what)


def report_crash(task: asyncio.Task[None]) -> None:
    """Log a member loop that ended with an unexpected exception (a bug)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("group loop %s crashed", task.get_name(), exc_info=task.exception())
