"""The cluster's ZooKeeper ACL: who may change its znodes, and taking a tree back.

With digest credentials in the config (:meth:`ClusterConfig.zk_credentials`),
a :class:`~._session.ZkSession` authenticates and its creates carry the
cluster's ACL (:func:`cluster_acl`: the user may do anything, the world may
read unless ``zk_world_readable`` is off). After connecting, the session runs
:func:`secure_tree`: it sets that ACL on the persistent nodes of its cluster's
tree, so a tree created earlier without credentials (or by someone else) is
taken back. ``/changebus`` itself stays open, so clusters with other
credentials share it; ephemeral nodes are left alone (their owners' sessions
created them).

Thread-safety: :func:`secure_tree` is a coroutine of the session's event
loop (the walk runs in one of the session's worker threads).
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from kazoo.exceptions import NodeExistsError, NoNodeError
from kazoo.security import ACL, OPEN_ACL_UNSAFE, make_acl, make_digest_acl

if TYPE_CHECKING:
    from ._session import ZkSession

__all__ = ["cluster_acl", "secure_tree"]

log = logging.getLogger("changebus.cluster.session")


def cluster_acl(user: str, password: str, *, world_readable: bool) -> list[ACL]:
    """The ACL of a cluster's znodes: ``user`` may do anything, the world may read (or not)."""
    acl = [make_digest_acl(user, password, all=True)]
    if world_readable:
        acl.append(make_acl("world", "anyone", read=True))
    return acl


async def secure_tree(session: ZkSession, acl: list[ACL]) -> None:
    """Create the cluster's root with ``acl`` and set it on its persistent nodes.

    ``/changebus`` is created open (shared by every cluster). Ephemeral
    nodes are left alone: their owners' sessions created them.
    """
    root = session.root
    top = root.rsplit("/", 1)[0]

    def run(zk: Any) -> int:
        timeout = session.op_timeout_s
        if zk.exists_async(top).get(timeout=timeout) is None:
            with contextlib.suppress(NodeExistsError):
                zk.create_async(top, b"", acl=OPEN_ACL_UNSAFE).get(timeout=timeout)
        zk.ensure_path_async(root).get(timeout=timeout)
        wanted = sorted(map(str, acl))
        changed = 0
        # a level of the tree at a time, its requests pipelined (one round trip per
        # request made a start with credentials take 10 s at 1,024 partitions); a
        # node gone meanwhile is skipped
        level = [root]
        while level:
            found = [(path, zk.exists_async(path)) for path in level]
            kept = [
                path
                for path, result in found
                if (stat := result.get(timeout=timeout)) is not None and not stat.ephemeralOwner
            ]
            acls = [(path, zk.get_acls_async(path)) for path in kept]
            kids = [(path, zk.get_children_async(path)) for path in kept]
            sets = []
            for path, result in acls:
                with contextlib.suppress(NoNodeError):
                    current, _ = result.get(timeout=timeout)
                    if sorted(map(str, current)) != wanted:
                        sets.append(zk.set_acls_async(path, acl))
            for result in sets:
                with contextlib.suppress(NoNodeError):
                    result.get(timeout=timeout)
                    changed += 1
            level = []
            for path, result in kids:
                with contextlib.suppress(NoNodeError):
                    level.extend(f"{path}/{child}" for child in result.get(timeout=timeout))
        return changed

    changed = await session.call(run)
    if changed:
        log.warning("set the cluster's ACL on %d znode(s) under %s", changed, root)
