"""Creating and deleting a group member's owner nodes ``owners/<unit>``.

Both run as one thread hop on the session (several pipelined requests) and
are fenced by the member node: a create or a delete goes through only in a
transaction that also checks that the member's own node still exists. After
the session expired the member node is gone, so a late request (sent on the
client's *new* session) can neither take a unit for a dead registration nor
delete the owner node another member created meanwhile.

Without a member node (the registration ended while the session lives, e.g.
the node was deleted by hand) :func:`delete_owners` deletes only the nodes
whose ephemeral owner is the client's current session: those are this
process's and nobody else's.

Thread-safety: coroutines of the session's event loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any, Literal

from kazoo.exceptions import NodeExistsError, NoNodeError

from changebus.schemas import Unit

from ._group_layout import encode_owner, owner_path, owners_path
from ._session import ZkSession

__all__ = ["CreateOutcome", "create_owner", "delete_owners"]

CreateOutcome = Literal["created", "held", "member gone", "retry"]

#: owner nodes deleted per transaction
_CHUNK = 200


async def create_owner(
    session: ZkSession,
    group: str,
    member_path: str,
    member_sid: int,
    unit: Unit,
    watch: Callable[[Any], None],
) -> CreateOutcome:
    """Try to create ``owners/<unit>`` for the member of ``member_path``.

    ``created``: the node is the member's (also when an earlier create of the
    same session made it); ``held``: another session holds it and ``watch``
    is set on it (it fires when the node goes); ``member gone``: the member
    node no longer exists; ``retry``: the node vanished meanwhile, try again.
    """
    node, parent = owner_path(group, unit), owners_path(group)
    member_id = member_path.rpartition("/")[2]
    data, timeout = encode_owner(member_id), session.op_timeout_s

    def run(zk: Any) -> CreateOutcome:
        tx = zk.transaction()
        tx.check(member_path, -1)
        tx.create(node, data, ephemeral=True)
        results = tx.commit_async().get(timeout=timeout)
        if not any(isinstance(r, Exception) for r in results):
            return "created"
        if isinstance(results[0], NoNodeError):
            return "member gone"
        if isinstance(results[1], NoNodeError):  # the owners/ parent is missing
            zk.ensure_path_async(parent).get(timeout=timeout)
            return "retry"
        if not isinstance(results[1], NodeExistsError):
            raise next(r for r in results if isinstance(r, Exception))
        stat = zk.exists_async(node, watch=watch).get(timeout=timeout)
        if stat is None:
            return "retry"
        if stat.ephemeralOwner != member_sid:
            return "held"
        with contextlib.suppress(NoNodeError):  # ours from before: name the current member
            zk.set_async(node, data, version=stat.version).get(timeout=timeout)
        return "created"

    outcome: CreateOutcome = await session.call(run)
    return outcome


async def delete_owners(
    session: ZkSession, group: str, member_path: str, units: Iterable[Unit]
) -> None:
    """Delete the member's owner nodes of ``units`` (missing ones are fine).

    With ``member_path`` the deletes are fenced by the member node (see the
    module docstring); without it, or when the member node is gone, only
    nodes of the client's current session are deleted.
    """
    nodes = sorted(owner_path(group, u) for u in units)
    if not nodes:
        return
    timeout = session.op_timeout_s

    def fenced(zk: Any, batch: list[str]) -> bool | None:
        """True: all deleted; False: some were missing; None: the member node is gone."""
        tx = zk.transaction()
        tx.check(member_path, -1)
        for node in batch:
            tx.delete(node)
        results = tx.commit_async().get(timeout=timeout)
        if not any(isinstance(r, Exception) for r in results):
            return True
        return None if isinstance(results[0], NoNodeError) else False

    def by_session(zk: Any, batch: list[str]) -> None:
        client = zk.client_id
        if not client:
            return  # not connected: the session's ephemeral nodes go with it, or later
        sid = int(client[0])
        pending = [(node, zk.exists_async(node)) for node in batch]
        for node, answer in pending:
            stat = answer.get(timeout=timeout)
            if stat is not None and stat.ephemeralOwner == sid:
                with contextlib.suppress(NoNodeError):
                    zk.delete_async(node, version=stat.version).get(timeout=timeout)

    def run(zk: Any) -> None:
        for at in range(0, len(nodes), _CHUNK):
            batch = nodes[at : at + _CHUNK]
            if not member_path:
                by_session(zk, batch)
                continue
            done = fenced(zk, batch)
            if done is None:
                by_session(zk, batch)
            elif not done:
                for node in batch:  # one by one: skip the missing ones
                    if fenced(zk, [node]) is None:
                        by_session(zk, [node])

    await session.call(run)
