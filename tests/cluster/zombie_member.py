"""A consumer-group member in its own process, for the SIGSTOP (zombie member) test.

Usage: python zombie_member.py HOSTS GROUP BUCKETS SESSION_TIMEOUT_S

It acquires the units of its target, claims each in a ZkUnitStore and
commits a rising checkpoint for every claimed unit every 0.1 s -- also after
it lost them (a buggy consumer ignoring its lease), to show that the store
refuses the writes. After the first loss it stops acquiring and leaves the
group. One JSON object per line:

* {"event": "owned", "member": id, "units": [...]} when the owned set changes;
* {"event": "probe", "gap_s": g, "valid": v}: from a thread calling
  ``lease_valid()`` every 5 ms, at the first call after a gap > 0.3 s;
* {"event": "lost", "units": [...]};
* {"event": "commit", "written": [...], "fenced": [...], "after_lost": b}
  for commits that refused something or ran after the loss
  ({"error": ...} instead when ZooKeeper did not answer);
* {"event": "left"} once it left the group after the loss.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import time

from changebus.cluster import ClusterConfig, GroupMember, ZkSession, ZkUnitStore
from changebus.schemas import ChangebusError, PartitionCheckpoint, Unit, UnitCommit


def say(**fields: object) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def probe(member: GroupMember) -> None:
    prev = time.monotonic()
    while True:
        now = time.monotonic()
        gap = now - prev
        if gap > 0.3:
            say(event="probe", gap_s=round(gap, 3), valid=member.lease_valid())
        prev = now
        time.sleep(0.005)


async def main() -> None:
    hosts, group, buckets, timeout = sys.argv[1:5]
    config = ClusterConfig(zookeeper=hosts, name="groups", session_timeout_s=float(timeout))
    session = ZkSession(config)
    await session.start()
    member = GroupMember(session, group, ["orders", "users"], int(buckets), name="zombie")
    store = ZkUnitStore(session)
    tokens: dict[Unit, int] = {}
    lost = asyncio.Event()
    busy: set[Unit] = set()
    running: set[asyncio.Task[None]] = set()

    async def take(unit: Unit) -> None:
        try:
            await member.acquire(unit)
            claim = await store.claim(group, unit, member.member_id)
        except ChangebusError:
            return
        finally:
            busy.discard(unit)
        tokens[unit] = claim.token

    def retarget(target: frozenset[Unit]) -> None:
        if lost.is_set():
            return
        for unit in target - member.owned - busy:
            busy.add(unit)
            task = asyncio.ensure_future(take(unit))
            running.add(task)
            task.add_done_callback(running.discard)

    def on_lost(units: frozenset[Unit]) -> None:
        say(event="lost", units=sorted(str(u) for u in units))
        lost.set()

    member.on_target(retarget)
    member.on_lost(on_lost)
    await member.start()
    threading.Thread(target=probe, args=(member,), daemon=True).start()
    shown: frozenset[Unit] = frozenset()
    scn = 0
    left = False
    while True:
        await asyncio.sleep(0.1)
        if member.owned != shown and not lost.is_set():
            shown = member.owned
            say(event="owned", member=member.member_id, units=sorted(str(u) for u in shown))
        if tokens:
            scn += 1
            checkpoint = PartitionCheckpoint(window_scn=scn, prev_scn=scn)
            commits = [UnitCommit(u, checkpoint, t) for u, t in sorted(tokens.items())]
            try:
                result = await store.commit(group, commits)
            except ChangebusError as exc:
                say(event="commit", error=str(exc), after_lost=lost.is_set())
                continue
            tokens.update(result.tokens)
            for unit in result.fenced:
                tokens.pop(unit, None)
            if result.fenced or lost.is_set():
                say(
                    event="commit",
                    written=sorted(str(u) for u in result.tokens),
                    fenced=sorted(str(u) for u in result.fenced),
                    after_lost=lost.is_set(),
                )
        if lost.is_set() and not tokens and not left:
            with contextlib.suppress(ChangebusError):
                await member.stop()
            left = True
            say(event="left")


if __name__ == "__main__":
    asyncio.run(main())
