"""Exponential backoff with jitter for reconnects.

The n-th consecutive delay is drawn uniformly from ``[d/2, d]`` with
``d = min(max_s, initial_s * multiplier**n)`` ("equal jitter"): it grows
exponentially, never exceeds ``max_s``, and consumers that lost the same
relay at the same moment do not come back in lock-step. :meth:`reset` after
a success starts again from ``initial_s``.
"""

from __future__ import annotations

import random

__all__ = ["Backoff"]


class Backoff:
    """Delays for consecutive failures (see the module docstring). Not thread-safe."""

    def __init__(
        self,
        initial_s: float,
        max_s: float,
        multiplier: float = 2.0,
        rng: random.Random | None = None,
    ) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self.multiplier = multiplier
        self.failures = 0
        self._rng = rng or random.Random()

    def next_delay(self) -> float:
        """The delay before the next attempt; counts one more failure."""
        ceiling = min(self.max_s, self.initial_s * self.multiplier ** min(self.failures, 64))
        self.failures += 1
        return self._rng.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self.failures = 0
