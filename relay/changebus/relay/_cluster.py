"""A relay as a member of a relay cluster (``[cluster]``, ``docs/cluster.md``).

:class:`~._cluster_member.ClusterMember` owns the relay's one :class:`~changebus.cluster.ZkSession`,
its :class:`~changebus.cluster.Registry` node (kind ``relay``), a
:class:`~changebus.cluster.RoutingTable` and, per partition, a
:class:`PartitionRole`: the partition's :class:`~changebus.cluster.PartitionElection`
and the fetcher switching that follows from it. The fetcher configured for a
partition is its *source*; the partition's :class:`~._host.PartitionHost`
starts without a fetcher and the role decides:

* **leader** (this member holds a :class:`~changebus.cluster.Leadership`):
  ``host.epoch = term.epoch``, the fence :class:`LeaderFence` is installed and
  the source fetcher starts from the buffer's newest SCN. For a Postgres
  source any other process still holding the replication slot (a paused,
  deposed leader's walsender) is terminated first: the new epoch is
  proof that it no longer leads.
* **follower** (another member leads): the ``relay`` fetcher kind
  (:mod:`changebus.relay.chain`) follows the leader's URL with
  ``min_epoch`` = the newest leader epoch seen in ZooKeeper, so a deposed
  leader's answers (a lower ``X-Changebus-Epoch``) are refused and none of
  its late windows is appended. It is re-pointed whenever the leader or its
  epoch changes.
* **none** (no leader known, or this member just stepped down): no
  fetcher; after a step-down the partition is ``fenced`` (``/readyz`` 503
  with the reason) until a new leader is known.

Fencing. :class:`LeaderFence` is checked by the host once per group, right
before the append (``admit``: the lease ``term.valid()``) and right before
the source acknowledgement (``ack_scn``: the lease again, then the follower
hold below). A failed check stops the ingest without appending or
acknowledging, and the role steps down. Losing ZooKeeper ends the lease
(the session is SUSPENDED): the leader stops appending and acknowledging
while it cannot prove it leads; everyone keeps serving what it holds.

No window lost at failover (Postgres). The leader acknowledges the source
no further than the lowest SCN held by the live followers of the partition
(:meth:`PartitionRole.follower_hold`): each follower's ``max_scn`` as it
registers it itself (its buffer's newest window, or with ``durability =
"fsync"`` the newest window on its disk; published within about ``_TICK_S +
_REGISTRY_INTERVAL_S``: it lags, never leads; a follower whose syncs failed
for good does not register the partition: :meth:`PartitionRole.registered`).
The positions
of its ``/v1/stream`` requests are *not* used: a follow response moves the
position the leader sees as windows are *sent*, before the follower has
appended them. A follower whose member node is gone holds nothing back. So
the slot's confirmed position never passes what any live follower holds,
and whichever follower wins the next election finds every window after its
own newest SCN still in the slot; the Postgres fetcher resumes right after
that SCN and drops what it holds already (SCNs are commit LSNs: the re-read
windows have the same SCNs and bytes). A periodic catch-up
(:meth:`~._host.PartitionHost.acknowledge_held`, every ``_TICK_S``) releases
what the hold kept back once the followers caught up.

MySQL: every member reads the binlog under its own ``server_id``: one is
derived from the member id and the partition unless the options set one
(:func:`member_server_id`); a new leader resumes from its own newest SCN
(the window's GTID).

Thread-safety: everything runs on the relay's event loop, except
:meth:`LeaderFence.admit`, which the writer thread calls (it reads the
lease, which is thread-safe).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import zlib
from typing import TYPE_CHECKING, Any

from changebus.cluster import Leadership, PartitionElection, PartitionState
from changebus.schemas import stop_task

from ._config import FetcherConfig
from ._host import PartitionHost
from ._slotholder import terminate_slot_holder

if TYPE_CHECKING:
    from ._cluster_member import ClusterMember

__all__ = ["LeaderFence", "PartitionRole", "member_server_id"]

log = logging.getLogger("changebus.relay.cluster")

#: how often a role re-checks its state, a leader recomputes the follower hold and
#: releases held acknowledgements, and the registry payload is refreshed
_TICK_S = 0.25
#: how long after a term began the leader holds the source at its buffer's end
#: then (followers register again within a few routing-table refreshes)
_HOLD_GRACE_S = 10.0
#: a follower whose chain failed for good (a 401 after a token rotation, a TLS error)
#: starts it again after this long (it re-reads its token and files)
_REFOLLOW_S = 5.0
#: what a follower's stream requests are called (the leader finds them in host.consumers)
FOLLOWER_CLIENT = "relay-follower-{member}"


def member_server_id(member_id: str, partition: str) -> int:
    """A MySQL replication server id for one member's reader of one partition.

    Derived ids lie in ``0x4352_0000 .. 0x4352_FFFF`` ("CR"), apart from the
    stand-alone relay's ``0x4342_xxxx``; two members of a cluster collide
    with probability 1/65,536 (set ``server_id`` in the options to be sure).
    """
    mixed = zlib.crc32(f"{member_id}/{partition}".encode()) & 0xFFFF
    return 0x4352_0000 | mixed


class LeaderFence:
    """The leader's checks before appending and acknowledging (``IngestFence``)."""

    def __init__(self, role: PartitionRole, term: Leadership) -> None:
        self.role = role
        self.term = term

    def admit(self) -> bool:
        return self.term.valid()

    def ack_scn(self, scn: int) -> int | None:
        if not self.term.valid():
            return None
        return min(scn, self.role.hold)

    def refused(self, reason: str) -> None:
        self.role.fence_refused(self.term, reason)


