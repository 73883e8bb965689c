"""``ZkUnitStore``: a consumer group's fenced unit checkpoints in ZooKeeper.

One persistent znode per unit, ``/changebus/groups/<group>/checkpoints/<unit>``
(JSON :class:`~changebus.cluster._group_layout.UnitRecord`: the checkpoint,
the member that claimed the unit last, the claim's generation and the write
time). The *token* handed to the consumer is the znode version.

* ``claim``: read the node (create it when missing), then set it with the
  claimer as owner and ``generation + 1``, compare-and-set on the version
  read (retried when someone else wrote in between). The new version is the
  token; every earlier token now fails. With a ``fence`` (the claimant's
  member node path) the write is one transaction with checks of that node
  and of the unit's owner node (``owners/<unit>``, which must name the
  claimant's member): a member whose membership ended (a pause past its
  session) cannot raise the generation after its successor claimed, nor can
  a live member that no longer holds the unit (it released it, and a late
  claim would fence the member reading it now).
* ``commit``: per unit ``set(data, version=token)``, several units in one
  transaction (a failed transaction is retried unit by unit to find the
  refused ones). A version mismatch is not always a foreign write: when the
  answer to an earlier commit was lost (ZooKeeper restarted, a connection
  dropped) the version moved on by this claim's own write. So on a mismatch
  the node is read, and the commit goes through only if the stored owner
  and generation are still the ones of this claim -- a claim by anyone
  else changes both. Otherwise the unit is *fenced*, as it is when the node
  is gone or the token predates the store's own newest claim of the unit.

The store remembers (owner, generation, first token) of its own claims; a
commit for a claim it did not make (another process) is checked against the
node's current version only.

Thread-safety: coroutines of the session's event loop; each call is one
thread hop on the session's workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from changebus.schemas import CommitResult, StoredUnit, Unit, UnitClaim, UnitCommit
from changebus.schemas.errors import ChangebusError, FencedError

from ._errors import CoordinationError
from ._group_layout import (
    UnitRecord,
    checkpoint_path,
    checkpoints_path,
    decode_owner,
    decode_unit_record,
    encode_unit_record,
    owner_path,
)
from ._group_nodes import mapped
from ._session import ZkSession, failed_op

__all__ = ["ZkUnitStore"]


class _NotAMember(Exception):
    """The claimant's member node is gone: the claim must not land."""


class _NotTheOwner(Exception):
    """The unit's owner node is gone or names another member: the claim must not land."""


class _Replaced(Exception):
    """The unit's owner node is not the one the claim's fence names (made since)."""


log = logging.getLogger("changebus.cluster.group.store")

#: units per commit transaction
_CHUNK = 200
#: compare-and-set attempts of one claim or commit before giving up (retriable)
_ATTEMPTS = 50


