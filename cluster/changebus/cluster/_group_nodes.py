"""The znode operations of a consumer-group member: meta, member node, owner nodes.

Each function is one thread hop on the session (several pipelined
requests). kazoo's "the answer is no" errors that the caller cannot act on
(no access, a vanished parent) come back as a non-retriable
:class:`CoordinationError`; "ZooKeeper did not answer" as a retriable one.

* :func:`check_meta`: create ``meta`` or compare with it (:class:`ConfigError`
  naming the stored and the configured values);
* :func:`create_member`: the ephemeral sequential member node, after
  deleting orphans of the same member and session (a create whose answer
  was lost);
* :func:`create_owner` / :func:`delete_owners`: the owner nodes, fenced by
  the member node: a create or a delete goes through only in a
  transaction that also checks that the member's own node still exists. After
the session expired the member node is gone, so a late request (sent on the
client's *new* session) can neither take a unit for a dead registration nor
delete the owner node another member created meanwhile.

Without a member node (the registration ended while the session lives, e.g.
the node was deleted by hand) :func:`delete_owners` deletes only the nodes
whose ephemeral owner is the client's current session: those are this
process's and nobody else's.

* :func:`leave_for_later`: the nodes a stop could not delete (ZooKeeper
  away), deleted when the session is connected again
  (:meth:`ZkSession.delete_later`): a live session would otherwise keep a
  member nobody runs, which the leader gives units to.

Thread-safety: coroutines of the session's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal, TypeVar

from kazoo.exceptions import BadVersionError, KazooException, NodeExistsError, NoNodeError

from changebus.schemas import Unit
from changebus.schemas.errors import ChangebusError, ConfigError

from ._errors import CoordinationError
from ._group_layout import (
    MEMBER_PREFIX,
    GroupMeta,
    decode_member_record,
    decode_meta,
    encode_meta,
    encode_owner,
    group_members_path,
    group_root,
    meta_path,
    owner_path,
    owners_path,
)
from ._session import ZkSession

__all__ = [
    "LOOP_ERRORS",
    "CreateOutcome",
    "check_meta",
    "create_member",
    "create_owner",
    "delete_owners",
    "leave_for_later",
    "mapped",
    "retry_pause",
]

log = logging.getLogger("changebus.cluster.group")

T = TypeVar("T")

CreateOutcome = Literal["created", "held", "member gone", "retry"]

#: owner nodes deleted per transaction
_CHUNK = 200


async def mapped(what: str, call: Awaitable[T]) -> T:
    """``await call``, kazoo's refusals as a non-retriable CoordinationError naming ``what``."""
    try:
        return await call
    except KazooException as exc:
        raise CoordinationError(
            f"ZooKeeper refused {what}: {type(exc).__name__}", retriable=False
        ) from None


async def check_meta(session: ZkSession, group: str, want: GroupMeta) -> bool:
    """Create the group's ``meta`` as ``want`` (True) or check it equals ``want`` (False)."""
    node = meta_path(group)
    await mapped(f"creating {group_root(group)}", session.ensure_path(group_root(group)))
    try:
        await session.op("create", node, encode_meta(want))
        return True
    except NodeExistsError:
        pass
    except KazooException as exc:
        raise CoordinationError(
            f"ZooKeeper refused creating {node}: {type(exc).__name__}", retriable=False
        ) from None
    data, _stat = await mapped(f"reading {node}", session.op("get", node))
    have = decode_meta(data, node)
    if have.buckets != want.buckets:
        raise ConfigError(
            f"group {group} uses {have.buckets} buckets (stored in ZooKeeper at "
            f"{node}); this member is configured with {want.buckets}"
        )
    if have.partitions != want.partitions:
        raise ConfigError(
            f"group {group} reads partitions {', '.join(have.partitions)} (stored in "
            f"ZooKeeper at {node}); this member is configured with {', '.join(want.partitions)}"
        )
    return False


async def create_member(
    session: ZkSession, group: str, data: bytes, started_ns: int, pid: int
) -> tuple[str, int]:
    """Create the member node; (its path, the session that owns it).

    First deletes nodes of the client's session whose record names the same
    ``started_ns`` and ``pid`` (an earlier create of this member whose answer
    was lost: left alone, the leader would give it units nobody reads).
    """
    parent, timeout = group_members_path(group), session.op_timeout_s

    def create(zk: Any) -> tuple[str, int]:
        zk.ensure_path_async(parent).get(timeout=timeout)
        client = zk.client_id
        sid = int(client[0]) if client else 0
        names = zk.get_children_async(parent).get(timeout=timeout)
        pending = [(f"{parent}/{name}", zk.get_async(f"{parent}/{name}")) for name in names]
        for node, answer in pending:
            with contextlib.suppress(NoNodeError, CoordinationError):
                raw, stat = answer.get(timeout=timeout)
                record = decode_member_record(raw, node)
                if stat.ephemeralOwner == sid and (record["started_ns"], record["pid"]) == (
                    started_ns,
                    pid,
                ):
                    zk.delete_async(node).get(timeout=timeout)
        path = zk.create_async(
            f"{parent}/{MEMBER_PREFIX}", data, ephemeral=True, sequence=True
        ).get(timeout=timeout)
        stat = zk.exists_async(path).get(timeout=timeout)
        if stat is None:
            raise CoordinationError(f"group member node {path} vanished at once")
        return str(path), int(stat.ephemeralOwner)

    return await mapped(f"creating a member node in {parent}", session.call(create))


