"""Cutting Postgres connections whose server stopped answering.

A server that is frozen (SIGSTOP, a stalled disk, a hung VM) or a network
path that went half-open keeps TCP connections open: the kernel (or a
middlebox) accepts what is sent and nothing ever comes back, so a blocking
query waits for ever and TCP keepalives see nothing wrong. libpq has no
client-side query timeout, so the fetcher's connections go through a
:class:`Guarded` wrapper: every ``execute`` arms a deadline in the
:class:`Watchdog`, and a call still running when its deadline passes gets
its socket shut down (``shutdown(SHUT_RDWR)`` on a duplicate of the
connection's descriptor), which makes the blocked call fail at once with
an ``OperationalError``. The caller turns that into a retriable
:class:`~changebus.schemas.SourceError` naming the timeout
(:meth:`Watchdog.check`), and the relay reconnects.

A call that may rightly take long (the SQL mode's peek decodes a whole
transaction before it answers) comes with a ``probe``: when its deadline
passes, the watchdog runs the probe (which asks the server, on a connection
of its own, whether that backend is still at work) and waits for it at most
one more timeout. A server that answers "still active" gets another
timeout; one that does not answer in time, or says the call is no longer
running, gets its socket cut. So a frozen server is still found within a
few timeouts, and a long decode is never cut (cutting it made the fetcher
peek the same transaction again, for ever).

Data structure: ``Watchdog._armed`` maps a guarded connection's id to
``(deadline, socket descriptor, what, probe)``, ``Watchdog._running`` the
same id to the number of its call in progress (a probe's answer extends only
the call it was asked about); the watchdog's thread scans it
every quarter of a second (the timeout's resolution). Thread-safety: one
lock guards ``_armed``; a :class:`Guarded` connection is used by one thread
at a time (as psycopg's synchronous connections are), the watchdog thread
only reads the map and shuts sockets down. The silence of the replication
stream itself is watched by the stream loop (``io_timeout_s`` in
:mod:`._stream`), which asks the server for a keepalive while idle.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Generator
from types import TracebackType
from typing import Any

from changebus.schemas import SourceError

__all__ = ["Guarded", "Watchdog", "cut_socket", "received_within"]

log = logging.getLogger("changebus.fetchers.postgres")

#: how often armed deadlines are checked
_TICK_S = 0.25


class Watchdog:
    """Shuts down the socket of a guarded call that overran its deadline (module docstring)."""

    def __init__(self, timeout_s: float, name: str) -> None:
        #: seconds a call may take (0: no deadline at all)
        self.timeout_s = timeout_s
        self.name = name
        #: what overran, once one did ("" before)
        self.fired = ""
        self._armed: dict[int, tuple[float, int, str, Callable[[], bool] | None]] = {}
        #: guarded connection id -> number of its call running now (armed or being
        #: probed); a probe's "still active" extends only that same call
        self._running: dict[int, int] = {}
        self._calls = 0
        #: calls a probe found still at work (their deadline was extended)
        self.extended = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def guard(self, conn: Any) -> Guarded:
        """``conn`` (a psycopg connection) with deadlines on its ``execute``."""
        return Guarded(conn, self)

    def arm(
        self,
        key: int,
        fd: int,
        what: str,
        timeout_s: float | None = None,
        probe: Callable[[], bool] | None = None,
    ) -> None:
        seconds = self.timeout_s if timeout_s is None else timeout_s
        if seconds <= 0:
            return
        with self._lock:
            self._calls += 1
            self._running[key] = self._calls
            self._armed[key] = (time.monotonic() + seconds, fd, what, probe)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"pg-watchdog-{self.name}", daemon=True
                )
                self._thread.start()

    def disarm(self, key: int) -> None:
        with self._lock:
            self._armed.pop(key, None)
            self._running.pop(key, None)

    def check(self) -> None:
        """Raise the retriable error of a call the watchdog cut (nothing when none was)."""
        if self.fired:
            raise SourceError(self.fired)

    def close(self) -> None:
        """Stop the thread (it exits within one tick; not joined)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(_TICK_S):
            now = time.monotonic()
            with self._lock:
                late = [(k, v, self._running.get(k)) for k, v in self._armed.items() if v[0] <= now]
                for key, _, _ in late:
                    del self._armed[key]
            for key, (_, fd, what, probe), call in late:
                if probe is not None and _ask(probe, self.timeout_s):
                    self.extended += 1
                    log.info("partition %s: %s still runs on the server", self.name, what)
                    with self._lock:
                        # only that same call, still running (it may have ended, and
                        # the connection be idle or at its next call, meanwhile)
                        if self._running.get(key) == call and key not in self._armed:
                            self._armed[key] = (time.monotonic() + self.timeout_s, fd, what, probe)
                    continue
                with self._lock:
                    if self._running.get(key) != call:
                        continue  # that call ended while its probe ran: nothing to cut
                    # a duplicate taken while the call still runs is its socket's: once the
                    # lock is let go the call may end and its descriptor be closed, and its
                    # number reused by another socket (found by review)
                    dup = _dup(fd)
                if dup is None:
                    continue
                self.fired = (
                    f"Postgres did not answer {what} within {self.timeout_s:g} s (a frozen "
                    "server or a broken network path): the connection was cut"
                )
                log.warning("partition %s: %s", self.name, self.fired)
                _shut_down(dup)


