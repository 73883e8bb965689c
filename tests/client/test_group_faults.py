"""Consumer groups under faults: real ZooKeeper, real Postgres, the Postgres fetcher in a real relay.

Each member is a process (``group_member.py``) with a :class:`PostgresReplica`
sink: all members write to one target database, each window's rows together
with its unit's fenced checkpoint (effectively-once). The members log every
delivered window and every rebalance callback with ``time.monotonic()`` (one
clock for all processes of the host), so the tests measure pauses and moves
from the logs. Writer threads run inserts, updates and deletes over many keys
(every bucket sees events several times a second). Every test that writes ends
by comparing the target tables with the source, row by row.

* kill -9 of the group's leader: its units deliver again at the other members
  within 1 s of the server's expiry of its session (which comes a session
  timeout after its last packet, rounded up to the server's tick);
* scale out 1 -> 4 members and back to 2: only the moved units move (the
  fewest moves), the units that stay with a member never pause (no delivery
  gap over ``GAP_S`` while the writers run);
* SIGSTOP past the session, SIGCONT: the zombie reports the loss, delivers
  nothing more of its lost units, its checkpoint writes with its old tokens
  are refused, and the stored unit checkpoints name the new owners with a
  higher generation;
* a member configured with another bucket count than the group's fails with a
  ConfigError naming both counts.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from pathlib import Path

import pytest
from group_procs import (
    BUCKETS,
    GAP_S,
    SESSION_S,
    TICK_S,
    UNITS,
    Proc,
    first_after,
    group_setup,
)

# (timing: the move and pause bounds hold on a machine no other test is loading)
pytestmark = [pytest.mark.pg, pytest.mark.zk, pytest.mark.timing]

# ---- kill -9 ------------------------------------------------------------------------------


async def test_kill_9_of_the_leader_moves_its_units_within_session_timeout(
    pg_dsn: str, tmp_path: Path, zk_hosts: str
) -> None:
    async with group_setup(pg_dsn, tmp_path, zk_hosts) as (group, writers):
        writers.start()
        members = [await group.spawn(f"m{i}") for i in range(3)]
        for p in members:
            await p.go()
        await group.balanced(members)
        await group.delivering(members)
        await asyncio.sleep(0.5)
        victim = min(members, key=lambda p: p.member_id)  # the leader: lowest sequence
        rest = [p for p in members if p is not victim]
        moved = victim.owned()
        assert len(moved) == BUCKETS // 3
        killed_at = time.monotonic()
        victim.signal(signal.SIGKILL)
        await group.balanced(rest)
        await asyncio.sleep(1.5)  # the writers keep touching every bucket
        await writers.stop()
        await group.converged(pg_dsn)
    took = {}
    for unit in sorted(moved):
        delivered = first_after(rest, "win", unit, killed_at)
        assigned = first_after(rest, "assigned", unit, killed_at)
        assert assigned is not None, f"{unit} was never assigned again"
        took[unit] = round((delivered if delivered is not None else assigned) - killed_at, 3)
    # ZooKeeper expires sessions on its tick boundaries: up to a tick after the timeout
    assert max(took.values()) <= SESSION_S + TICK_S + 1.0, f"kill -> delivering elsewhere: {took}"
    # the survivors kept theirs: nothing was revoked from them
    assert not [x for p in rest for x in p.lines("revoked") if x["t"] > killed_at]


# ---- scale out and in -----------------------------------------------------------------------


def delivery_gaps(p: Proc, until: float) -> dict[str, float]:
    """Per unit, the longest pause in ``p``'s deliveries while it held the unit (up to ``until``).

    A holding starts at the first delivery after ``assigned`` (a moved unit's
    catch-up is its move's pause, not a gap) and ends at ``revoked``/``lost``
    (then at the last delivery before it) or at ``until`` (the writers' stop).
    """
    gaps: dict[str, float] = {}
    start: dict[str, float] = {}
    last: dict[str, float] = {}
    for x in p.lines():
        if x["ev"] == "assigned":
            for u in x["units"]:
                start[u] = x["t"]
                last.pop(u, None)
        elif x["ev"] in ("revoked", "lost"):
            for u in x["units"]:
                start.pop(u, None)
                last.pop(u, None)
        elif x["ev"] == "win" and x["u"] in start and x["t_start"] <= until:
            u, t = x["u"], x["t_start"]
            if u in last:
                gaps[u] = max(gaps.get(u, 0.0), t - last[u])
            last[u] = t
    for u, t in last.items():  # still held at the end: the pause up to the writers' stop
        if u in start:
            gaps[u] = max(gaps.get(u, 0.0), until - t)
    return gaps


async def test_scale_out_1_to_4_and_in_to_2_moves_only_the_units_that_must_move(
    pg_dsn: str, tmp_path: Path, zk_hosts: str
) -> None:
    async with group_setup(pg_dsn, tmp_path, zk_hosts) as (group, writers):
        spare = [await group.spawn(f"m{i}") for i in range(4)]
        for p in spare:
            await p.ready()
        writers.start()
        members: list[Proc] = []
        for p in spare:
            await p.go()
            members.append(p)
            await group.balanced(members)
            await group.delivering(members)
            await asyncio.sleep(1.0)
        for p in (members[3], members[2]):
            await p.terminate()
            members.remove(p)
            await group.balanced(members)
            await asyncio.sleep(1.0)
        await writers.stop()
        await group.converged(pg_dsn)
        for p in members:
            await p.terminate()
    procs = group.procs
    # the fewest moves: 12 first, then 6, 4 and 3 for the joins, then 3 and 4 for the leaves
    # (a member that stops may or may not call on_revoked for what it held: not counted)
    assigned = sum(
        len(x["units"]) for p in procs for x in p.lines("assigned") if x["t"] < writers.stopped
    )
    revoked = sum(
        len(x["units"])
        for p in procs
        for x in p.lines("revoked")
        if x["t"] < min(writers.stopped, p.stopped_at or writers.stopped)
    )
    moves = sorted(
        (round(x["t"] - writers.started, 3), p.name, x["ev"], len(x["units"]))
        for p in procs
        for x in p.lines()
        if x["ev"] in ("assigned", "revoked")
    )
    stops = {p.name: round(p.stopped_at - writers.started, 3) for p in procs}
    assert (assigned, revoked) == (12 + 6 + 4 + 3 + 3 + 4, 6 + 4 + 3), (moves, stops)
    assert not [x for p in procs for x in p.lines("lost")]
    # units that stayed with their member kept delivering through every rebalance
    gaps = {p.name: delivery_gaps(p, min(writers.stopped, p.stopped_at or 1e18)) for p in procs}
    worst = {name: max(g.values(), default=0.0) for name, g in gaps.items()}
    detail = {n: {u: round(v, 2) for u, v in g.items()} for n, g in gaps.items()}
    assert max(worst.values()) <= GAP_S, detail


# ---- SIGSTOP past the session --------------------------------------------------------------


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state T in /proc)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rpartition(")")[2].split()[0] == "T"


@pytest.mark.parametrize("where", ["anywhere", "mid_window"])
async def test_sigstopped_member_loses_its_units_and_its_checkpoint_writes_are_refused(
    pg_dsn: str, tmp_path: Path, zk_hosts: str, where: str
) -> None:
    """A member frozen past its session delivers and writes nothing of its old units on waking.

    ``anywhere``: SIGSTOP from outside, at whatever moment. ``mid_window``: the
    member stops itself inside a window's ``on_end_window``; on waking that
    window fails, so the dispatcher replays what it kept at once, before the
    member has heard from ZooKeeper that its session is gone: the replay must
    be fenced like a first delivery.
    """
    async with group_setup(pg_dsn, tmp_path, zk_hosts) as (group, writers):
        writers.start()
        members = [await group.spawn(f"m{i}", extra=("--fail-on-wake",)) for i in range(3)]
        for p in members:
            await p.go()
        await group.balanced(members)
        await group.delivering(members)
        await asyncio.sleep(0.5)
        zombie = sorted(members, key=lambda p: p.member_id)[1]  # not the leader
        old_id = zombie.member_id
        lost = zombie.owned()
        claimed = {x["u"]: x["generation"] for x in zombie.lines("claim")}
        assert lost and lost <= set(claimed)
        if where == "mid_window":
            zombie.signal(signal.SIGUSR1)
            await group.wait(
                lambda: bool(zombie.lines("self_stop")) and _stopped(zombie.proc.pid),
                10,
                "the zombie stopping itself in a window",
            )
        else:
            zombie.signal(signal.SIGSTOP)
        stopped_at = time.monotonic()

        def taken_over() -> bool:
            stored = group.stored()
            return all(
                u in stored and stored[u][0] != old_id and stored[u][1] > claimed[u] for u in lost
            )

        await group.wait(taken_over, 20, "the zombie's units claimed by others", interval=0.1)
        # ZooKeeper expires the session a session timeout after the member's last packet,
        # which may be a ping sent up to a third of it before the stop: not sooner than that
        assert time.monotonic() - stopped_at > SESSION_S / 2
        woke_at = time.monotonic()
        zombie.signal(signal.SIGCONT)
        await group.wait(
            lambda: (
                [x for x in zombie.lines("zombie_commit") if x["t"] > woke_at]
                and [x for x in zombie.lines("lost") if x["t"] > woke_at]
            ),
            15,
            "the zombie's wake-up",
        )
        await asyncio.sleep(1.0)
        await writers.stop()
        await group.converged(pg_dsn)
        stored = group.stored()
        for p in members:
            await p.terminate()
    after = [x for x in zombie.lines() if x["t"] > woke_at]
    # it learnt that it lost them
    told = set().union(*(set(x["units"]) for x in after if x["ev"] == "lost"))
    assert lost <= told
    # no window of them passed its fence after waking up: not under its old member id, and
    # not at all before it claimed the unit again (as a new member)
    reclaimed_at: dict[str, float] = {}
    for x in after:
        if x["ev"] == "claim":
            reclaimed_at.setdefault(x["u"], x["t"])
    woke = [x for x in zombie.lines("win") if x["t_start"] > woke_at and x["u"] in lost]
    late = [
        x
        for x in woke
        if x["admitted"] > woke_at
        and (x["m"] == old_id or x["admitted"] < reclaimed_at.get(x["u"], float("inf")))
    ]
    assert not late, json.dumps({"late": late[:5], "after": after[:40]})
    # a stop that came between a window's fence and its first callback (microseconds, on
    # the loop) lets that one window start on waking: it is an old owner's, written by nobody
    in_flight = [x for x in woke if x["admitted"] <= woke_at]
    assert len(in_flight) <= 1 and not [x for x in in_flight if x["applied"]], in_flight
    if where == "mid_window":  # the window cut by the stop failed: the replay came at once
        assert [x for x in after if x["ev"] == "fail"], after[:20]
    # its checkpoint writes with its old tokens were refused ...
    attempt = next(x for x in after if x["ev"] == "zombie_commit")
    assert "error" not in attempt, attempt
    assert set(attempt["fenced"]) >= lost & set(attempt["tokens"]) and attempt["tokens"]
    assert not set(attempt["written"]) & lost
    for x in zombie.lines("commit"):
        # the engine's own writes sent after the wake: none for a lost unit not reclaimed (one
        # sent before the stop may be answered, and logged, only after the wake)
        if x["t_start"] > woke_at:
            early = {u for u in set(x["written"]) & lost if x["t"] < reclaimed_at.get(u, 1e18)}
            assert not early, x
    # ... and the stored checkpoints name the new owners, with a higher generation
    for u in lost:
        owner, generation, _ = stored[u]
        assert owner != old_id and generation > claimed[u], (u, stored[u], claimed[u])
    counters = [x for x in zombie.lines("stats") if x["t"] > woke_at]
    assert (
        counters and counters[-1].get("units_lost", 0) + counters[-1].get("fenced_commits", 0) > 0
    )


# ---- bad input -------------------------------------------------------------------------------


async def test_member_with_another_bucket_count_fails_with_a_clear_config_error(
    pg_dsn: str, tmp_path: Path, zk_hosts: str
) -> None:
    async with group_setup(pg_dsn, tmp_path, zk_hosts) as (group, _):
        first = await group.join("m0")
        await group.balanced([first])
        wrong = await group.spawn("m1", buckets=8, hold=False)
        await asyncio.wait_for(wrong.proc.wait(), 30)
        assert wrong.proc.returncode == 2, wrong.stderr()[-3000:]
        message = next(x for x in wrong.lines("error"))
        assert message["type"] == "ConfigError"
        text = message["message"]
        assert group.name in text and "bucket" in text, text
        assert re.search(r"\b12\b", text) and re.search(r"\b8\b", text), text
        assert f"error: ConfigError: {text}" in wrong.stderr()
        # the group goes on: the first member kept its units
        assert first.alive and first.owned() == set(UNITS)
