"""Polling helpers shared by the tests (the servers under test are real: events arrive
when they arrive, and a test waits for a condition with a deadline, never a fixed sleep)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def wait_until(
    pred: Callable[[], object], seconds: float = 30, what: str = "", interval: float = 0.02
) -> None:
    """Poll ``pred`` until it is true; fail the test after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what or pred}"
        await asyncio.sleep(interval)
