"""The store threads: one writer thread and a pool of reader threads, each with its own store.

Store calls block (SQLite, psycopg), so none runs on the event loop: every
write (log appends, applier transactions, schema rows) runs in one *writer*
thread that owns the writer :class:`~._store.Store`; reads for HTTP pages
run in a small pool of *reader* threads, each with its own connection
(SQLite in WAL mode and Postgres both let readers run beside the writer).

Thread-safety: :meth:`StoreThreads.write` and :meth:`StoreThreads.read`
are called from the event loop; each :class:`~._store.Store` is opened and
used by one thread only (a thread-local), and the list of opened stores is
guarded by a lock so :meth:`StoreThreads.close` can close them all.

Lost connections. A Postgres store's server may close a connection (a
restart, a failover, an idle-connection killer). A call that fails on a
lost connection drops that thread's store and raises a retriable
:class:`~changebus.schemas.StoreUnavailableError` (503 over HTTP); the
thread's next call opens a new connection. The callers (log writer,
applier) retry; what they write is idempotent (the log skips windows at or
below the producer SCN, the snapshot keeps the newer SCN), so a commit whose
answer was lost does no harm when done again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from changebus.schemas import SourceError, StoreUnavailableError

from ._config import BootstrapConfig
from ._store import Store

__all__ = ["StoreThreads", "open_store"]

T = TypeVar("T")

log = logging.getLogger("changebus.bootstrap")


def open_store(config: BootstrapConfig) -> Store:
    """A new connection to the configured store (tables created when missing)."""
    if config.store.kind == "postgres":
        return Store.postgres(config.store.dsn)
    return Store.sqlite(config.sqlite_path)


class StoreThreads:
    """The writer thread and the reader pool, each thread with its own :class:`Store`."""

    def __init__(self, config: BootstrapConfig, readers: int = 2) -> None:
        self._config = config
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="bootstrap-writer")
        self._readers = ThreadPoolExecutor(readers, thread_name_prefix="bootstrap-reader")
        self._local = threading.local()
        self._opened: list[Store] = []
        self._lock = threading.Lock()

    def _store(self) -> Store:
        store: Store | None = getattr(self._local, "store", None)
        if store is None:
            try:
                store = open_store(self._config)
            except SourceError as exc:
                if not exc.retriable:  # a bad DSN, not an unreachable server
                    raise
                raise StoreUnavailableError(exc.message) from None
            self._local.store = store
            with self._lock:
                self._opened.append(store)
        return store

    def _call(self, fn: Callable[[Store], T]) -> T:
        """``fn(store)`` on this thread's store; a lost connection is dropped (module docstring)."""
        store = self._store()
        try:
            return fn(store)
        except Exception as exc:
            if not store.connection_lost():
                raise
            self._local.store = None
            with self._lock:
                if store in self._opened:
                    self._opened.remove(store)
            with contextlib.suppress(Exception):
                store.close()
            log.warning(
                "the bootstrap store's connection was lost (%s); the next call reconnects",
                type(exc).__name__,
            )
            raise StoreUnavailableError(
                f"the bootstrap store's connection was lost ({type(exc).__name__}); reconnecting"
            ) from None

    async def write(self, fn: Callable[[Store], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._writer, self._call, fn)

    async def read(self, fn: Callable[[Store], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._readers, self._call, fn)

    def close(self) -> None:
        self._writer.shutdown(wait=True, cancel_futures=True)
        self._readers.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for store in self._opened:
                with contextlib.suppress(Exception):
                    store.close()
            self._opened.clear()
