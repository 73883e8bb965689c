"""``ZkSession``: one ZooKeeper session for an asyncio program, over kazoo.

kazoo is threaded: its connection thread does the I/O, its callback thread
runs watches and completion callbacks, and even its "async" calls write to a
blocking socket. So every request here runs in a worker thread and waits at
most ``op_timeout_s`` (the session timeout) for its answer, instead of
kazoo's unbounded wait while the connection is suspended. The event loop
never blocks on ZooKeeper. The workers are the session's own
(``_WORKERS`` threads named ``changebus-zk``), not the loop's default
executor: requests stuck while ZooKeeper is away cannot starve the
``asyncio.to_thread`` work of the program hosting the session.

State. kazoo reports CONNECTED, SUSPENDED (connection lost, the session may
still live) and LOST (the session expired: every ephemeral node of it is
gone) from its connection thread. The listener records the state in
:attr:`ZkSession.thread_state` at once (readable from any thread; what a
leader's lease checks) and hands it to the event loop with
``call_soon_threadsafe``; there :attr:`ZkSession.state` changes and the
listeners added with :meth:`ZkSession.add_listener` run, in order. A
CONNECTED with a session id different from the previous one is a *new
session* (:attr:`StateChange.new_session`): whoever owns ephemeral nodes
creates them again. kazoo reconnects by itself forever (short backoff, at
most 1 s between attempts), also after LOST.

Round trips. :attr:`ZkSession.last_ok` is the ``time.monotonic()`` at which
the most recent successful request was *sent* (not answered): ZooKeeper saw
the session alive no earlier than that, so a lease counted from it is
conservative.

Access control. With digest credentials in the config
(:meth:`ClusterConfig.zk_credentials`), the session authenticates, its
creates carry the cluster's ACL, and after connecting it takes its cluster's
tree back (:mod:`._session_acl`).

Leftovers. An ephemeral node its owner could not delete (a candidate or a
group member stopped while the connection was down) is handed to
:meth:`ZkSession.delete_later` (or, not known by path,
:meth:`ZkSession.delete_children_later`) and deleted when the same session
is connected again (:mod:`._session_leftovers`).

Thread-safety: :meth:`start`, :meth:`stop`, :meth:`op`, :meth:`commit`,
:meth:`delete_later` and the listeners belong to the event loop that called :meth:`start`;
:attr:`thread_state` and :attr:`last_ok` may be read from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import (
    ConnectionClosedError,
    ConnectionLoss,
    OperationTimeoutError,
    RolledBackError,
    RuntimeInconsistency,
    SessionExpiredError,
)
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.retry import KazooRetry

from changebus.schemas.errors import ConfigError

from ._config import ClusterConfig
from ._errors import CoordinationError
from ._kazoolog import KAZOO_LOG as _KAZOO_LOG
from ._layout import cluster_root
from ._session_acl import cluster_acl, secure_tree
from ._session_leftovers import Leftovers

__all__ = ["SessionState", "StateChange", "ZkSession", "failed_op"]

log = logging.getLogger("changebus.cluster.session")


def failed_op(results: list[Any]) -> int | None:
    """The index of the operation that failed a transaction (:meth:`ZkSession.commit`'s
    result), None when it was committed. kazoo reports the operations before the
    failed one as ``RolledBackError`` and those after it as ``RuntimeInconsistency``:
    neither is what failed."""
    for i, r in enumerate(results):
        if isinstance(r, Exception) and not isinstance(r, RolledBackError | RuntimeInconsistency):
            return i
    return None


T = TypeVar("T")

#: worker threads per session (requests in flight at once)
_WORKERS = 8

SessionState = Literal["connecting", "connected", "suspended", "lost", "closed"]

_KAZOO_STATES: dict[str, SessionState] = {
    KazooState.CONNECTED: "connected",
    KazooState.SUSPENDED: "suspended",
    KazooState.LOST: "lost",
}

#: kazoo errors that say "ZooKeeper could not answer", not "the answer is no"
_UNREACHABLE = (
    ConnectionLoss,
    ConnectionClosedError,
    SessionExpiredError,
    OperationTimeoutError,
    KazooTimeoutError,
    TimeoutError,
)


@dataclass(frozen=True, slots=True)
class StateChange:
    """A session state as the event loop sees it.

    ``new_session`` is True on the CONNECTED that starts a session other than
    the previous one (after LOST, or the first connection): ephemeral nodes
    of the old session are gone.
    """

    state: SessionState
    session_id: int
    new_session: bool


class ZkSession:
    """One kazoo client and its session, driven from an asyncio event loop.

    ``root`` is ``/changebus/<cluster>``. Create, :meth:`start`, use,
    :meth:`stop` (closing the session deletes its ephemeral nodes at once).
    """

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.root = cluster_root(config.name)
        self.op_timeout_s = max(1.0, config.session_timeout_s)
        self.state: SessionState = "closed"
        #: the latest kazoo state, written by kazoo's connection thread
        self.thread_state: SessionState = "closed"
        #: monotonic send time of the newest successful request (see module docstring)
        self.last_ok = 0.0
        self.session_id = 0
        self._zk: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listeners: list[Callable[[StateChange], None]] = []
        self._changed = asyncio.Event()
        self._pool: ThreadPoolExecutor | None = None
        #: the session timeout the server granted (s; 0: no session yet), written by
        #: kazoo's connection thread at every connect
        self.negotiated_timeout_s = 0.0
        #: ephemeral nodes to delete once connected again (see the module docstring)
        self._leftovers = Leftovers(self)

    @property
    def session_timeout_s(self) -> float:
        """The session's timeout: the one asked for, or less when the server granted less.

        ZooKeeper bounds a session's timeout to its ``minSessionTimeout`` ..
        ``maxSessionTimeout`` (by default 2 to 20 ticks): asked for 30 s, a
        server with ``tickTime=500`` grants 10 s, and expires the session
        then. Leases (a leader's, a group member's) are a fraction of this
        figure, never of the one asked for: a lease longer than the real
        session would let a deposed process act after its successor took over.
        Readable from any thread.
        """
        granted = self.negotiated_timeout_s
        asked = self.config.session_timeout_s
        return min(asked, granted) if granted > 0 else asked

    @property
    def lease_s(self) -> float:
        """How long a confirmed heartbeat keeps a lease: ``lease_fraction`` of the session."""
        return self.session_timeout_s * self.config.lease_fraction

    @property
    def client(self) -> Any:
        """The ``KazooClient`` (for kazoo recipes; its calls block: use them in threads)."""
        if self._zk is None:
            raise CoordinationError("the ZooKeeper session is not started")
        return self._zk

    @property
    def connected(self) -> bool:
        """True while kazoo reports the connection up (readable from any thread)."""
        return self.thread_state == "connected"

    async def start(self) -> None:
        """Connect; raises a retriable :class:`CoordinationError` after ``connect_timeout_s``."""
        if self._zk is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="changebus-zk")
        try:
            credentials = await self._in_thread(self.config.zk_credentials)
        except ConfigError:
            self._shutdown_pool()
            raise
        security: dict[str, Any] = {}
        if credentials is not None:
            user, password = credentials
            security = {
                "auth_data": [("digest", f"{user}:{password}")],
                "default_acl": cluster_acl(
                    user, password, world_readable=self.config.zk_world_readable
                ),
            }
        zk = KazooClient(
            hosts=self.config.zookeeper,
            **security,
            timeout=self.config.session_timeout_s,
            connection_retry=KazooRetry(
                max_tries=-1, delay=0.05, backoff=2, max_delay=1.0, max_jitter=0.1
            ),
            command_retry=KazooRetry(max_tries=3, delay=0.05, max_delay=0.5, max_jitter=0.1),
            logger=_KAZOO_LOG,
        )
        zk.add_listener(self._on_kazoo_state)
        self._watch_negotiation(zk)
        self.state = self.thread_state = "connecting"
        self._zk = zk
        t0 = time.monotonic()

        def start() -> int:
            zk.start(self.config.connect_timeout_s)
            client_id = zk.client_id
            return int(client_id[0]) if client_id else 0

        try:
            sid = await self._in_thread(start)
        except asyncio.CancelledError:
            # stopped (a SIGTERM) during start-up: no session may go on connecting in the
            # background (found by review)
            self._zk = None
            with contextlib.suppress(Exception):
                await self._in_thread(lambda: _close_quietly(zk))
            self._shutdown_pool()
            self.state = self.thread_state = "closed"
            raise
        except KazooTimeoutError:
            self._zk = None
            await self._in_thread(lambda: _close_quietly(zk))
            self._shutdown_pool()
            self.state = self.thread_state = "closed"
            raise CoordinationError(
                f"ZooKeeper {self.config.zookeeper} did not answer within "
                f"{self.config.connect_timeout_s:g} s"
            ) from None
        self.last_ok = max(self.last_ok, t0)
        if self.thread_state == "connecting":  # (never over a later report of kazoo's thread)
            self.thread_state = "connected"
        if self.connected:  # (kazoo's thread may have reported a loss since)
            self._set_state("connected", sid)
        else:  # lost again already: kazoo's queued reports say so, then its next CONNECTED
            self.session_id = sid
        if credentials is not None:
            try:
                await secure_tree(self, security["default_acl"])
            except BaseException:
                # (not left connected: each join retry of a member left a live session,
                # its threads and a connection of the server's per-host limit; review)
                await self.stop()
                raise

    async def stop(self) -> None:
        """Close the session (its ephemeral nodes go at once) and the client."""
        if self._zk is None:
            return
        self.thread_state = "closed"
        self._set_state("closed")
        self._listeners.clear()
        zk, self._zk = self._zk, None
        await self._in_thread(lambda: _close_quietly(zk))
        self._shutdown_pool()

    def add_listener(self, callback: Callable[[StateChange], None]) -> Callable[[], None]:
        """Call ``callback`` on the event loop at each state change; returns the remover.

        A callback must not block; an exception it raises is logged and ignored.
        """
        self._listeners.append(callback)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._listeners.remove(callback)

        return remove

    def delete_later(self, nodes: dict[str, tuple[int, bytes | None]]) -> None:
        """Delete these ephemeral nodes of this session when it is connected (again).

        ``nodes``: path -> (its czxid, -1: any; its data, None: any), in the order
        to delete them. A node that is gone, of another session, or whose czxid or
        data differ is skipped. Forgotten when the session ends.
        """
        self._leftovers.add(nodes, self._leftover_sid())

    def delete_children_later(self, parent: str, data: bytes) -> None:
        """Delete this session's ephemeral children of ``parent`` holding exactly ``data``
        when it is connected (again), whatever their names: for a sequential node whose
        create may still run (queued in kazoo while the connection was down, or sent
        and not answered). ``data`` must be unique to the caller (an election's token).
        Forgotten when the session ends; settled by one pass once connected.
        """
        self._leftovers.add_children(parent, data, self._leftover_sid())

    def _leftover_sid(self) -> int:
        """The session leftovers are kept for now (0: none, nothing is kept)."""
        return self.session_id if self._zk is not None else 0

    async def wait_connected(self) -> None:
        """Wait until the session is connected (bound it with ``asyncio.timeout``)."""
        while self.state != "connected":
            if self.state == "closed":
                raise CoordinationError("the ZooKeeper session is closed", retriable=False)
            await self._changed.wait()

    async def op(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``client.<name>_async(*args, **kwargs)`` in a thread, waited up to ``op_timeout_s``.

        kazoo's answers (``NoNodeError``, ``NodeExistsError``, ``BadVersionError``
        ...) are raised as they are; "ZooKeeper did not answer" (connection
        loss, expired session, timeout) becomes a retriable
        :class:`CoordinationError`.
        """
        zk = self.client
        func = getattr(zk, f"{name}_async")
        return await self._run(lambda: func(*args, **kwargs).get(timeout=self.op_timeout_s), name)

    async def commit(self, build: Callable[[Any], None]) -> list[Any]:
        """Run a ZooKeeper transaction: ``build(transaction)`` adds the operations.

        Returns kazoo's result list (an exception instance in the place of a
        failed operation; everything after it is rolled back).
        """
        zk = self.client

        def run() -> list[Any]:
            tx = zk.transaction()
            build(tx)
            result: list[Any] = tx.commit_async().get(timeout=self.op_timeout_s)
            return result

        answer: list[Any] = await self._run(run, "transaction")
        return answer

    async def call(self, func: Callable[[Any], T]) -> T:
        """``func(client)`` in a thread: several requests in one hop.

        ``func`` must bound its own waits (``client.<op>_async(...).get(timeout=
        session.op_timeout_s)``); errors are mapped as in :meth:`op`.
        """
        zk = self.client
        result: T = await self._run(lambda: func(zk), "request")
        return result

    async def ensure_path(self, path: str) -> None:
        """Create ``path`` and its parents (persistent, empty) when missing."""
        await self.op("ensure_path", path)

    async def _run(self, call: Callable[[], Any], what: str) -> Any:
        t0 = time.monotonic()
        try:
            result = await self._in_thread(call)
        except _UNREACHABLE as exc:
            raise CoordinationError(
                f"ZooKeeper {what} failed: {type(exc).__name__}", retriable=True
            ) from None
        if t0 > self.last_ok:
            self.last_ok = t0
        return result

    async def _in_thread(self, call: Callable[[], T]) -> T:
        if self._pool is None:
            raise CoordinationError("the ZooKeeper session is closed", retriable=False)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def _watch_negotiation(self, zk: Any) -> None:
        """Record the session timeout the server grants at each connect.

        kazoo does not keep it: it reads it from the server's answer to the
        connect request (``time_out``, ms), which its connection handler's
        ``_invoke`` returns. This wrapper records it there, before kazoo
        reports the session connected. Without that method (another kazoo),
        the timeout asked for is used and a warning says so.
        """
        handler: Any = getattr(zk, "_connection", None)
        invoke = getattr(handler, "_invoke", None)
        if invoke is None:
            log.warning(
                "cannot read the session timeout ZooKeeper grants (kazoo changed): leases "
                "assume the %g s asked for; keep it within the servers' maxSessionTimeout",
                self.config.session_timeout_s,
            )
            return

        def recording(*args: Any, **kwargs: Any) -> Any:
            result = invoke(*args, **kwargs)
            answer = result[0] if isinstance(result, tuple) and result else None
            time_out = getattr(answer, "time_out", None)
            if isinstance(time_out, int) and time_out > 0:
                granted = time_out / 1000.0
                if granted < self.config.session_timeout_s and granted != self.negotiated_timeout_s:
                    log.warning(
                        "ZooKeeper granted a session timeout of %g s, not the %g s asked "
                        "for (its maxSessionTimeout): leases use %g s",
                        granted,
                        self.config.session_timeout_s,
                        granted,
                    )
                self.negotiated_timeout_s = granted
            return result

        handler._invoke = recording

    def _shutdown_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    # -- state hand-off ------------------------------------------------------------

    def _on_kazoo_state(self, kstate: str) -> None:
        """kazoo's connection thread: record at once, hand to the loop (never blocks)."""
        state = _KAZOO_STATES.get(kstate)
        if state is None:
            return
        self.thread_state = state
        sid = 0
        if state == "connected":
            # the session id now, on this thread: read later on the loop, a connection
            # lost meanwhile shows none, which looked like a new session
            zk = self._zk
            client_id = zk.client_id if zk is not None else None
            sid = int(client_id[0]) if client_id else 0
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
            loop.call_soon_threadsafe(self._set_state, state, sid)

    def _set_state(self, state: SessionState, sid: int = 0) -> None:
        """On the loop: ``state`` as kazoo's thread saw it, with the session id it saw
        then for ``"connected"`` (0: unknown, taken as the same session)."""
        if self._zk is None:
            return  # stopped: late reports from kazoo's thread are dropped
        new_session = False
        if state == "connected" and sid:
            new_session = sid != self.session_id
            self.session_id = sid
        if state == self.state and not new_session:
            return
        log.info(
            "ZooKeeper session %s: %s%s",
            hex(self.session_id),
            state,
            " (new session)" if new_session else "",
        )
        self.state = state
        self._changed.set()
        self._changed = asyncio.Event()
        self._leftovers.on_state(state, new_session)
        change = StateChange(state, self.session_id, new_session)
        for callback in list(self._listeners):
            try:
                callback(change)
            except Exception:
                log.exception("a ZooKeeper state listener failed")


def _close_quietly(zk: Any) -> None:
    with contextlib.suppress(Exception):
        zk.stop()
    with contextlib.suppress(Exception):
        zk.close()
