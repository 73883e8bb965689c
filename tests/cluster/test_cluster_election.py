"""Leader election per partition against a real ZooKeeper: one leader, rising epochs,
fast handover on a closed session, and a SIGSTOPped leader fenced by its lease."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.security import OPEN_ACL_UNSAFE, make_digest_acl

from changebus.cluster import (
    ClusterConfig,
    CoordinationError,
    Leadership,
    PartitionElection,
    current_leader,
    election_path,
    epoch_path,
)
from changebus.cluster._layout import CANDIDATE_PREFIX, encode_candidate
from waiting import wait_until

pytestmark = pytest.mark.zk

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client", "discovery")


def leaders(elections: list[PartitionElection]) -> list[PartitionElection]:
    return [e for e in elections if e.leadership is not None and e.leadership.valid()]


async def test_three_candidates_elect_one_leader_and_epochs_rise(zk_session) -> None:
    sessions = [await zk_session(f"r{i}") for i in range(3)]
    elections = [PartitionElection(s, "p0") for s in sessions]
    for e in elections:
        await e.start()
    await wait_until(lambda: len(leaders(elections)) == 1, 10, "a leader")
    # exactly one, and it stays that way
    for _ in range(20):
        assert len([e for e in elections if e.leadership is not None]) == 1
        await asyncio.sleep(0.02)
    first = leaders(elections)[0]
    assert first.leadership is not None and first.leadership.epoch == 1
    info = await current_leader(sessions[0], "p0")
    assert info is not None
    assert (info.member_id, info.epoch, info.url) == (
        first.member_id,
        1,
        f"http://{first.member_id}.test:1",
    )

    # each leader resigns in turn: the next one takes a strictly higher epoch
    epochs = [1]
    remaining = list(elections)
    while len(remaining) > 1:
        current = leaders(remaining)[0]
        term = current.leadership
        assert term is not None
        await current.stop()
        assert term.lost and not term.valid()
        remaining.remove(current)
        await wait_until(lambda: len(leaders(remaining)) == 1, 10, "the next leader")
        nxt = leaders(remaining)[0].leadership
        assert nxt is not None
        epochs.append(nxt.epoch)
    assert epochs == sorted(set(epochs)) and len(epochs) == 3
    for e in remaining:
        await e.stop()


async def test_closed_leader_session_hands_over_within_a_second(zk_session) -> None:
    sessions = [await zk_session(f"r{i}", session_timeout_s=2.0) for i in range(3)]
    elections = [PartitionElection(s, "p1") for s in sessions]
    for e in elections:
        await e.start()
    await wait_until(lambda: len(leaders(elections)) == 1, 10, "a leader")
    old = leaders(elections)[0]
    term = old.leadership
    assert term is not None
    lost: list[str] = []
    term.on_lost(lambda t: lost.append(t.lost_reason or ""))
    others = [e for e in elections if e is not old]
    started = time.monotonic()
    await old.session.stop()
    assert term.lost and not term.valid() and lost
    await wait_until(lambda: len(leaders(others)) == 1, 5, "a new leader")
    took = time.monotonic() - started
    new = leaders(others)[0].leadership
    assert new is not None
    assert new.epoch == term.epoch + 1
    assert took < 1.0, f"handover took {took:.3f} s"
    for e in others:
        await e.stop()


async def test_leader_loses_lease_when_zookeeper_stops_and_takes_a_new_epoch(
    zk_session, zk_server
) -> None:
    session = await zk_session("r0", session_timeout_s=2.0)
    election = PartitionElection(session, "p2")
    await election.start()
    async with asyncio.timeout(10):
        term = await election.wait_elected()
    assert term.valid()
    try:
        await asyncio.to_thread(zk_server.stop)
        # the lease ends within lease_s (1 s) of the last confirmed heartbeat
        await wait_until(lambda: not term.valid(), term.lease_s + 1.0, "the lease to end")
        await asyncio.to_thread(zk_server.start)
    finally:
        if zk_server.proc is None:
            await asyncio.to_thread(zk_server.start)
    async with asyncio.timeout(15):
        again = await election.wait_elected()
    assert again is not term and again.epoch > term.epoch and again.valid()
    # nobody else led in between: the new term follows this member's own one
    assert again.epoch == term.epoch + 1 and again.follows_own_term(term.epoch)
    assert not term.valid()
    await election.stop()


async def _lines(proc: asyncio.subprocess.Process, into: list[dict[str, object]]) -> None:
    assert proc.stdout is not None
    while line := await proc.stdout.readline():
        into.append(json.loads(line))


async def test_sigstopped_leader_is_fenced_when_it_wakes(zk_session, zk_hosts, zk_cluster) -> None:
    timeout_s = 1.0
    env = {**os.environ, "PYTHONPATH": ":".join(str(ROOT / s) for s in SOURCE_ROOTS)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(Path(__file__).with_name("zombie_candidate.py")),
        zk_hosts,
        zk_cluster,
        "p3",
        "zombie",
        str(timeout_s),
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    events: list[dict[str, object]] = []
    reader = asyncio.create_task(_lines(proc, events))
    try:
        await wait_until(
            lambda: any(e["event"] == "elected" for e in events), 30, "the subprocess to lead"
        )
        (first,) = [e for e in events if e["event"] == "elected"]
        assert first["valid"] is True
        session = await zk_session("survivor", session_timeout_s=timeout_s)
        terms: list[Leadership] = []
        survivor = PartitionElection(session, "p3", on_elected=terms.append)
        await survivor.start()
        await asyncio.sleep(0.3)
        assert not terms, "a second leader while the first is alive"

        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        await wait_until(lambda: terms, 10, "the survivor to lead")
        new = terms[0]
        assert new.epoch > int(first["epoch"])  # type: ignore[call-overload]
        assert not new.follows_own_term(new.epoch - 1)
        await asyncio.sleep(max(0.0, stopped + 2 * timeout_s - time.monotonic()))
        os.kill(proc.pid, signal.SIGCONT)

        # the first valid() after waking, from the probe thread: already False
        await wait_until(
            lambda: any(e["event"] == "probe" and float(e["gap_s"]) > timeout_s for e in events),  # type: ignore[arg-type]
            10,
            "the probe after the gap",
        )
        probes = [e for e in events if e["event"] == "probe" and float(e["gap_s"]) > timeout_s]  # type: ignore[arg-type]
        assert probes and all(p["valid"] is False for p in probes), probes
        await wait_until(
            lambda: any(e["event"] == "lost" for e in events), 10, "the old leader to step down"
        )
        # while the survivor leads, the old one never leads again
        await asyncio.sleep(1.0)
        assert [e for e in events if e["event"] == "elected"] == [first]
        assert new.valid()
        info = await current_leader(session, "p3")
        assert info is not None and (info.member_id, info.epoch) == ("survivor", new.epoch)

        # when the survivor resigns, the old member may lead again, but only with a new epoch
        await survivor.stop()
        await wait_until(
            lambda: len([e for e in events if e["event"] == "elected"]) == 2, 10, "re-election"
        )
        second = [e for e in events if e["event"] == "elected"][1]
        assert int(second["epoch"]) > new.epoch  # type: ignore[call-overload]
    finally:
        if proc.returncode is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            await proc.wait()
        reader.cancel()


async def test_epoch_node_holds_the_holder(zk_session, zk_cluster) -> None:
    session = await zk_session("r9")
    election = PartitionElection(session, "p4")
    await election.start()
    async with asyncio.timeout(10):
        term = await election.wait_elected()
    data, _stat = await session.op("get", epoch_path(zk_cluster, "p4"))
    assert json.loads(data) == {"epoch": term.epoch, "member_id": "r9", "url": "http://r9.test:1"}
    await election.stop()
    assert await current_leader(session, "p4") is None


def test_cluster_config_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "relay.toml"
    path.write_text(
        '[cluster]\nzookeeper = "127.0.0.1:2181"\nname = "c1"\nmember_id = "r1"\n'
        'advertised_url = "http://r1:8470"\nsession_timeout_s = 6\n'
    )
    config = ClusterConfig.from_toml(path)
    assert config == ClusterConfig(
        zookeeper="127.0.0.1:2181",
        name="c1",
        member_id="r1",
        advertised_url="http://r1:8470",
        session_timeout_s=6.0,
    )
    assert config.session_timeout_s == 6.0 and config.connect_timeout_s == 15.0
    (tmp_path / "plain.toml").write_text("[http]\nport = 1\n")
    assert ClusterConfig.from_toml(tmp_path / "plain.toml") is None
    from changebus.schemas.errors import ConfigError

    with pytest.raises(ConfigError):
        ClusterConfig.from_table({"zookeeper": "h:1", "name": "a/b"})
    with pytest.raises(ConfigError):
        ClusterConfig.from_table({"zookeeper": "h:1", "name": "c", "bogus": 1})


async def test_leader_whose_candidate_node_is_deleted_steps_down(zk_session) -> None:
    s1, s2 = await zk_session("r1"), await zk_session("r2")
    first = PartitionElection(s1, "p5")
    await first.start()
    async with asyncio.timeout(10):
        term = await first.wait_elected()
    second = PartitionElection(s2, "p5")
    await second.start()
    await asyncio.sleep(0.1)
    await s2.op("delete", term.candidate)  # an operator removes it by hand
    async with asyncio.timeout(5):
        assert await term.wait_lost() == "candidate node gone"
    assert not term.valid()
    async with asyncio.timeout(10):
        other = await second.wait_elected()
    assert other.epoch == term.epoch + 1
    await first.stop()
    await second.stop()


async def test_an_orphan_candidate_of_its_own_session_does_not_block_its_turn(
    zk_session, caplog: pytest.LogCaptureFixture
) -> None:
    """A create whose answer was lost leaves a candidate node of the member's own
    session. The start-up scan deletes such orphans, but one it misses (a lagging
    server; here the node names another member, so the scan passes it over) sat
    before the real candidate: the member waited for its own session to end."""
    s1, s2 = await zk_session("r1"), await zk_session("r2")
    leader = PartitionElection(s1, "p6")
    await leader.start()
    async with asyncio.timeout(10):
        term = await leader.wait_elected()
    orphan = await s2.op(
        "create",
        f"{election_path(s2.config.name, 'p6')}/{CANDIDATE_PREFIX}",
        encode_candidate("r2-before-a-restart", "http://old.test:1"),
        ephemeral=True,
        sequence=True,
    )
    second = PartitionElection(s2, "p6")
    await second.start()
    await wait_until(lambda: second._candidate is not None, 10, "a candidate")
    await leader.stop()
    assert term.lost
    async with asyncio.timeout(10):
        other = await second.wait_elected()
    assert other.valid() and other.epoch == term.epoch + 1
    assert await s2.op("exists", orphan) is None
    assert any("deleting own orphan" in r.getMessage() for r in caplog.records)
    await second.stop()


async def test_a_stopped_election_leaves_no_candidate_of_its_session(zk_session) -> None:
    """``requeue`` leaves the old candidate node for the next pass's orphan scan; a
    ``stop`` before that pass (a relay withdrawing a partition after its syncs failed)
    left it in place while the session lived on: every other member queued behind it,
    and the partition had no leader until this process ended (review)."""
    s1, s2 = await zk_session("r1"), await zk_session("r2")
    first = PartitionElection(s1, "p7")
    await first.start()
    async with asyncio.timeout(10):
        term = await first.wait_elected()
    first.requeue("the store failed")
    await first.stop()  # before the candidacy's loop ran again
    assert term.lost
    path = election_path(s1.config.name, "p7")
    assert await s1.op("get_children", path) == []
    second = PartitionElection(s2, "p7")
    await second.start()
    async with asyncio.timeout(10):
        other = await second.wait_elected()
    assert other.epoch == term.epoch + 1
    await second.stop()


async def test_an_error_from_zookeeper_does_not_end_the_candidacy(
    zk_session, zk_hosts: str, zk_cluster: str, caplog: pytest.LogCaptureFixture
) -> None:
    """ZooKeeper refusing a request (here NoAuth: an ACL locks the election node) is not
    "ZooKeeper did not answer": the candidacy must not end on it. A task that ended left
    its candidate node in place and nobody could take its turn until the process died."""
    admin = KazooClient(hosts=zk_hosts, timeout=5.0)
    admin.start(10)
    try:
        admin.add_auth("digest", "admin:pw")
        election = election_path(zk_cluster, "plock")
        admin.ensure_path(election.rpartition("/")[0])  # (the parents stay open)
        admin.create(election, acl=[make_digest_acl("admin", "pw", all=True)])
        session = await zk_session("r1")
        e = PartitionElection(session, "plock")
        await e.start()
        await asyncio.sleep(1.5)  # refused meanwhile, again and again
        assert e.leadership is None
        admin.set_acls(election, OPEN_ACL_UNSAFE)
        async with asyncio.timeout(15):
            term = await e.wait_elected()
        assert term.valid() and term.epoch == 1
        assert any("left the election after an error" in r.getMessage() for r in caplog.records)
        await e.stop()
    finally:
        admin.stop()
        admin.close()


async def test_the_lease_follows_the_session_timeout_the_server_grants(
    zk_session, caplog: pytest.LogCaptureFixture
) -> None:
    """Asked for 30 s, the test server (tickTime 500: at most 10 s) grants 10 s.

    The session expires after those 10 s and a rival leads after that: a lease
    of 0.9 x 30 s (what it was) would let this leader act for 17 s more.
    """
    session = await zk_session("r0", session_timeout_s=30.0, lease_fraction=0.9)
    assert session.negotiated_timeout_s == pytest.approx(10.0, abs=0.01)
    assert session.session_timeout_s == pytest.approx(10.0, abs=0.01)
    assert "granted a session timeout of 10 s, not the 30 s" in caplog.text
    election = PartitionElection(session, "p0")
    await election.start()
    await wait_until(lambda: election.leadership is not None, 10, "the leadership")
    assert election.leadership is not None
    assert election.leadership.lease_s == pytest.approx(9.0, abs=0.01)
    await election.stop()
    # asked for less than the server's maximum: the lease is a fraction of what was asked
    short = await zk_session("r1", session_timeout_s=2.0)
    assert short.session_timeout_s == pytest.approx(2.0, abs=0.01)
    assert short.lease_s == pytest.approx(2.0 * short.config.lease_fraction)


async def test_an_epoch_node_behind_the_epochs_seen_does_not_take_an_old_epoch(
    zk_session, zk_cluster
) -> None:
    """ZooKeeper that lost its data (no persistent volume, a re-created ensemble) has the
    epoch node back at 0. The next term took epoch 1, which every relay that had seen a
    newer epoch refused: the partition had no leader until the relays restarted. An
    election now takes one past the newest epoch it or its caller saw (found by review)."""
    from changebus.cluster._layout import EpochRecord, encode_epoch

    session = await zk_session("r1")
    election = PartitionElection(session, "p7")
    await election.start()
    async with asyncio.timeout(10):
        first = await election.wait_elected()
    assert first.epoch == 1
    await session.op("set", epoch_path(zk_cluster, "p7"), encode_epoch(EpochRecord(0)))
    election.requeue("test: ZooKeeper lost its data")
    await wait_until(lambda: election.leadership is not None and election.leadership is not first)
    assert election.leadership is not None and election.leadership.epoch == 2
    await election.stop()
    # a fresh election with the relay's floor (its followers saw epoch 5)
    other = PartitionElection(await zk_session("r2"), "p8", epoch_floor=lambda: 5)
    await other.start()
    async with asyncio.timeout(10):
        assert (await other.wait_elected()).epoch == 6
    await other.stop()


async def test_a_waiting_candidate_keeps_one_watch_on_its_predecessor(zk_session) -> None:
    """Each pass of the wait (every 2 op timeouts) added a new closure as a watcher of
    the predecessor; kazoo keeps a set of them, so they piled up for as long as the
    leader lived (thousands a day per waiting partition; found by review)."""
    first_session = await zk_session("r1", session_timeout_s=1.0)
    waiting_session = await zk_session("r2", session_timeout_s=1.0)
    first, waiting = (
        PartitionElection(first_session, "p9"),
        PartitionElection(waiting_session, "p9"),
    )
    await first.start()
    async with asyncio.timeout(10):
        term = await first.wait_elected()
    await waiting.start()
    await asyncio.sleep(5.0)  # a pass every 2 s
    watchers = waiting_session.client._data_watchers.get(term.candidate, set())
    assert len(watchers) == 1, watchers
    await first.stop()
    async with asyncio.timeout(10):
        await waiting.wait_elected()
    await waiting.stop()


async def test_an_epoch_race_lost_keeps_the_candidacy(zk_session, zk_cluster) -> None:
    """Another writer bumps the epoch node between the candidate's read and its
    transaction. kazoo reports the transaction's first operation (the candidate check,
    which held) as RolledBackError: it was read as "candidate gone", the candidate
    forgot its node and deleted it as an orphan (to the back of the line; found by
    review). It is a lost race: the same candidate tries again and leads."""
    session = await zk_session("r7")
    election = PartitionElection(session, "p7")
    commit = session.commit
    bumped: list[str] = []

    async def racing_commit(build: Any) -> list[Any]:
        if not bumped:
            bumped.append(election._candidate or "")
            node = epoch_path(zk_cluster, "p7")
            data, stat = await session.op("get", node)
            record = json.loads(data) if data else {"epoch": 0}
            other = {"epoch": record["epoch"] + 5, "member_id": "elsewhere", "url": "http://x:1"}
            await session.op("set", node, json.dumps(other).encode(), stat.version)
        results: list[Any] = await commit(build)
        return results

    session.commit = racing_commit
    await election.start()
    async with asyncio.timeout(10):
        term = await election.wait_elected()
    assert bumped and bumped[0] and term.candidate == bumped[0]  # the same node throughout
    assert term.epoch == 6  # past the epoch written in the race
    await election.stop()


async def test_watches_do_not_pile_up_over_terms(zk_session) -> None:
    """Each term registered a new closure watching the candidate node, and kazoo keeps a
    set of watchers per node: one more per term for as long as the candidate lived
    (review). The watch is one bound method now; deleting the candidate still ends the
    current term at once."""
    session = await zk_session("r-watch", session_timeout_s=2.0)
    election = PartitionElection(session, "p-watch")
    await election.start()
    try:
        async with asyncio.timeout(10):
            term = await election.wait_elected()
        candidate = term.candidate
        for i in range(6):  # terms end (a lapsed lease, a refused fence) and come again
            term.lose(f"test {i}")
            async with asyncio.timeout(10):
                while election.leadership is None or election.leadership is term:
                    await asyncio.sleep(0.02)
            term = election.leadership
            await asyncio.sleep(0.3)  # (a heartbeat or two: the watches registered)
        assert term.candidate == candidate  # (the same candidate node all along)
        watchers = session.client._data_watchers.get(candidate, set())
        assert 1 <= len(watchers) <= 2, watchers
        await session.op("delete", candidate)
        async with asyncio.timeout(5):
            await term.wait_lost()
        assert term.lost_reason == "candidate node gone" and not term.valid()
    finally:
        await election.stop()


async def test_a_heartbeat_that_cannot_read_the_epoch_ends_the_term(zk_session) -> None:
    """A non-retriable error in the leader's heartbeat (a malformed epoch node, its watch
    gone with a reconnect) was swallowed: the term was neither renewed nor lost, and its
    candidate held the line with nothing logged (review). It ends the term now."""
    session = await zk_session("r-beat", session_timeout_s=2.0)
    election = PartitionElection(session, "p-beat")
    await election.start()
    try:
        async with asyncio.timeout(10):
            term = await election.wait_elected()
        call = session.call

        async def failing(fn: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(fn, "__name__", "") == "beat":
                raise CoordinationError("malformed epoch node (test)", retriable=False)
            return await call(fn, *args, **kwargs)

        session.call = failing
        async with asyncio.timeout(10):
            await term.wait_lost()
        assert "epoch unreadable" in (term.lost_reason or "")
        session.call = call
    finally:
        await election.stop()


async def test_a_candidate_created_after_a_stop_while_zookeeper_was_away_is_deleted(
    zk_session, zk_server
) -> None:
    """A candidacy's create that kazoo queued while the connection was down runs once it is
    back, after ``stop`` gave up on it: its node then headed the line for as long as the
    session lived on, and no other member could lead the partition (review). It is deleted
    when the session connects again, and the other member leads."""
    s1 = await zk_session("r1", session_timeout_s=40.0)
    s2 = await zk_session("r2", session_timeout_s=40.0)
    first = PartitionElection(s1, "p9")
    await first.start()
    async with asyncio.timeout(10):
        term = await first.wait_elected()
    path = election_path(s1.config.name, "p9")
    sid = s1.session_id
    try:
        await asyncio.to_thread(zk_server.stop)
        await wait_until(lambda: not s1.connected, 10, "the connection to drop")
        # what a candidacy cut off by stop() leaves: its create waiting in kazoo's queue
        queued = s1.client.create_async(
            f"{path}/{CANDIDATE_PREFIX}",
            first._candidate_data,
            ephemeral=True,
            sequence=True,
        )
        await first.stop()
        assert term.lost
    finally:
        if zk_server.proc is None:
            await asyncio.to_thread(zk_server.start)
    await wait_until(lambda: s1.connected and s2.connected, 20, "both sessions back")
    assert s1.session_id == sid  # the same session: the queued create ran in it
    assert str(await asyncio.to_thread(queued.get, timeout=10)).startswith(f"{path}/")
    other = PartitionElection(s2, "p9")
    await other.start()
    async with asyncio.timeout(20):
        later = await other.wait_elected()
    assert later.valid() and later.epoch > term.epoch
    names: list[str] = await s1.op("get_children", path)
    assert len(names) == 1, names
    _data, stat = await s1.op("get", f"{path}/{names[0]}")
    assert stat.ephemeralOwner == s2.session_id
    await other.stop()


async def test_a_requeue_while_the_epoch_is_taken_does_not_lead(zk_session) -> None:
    """A follower whose chain failed for good requeues to let a healthy member lead; when
    that landed between its read of the epoch node and its commit, the commit went on and
    it led on its old candidate node all the same (review)."""
    s1 = await zk_session("r1")
    election = PartitionElection(s1, "p10")
    real = s1.commit
    requeued: list[int] = []

    async def commit(build: Any) -> Any:
        if not requeued:
            requeued.append(1)
            election.requeue("its chain failed")
        return await real(build)

    s1.commit = commit
    await election.start()
    async with asyncio.timeout(10):
        term = await election.wait_elected()
    assert requeued == [1]
    assert term.epoch >= 2  # the epoch taken as it requeued was given up
    assert term.candidate != ""
    await election.stop()
