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

Frozen servers. A Postgres server that stops answering (SIGSTOP, a hung VM,
a half-open path) leaves a call blocked for ever, and with it the writer
thread every partition shares. Each call on a Postgres store is watched
(``store.io_timeout_s``, the fetchers' :class:`~changebus.fetchers.postgres.PgWatchdog`):
past the timeout the server is asked on a new connection, and when that
gets no answer either the call's connection is cut, the call fails as a
lost connection, and the callers retry. :meth:`StoreThreads.close` waits
``store.stop_grace_s`` for calls in progress, then interrupts the calls
still running (:meth:`~._db.StoreDb.interrupt`: a Postgres connection is
cut, a SQLite statement is interrupted): a stop (SIGTERM) once waited for
ever on a frozen store, or on a long SQLite statement.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

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


def _server_answers(dsn: str, timeout_s: float) -> bool:
    """Whether the Postgres server of ``dsn`` answers a new connection's ``SELECT 1``."""
    from changebus.fetchers.postgres import pg_connect

    conn = pg_connect(dsn, "probing the bootstrap store", option="store.dsn", timeout_s=timeout_s)
    try:
        conn.execute("SELECT 1")
        return True
    finally:
        conn.close()


class StoreThreads:
    """The writer thread and the reader pool, each thread with its own :class:`Store`.

    ``_in_call`` maps a thread's id to the store it is in a call on (what
    :meth:`close` cuts), guarded by ``_lock``; ``_idle`` is notified when a
    call ends.
    """

    def __init__(self, config: BootstrapConfig, readers: int = 2) -> None:
        self._config = config
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="bootstrap-writer")
        self._readers = ThreadPoolExecutor(readers, thread_name_prefix="bootstrap-reader")
        self._local = threading.local()
        self._opened: list[Store] = []
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_call: dict[int, Store] = {}
        self._watchdog: Any = None
        store = config.store
        if store.kind == "postgres" and store.io_timeout_s > 0:
            from changebus.fetchers.postgres import PgWatchdog

            self._watchdog = PgWatchdog(store.io_timeout_s, "bootstrap-store")

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
        me = threading.get_ident()
        dog, fd = self._watchdog, store.socket()
        with self._lock:
            self._in_call[me] = store
        if dog is not None and fd is not None:
            timeout = self._config.store.io_timeout_s
            dsn = self._config.store.dsn
            dog.arm(me, fd, "a store call", probe=lambda: _server_answers(dsn, timeout))
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
        finally:
            if dog is not None:
                dog.disarm(me)
            with self._lock:
                self._in_call.pop(me, None)
                self._idle.notify_all()

    async def write(self, fn: Callable[[Store], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._writer, self._call, fn)

    async def read(self, fn: Callable[[Store], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._readers, self._call, fn)

    def close(self) -> None:
        """Stop the threads: calls queued are dropped, calls in progress get
        ``store.stop_grace_s``, then they are interrupted (module docstring)."""
        self._writer.shutdown(wait=False, cancel_futures=True)
        self._readers.shutdown(wait=False, cancel_futures=True)
        grace = self._config.store.stop_grace_s
        if not self._wait_idle(grace):
            with self._lock:
                stuck = list(self._in_call.values())
                log.warning(
                    "%d bootstrap store call(s) still running after %g s of the stop;"
                    " interrupting them",
                    len(stuck),
                    grace,
                )
                for store in stuck:  # (under the lock: their calls, and descriptors, go on)
                    store.interrupt()
            self._wait_idle(max(grace, 1.0))
        if self._watchdog is not None:
            self._watchdog.close()
        with self._lock:
            if self._in_call:
                # (a SQLite call stuck in one disk syscall: the interrupt acts after it)
                log.error("%d bootstrap store call(s) did not end", len(self._in_call))
                return
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        with self._lock:
            for store in self._opened:
                with contextlib.suppress(Exception):
                    store.close()
            self._opened.clear()

    def _wait_idle(self, seconds: float) -> bool:
        """Wait up to ``seconds`` until no call is in progress; whether none is."""
        deadline = time.monotonic() + seconds
        with self._lock:
            while self._in_call:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True