def _ask(probe: Callable[[], bool], timeout_s: float) -> bool:
    """The probe's answer, False when it raised or took more than ``timeout_s``."""
    answer: list[bool] = []

    def run() -> None:
        try:
            answer.append(bool(probe()))
        except Exception:  # noqa: BLE001 - a probe that fails is a "no"
            answer.append(False)

    thread = threading.Thread(target=run, name="pg-watchdog-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(answer and answer[0])


def received_within(fd: int, seconds: float) -> bool:
    """Whether the TCP socket ``fd`` received data less than ``seconds`` ago.

    Linux's ``TCP_INFO`` (``tcpi_last_data_recv``, ms since the last data
    segment, at byte 52). True when it cannot tell (not TCP: a Unix socket
    has no network path to die; another OS).
    """
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return True
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return True
        info = sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, "TCP_INFO", 11), 104)
    except OSError:
        return True
    finally:
        sock.close()
    if len(info) < 56:
        return True
    return int.from_bytes(info[52:56], sys.byteorder) < seconds * 1000


def _dup(fd: int) -> int | None:
    """A duplicate of descriptor ``fd`` (None: it is closed)."""
    try:
        return os.dup(fd)
    except OSError:
        return None


def _shut_down(dup: int) -> None:
    """Shut the socket behind ``dup`` (a duplicate, closed here) down, both ways."""
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return
    try:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    finally:
        sock.close()


class Guarded:
    """A psycopg connection whose ``execute`` calls have a deadline (module docstring).

    Everything else is the connection's own (attribute access is passed
    through). Use from one thread at a time.
    """

    def __init__(self, conn: Any, watchdog: Watchdog) -> None:
        self.conn = conn
        self._watchdog = watchdog

    def execute(
        self,
        query: Any,
        params: Any = None,
        *,
        timeout_s: float | None = None,
        probe: Callable[[], bool] | None = None,
    ) -> Any:
        """``conn.execute`` with a deadline: the watchdog's, or ``timeout_s`` (0: none);
        ``probe`` may extend it (see the module docstring)."""
        dog, key = self._watchdog, id(self)
        dog.arm(key, self.conn.pgconn.socket, "a query", timeout_s, probe)
        try:
            cursor = self.conn.execute(query, params)
            # fetch inside the deadline too: a result can arrive slowly
            return _Fetched(cursor.fetchall() if cursor.description is not None else [])
        except Exception:
            dog.check()
            raise
        finally:
            dog.disarm(key)

    def stream(
        self,
        query: Any,
        params: Any = None,
        *,
        size: int,
        probe: Callable[[], bool] | None = None,
    ) -> Generator[Any, None, None]:
        """The rows of ``query`` as they arrive, ``size`` at a time (libpq's chunked mode).

        Memory holds one chunk, not the whole answer. The deadline (and
        ``probe``) covers each wait for the server only: while the caller
        holds a row (handing a window to a busy relay, say) the call is
        disarmed, because that time is not the server's. Closing the
        iterator early cancels the query, under a deadline too.
        """
        dog, key, fd = self._watchdog, id(self), self.conn.pgconn.socket
        rows = self.conn.cursor().stream(query, params, size=size)
        try:
            while True:
                dog.arm(key, fd, "a query", None, probe)
                try:
                    row = next(rows)
                except StopIteration:
                    return
                except Exception:
                    dog.check()
                    raise
                finally:
                    dog.disarm(key)
                yield row
        finally:
            dog.arm(key, fd, "cancelling a query")
            try:
                rows.close()
            finally:
                dog.disarm(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)

    def __enter__(self) -> Guarded:
        self.conn.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.conn.__exit__(exc_type, exc, tb)


class _Fetched:
    """The rows of a finished query, read like a cursor (``fetchone``, ``fetchall``, iteration)."""

    __slots__ = ("_rows",)

    def __init__(self, rows: list[Any]) -> None:
        self._rows = rows

    def fetchone(self) -> Any:
        return self._rows[0] if self._rows else None

    def fetchall(self) -> list[Any]:
        return self._rows

    def __iter__(self) -> Any:
        return iter(self._rows)


def cut_socket(fd: int) -> None:
    """Shut the socket ``fd`` down now: a call blocked on it fails at once (the caller
    holds what keeps ``fd`` that socket's while this runs: the call still in progress)."""
    dup = _dup(fd)
    if dup is not None:
        _shut_down(dup)
