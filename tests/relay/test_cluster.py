"""Relay clusters: three ``changebus relay`` processes on one Postgres partition, on a real
ZooKeeper (session timeout 2 s).

One leader reads the slot (exactly one replication connection), the others chain
from it; all serve the same bytes. kill -9 of the leader under a writer: a follower
takes over with a higher epoch and a consumer given the three URLs ends with the
source's rows, every transaction once, SCNs increasing. SIGSTOP of the leader past
its session: a new leader takes the slot over, and the old one, woken, steps down,
never touches the slot again and appends nothing of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any

import psycopg
import pytest
from kazoo.client import KazooClient
from relay_cluster import (
    PART,
    Cluster,
    Writer,
    all_hold,
    identical,
    marker,
    new_leader,
    same_content,
    settled,
    slot_state,
    stream_bytes,
    walsenders,
)

from changebus.client import ChangeOp, Consumer, ConsumerConfig
from changebus.cluster import member_path
from fix_pg import wait_until

pytestmark = pytest.mark.zk


async def test_three_relays_one_slot_reader_identical_bytes(cluster: Cluster) -> None:
    leader = await settled(cluster)
    with Writer(cluster.dsn, rate=400) as w:
        await wait_until(lambda: w.committed >= 200, 30, "200 transactions")
    await all_hold(cluster.relays, marker(cluster.dsn))
    senders = walsenders(cluster.dsn)
    assert len(senders) == 1
    active, _confirmed = slot_state(cluster.dsn, cluster.slot)
    assert active == senders[0]
    assert identical(cluster.relays) >= 200
    # metrics and registry-visible role
    code, _h, body = leader.get("/metrics")
    assert code == 200
    text = body.decode()
    assert f'changebus_relay_partition_leader{{partition="{PART}",role="leader"}} 1.0' in text
    assert f'changebus_relay_partition_epoch{{partition="{PART}"}}' in text


@pytest.mark.pg
async def test_the_slot_never_passes_a_live_follower(cluster: Cluster) -> None:
    """The leader acknowledges no further than a paused follower holds, until its node goes."""
    leader = await settled(cluster)
    follower = next(r for r in cluster.relays if r is not leader)
    assert follower.proc is not None

    def held() -> int:
        """The SCN the follower registered it holds (its own ZooKeeper node)."""
        zk = KazooClient(hosts=cluster.zk)
        zk.start(10)
        try:
            data, _stat = zk.get(member_path(cluster.name, follower.name))
        finally:
            zk.stop()
            zk.close()
        return int(json.loads(data)["partitions"][PART]["max_scn"])

    with Writer(cluster.dsn, rate=200) as w:
        await wait_until(lambda: w.committed >= 50, 30, "50 transactions")
        os.kill(follower.proc.pid, signal.SIGSTOP)
        follower.stopped = True
        await asyncio.sleep(0.3)
        position = await asyncio.to_thread(held)
        lacking = [scn for scn in stream_bytes(leader, -1)[1] if scn > position]
        # while the paused follower's member node lives (2 s session), the slot stays behind
        deadline = time.monotonic() + 1.2
        while time.monotonic() < deadline:
            confirmed = slot_state(cluster.dsn, cluster.slot)[1]
            lacking = lacking or [s for s in stream_bytes(leader, -1)[1] if s > position]
            if lacking:
                assert confirmed <= lacking[0], "the slot passed what a live follower holds"
            await asyncio.sleep(0.1)
        assert lacking, "the writer ran: the follower must lack windows"
        # its session expires: it holds nothing back any more
        await wait_until(
            lambda: slot_state(cluster.dsn, cluster.slot)[1] > lacking[0], 15, "the slot released"
        )
        os.kill(follower.proc.pid, signal.SIGCONT)
        follower.stopped = False
    await all_hold(cluster.relays, marker(cluster.dsn))
    identical(cluster.relays)


@pytest.mark.pg
async def test_kill_9_of_the_leader_under_a_writer(cluster: Cluster) -> None:
    leader = await settled(cluster)
    epoch = cluster.epoch(leader)
    windows: list[Any] = []
    target = [1 << 62]
    done = asyncio.Event()

    async def reader() -> None:
        cfg = ConsumerConfig(
            relays=tuple(r.url for r in cluster.relays),
            partition=PART,
            start="earliest",
            wait_s=0.5,
            backoff_initial_s=0.05,
            backoff_max_s=0.5,
        )
        async with Consumer(cfg) as consumer:
            async for window in consumer:
                windows.append(window)
                if done.is_set() and window.scn >= target[0]:
                    return

    task = asyncio.create_task(reader())
    with Writer(cluster.dsn, rate=200) as w:
        await wait_until(lambda: w.committed >= 150, 30, "150 transactions")
        assert leader.proc is not None
        killed_at = time.monotonic()
        leader.proc.kill()
        leader.proc.wait(10)
        new = await new_leader(cluster, epoch)
        failover = time.monotonic() - killed_at
        assert new is not leader
        before = w.committed
        await wait_until(lambda: w.committed >= before + 150, 30, "150 more transactions")
    target[0] = marker(cluster.dsn)
    done.set()
    await asyncio.wait_for(task, 60)
    print(f"failover (kill -9 -> new leader streaming): {failover:.2f} s")
    assert failover < 10

    scns = [win.scn for win in windows]
    assert scns == sorted(set(scns)), "windows repeated or out of order"
    ids: list[int] = []
    replica: dict[int, int] = {}
    for win in windows:
        for e in win.events:
            key = int(e.key["id"])
            if e.after is None:
                replica.pop(key, None)
            else:
                if e.op == ChangeOp.INSERT:
                    ids.append(key)
                replica[key] = int(e.after["v"])
    with psycopg.connect(cluster.dsn) as conn:
        source: dict[int, int] = dict(conn.execute("SELECT id, v FROM t").fetchall())
    assert sorted(ids) == list(range(len(source)))  # every transaction, once
    assert replica == source
    survivors = [r for r in cluster.relays if r is not leader]
    await all_hold(survivors, target[0])
    assert len(walsenders(cluster.dsn)) == 1
    # byte for byte: a window the new leader re-read from the slot equals the copy the
    # other follower got from the dead leader (no table announced again)
    identical(survivors)


@pytest.mark.pg
async def test_sigstop_leader_is_fenced_and_steps_down(cluster: Cluster) -> None:
    old = await settled(cluster)
    epoch = cluster.epoch(old)
    assert old.proc is not None
    with Writer(cluster.dsn, rate=200) as w:
        await wait_until(lambda: w.committed >= 100, 30, "100 transactions")
        old_sender = slot_state(cluster.dsn, cluster.slot)[0]
        assert old_sender is not None
        stopped_at = time.monotonic()
        os.kill(old.proc.pid, signal.SIGSTOP)
        old.stopped = True
        new = await new_leader(cluster, epoch)
        takeover = time.monotonic() - stopped_at
        assert new is not old
        new_epoch = cluster.epoch(new)

        # the new leader holds the slot; the paused one's walsender was ended (the new
        # walsender connects first and takes the slot a moment later: wait for both)
        def one_holder() -> bool:
            senders = walsenders(cluster.dsn)
            return len(senders) == 1 and slot_state(cluster.dsn, cluster.slot)[0] == senders[0]

        await wait_until(one_holder, 10, "one walsender, holding the slot")
        holder, confirmed_before = slot_state(cluster.dsn, cluster.slot)
        assert holder is not None and holder != old_sender
        before = w.committed
        await wait_until(lambda: w.committed >= before + 100, 30, "100 more transactions")

        os.kill(old.proc.pid, signal.SIGCONT)
        old.stopped = False
        woke_at = time.monotonic()

        def old_follows() -> bool:
            st = old.status()
            return bool(
                st
                and st.get("role") == "follower"
                and st.get("epoch") == new_epoch
                and st["state"] == "streaming"
            )

        await wait_until(old_follows, 20, "the old leader following the new one")
        stepped = time.monotonic() - woke_at
        for _ in range(20):  # the slot stays with the new leader, nobody else connects
            assert slot_state(cluster.dsn, cluster.slot)[0] == holder
            assert walsenders(cluster.dsn) == [holder]
            await asyncio.sleep(0.1)
        before = w.committed
        await wait_until(lambda: w.committed >= before + 50, 30, "50 more transactions")
    end = marker(cluster.dsn)
    await all_hold(cluster.relays, end)
    _holder, confirmed_after = slot_state(cluster.dsn, cluster.slot)
    assert confirmed_after >= confirmed_before
    print(f"SIGSTOP -> new leader: {takeover:.2f} s; SIGCONT -> old one follows: {stepped:.2f} s")
    log = old.log()
    assert "stepped down" in log or "no longer leads epoch" in log
    assert f"follows {new.url} (epoch {new_epoch})" in log
    # whatever the old leader holds is what the new leader serves, byte for byte: it
    # re-read the old leader's last windows from the slot without announcing the table again
    assert same_content(cluster.relays) == identical(cluster.relays)
    with psycopg.connect(cluster.dsn) as conn:
        (count,) = conn.execute("SELECT count(*) FROM t").fetchone() or (0,)
    assert count == w.committed


# ---- MariaDB: one binlog reader, a server id per member -----------------------------
