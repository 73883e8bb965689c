"""The bootstrap service's :class:`~._chunks.SnapshotSink`: chunks into the store.

:class:`StoreSink` is called from the seeder's worker thread; each call
hands one store operation to the store's writer thread
(:mod:`._storethreads`) through the event loop and waits for it, so the
seeder never touches a store connection and a slow store slows the seed
(one chunk in flight: memory stays bounded by ``chunk_rows``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from ._chunks import Chunk, JobState, SnapshotScope
from ._store import Store
from ._storethreads import StoreThreads

__all__ = ["StoreSink"]

T = TypeVar("T")


class StoreSink:
    """Chunks of partition ``part`` into the store (see the module docstring).

    Thread-safety: its methods are called from one seeder thread, never from
    the event loop (they block until the writer thread is done).
    """

    def __init__(self, stores: StoreThreads, part: str, loop: asyncio.AbstractEventLoop) -> None:
        self._stores = stores
        self._part = part
        self._loop = loop

    def _call(self, fn: Callable[[Store], T]) -> T:
        return asyncio.run_coroutine_threadsafe(self._stores.write(fn), self._loop).result()

    def resume(self, scope: SnapshotScope) -> JobState | None:
        return self._call(lambda s: s.snapshot_job(self._part, scope))

    def chunk(self, scope: SnapshotScope, job: JobState, chunk: Chunk) -> None:
        self._call(
            lambda s: s.snapshot_chunk(self._part, job, chunk.events, chunk.tag, chunk.absent)
        )

    def finish(self, scope: SnapshotScope, job: JobState) -> None:
        if scope.whole:
            after: int | None = 0
            while after is not None:
                start = after
                after = self._call(
                    lambda s, a=start: s.sweep_step(self._part, scope.table, job.first_tag, a)  # type: ignore[misc]
                )
        self._call(lambda s: s.finish_snapshot(self._part, job, seeded=scope.whole))
