"""Ephemeral nodes a session's owner could not delete, deleted once it is connected again.

An ephemeral node its owner could not delete (an election or a group member
stopped while the connection was down, with the session going on for the
rest of the program) would stay as long as the session does: a stopped
candidate at the head of an election's line, a stopped member the group
leader gives units to. :class:`Leftovers` keeps such nodes
(:meth:`ZkSession.delete_later <._session.ZkSession.delete_later>`) and
deletes them when the same session is connected again; a node that changed
hands meanwhile (another creation: a different czxid; or other data) is left
alone, and a new session forgets them (they went with the old one). Nodes
not known by path are kept as (parent, data) scans
(:meth:`ZkSession.delete_children_later
<._session.ZkSession.delete_children_later>`): a create that was queued in
kazoo while the connection was down still runs when it comes back, after its
caller gave up on it.

Thread-safety: everything runs on the session's event loop; a sweep's
ZooKeeper requests run in one of the session's worker threads, on a copy of
what is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from kazoo.exceptions import BadVersionError, NoNodeError

from ._errors import CoordinationError

if TYPE_CHECKING:
    from ._session import SessionState, ZkSession

__all__ = ["Leftovers"]

log = logging.getLogger("changebus.cluster.session")


class Leftovers:
    """The leftover ephemeral nodes of one :class:`~._session.ZkSession`.

    ``_nodes``: path -> (czxid or -1, data or None), to delete in insertion
    order; ``_children``: (parent, data) -> nothing, this session's ephemeral
    children of parent that hold exactly data. Both belong to session
    ``_sid``: kept for another session id, they are dropped first. At most
    one sweep task runs at a time (``_sweeping``).
    """

    def __init__(self, session: ZkSession) -> None:
        self._session = session
        self._nodes: dict[str, tuple[int, bytes | None]] = {}
        self._children: dict[tuple[str, bytes], None] = {}
        self._sid = 0
        self._sweeping: asyncio.Task[None] | None = None

    def add(self, nodes: dict[str, tuple[int, bytes | None]], sid: int) -> None:
        """Keep ``nodes`` of session ``sid`` (0: no session: nothing is kept)."""
        if not nodes or not self._own(sid):
            return
        self._nodes.update(nodes)
        if self._session.state == "connected":
            self._sweep_soon()

    def add_children(self, parent: str, data: bytes, sid: int) -> None:
        """Keep a scan of ``parent``'s children holding ``data``, of session ``sid``."""
        if not self._own(sid):
            return
        self._children[(parent, data)] = None
        if self._session.state == "connected":
            self._sweep_soon()

    def on_state(self, state: SessionState, new_session: bool) -> None:
        """The session changed state (on the loop): forget, or sweep when connected again."""
        if self._nodes or self._children:
            if new_session or state in ("lost", "closed"):
                self._nodes.clear()  # (they went with the session)
                self._children.clear()
            elif state == "connected" and self._session.session_id == self._sid:
                self._sweep_soon()

    def _own(self, sid: int) -> bool:
        """Whether leftovers can be kept (a session); those of an older session are dropped."""
        if not sid:
            return False
        if self._sid != sid:
            self._nodes.clear()
            self._children.clear()
            self._sid = sid
        return True

    def _sweep_soon(self) -> None:
        if self._sweeping is None or self._sweeping.done():
            self._sweeping = asyncio.get_running_loop().create_task(
                self._sweep(), name="changebus-zk-leftovers"
            )

    async def _sweep(self) -> None:
        """Delete the leftovers (kept for the next connect when ZooKeeper does not answer).

        The worker thread only reads its own copy; the loop forgets the nodes
        it settled, and sweeps again for nodes handed over meanwhile.
        """
        session = self._session
        nodes, sid = dict(self._nodes), self._sid
        scans = list(self._children)
        timeout = session.op_timeout_s

        def run(zk: Any) -> list[str]:
            settled: list[str] = []
            for parent, want in scans:
                with contextlib.suppress(NoNodeError):
                    # after the queued requests (one connection, in order): a create
                    # sent before is answered, so its node is seen
                    zk.sync_async(parent).get(timeout=timeout)
                    names = zk.get_children_async(parent).get(timeout=timeout)
                    for name in names:
                        path = f"{parent}/{name}"
                        with contextlib.suppress(NoNodeError, BadVersionError):
                            found, stat = zk.get_async(path).get(timeout=timeout)
                            if stat.ephemeralOwner == sid and found == want:
                                zk.delete_async(path, version=stat.version).get(timeout=timeout)
                                log.info("ZooKeeper: deleted %s, created after its stop", path)
            for path, (czxid, data) in nodes.items():
                try:
                    found, stat = zk.get_async(path).get(timeout=timeout)
                    mine = stat.ephemeralOwner == sid and czxid in (-1, stat.czxid)
                    if mine and (data is None or found == data):
                        zk.delete_async(path, version=stat.version).get(timeout=timeout)
                        log.info("ZooKeeper: deleted %s, left by a stop while away", path)
                except (NoNodeError, BadVersionError):
                    pass  # gone, or changed meanwhile: not ours to delete
                settled.append(path)
            return settled

        try:
            settled = await session.call(run)
        except CoordinationError as exc:
            log.info(
                "ZooKeeper: %d leftover node(s) stay for the next connect: %s",
                len(nodes) + len(scans),
                exc,
            )
            return
        if sid == self._sid:
            for scan in scans:
                self._children.pop(scan, None)
        for path in settled:
            if self._nodes.get(path) == nodes[path]:  # (not handed over again meanwhile)
                del self._nodes[path]
        left = self._nodes or self._children
        if left and session.state == "connected" and sid == self._sid:
            self._sweeping = None
            self._sweep_soon()  # (nodes handed over while this sweep ran)