async def create_owner(
    session: ZkSession,
    group: str,
    member_path: str,
    member_sid: int,
    unit: Unit,
    watch: Callable[[Any], None],
) -> tuple[CreateOutcome, int]:
    """Try to create ``owners/<unit>`` for the member of ``member_path``; (outcome, czxid).

    ``created``: the node is the member's (also when an earlier create of the
    same session made it); ``held``: another session holds it and ``watch``
    is set on it (it fires when the node goes); ``member gone``: the member
    node no longer exists; ``retry``: the node vanished meanwhile, try again.
    With ``created`` comes the node's creation zxid: every later owner node
    of the unit has a larger one (the claim's fence, see
    :class:`changebus.schemas.UnitStore`); -1 with the other outcomes.
    """
    node, parent = owner_path(group, unit), owners_path(group)
    member_id = member_path.rpartition("/")[2]
    data, timeout = encode_owner(member_id), session.op_timeout_s

    def run(zk: Any) -> tuple[CreateOutcome, int]:
        tx = zk.transaction()
        tx.check(member_path, -1)
        tx.create(node, data, ephemeral=True)
        results = tx.commit_async().get(timeout=timeout)
        if not any(isinstance(r, Exception) for r in results):
            stat = zk.exists_async(node).get(timeout=timeout)  # (its czxid)
            if stat is None or stat.ephemeralOwner != member_sid:
                return "retry", -1  # gone with the session meanwhile: look again
            return "created", int(stat.czxid)
        if isinstance(results[0], NoNodeError):
            return "member gone", -1
        if isinstance(results[1], NoNodeError):  # the owners/ parent is missing
            zk.ensure_path_async(parent).get(timeout=timeout)
            return "retry", -1
        if not isinstance(results[1], NodeExistsError):
            names = ", ".join(type(r).__name__ for r in results)
            raise CoordinationError(f"ZooKeeper refused creating {node}: {names}", retriable=False)
        stat = zk.exists_async(node, watch=watch).get(timeout=timeout)
        if stat is None:
            return "retry", -1
        if stat.ephemeralOwner != member_sid:
            return "held", -1
        try:  # ours from before: name the current member
            zk.set_async(node, data, version=stat.version).get(timeout=timeout)
        except (NoNodeError, BadVersionError):
            return "retry", -1  # it went (or changed) meanwhile: look again
        return "created", int(stat.czxid)

    outcome: tuple[CreateOutcome, int] = await mapped(f"creating {node}", session.call(run))
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

    await mapped(f"deleting owner nodes in {owners_path(group)}", session.call(run))


#: backoff of a member's loops after failed rounds (seconds, the last one repeats)
_RETRY_S = (0.05, 0.1, 0.2, 0.5, 1.0)
#: what a round of a member's loop may fail with and survive
LOOP_ERRORS = (CoordinationError, ConfigError, KazooException)


async def retry_pause(session: ZkSession, failures: int, what: str, exc: Exception) -> bool:
    """Back off after the ``failures``-th failed round of a loop; False: the session is closed.

    A retriable error is logged at INFO (ZooKeeper away), anything else at
    ERROR (it will not fix itself, the loop still tries again).
    """
    if session.state == "closed":
        log.info("%s: the session closed, the loop ends", what)
        return False
    delay = _RETRY_S[min(failures, len(_RETRY_S) - 1)]
    retriable = isinstance(exc, CoordinationError) and exc.retriable
    log.log(
        logging.INFO if retriable else logging.ERROR,
        "%s: retry in %.2f s after %s",
        what,
        delay,
        exc if isinstance(exc, ChangebusError) else type(exc).__name__,
    )
    await asyncio.sleep(delay)
    return True


def leave_for_later(
    session: ZkSession,
    group: str,
    member_path: str,
    member_id: str,
    units: dict[Unit, int],
    record: bytes,
) -> None:
    """Hand the member's undeleted nodes to the session: owner nodes of ``units``
    (unit -> czxid, -1: unknown; deleted only while they still name ``member_id``),
    then the member node (``member_path``; "" when it was deleted); and any member node
    of this session holding ``record``: a registration whose create kazoo still holds
    (queued while the connection was down, or cut off by the stop's cancel) runs later,
    and the leader would give units to a member nobody runs (review)."""
    mine = encode_owner(member_id)
    nodes: dict[str, tuple[int, bytes | None]] = {
        owner_path(group, u): (czxid, mine) for u, czxid in sorted(units.items())
    }
    if member_path:
        nodes[member_path] = (-1, None)
    session.delete_later(nodes)
    session.delete_children_later(group_members_path(group), record)