_Plan = tuple[str, int, str]  # (role "lead" | "follow" | "none", epoch, leader url)


class PartitionRole:
    """One partition's election and the fetcher it implies (module docstring)."""

    def __init__(
        self,
        member: ClusterMember,
        host: PartitionHost,
        source: FetcherConfig,
    ) -> None:
        self.member = member
        self.host = host
        self.name = host.name
        self.source = source
        self.member_id = member.config.member_id
        self.election = PartitionElection(
            member.session,
            host.name,
            on_elected=self._elected,
            epoch_floor=lambda: max(self.min_epoch, self._registered_epoch()),
        )
        #: the SCN the leader may acknowledge up to (see follower_hold)
        self.hold = 0
        #: when this member's current term began (monotonic) and its buffer's end then
        self._lead_since = float("-inf")
        self._lead_from = -1
        #: the lowest SCN the live followers held when this member last saw any (-1:
        #: never); a new term of this member holds the source there too (follower_hold)
        self._followers_held = -1
        #: the newest leader epoch seen (a follower's min_epoch)
        self.min_epoch = 0
        #: the current plan
        self.plan: _Plan = ("none", 0, "")
        #: why this member last stepped down ("" while it did not)
        self.step_down_reason = ""
        self.terms = 0
        self._refused_epoch = 0
        #: leading: since when the source has not streamed (monotonic)
        self._unread_since = 0.0
        self._failing = (0, 0.0)  # (term epoch, since): its role change keeps failing
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: this member left the election for good: its buffer's syncs failed
        self.withdrawn = False
        self._failed_since = 0.0  # (monotonic) a follower's chain stopped for good
        #: the candidacy went to the back of the line for the chain failure under way
        self._yielded = False

    async def start(self) -> None:
        await self.election.start()
        self._task = asyncio.create_task(self._run(), name=f"cluster-role-{self.name}")

    async def stop(self) -> None:
        """Stop switching, close the partition's fetcher, then leave the election.

        In that order: a leader closes the source before a successor can be
        elected, so two readers never overlap on a graceful stop.
        """
        task, self._task = self._task, None
        await stop_task(task)
        if self.plan[0] != "none" or self.host.fetcher is not None:
            try:
                await self.host.switch_fetcher(FetcherConfig())
            finally:
                self.plan = ("none", 0, "")
        if not self.withdrawn:
            await self.election.stop()

    def kick(self) -> None:
        self._kick.set()

    # -- callbacks (event loop) ----------------------------------------------

    def _elected(self, term: Leadership) -> None:
        term.on_lost(lambda _t: self._kick.set())
        self._kick.set()

    def _give_up_if_unread(self) -> None:
        """Leading, but the source has not streamed for ``source_give_up_s``: requeue.

        The term is kept only while it is of use: a member that cannot read the
        source (its own DSN or password is wrong, it has no route to the
        database) would otherwise hold the partition for good while the others,
        who might read it, wait behind it.
        """
        limit = self.member.config.source_give_up_s
        now = time.monotonic()
        if self.host.state == "streaming" or not limit:
            self._unread_since = now
            return
        if now - self._unread_since < limit:
            return
        self._requeue(f"its source was not read for {limit:g} s (state {self.host.state})")

    def _give_up_if_failing(self) -> None:
        """The role change to lead failed (its fetcher cannot be made: options this member
        lacks, ...): for ``source_give_up_s`` of failures under one term, requeue, as for a
        source not read (the failing member kept the term for good: review)."""
        term = self.election.leadership
        limit = self.member.config.source_give_up_s
        if term is None or term.lost or not limit:
            return
        now = time.monotonic()
        if self._failing[0] != term.epoch:
            self._failing = (term.epoch, now)
        elif now - self._failing[1] >= limit:
            self._failing = (0, now)
            self._requeue(f"it could not take up its term for {limit:g} s")

    def _requeue(self, reason: str) -> None:
        log.error(
            "partition %s: %s gives up its term: %s; it queues again behind the others",
            self.name,
            self.member_id,
            reason,
        )
        self.step_down_reason = reason
        self._unread_since = time.monotonic()
        self.election.requeue(reason)
        self._kick.set()

    def fence_refused(self, term: Leadership, reason: str) -> None:
        """The ingest stopped under ``term``: never lead that epoch again, and give it up.

        Giving it up matters when the lease lapsed but the ZooKeeper session
        lived (a pause shorter than the session): the election would
        otherwise keep this member's term, so no member, this one included,
        could lead the partition until the session ended. Ended, the term
        makes the election take a new epoch (this member's again when it is
        still first in line).
        """
        self._refused_epoch = max(self._refused_epoch, term.epoch)
        self.step_down_reason = f"epoch {term.epoch}: {reason}"
        term.lose(f"the ingest's fence refused it: {reason}")
        self._kick.set()

    # -- the plan ---------------------------------------------------------------

    def _registered_epoch(self) -> int:
        """The newest epoch a member registered for this partition (a follower registers
        the epoch it follows, a leader its own)."""
        members = self.member.table.snapshot().members.values()
        return max(
            (m.partitions[self.name].epoch for m in members if self.name in m.partitions),
            default=0,
        )

    def _wanted(self) -> _Plan:
        if self.withdrawn:
            return ("none", 0, "")
        term = self.election.leadership
        leader = self.member.table.leader(self.name)
        if leader is not None:
            self.min_epoch = max(self.min_epoch, leader.epoch)
        registered = self._registered_epoch()
        if term is not None and not term.lost and term.epoch < registered:
            # a member has seen a newer epoch than this term's: ZooKeeper lost its data
            # and this member, knowing less, took a smaller one, which the members that
            # saw newer ones refuse for good. Stepping down, it takes one past theirs
            # (the election's floor counts the registered epochs)
            log.warning(
                "partition %s: epoch %d is behind epoch %d a member registered (did "
                "ZooKeeper lose its data?); taking a newer one",
                self.name,
                term.epoch,
                registered,
            )
            term.lose(f"a member registered the newer epoch {registered}")
            return ("none", 0, "")
        if (
            term is not None
            and not term.lost
            and term.epoch > self._refused_epoch
            and term.epoch >= self.min_epoch
            and term.valid()
        ):
            self.min_epoch = term.epoch
            return ("lead", term.epoch, "")
        if (
            leader is not None
            and leader.member_id != self.member_id
            and leader.epoch >= self.min_epoch
        ):
            return ("follow", leader.epoch, leader.url)
        return ("none", 0, "")

    async def _withdraw_if_store_failed(self) -> None:
        """Leave the election for good once the buffer's syncs failed (``durability =
        "fsync"``): the ingest stopped, so as a leader this member would hold the
        partition, unread, until ``source_give_up_s`` requeued it (and take it again
        when no other member stands), and as a follower it can append nothing."""
        syncer = self.host.syncer
        if self.withdrawn or syncer is None or not syncer.error:
            return
        self.withdrawn = True
        self.step_down_reason = f"its buffer's syncs failed ({syncer.error})"
        log.error(
            "partition %s: %s leaves the election until it is restarted: %s",
            self.name,
            self.member_id,
            self.step_down_reason,
        )
        await self.election.stop()

    async def _run(self) -> None:
        while True:
            self._kick.clear()
            try:
                await self._withdraw_if_store_failed()
                self._yield_if_chain_failed()
                wanted = self._wanted()
                if wanted != self.plan or self._refollow_due():
                    await self._apply(wanted)
                    self._failing = (0, 0.0)
                if self.plan[0] == "lead":
                    self.hold = self.follower_hold()
                    await self.host.acknowledge_held()
                    self._give_up_if_unread()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("partition %s: role change failed; retrying", self.name)
                self._give_up_if_failing()
                self.plan = ("none", -1, "")  # differs from every plan: try again
                await asyncio.sleep(0.5)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_TICK_S):
                    await self._kick.wait()

    async def _apply(self, plan: _Plan) -> None:
        host, (what, epoch, url) = self.host, plan
        was_leader = self.plan[0] == "lead"
        if what == "lead":
            term = self.election.leadership
            assert term is not None
            self._lead_since, self._lead_from = time.monotonic(), host.buffer.meta.last_scn
            if self._followers_held >= 0:
                # (followers behind this buffer's end when they were last seen lack those
                # windows still, unless they caught up since: they say so when they register)
                self._lead_from = min(self._lead_from, self._followers_held)
            self.hold = self.follower_hold()
            fence = LeaderFence(self, term)
            await self._take_over_source(term)
            host.epoch, host.role = epoch, "leader"
            self.step_down_reason = ""
            self.terms += 1
            log.warning(
                "partition %s: %s leads with epoch %d: reading the source",
                self.name,
                self.member_id,
                epoch,
            )
            self.plan = plan
            self._unread_since = time.monotonic()
            await host.switch_fetcher(self._source_config(), fence=fence)
        elif what == "follow":
            if was_leader and not self.step_down_reason:
                self.step_down_reason = f"a new leader took epoch {epoch}"
            log.warning(
                "partition %s: %s follows %s (epoch %d)%s",
                self.name,
                self.member_id,
                url,
                epoch,
                f"; stepped down: {self.step_down_reason}" if was_leader else "",
            )
            self.plan = plan
            await host.switch_fetcher(self._follow_config(url))
            host.epoch, host.role = epoch, "follower"
        else:
            if was_leader and not self.step_down_reason:
                term = self.election.leadership
                self.step_down_reason = (
                    term.lost_reason or "lease not valid" if term else "leadership lost"
                )
            if was_leader:
                # its windows no longer come under that epoch: advertised still, a
                # follower whose routing table lagged took a deposed leader's late
                # window as the leader's (review); no epoch is refused by every fence
                host.epoch = None
                log.error(
                    "partition %s: %s stepped down (%s); no leader to follow yet",
                    self.name,
                    self.member_id,
                    self.step_down_reason,
                )
            self.plan = plan
            await host.switch_fetcher(FetcherConfig())
            host.role = "follower" if host.role else ""
            if self.step_down_reason:
                host.state = "fenced"
                host.last_error = f"stepped down: {self.step_down_reason}"

    def _source_config(self) -> FetcherConfig:
        source = self.source
        if source.kind == "mysql" and not source.options.get("server_id"):
            options = {**source.options, "server_id": member_server_id(self.member_id, self.name)}
            return dataclasses.replace(source, options=options)
        return source

    def _follow_config(self, url: str) -> FetcherConfig:
        options: dict[str, Any] = {
            "upstream": [url],
            "client_id": FOLLOWER_CLIENT.format(member=self.member_id),
            "min_epoch": self._follower_min_epoch,
            "backoff_max_s": 1.0,
            # a follower that fell off the leader lost nothing of the source: it starts
            # its buffer again (its consumers go to other members or bootstrap) rather
            # than hand them a DATA_LOSS window that stops them
            "on_fell_off": "restart",
        }
        if self.member.upstream.enabled:
            options["auth"] = self.member.upstream
        return FetcherConfig("relay", options, retry_initial_s=0.1, retry_max_s=1.0)

    def _follower_min_epoch(self) -> int:
        return self.min_epoch

    async def _take_over_source(self, term: Leadership) -> None:
        """Postgres: end any other process's hold on the slot (a deposed leader's walsender)."""
        if self.source.kind != "postgres":
            return
        dsn = str(self.source.options.get("dsn", ""))
        slot = str(self.source.options.get("slot", "changebus"))
        if not dsn or not term.valid():
            return
        try:
            ended = await asyncio.to_thread(terminate_slot_holder, dsn, slot, term.valid)
        except Exception as exc:  # noqa: BLE001 - best effort: the fetcher retries a busy slot
            log.warning(
                "partition %s: could not check the slot's holder: %s", self.name, type(exc).__name__
            )
            return
        if ended:
            log.warning(
                "partition %s: ended the deposed holder of slot %s (pid %s)", self.name, slot, ended
            )

    # -- the follower hold ----------------------------------------------------------

    def follower_hold(self) -> int:
        """The lowest SCN held by a live follower of this partition (no follower: no limit).

        For :data:`_HOLD_GRACE_S` after a term began, also no further than this
        member's buffer reached then, nor than the followers held when this
        member last saw any (a previous term): followers whose sessions ended
        with the leader's (ZooKeeper restarting, a network cut) are not in the
        routing table again yet, and acknowledging past them would lose what
        they lack should one of them lead next. (The buffer's end alone let a
        re-elected leader acknowledge what a lagging follower still lacked:
        review.)
        """
        snapshot = self.member.table.snapshot()
        hold: int | None = None
        for member_id, info in snapshot.members.items():
            if member_id == self.member_id or info.kind != "relay":
                continue
            state = info.partitions.get(self.name)
            if state is None or state.role != "follower":
                continue
            hold = state.max_scn if hold is None else min(hold, state.max_scn)
        if hold is not None:
            self._followers_held = hold
        if time.monotonic() - self._lead_since < _HOLD_GRACE_S:
            hold = self._lead_from if hold is None else min(hold, self._lead_from)
        return (1 << 63) - 1 if hold is None else hold

    def _yield_if_chain_failed(self) -> None:
        """A follower whose chain failed for good goes to the back of the line, once per
        failure (until it streams again).

        It is out of the routing table meanwhile, so the leader acknowledges the
        source past it: elected next (its candidate node older than a healthy
        follower's), it would find the source moved on and record a DATA_LOSS
        that a healthy follower could have avoided (found by review). Alone in
        the line, it still leads.
        """
        if self.host.state == "streaming":
            self._yielded = False
            return
        if self._yielded or self.plan[0] != "follow" or self.host.state != "failed":
            return
        self._yielded = True
        log.warning(
            "partition %s: %s goes to the back of the leader line: its chain failed (%s)",
            self.name,
            self.member_id,
            self.host.last_error,
        )
        self.election.requeue(f"its chain failed: {self.host.last_error}")

    def _refollow_due(self) -> bool:
        """A follower's chain failed for good: start it again every ``_REFOLLOW_S`` (it
        stayed failed, and registered, until the relay restarted: review)."""
        if self.plan[0] != "follow" or self.host.state != "failed":
            self._failed_since = 0.0
            return False
        now = time.monotonic()
        if not self._failed_since:
            self._failed_since = now
        if now - self._failed_since < _REFOLLOW_S:
            return False
        self._failed_since = 0.0
        log.warning(
            "partition %s: following %s again after: %s",
            self.name,
            self.plan[2],
            self.host.last_error,
        )
        return True

    def registered(self) -> bool:
        """Whether this member registers the partition at all: not as a follower whose
        ``durability = "fsync"`` syncs failed for good (its synced SCN no longer moves
        and its ingest stopped: as a follower it would hold the leader's acknowledgements
        back, and the source's log would grow, until someone restarted it; found by
        review). Clients then do not read it there either."""
        syncer = self.host.syncer
        if self.plan[0] == "follow" and self.host.state == "failed":
            return False  # (nor one whose chain failed: it holds nothing and serves nothing)
        return self.plan[0] == "lead" or syncer is None or not syncer.error

    def state(self) -> PartitionState:
        """What this member registers for the partition. A follower's ``max_scn`` is the
        leader's hold (:meth:`follower_hold`): with ``durability = "fsync"`` the newest
        window on its disk, not in its buffer (the leader acknowledged windows a follower
        would lose in an OS crash: found by review)."""
        meta = self.host.buffer.meta
        leader = self.plan[0] == "lead"
        last = meta.last_scn
        syncer = self.host.syncer
        if syncer is not None and not leader:
            last = min(last, syncer.synced_scn)
        return PartitionState(
            "leader" if leader else "follower",
            # the newest epoch seen, also after stepping down (epoch None): a member that
            # registered 0 then hid from a leader of a smaller epoch, after ZooKeeper lost
            # its data, the newer one it refuses to follow (review)
            max(self.host.epoch or 0, self.min_epoch),
            max(meta.min_scn, 0),
            max(last, 0),
        )