class ZkUnitStore:
    """:class:`~changebus.schemas.UnitStore` over ``session`` (see the module docstring).

    The session is the caller's: :meth:`close` forgets the claims, it does
    not stop the session.
    """

    def __init__(self, session: ZkSession, *, fence: Callable[[], str] | None = None) -> None:
        self.session = session
        #: the claimant's member node path now ("" when it is no member): a claim lands
        #: only while that node exists (checked in the claim's own transaction)
        self.fence = fence
        # (group, unit) -> (owner, generation, token of the claim) of this store's claims
        self._claims: dict[tuple[str, Unit], tuple[str, int, int]] = {}
        self._ready: set[str] = set()

    async def _ensure(self, group: str) -> None:
        if group not in self._ready:
            path = checkpoints_path(group)
            await mapped(f"creating {path}", self.session.ensure_path(path))
            self._ready.add(group)

    async def claim(self, group: str, unit: Unit, owner: str, fence: int = -1) -> UnitClaim:
        """Raise ``unit``'s generation for ``owner``; the token is the new znode version.

        With the store's member fence the claim checks the unit's owner node
        itself in the same transaction. Without one (a store the application
        made), ``fence`` (the owner node's czxid, >= 0) is checked against the
        owner node in that transaction instead: a claimant paused between its
        acquire and its claim, whose node was replaced meanwhile, is refused with
        :class:`~changebus.schemas.FencedError` (it was a bare read-modify-write,
        and the late claim fenced the unit's rightful owner: review). A narrow
        window remains there: the czxid is read before the transaction, which
        can check only the node's version, and a node deleted and made again in
        between has version 0 as the untouched one had. The consumer's own store
        (with the member fence) has no such window.
        """
        node, parent = checkpoint_path(group, unit), checkpoints_path(group)
        await self._ensure(group)
        timeout = self.session.op_timeout_s

        member_fence = self.fence
        owner_node = owner_path(group, unit)

        def guards(zk: Any) -> list[tuple[str, int]]:
            """(path, version) of the claimant's member node and of the unit's owner node,
            which must name the claimant's member; none without a fence."""
            if member_fence is None:
                if fence < 0:
                    return []
                try:
                    ostat = zk.exists_async(owner_node).get(timeout=timeout)
                except NoNodeError:
                    ostat = None
                if ostat is None or int(ostat.czxid) != fence:
                    raise _Replaced
                return [(owner_node, int(ostat.version))]
            path = member_fence()
            stat = zk.exists_async(path).get(timeout=timeout) if path else None
            if stat is None:
                raise _NotAMember
            try:
                data, ostat = zk.get_async(owner_node).get(timeout=timeout)
            except NoNodeError:
                raise _NotTheOwner from None
            try:
                holder = decode_owner(data, owner_node)
            except CoordinationError:
                raise _NotTheOwner from None
            if holder != path.rpartition("/")[2]:
                raise _NotTheOwner
            return [(path, int(stat.version)), (owner_node, int(ostat.version))]

        def write(zk: Any, checks: list[tuple[str, int]], op: Any) -> Any:
            """``op(tx)`` in one transaction with the ``checks``; its result."""
            tx = zk.transaction()
            for path, version in checks:
                tx.check(path, version)
            op(tx)
            results = tx.commit_async().get(timeout=timeout)
            failed = failed_op(results)
            if failed is not None and failed < len(checks):
                if isinstance(results[failed], NoNodeError):
                    if member_fence is None:
                        raise _Replaced
                    raise _NotTheOwner if failed else _NotAMember
                raise BadVersionError()  # a guard node changed: read them again
            last = results[-1]
            if isinstance(last, Exception):
                raise last
            return last

        def run(zk: Any) -> tuple[UnitRecord, int]:
            for _ in range(_ATTEMPTS):
                member = guards(zk)
                try:
                    data, stat = zk.get_async(node).get(timeout=timeout)
                except NoNodeError:
                    record = UnitRecord(None, owner, 1, time.time_ns())
                    body = encode_unit_record(record)
                    try:
                        write(zk, member, lambda tx, b=body: tx.create(node, b))
                    except (NodeExistsError, BadVersionError):
                        continue
                    except NoNodeError:  # the group's tree was deleted (group delete --force)
                        zk.ensure_path_async(parent).get(timeout=timeout)
                        continue
                    return record, 0
                old = decode_unit_record(data, node)
                record = UnitRecord(old.checkpoint, owner, old.generation + 1, time.time_ns())
                body, version = encode_unit_record(record), stat.version
                try:
                    new = write(
                        zk, member, lambda tx, b=body, v=version: tx.set_data(node, b, version=v)
                    )
                except (BadVersionError, NoNodeError):
                    continue
                return record, int(new.version)
            raise CoordinationError(f"group {group}: claim of {unit} kept losing races")

        call = asyncio.ensure_future(mapped(f"claiming {node}", self.session.call(run)))
        try:
            record, token = await asyncio.shield(call)
        except asyncio.CancelledError:
            # the claim goes on in its thread: wait for it, so that the caller's cleanup
            # (releasing the owner node) comes after it. A release first would let the
            # next owner recreate the node (version 0 again, which the claim's version
            # check cannot tell apart) and claim, and this claim would then fence it
            with contextlib.suppress(BaseException):
                await call
            raise
        except _NotAMember:
            # a member that lost its membership (a pause past its session) may not raise
            # the generation: that would fence the unit's rightful next owner
            raise CoordinationError(
                f"group {group}: {owner} is no member now; {unit} not claimed", retriable=True
            ) from None
        except _Replaced:
            raise FencedError(
                f"group {group}: {unit}'s owner node was made again since {owner}'s fence "
                f"{fence}: not claimed",
                units=frozenset({str(unit)}),
            ) from None
        except _NotTheOwner:
            # a member still in the group but without the unit's owner node (released, or
            # another member's now) may not either: it would take the unit from its reader
            raise CoordinationError(
                f"group {group}: {owner} does not hold {unit}'s owner node; not claimed",
                retriable=True,
            ) from None
        self._claims[(group, unit)] = (owner, record.generation, token)
        log.debug("group %s: %s claimed %s (generation %d)", group, owner, unit, record.generation)
        return UnitClaim(unit, record.checkpoint, token, record.generation)

    async def commit(self, group: str, commits: Sequence[UnitCommit]) -> CommitResult:
        """Write the checkpoints whose claims still hold; report the others as fenced."""
        latest = {c.unit: c for c in commits}  # the last commit of a unit wins
        if not latest:
            return CommitResult()
        timeout = self.session.op_timeout_s
        claims = {u: self._claims.get((group, u)) for u in latest}
        now = time.time_ns()

        def identity(zk: Any, c: UnitCommit, fenced: set[Unit]) -> tuple[str, int] | None:
            """(owner, generation) of the claim behind ``c``; None (and fenced) if not current."""
            known = claims[c.unit]
            if known is not None:
                if c.token < known[2]:
                    fenced.add(c.unit)  # a token of an earlier claim of this store
                    return None
                return known[0], known[1]
            node = checkpoint_path(group, c.unit)
            try:
                data, stat = zk.get_async(node).get(timeout=timeout)
            except NoNodeError:
                fenced.add(c.unit)
                return None
            if stat.version != c.token:
                fenced.add(c.unit)
                return None
            record = decode_unit_record(data, node)
            return record.owner, record.generation

        def one(zk: Any, unit: Unit, data: bytes, token: int, who: tuple[str, int]) -> int | None:
            """Write one unit; the new version, or None when fenced."""
            node = checkpoint_path(group, unit)
            version = token
            for _ in range(_ATTEMPTS):
                try:
                    return int(
                        zk.set_async(node, data, version=version).get(timeout=timeout).version
                    )
                except NoNodeError:
                    return None
                except BadVersionError:
                    pass
                try:
                    raw, stat = zk.get_async(node).get(timeout=timeout)
                except NoNodeError:
                    return None
                record = decode_unit_record(raw, node)
                if (record.owner, record.generation) != who or stat.version < token:
                    return None
                version = stat.version  # our own earlier write whose answer was lost
            raise CoordinationError(f"group {group}: commit of {unit} kept losing races")

        def run(zk: Any) -> tuple[dict[Unit, int], set[Unit]]:
            tokens: dict[Unit, int] = {}
            fenced: set[Unit] = set()
            plans: list[tuple[Unit, bytes, int, tuple[str, int]]] = []
            for unit in sorted(latest):
                c = latest[unit]
                who = identity(zk, c, fenced)
                if who is None:
                    continue
                record = UnitRecord(c.checkpoint, who[0], who[1], now)
                plans.append((unit, encode_unit_record(record), c.token, who))
            for at in range(0, len(plans), _CHUNK):
                batch = plans[at : at + _CHUNK]
                tx = zk.transaction()
                for unit, data, token, _who in batch:
                    tx.set_data(checkpoint_path(group, unit), data, token)
                results = tx.commit_async().get(timeout=timeout)
                if not any(isinstance(r, Exception) for r in results):
                    for (unit, *_rest), stat in zip(batch, results, strict=True):
                        tokens[unit] = int(stat.version)
                    continue
                for unit, data, token, who in batch:
                    version = one(zk, unit, data, token, who)
                    if version is None:
                        fenced.add(unit)
                    else:
                        tokens[unit] = version
            return tokens, fenced

        what = f"writing checkpoints in {checkpoints_path(group)}"
        tokens, fenced = await mapped(what, self.session.call(run))
        for unit in fenced:
            self._claims.pop((group, unit), None)
        if fenced:
            log.info(
                "group %s: commit refused for %s (claimed by another member)",
                group,
                " ".join(sorted(str(u) for u in fenced)[:8]),
            )
        return CommitResult(tokens=tokens, fenced=frozenset(fenced))

    async def read(self, group: str) -> dict[Unit, StoredUnit]:
        """Every unit checkpoint of ``group`` (malformed nodes are logged and left out)."""
        parent, timeout = checkpoints_path(group), self.session.op_timeout_s

        def run(zk: Any) -> list[tuple[str, bytes | None]]:
            try:
                names = zk.get_children_async(parent).get(timeout=timeout)
            except NoNodeError:
                return []
            pending = [(name, zk.get_async(f"{parent}/{name}")) for name in sorted(names)]
            found: list[tuple[str, bytes | None]] = []
            for name, answer in pending:
                try:
                    found.append((name, answer.get(timeout=timeout)[0]))
                except NoNodeError:
                    continue
            return found

        out: dict[Unit, StoredUnit] = {}
        for name, data in await mapped(f"reading {parent}", self.session.call(run)):
            node = f"{parent}/{name}"
            try:
                unit = Unit.parse(name)
                record = decode_unit_record(data, node)
            except ChangebusError as exc:
                log.warning("group %s: skipping checkpoint node %s: %s", group, node, exc)
                continue
            out[unit] = StoredUnit(
                unit, record.checkpoint, record.owner, record.generation, record.updated_ns
            )
        return out

    async def close(self) -> None:
        """Forget this store's claims (the session stays open)."""
        self._claims.clear()
        self._ready.clear()
