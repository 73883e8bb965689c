"""A candidate in its own process, for the SIGSTOP (zombie leader) test.

Usage: python zombie_candidate.py HOSTS CLUSTER PARTITION MEMBER_ID SESSION_TIMEOUT_S

Prints one JSON object per line: {"event": "elected", "epoch": n},
{"event": "lost", "epoch": n, "reason": ...}, and from a probe thread that
calls ``valid()`` every 5 ms: {"event": "probe", "gap_s": g, "valid": v} for
each term at the first call after a gap of more than 0.3 s in its own loop
(the process was stopped, or badly starved).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time

from changebus.cluster import ClusterConfig, Leadership, PartitionElection, ZkSession


def say(**fields: object) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def probe(terms: list[Leadership]) -> None:
    prev = time.monotonic()
    while True:
        now = time.monotonic()
        gap = now - prev
        if gap > 0.3:
            for term in list(terms):
                say(event="probe", epoch=term.epoch, gap_s=round(gap, 3), valid=term.valid())
        prev = now
        time.sleep(0.005)


async def main() -> None:
    hosts, cluster, partition, member, timeout = sys.argv[1:6]
    config = ClusterConfig(
        zookeeper=hosts,
        name=cluster,
        member_id=member,
        advertised_url=f"http://{member}.test:1",
        session_timeout_s=float(timeout),
    )
    session = ZkSession(config)
    await session.start()
    terms: list[Leadership] = []

    def elected(term: Leadership) -> None:
        terms.append(term)
        say(event="elected", epoch=term.epoch, valid=term.valid())
        term.on_lost(lambda t: say(event="lost", epoch=t.epoch, reason=t.lost_reason))

    election = PartitionElection(session, partition, on_elected=elected)
    threading.Thread(target=probe, args=(terms,), daemon=True).start()
    await election.start()
    say(event="started")
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
