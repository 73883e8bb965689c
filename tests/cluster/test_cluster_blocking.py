"""The cluster slice never blocks the event loop it runs on (kazoo's calls run in threads)."""

from __future__ import annotations

import asyncio

import pytest

from changebus.cluster import PartitionElection, PartitionState, Registry, RoutingTable
from waiting import wait_until

pytestmark = [pytest.mark.zk, pytest.mark.usefixtures("no_blocking")]


async def test_election_registry_and_routing_do_not_block(zk_session) -> None:
    s1, s2 = await zk_session("r1"), await zk_session("r2")
    table = RoutingTable(s2)
    await table.start()
    registry = Registry(s1, "relay", min_interval_s=0.05)
    await registry.start()
    election = PartitionElection(s1, "p0")
    other = PartitionElection(s2, "p0")
    await election.start()
    async with asyncio.timeout(10):
        term = await election.wait_elected()
    await other.start()
    registry.update({"p0": PartitionState("leader", term.epoch, 1, 2)})
    await wait_until(lambda: table.leader("p0") is not None, 10, "the leader in the table")
    await asyncio.sleep(term.lease_s)  # a few heartbeats
    assert term.valid()
    await election.stop()
    async with asyncio.timeout(10):
        await other.wait_elected()
    await other.stop()
    await registry.stop()
    await table.stop()
    await s1.stop()
