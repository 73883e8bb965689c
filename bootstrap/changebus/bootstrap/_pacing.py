"""Pacing a chunked snapshot: how many rows the next chunk reads, and when.

One job: :class:`ChunkSizer` keeps chunk transactions under a time budget,
:class:`Throttle` keeps the seed under a rows-per-second and source-time
budget (:func:`~._chunks.run_chunked` asks both after every chunk). Both
belong to one seeder thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from changebus.schemas import ConfigError

__all__ = ["ChunkSizer", "Throttle"]


@dataclass
class ChunkSizer:
    """Rows for the next chunk: ``rows``, fewer while chunk transactions run over
    ``max_txn_s`` or chunks weigh more than ``max_bytes``.

    After each chunk, :meth:`after` aims the next chunk's transaction at 70 %
    of ``max_txn_s`` (seconds; 0: off), assuming time grows with rows, and
    its bytes at 70 % of ``max_bytes`` (0: off), at the chunk's bytes a row:
    the limit shrinks at once, and grows back at most 2x a chunk, only after
    a full chunk, never above ``rows``. Time alone never takes it below
    ``min(rows, 100)``; bytes take it down to 1 row. With ``max_bytes``,
    each table starts at ``min(rows, 256)`` rows (:meth:`start_table`): its
    first chunk is read before its rows' size is known (5,000 rows of 2 MB
    each were 10 GB, held a few times over; found by review). A reader that
    does not time its transactions (``txn_s`` < 0) leaves the time rule out.
    Not thread-safe (the seeder's).
    """

    rows: int
    max_txn_s: float = 0.0
    max_bytes: int = 0
    limit: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.max_txn_s < 0:
            raise ConfigError("max_chunk_txn_s must not be negative (0: off)")
        if self.max_bytes < 0:
            raise ConfigError("max_chunk_bytes must not be negative (0: off)")
        self.limit = self.rows

    def start_table(self) -> int:
        """A new table: its first chunk's rows (its row size is not known yet)."""
        if self.max_bytes > 0:
            self.limit = min(self.rows, _FIRST_ROWS)
        return self.limit

    def after(self, rows_read: int, txn_s: float, nbytes: int = -1) -> int:
        """Note a chunk of ``rows_read`` rows whose transaction took ``txn_s`` and whose
        rows weigh ``nbytes`` (-1: not known); the next limit."""
        floor = min(self.rows, 100)
        wants: list[int] = []
        if self.max_txn_s > 0 and txn_s >= 0:
            wants.append(int(self.limit * 0.7 * self.max_txn_s / max(txn_s, 1e-6)))
        if self.max_bytes > 0 and nbytes > 0 and rows_read > 0:
            fit = int(0.7 * self.max_bytes * rows_read / nbytes)
            wants.append(fit)
            floor = min(floor, max(fit, 1))
        if not wants:
            return self.limit
        want = min(wants)
        if want > self.limit and rows_read < self.limit:
            return self.limit  # a short chunk (the scope's end) says nothing of a full one
        want = min(want, 2 * self.limit, self.rows)
        self.limit = max(want, floor)
        return self.limit


#: a table's first chunk with a byte budget (its rows' size not known yet)
_FIRST_ROWS = 256


@dataclass
class Throttle:
    """Paces chunks: at most ``rows_per_s`` rows a second (0: no limit) and the source
    busy with reads at most ``time_budget`` of the wall time (1: no limit).

    :meth:`pause` says how long to wait before the next chunk, given the rows
    and the source time of the chunk just read. Not thread-safe (the seeder's).
    """

    rows_per_s: float = 0.0
    time_budget: float = 1.0
    clock: Callable[[], float] = time.monotonic
    #: when the rows paced so far are due at ``rows_per_s`` (-1: no chunk yet)
    _due: float = field(default=-1.0, init=False)

    def __post_init__(self) -> None:
        if self.rows_per_s < 0:
            raise ConfigError("max_rows_per_s must not be negative")
        if not 0 < self.time_budget <= 1:
            raise ConfigError("source_time_budget must be in (0, 1]")

    def pause(self, rows: int, busy_s: float) -> float:
        now = self.clock()
        wait = 0.0
        if self.rows_per_s > 0:
            # a bucket of one chunk: time the seed stood still (a refill waiting for the
            # applier, a long sweep, the next table's set-up) earns no credit. Paced as
            # an average since the first chunk, a 5-minute sweep let the next table read
            # 600k rows at 2,000/s without a pause (found by review)
            self._due = max(self._due, now - busy_s) + rows / self.rows_per_s
            wait = max(wait, self._due - now)
        if self.time_budget < 1:
            wait = max(wait, busy_s * (1 / self.time_budget - 1))
        return wait
