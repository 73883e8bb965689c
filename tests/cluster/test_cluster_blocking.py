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


async def test_a_start_cancelled_while_connecting_leaves_no_session_connecting() -> None:
    """A stop (SIGTERM) while the session was still connecting left kazoo connecting
    in the background until the process ended (found by review)."""
    import socket
    import threading

    from changebus.cluster import ClusterConfig, ZkSession

    with socket.socket() as s:  # a port nobody listens on: kazoo keeps retrying
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = set(threading.enumerate())
    session = ZkSession(
        ClusterConfig(zookeeper=f"127.0.0.1:{port}", name="c", connect_timeout_s=3.0)
    )
    task = asyncio.create_task(session.start())
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert session.state == "closed"

    def kazoo_threads() -> list[threading.Thread]:
        # (the session's own worker may still sit in kazoo's start() until its timeout:
        # kazoo's threads, which connect and retry, are what must be gone)
        return [
            t
            for t in threading.enumerate()
            if t not in before and t.is_alive() and not t.name.startswith("changebus-zk")
        ]

    await wait_until(lambda: not kazoo_threads(), 10, "kazoo's threads to end")
