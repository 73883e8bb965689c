"""``Registry``: this member's ephemeral node ``members/<member_id>``.

The node holds :class:`~changebus.cluster.MemberInfo` as JSON (layout in
:mod:`changebus.cluster._layout`). :meth:`Registry.update` replaces the
partitions part; writes are throttled to one per ``min_interval_s`` (every
ZooKeeper write is fsynced), the newest payload winning, and
:meth:`Registry.flush` writes at once.

Re-registration: the node dies with the session. When the session comes
back as a *new* session (after LOST), or a write finds the node missing, the
registry creates it again by itself, with the newest payload, retrying
until ZooKeeper answers. A node of the same name owned by another session
(this member's previous process, not yet expired) is replaced: member ids
are unique per cluster, so it can only be a dead predecessor.

Thread-safety: all methods on the session's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping

from kazoo.exceptions import KazooException, NodeExistsError, NoNodeError

from changebus.schemas import stop_task

from ._errors import CoordinationError
from ._layout import Kind, MemberInfo, PartitionState, encode_member, member_path, members_path
from ._session import StateChange, ZkSession

__all__ = ["Registry"]

log = logging.getLogger("changebus.cluster.registry")


class Registry:
    """Registers one member (a relay or a bootstrap server) in the cluster."""

    def __init__(
        self,
        session: ZkSession,
        kind: Kind,
        *,
        member_id: str | None = None,
        url: str | None = None,
        min_interval_s: float = 1.0,
    ) -> None:
        self.session = session
        member = member_id or session.config.member_id
        if not member:
            raise CoordinationError("a member needs a member id", retriable=False)
        self.info = MemberInfo(
            member_id=member,
            kind=kind,
            url=url if url is not None else session.config.advertised_url,
        )
        self.path = member_path(session.config.name, member)
        self.min_interval_s = min_interval_s
        #: how many times the node was created (1 after start; more after re-registrations)
        self.registrations = 0
        self._written = 0.0
        self._dirty = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._remove_listener: Callable[[], None] | None = None
        self._registered = False

    async def start(self) -> None:
        """Create the node now (raises :class:`CoordinationError` if ZooKeeper does not answer)."""
        await self.session.ensure_path(members_path(self.session.config.name))
        await self._register()
        self._remove_listener = self.session.add_listener(self._on_state)
        self._task = asyncio.create_task(self._keep(), name=f"registry-{self.info.member_id}")

    async def stop(self) -> None:
        """Stop keeping the node and delete it (best effort)."""
        if self._remove_listener is not None:
            self._remove_listener()
        task, self._task = self._task, None
        await stop_task(task)
        if self.session.connected and self._registered:
            with contextlib.suppress(CoordinationError, NoNodeError):
                await self.session.op("delete", self.path)
        self._registered = False

    def update(self, partitions: Mapping[str, PartitionState]) -> None:
        """Publish a new partitions table (written within ``min_interval_s``)."""
        self.info = MemberInfo(self.info.member_id, self.info.kind, self.info.url, dict(partitions))
        self._dirty = True
        self._wake.set()

    async def flush(self) -> None:
        """Write the newest payload now."""
        await self._write()

    # -- keeping the node ---------------------------------------------------------

    def _on_state(self, change: StateChange) -> None:
        if change.state == "connected" and change.new_session:
            self._registered = False
        self._wake.set()

    async def _register(self) -> None:
        session, data = self.session, encode_member(self.info)
        try:
            try:
                await session.op("create", self.path, data, ephemeral=True)
            except NoNodeError:  # the tree is gone (ZooKeeper lost its data): make it again
                await session.ensure_path(members_path(session.config.name))
                await session.op("create", self.path, data, ephemeral=True)
        except NodeExistsError:
            try:
                _data, stat = await session.op("get", self.path)
                if stat.ephemeralOwner != session.session_id:
                    log.info("member %s: replacing a node of an older session", self.info.member_id)
                    await session.op("delete", self.path)
                    await session.op("create", self.path, data, ephemeral=True)
                else:
                    await session.op("set", self.path, data)
            except (NoNodeError, NodeExistsError):
                raise CoordinationError(
                    f"member {self.info.member_id}: node changed during registration"
                ) from None
        self._registered = True
        self._dirty = False
        self._written = time.monotonic()
        self.registrations += 1
        log.info("member %s registered (%s)", self.info.member_id, self.info.url)

    async def _write(self) -> None:
        if not self._registered:
            await self._register()
            return
        self._dirty = False
        try:
            await self.session.op("set", self.path, encode_member(self.info))
        except NoNodeError:
            self._registered = False
            await self._register()
        except (CoordinationError, KazooException):
            self._dirty = True  # (written again by _keep)
            raise
        self._written = time.monotonic()

    async def _keep(self) -> None:
        failures = 0
        while True:
            self._wake.clear()
            if self._registered and not self._dirty:
                await self._wake.wait()
                continue
            if self.session.state != "connected":
                await self.session.wait_connected()
            wait = self._written + self.min_interval_s - time.monotonic()
            if self._registered and wait > 0:
                await asyncio.sleep(wait)
            try:
                await self._write()
                failures = 0
            except (CoordinationError, KazooException) as exc:
                # (KazooException: a node removed under us again, an ACL refusing us: the
                # registry keeps trying, it never ends quietly)
                failures += 1
                log.info("member %s: registry write failed: %r", self.info.member_id, exc)
                # (2**failures overflowed a float at 1,024 failures in a row, about 17
                # minutes: the task ended without a word and never wrote again; review)
                await asyncio.sleep(min(1.0, 0.05 * 2 ** min(failures, 5)))
