"""Leader election per partition and its epochs (the term's lease: :mod:`._leadership`).

``PartitionElection`` runs one candidate of partition ``p`` (layout in
:mod:`changebus.cluster._layout`):

1. when connected, it creates its candidate ``partitions/<p>/election/c-<seq>``
   (ephemeral sequential, JSON member id and URL) unless the current session
   already has one;
2. it waits until its candidate is the lowest (watching only its
   predecessor, so a leader's exit wakes one candidate, not all);
3. it raises the epoch: one transaction checks that its candidate still
   exists and sets ``partitions/<p>/epoch`` to ``{"epoch": old + 1, member_id,
   url}`` with a compare-and-set on the node's version. Success makes it the
   leader of that epoch (a :class:`Leadership`); a lost race or a vanished
   candidate sends it back to 1 or 2;
4. it leads until the leadership is lost, then goes back to 1. A new term
   always takes a new epoch: a candidate never resumes an old one.

The election ends a :class:`~._leadership.Leadership` (for good) when the
session is SUSPENDED, LOST or closed, when the epoch node changes or the
candidate node is gone (both watched, and read by every heartbeat), or when
the election stops; the term's lease (fencing) is :mod:`._leadership`'s.

Heartbeat: while leading, every ``lease / 3`` one thread hop syncs the
server with the ensemble's leader, then reads the epoch node and checks the
candidate node (three pipelined requests): a server cut off from the
quorum cannot confirm the lease from its own stale copy.

Thread-safety: everything here runs on the event loop of the session (and
the watches on kazoo's thread hand over to it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kazoo.exceptions import NodeExistsError, NoNodeError

from changebus.schemas import stop_task

from ._errors import CoordinationError
from ._layout import (
    CANDIDATE_PREFIX,
    EpochRecord,
    candidate_seq,
    decode_candidate,
    decode_epoch,
    election_path,
    encode_candidate,
    encode_epoch,
    epoch_path,
)
from ._leadership import Leadership
from ._session import StateChange, ZkSession, failed_op

__all__ = ["LeaderInfo", "PartitionElection", "current_leader"]

log = logging.getLogger("changebus.cluster.election")

_RETRY_S = (0.05, 0.1, 0.2, 0.5, 1.0)
#: waits before joining again after an error that is not "ZooKeeper did not answer"
_WITHDRAW_S = (0.5, 1.0, 2.0, 5.0)


@dataclass(frozen=True, slots=True)
class LeaderInfo:
    """The leader of a partition: who, where, and the epoch it leads with."""

    partition: str
    member_id: str
    url: str
    epoch: int


class PartitionElection:
    """This member's candidacy for partition ``partition`` (see the module docstring).

    ``on_elected(leadership)`` runs on the event loop each time it becomes
    leader; pair it with ``leadership.on_lost`` or ``await
    leadership.wait_lost()`` to step down.
    """

    def __init__(
        self,
        session: ZkSession,
        partition: str,
        *,
        member_id: str | None = None,
        url: str | None = None,
        on_elected: Callable[[Leadership], None] | None = None,
        epoch_floor: Callable[[], int] | None = None,
    ) -> None:
        self.session = session
        self.partition = partition
        self.member_id = member_id or session.config.member_id
        self.url = url if url is not None else session.config.advertised_url
        if not self.member_id:
            raise CoordinationError("an election needs a member id", retriable=False)
        self.on_elected = on_elected
        #: the newest epoch the caller saw (e.g. a relay's followers' ``min_epoch``);
        #: with the epochs this election saw itself, a floor for the next one
        self.epoch_floor = epoch_floor
        self._highest_epoch = 0
        self.election = election_path(session.config.name, partition)
        self.epoch_node = epoch_path(session.config.name, partition)
        #: the current term, while leading (None between terms)
        self.leadership: Leadership | None = None
        self._candidate: str | None = None  # full path
        #: this object's candidate nodes' data: a token tells them from those of a later
        #: election of this member in this session (``stop`` while ZooKeeper is away)
        self._candidate_data = encode_candidate(self.member_id, self.url, secrets.token_hex(8))
        self._candidate_session = 0
        self._kick = asyncio.Event()
        self._elected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._remove_listener: Callable[[], None] | None = None
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None  # (for kazoo's watch thread)

    async def start(self) -> None:
        """Join the election (returns at once; the candidacy runs in a task)."""
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._remove_listener = self.session.add_listener(self._on_state)
        self._task = asyncio.create_task(
            self._run(), name=f"election-{self.partition}-{self.member_id}"
        )

    async def stop(self) -> None:
        """Leave the election: end any leadership and delete the candidate node."""
        self._stopping = True
        if self.leadership is not None:
            self.leadership.lose("election stopped")
        if self._remove_listener is not None:
            self._remove_listener()
        task, self._task = self._task, None
        await stop_task(task)
        candidate, self._candidate = self._candidate, None
        if candidate is not None and self.session.connected:
            with contextlib.suppress(CoordinationError, NoNodeError):
                await self.session.op("delete", candidate)
                candidate = None
        dropped = False
        if self.session.connected:
            # and a node ``requeue`` left for the next pass's orphan scan, or a create whose
            # answer the cancel cut off: left, it headed the line while this session lived
            # on (a relay goes on after withdrawing a partition) and nobody else led (review)
            with contextlib.suppress(Exception):
                await self._drop_orphans(self.session.session_id)
                dropped = True
        if not dropped:
            # ZooKeeper away: a create the cancel cut off may wait in kazoo's queue and run
            # once the connection is back, its node then heading the line (review)
            self.session.delete_children_later(self.election, self._candidate_data)
        if candidate is not None:
            # ZooKeeper away: left, the node would stay at the head of the line for as long
            # as the session lives on in this program (no other candidate could lead)
            self.session.delete_later({candidate: (-1, None)})

    def requeue(self, reason: str) -> None:
        """Give up any term and go to the back of the line: the candidacy starts over
        with a new candidate node (the old one is dropped as an orphan of this session),
        so every other member waiting now goes first."""
        term = self.leadership
        if term is not None:
            term.lose(reason)
        self._candidate = None
        self._kick.set()

    async def wait_elected(self) -> Leadership:
        """Wait until this member leads (returns the current term)."""
        while True:
            term = self.leadership
            if term is not None and not term.lost:
                return term
            self._elected.clear()
            await self._elected.wait()

    async def current_leader(self) -> LeaderInfo | None:
        """The partition's leader as ZooKeeper has it now (one read)."""
        return await current_leader(self.session, self.partition)

    # -- the candidacy ----------------------------------------------------------

    def _on_state(self, change: StateChange) -> None:
        if change.state != "connected" and self.leadership is not None:
            self.leadership.lose(f"ZooKeeper session {change.state}")
        if change.new_session:
            self._candidate = None  # its ephemeral node died with the old session
        self._kick.set()

    async def _run(self) -> None:
        """The candidacy's loop. It never ends on an error, only on :meth:`stop` or a
        closed session: a task that died would leave its candidate node in place
        (the session lives), so no other member could ever take its turn."""
        failures = 0
        while not self._stopping:
            try:
                await self.session.wait_connected()
                await self._ensure_candidate()
                if not await self._wait_turn():
                    continue
                term = await self._take_epoch()
                if term is None:
                    continue
                failures = 0
                await self._lead(term)
            except CoordinationError as exc:
                if self.session.state == "closed":
                    log.info("partition %s: the session closed, candidacy ends", self.partition)
                    return
                if exc.retriable:
                    delay = _RETRY_S[min(failures, len(_RETRY_S) - 1)]
                    failures += 1
                    log.info(
                        "partition %s: election retry in %.2f s: %s", self.partition, delay, exc
                    )
                    await asyncio.sleep(delay)
                    continue
                failures = await self._withdraw(exc, failures)
            except Exception as exc:  # noqa: BLE001 - ZooKeeper said no (NoAuth, a node gone ...)
                failures = await self._withdraw(exc, failures)

    async def _withdraw(self, exc: BaseException, failures: int) -> int:
        """After an error the loop cannot retry in place: log it, give up any term and
        the candidate node (the next member goes first), wait, and start over."""
        delay = _WITHDRAW_S[min(failures, len(_WITHDRAW_S) - 1)]
        log.error(
            "partition %s: %s left the election after an error, joins again in %.1f s: %s: %s",
            self.partition,
            self.member_id,
            delay,
            type(exc).__name__,
            exc,
        )
        candidate = self._candidate
        self.requeue(f"election error: {type(exc).__name__}")
        if candidate is not None:  # (now, not as an orphan later: others go first meanwhile)
            with contextlib.suppress(Exception):  # best effort: it dies with the session anyway
                await self.session.op("delete", candidate)
        await asyncio.sleep(delay)
        return failures + 1

    async def _ensure_candidate(self) -> None:
        session = self.session
        if self._candidate is not None and self._candidate_session == session.session_id:
            return
        await session.ensure_path(self.election)
        with contextlib.suppress(NodeExistsError):
            await session.op("create", self.epoch_node, encode_epoch(EpochRecord(0)))
        sid = session.session_id
        await self._drop_orphans(sid)
        path = await session.op(
            "create",
            f"{self.election}/{CANDIDATE_PREFIX}",
            self._candidate_data,
            ephemeral=True,
            sequence=True,
        )
        self._candidate, self._candidate_session = str(path), sid
        log.info("partition %s: %s is candidate %s", self.partition, self.member_id, path)

    async def _drop_orphans(self, sid: int) -> None:
        """Delete candidates of this session left by a create whose answer was lost."""
        election, timeout = self.election, self.session.op_timeout_s

        def scan(zk: Any) -> list[str]:
            # a server we reconnected to may lag behind the one that took the
            # lost create: make it catch up first, or the orphan goes unseen
            zk.sync_async(election).get(timeout=timeout)
            names = zk.get_children_async(election).get(timeout=timeout)
            found = [(n, zk.get_async(f"{election}/{n}")) for n in names]
            mine = []
            for name, pending in found:
                with contextlib.suppress(NoNodeError):
                    data, stat = pending.get(timeout=timeout)
                    if stat.ephemeralOwner == sid and decode_candidate(data)[0] == self.member_id:
                        mine.append(f"{election}/{name}")
            return mine

        for path in await self.session.call(scan):
            with contextlib.suppress(NoNodeError):
                await self.session.op("delete", path)

    # -- watches (kazoo's thread) ------------------------------------------------------
    # Bound methods, equal for every pass, wait and term: kazoo keeps a *set* of watchers
    # per node, where a new closure each time piled up for as long as the node lived (a
    # predecessor for months; review).

    def _predecessor_fired(self, _event: Any) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._kick.set)

    def _candidate_fired(self, event: Any) -> None:
        """The candidate node of the current term was deleted: the lease ends at once."""
        term, loop = self.leadership, self._loop
        if getattr(event, "type", None) != "DELETED" or term is None or loop is None:
            return
        if getattr(event, "path", None) != term.candidate:
            return  # (an earlier candidate's node: not this term's)
        term.revoked = True
        term.confirmed_at = float("-inf")
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(term.lose, "candidate node gone")

    async def _wait_turn(self) -> bool:
        """Wait until our candidate is the lowest; False if it is gone or the session changed."""
        fired = self._predecessor_fired
        while not self._stopping:
            candidate = self._candidate
            if candidate is None:
                return False
            self._kick.clear()
            names = await self.session.op("get_children", self.election)
            ordered = sorted((n for n in names if candidate_seq(n) >= 0), key=candidate_seq)
            mine = candidate.rpartition("/")[2]
            if mine not in ordered:
                log.info("partition %s: candidate %s is gone", self.partition, mine)
                self._candidate = None
                return False
            at = ordered.index(mine)
            if at == 0:
                return True
            kick = self._kick
            predecessor = f"{self.election}/{ordered[at - 1]}"
            stat = await self.session.op("exists", predecessor, watch=fired)
            if stat is None:
                continue
            if stat.ephemeralOwner == self._candidate_session:
                # our own orphan (a lost create the scan missed): waiting for it
                # to go would wait for our own session to end
                log.warning("partition %s: deleting own orphan %s", self.partition, predecessor)
                with contextlib.suppress(NoNodeError):
                    await self.session.op("delete", predecessor)
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.session.op_timeout_s * 2):
                    await kick.wait()
            if self.session.state != "connected":
                return False
        return False

    async def _take_epoch(self) -> Leadership | None:
        candidate = self._candidate
        if candidate is None:
            return None
        t0 = time.monotonic()
        data, stat = await self.session.op("get", self.epoch_node)
        record = decode_epoch(data)
        # an epoch node behind epochs already seen: ZooKeeper lost its data (no
        # persistent volume, a re-created ensemble). Taking its epoch + 1 would give
        # a term that everyone who saw the newer epochs refuses, for good
        floor = max(self._highest_epoch, self.epoch_floor() if self.epoch_floor else 0)
        if floor > record.epoch:
            log.warning(
                "partition %s: the epoch node holds epoch %d, but epoch %d was seen before "
                "(did ZooKeeper lose its data?); taking epoch %d",
                self.partition,
                record.epoch,
                floor,
                floor + 1,
            )
        new = EpochRecord(max(record.epoch, floor) + 1, self.member_id, self.url)
        self._highest_epoch = max(self._highest_epoch, record.epoch)
        node = self.epoch_node

        def build(tx: Any) -> None:
            tx.check(candidate, 0)
            tx.set_data(node, encode_epoch(new), stat.version)

        results = await self.session.commit(build)
        failed = failed_op(results)
        if failed == 0:  # the candidate node is gone
            self._candidate = None
            return None
        if failed is not None:
            log.info("partition %s: epoch race lost (%r)", self.partition, results[failed])
            return None
        self._highest_epoch = max(self._highest_epoch, new.epoch)
        term = Leadership(
            self.session, self.partition, new.epoch, self.member_id, candidate, previous=record
        )
        term.confirmed_at = t0
        if self.session.thread_state != "connected":
            term.lose("ZooKeeper session not connected")
            return None
        if self._candidate != candidate or self._stopping:
            # requeued (or stopped) while the epoch was taken: the member gave its turn
            # up, so it does not lead on the old candidate node (review)
            term.lose("requeued while taking the epoch")
            return None
        log.info("partition %s: %s leads with epoch %d", self.partition, self.member_id, new.epoch)
        return term

    async def _lead(self, term: Leadership) -> None:
        self.leadership = term
        self._elected.set()
        loop = asyncio.get_running_loop()

        def watch(event: Any) -> None:
            if getattr(event, "type", None) in ("CHANGED", "DELETED"):
                # another leader took a newer epoch: end the lease at once, in this thread
                term.revoked = True
                term.confirmed_at = float("-inf")
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(term.lose, "the epoch moved on")

        if self.on_elected is not None:
            try:
                self.on_elected(term)
            except Exception:
                log.exception("an on_elected callback failed")
        node, candidate, timeout = self.epoch_node, term.candidate, self.session.op_timeout_s
        expected = term.epoch

        def beat(zk: Any) -> tuple[int, bool]:
            # sync first: the server answering must have caught up with the ensemble's
            # leader, so the reads after it (a session's requests are answered in order) are
            # the quorum's state. A server cut off from the ensemble may go on answering
            # reads from its own copy for a while after our session expired elsewhere;
            # its sync does not complete, so the lease runs out instead
            pending_sync = zk.sync_async(node)
            pending_epoch = zk.get_async(node, watch=watch)
            pending_candidate = zk.exists_async(candidate, watch=self._candidate_fired)
            pending_sync.get(timeout=timeout)
            data, _stat = pending_epoch.get(timeout=timeout)
            return decode_epoch(data).epoch, pending_candidate.get(timeout=timeout) is not None

        try:
            while not term.lost:
                t0 = time.monotonic()
                try:
                    epoch, alive = await self.session.call(beat)
                except CoordinationError as exc:
                    if not exc.retriable:
                        # (a malformed epoch node: the term was neither renewed nor
                        # lost, and its candidate held the line without a word; review)
                        log.error("partition %s: %s", self.partition, exc.message)
                        term.lose(f"epoch unreadable: {exc.message}")
                    # else the lease runs out by itself; the session state decides the rest
                else:
                    if epoch != expected:
                        term.lose(f"epoch is now {epoch}")
                    elif not alive:
                        term.lose("candidate node gone")
                    elif t0 > term.confirmed_at:
                        term.confirmed_at = t0
                with contextlib.suppress(TimeoutError):
                    # (read each time: a reconnect may be granted a shorter session)
                    async with asyncio.timeout(term.lease_s / 3):
                        await term.wait_lost()
        finally:
            if self.leadership is term:
                self.leadership = None
            if not term.lost:
                term.lose("election task ended")
        if term.lost_reason == "candidate node gone":
            self._candidate = None


async def current_leader(session: ZkSession, partition: str) -> LeaderInfo | None:
    """The leader of ``partition`` now: the epoch's holder while its candidate lives.

    None between leaders (no holder yet, or the holder's candidate is gone).
    """
    election = election_path(session.config.name, partition)
    node, timeout = epoch_path(session.config.name, partition), session.op_timeout_s

    def read(zk: Any) -> LeaderInfo | None:
        try:
            pending_epoch = zk.get_async(node)
            names = zk.get_children_async(election).get(timeout=timeout)
            record = decode_epoch(pending_epoch.get(timeout=timeout)[0])
        except NoNodeError:
            return None
        ordered = sorted((n for n in names if candidate_seq(n) >= 0), key=candidate_seq)
        if not record.member_id or not ordered:
            return None
        try:
            data, _stat = zk.get_async(f"{election}/{ordered[0]}").get(timeout=timeout)
        except NoNodeError:
            return None
        if decode_candidate(data)[0] != record.member_id:
            return None
        return LeaderInfo(partition, record.member_id, record.url, record.epoch)

    return await session.call(read)
