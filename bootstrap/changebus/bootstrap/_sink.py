"""The bootstrap service's :class:`~._chunks.SnapshotSink`: chunks into the store.

:class:`StoreSink` is called from the seeder's worker thread; each call
hands one store operation to the store's writer thread
(:mod:`._storethreads`) through the event loop, so the seeder never touches
a store connection and a slow store slows the seed.

A chunk's write is **pipelined**: :meth:`StoreSink.chunk` returns once the
write is handed over, after waiting for the previous chunk's write, so the
seeder reads and encodes chunk *i+1* while the writer thread stores chunk
*i* (SQLite runs its statements without the GIL: the two overlap on two
cores). At most two chunks are in flight (memory stays bounded by
``2 * chunk_rows``), the writes keep their order (one writer thread), and
every other call (resume, finish, :meth:`StoreSink.flush`) first waits for
the pending write, raising its error. After a crash, the stored job names
the chunks whose rows are stored: the resume reads at most the two chunks
that were in flight again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from changebus.schemas import ChangebusError

from ._chunks import Chunk, JobState, SnapshotScope
from ._store import Store
from ._storethreads import StoreThreads

__all__ = ["QUIET_S", "StoreSink"]

T = TypeVar("T")

log = logging.getLogger("changebus.bootstrap.seed")

#: seconds the producer and the applier must stand still, all folded, before a refill
#: stops waiting for the applier to reach the snapshot's newest tag (an idle source)
QUIET_S = 0.5
#: how often the wait looks at the store's positions
_POLL_S = 0.05


class StoreSink:
    """Chunks of partition ``part`` into the store (see the module docstring).

    Thread-safety: its methods are called from one seeder thread, never from
    the event loop (they block until the writer thread is done).
    """

    def __init__(self, stores: StoreThreads, part: str, loop: asyncio.AbstractEventLoop) -> None:
        self._stores = stores
        self._part = part
        self._loop = loop
        #: the chunk write handed over and not waited for yet
        self._pending: concurrent.futures.Future[None] | None = None

    def _submit(self, fn: Callable[[Store], T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(self._stores.write(fn), self._loop)

    def _call(self, fn: Callable[[Store], T]) -> T:
        self.flush()
        return self._submit(fn).result()

    def flush(self) -> None:
        """Wait for the pending chunk write (its error raised here)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def resume(self, scope: SnapshotScope) -> JobState | None:
        return self._call(lambda s: s.snapshot_job(self._part, scope))

    def chunk(self, scope: SnapshotScope, job: JobState, chunk: Chunk) -> None:
        self.flush()
        self._pending = self._submit(
            lambda s: s.snapshot_chunk(self._part, job, chunk.events, chunk.tag, chunk.absent)
        )

    def unfilled(
        self, scope: SnapshotScope, upto: int, stop: threading.Event, *, exact: bool
    ) -> list[tuple[bytes, tuple[Any, ...], int]]:
        """Once the applier has folded the stream up to ``upto``, the keys of rows of
        ``scope.table`` that lack columns: (store key, values, SCN of the entry)
        (:mod:`._refill`).

        ``exact``: ``upto`` is a marker the source wrote, which the stream
        brings. Else it is a tag, which a source with no commit after it never
        brings the applier to: the wait also ends when the applier has folded
        all the producer stored and neither has moved for :data:`QUIET_S`. A
        long wait is logged every minute; ``stop`` ends it with a retriable
        error.
        """
        quiet: tuple[float, int, int] | None = None  # since when, and the positions then
        began = told = time.monotonic()
        while True:
            st = self._call(lambda s: s.state(self._part))
            if st.applier_scn >= upto:
                break
            now = time.monotonic()
            if exact or st.applier_scn < st.producer_scn:
                quiet = None
            elif quiet is None or quiet[1:] != (st.producer_scn, st.applier_scn):
                quiet = (now, st.producer_scn, st.applier_scn)
            elif now - quiet[0] >= QUIET_S:
                break
            if now - told >= 60:
                told = now
                log.warning(
                    "%s: the refill has waited %.0fs for the applier to reach SCN %d "
                    "(it is at %d, the log at %d)",
                    scope.table,
                    now - began,
                    upto,
                    st.applier_scn,
                    st.producer_scn,
                )
            if stop.wait(_POLL_S):
                raise ChangebusError("seeding stopped", retriable=True)
        return self._call(lambda s: s.unfilled_keys(self._part, scope.table))

    def refill(self, scope: SnapshotScope, chunk: Chunk, skipped: list[bytes]) -> None:
        self._call(
            lambda s: s.refill_chunk(
                self._part, scope.table, chunk.events, chunk.tag, chunk.absent, skipped
            )
        )

    def finish(self, scope: SnapshotScope, job: JobState, stop: threading.Event) -> None:
        if scope.whole and job.chunks:  # (no chunk: a table gone from the source, nothing read)
            after: int | None = 0
            while after is not None:
                if stop.is_set():
                    # (a service stop waited for the whole sweep, thousands of steps
                    # of a big table; a sweep stopped is done again after a restart)
                    raise ChangebusError("seeding stopped", retriable=True)
                start = after
                after = self._call(
                    lambda s, a=start: s.sweep_step(self._part, scope.table, job.first_tag, a)  # type: ignore[misc]
                )
        self._call(lambda s: s.finish_snapshot(self._part, job, seeded=scope.whole))
