"""Consumer groups: rebalance after kill -9, pauses on a join, and scaling from 1 to 4 members.

Everything is private to the run: a ZooKeeper (``_zk.ZkServer``, the tests'
launcher) and ``changebus relay`` processes with the synthetic fetcher (one
partition). Each group member is a process of its own (this script with
``--member``): a :class:`Consumer` with ``group=...`` (64 buckets, the
default :class:`ZkUnitStore`, ZooKeeper session timeout 2 s) whose callbacks
count each window's decoded events. Members log their rebalance callbacks and, per unit, the first
delivery after each assignment and every delivery gap over ``PAUSE_S``, all
with ``time.monotonic()`` (one clock for all processes of the host).

* **scaling** (``group_scaling_ratio``, goal >= 1.6): a relay holding a
  finished backlog (``--backlog-windows`` windows of 10 events); a group of
  1 member, then a group of 4 members (another group name, so the same
  backlog from the start) read all of it. Rate = data events decoded by all
  members from the moment the group is balanced (4 members joining at once
  move units a few times first) to the last new delivery; the 1-member run is
  the baseline in the same run. ``group_scaling_ratio_whole_backlog`` divides
  the whole backlog by first -> last delivery instead (group formation
  included; it needs a backlog that takes many seconds). The CPU time of
  the relay and of the members (``/proc/<pid>/stat``) and of the whole
  machine (``/proc/stat``: it is shared) over each run says where the limit
  is (``scaling_limit``): the relay filters the whole buffer once per lane
  (one lane per member), each member decodes its share, and the machine has
  2 cores.
* **kill -9** (``rebalance_s_max``, goal <= 3 s with a 2 s session): 3 members
  on a live relay (``--rate`` windows/s of 20 events, keys spread over every
  bucket); ``--rounds`` times a member is killed with SIGKILL (the leader in
  even rounds, another member in odd ones); rebalance = kill -> the first
  delivery of each of its units at another member (max over its units).
* **join** (``paused_units_on_join``, goal: only the moved units): after each
  kill a new member joins (its process started beforehand and held, so its
  start-up costs no CPU at the join). Moved units = units revoked from the
  members already there; paused units = units with a delivery gap over
  ``PAUSE_S`` from the join until 1.5 s after the group is balanced again (a
  moved unit: its last delivery at the old member -> its first at the new
  one). ``paused_stayed_units_on_join`` counts the paused units that did not
  move (goal 0); ``paused_stayed_lease_held`` of them paused while their
  member held deliveries because its ZooKeeper lease was in doubt (heartbeats
  late: a starved member or ZooKeeper), ``lease_holds`` counts such holds over
  the kill/join rounds. Baseline in the same run: ``paused_units_without_rebalance``,
  the units with such a gap in 3 s of the same group with nothing happening
  (at 100 windows/s of 20 events a bucket sees ~30 events/s: a natural gap
  of 0.5 s is rare; a starved member is not).

Last line: one JSON object.
Usage: ``python bench/consumer_group.py [--backlog-windows N] [--rounds R] [--rate W]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import _common
from _group_member import BUCKETS, PAUSE_S, SESSION_S, member_main
from _group_procs import Bench, Member, balanced, cpu_s, machine_busy_s, relay_status, wait_for

EVENTS_PER_WINDOW = 10
LIVE_EVENTS_PER_WINDOW = 20


# ---- scaling ---------------------------------------------------------------------------------------


def scaling_run(bench: Bench, url: str, relay_pid: int, n: int, expected: int) -> dict[str, float]:
    """``n`` members read the whole backlog; distinct events/s and CPU shares."""
    group = f"scale{n}-{uuid.uuid4().hex[:6]}"
    members = [bench.member(group, url, f"s{n}-{i}") for i in range(n)]
    for m in members:
        wait_for(lambda m=m: m.lines("ready"), 60, f"{m.name} ready")
    pids = [relay_pid, *(m.proc.pid for m in members)]
    samples = [(time.monotonic(), [machine_busy_s(), *(cpu_s(p) for p in pids)])]  # CPU s
    for m in members:
        m.go()

    def totals() -> tuple[int, float]:
        last = [m.lines("progress") for m in members]
        events = sum(p[-1]["events"] for p in last if p)
        return events, max((p[-1]["t_last"] for p in last if p), default=0.0)

    # done when every event came and nothing new comes any more (replays after the first
    # moves may count twice); a group that loses events ends after 15 s without news
    seen, changed = (0, 0.0), time.monotonic()
    t_bal = 0.0  # when the group first was balanced (no more moves from then on)
    while True:
        time.sleep(0.2)
        now = time.monotonic()
        samples.append((now, [machine_busy_s(), *(cpu_s(p) for p in pids)]))
        if not t_bal and balanced(members):
            t_bal = now
        current = totals()
        if current != seen:
            seen, changed = current, now
        if (seen[0] >= expected and now - changed >= 1.5) or now - changed >= 15:
            break
    events, t_end = seen
    t_first = min(x["t"] for m in members for x in m.lines("first"))
    for m in members:
        m.stop()
    (t0, cpu0), (t1, cpu1) = samples[0], min(samples, key=lambda s: abs(s[0] - t_end))
    wall = t1 - t0
    if events < expected:
        print(f"{n} member(s): {expected - events} of {expected} events never came", flush=True)
    rate = expected / (t_end - t_first)
    # steady state: every event decoded once the group was balanced, per second
    steady = 0.0
    if t_bal and t_end > t_bal:
        at_bal = sum(
            max((x["decoded"] for x in m.lines("progress") if x["t"] <= t_bal), default=0)
            for m in members
        )
        final = sum(m.lines("progress")[-1]["decoded"] for m in members)
        steady = (final - at_bal) / (t_end - t_bal)
    return {
        "events_per_s": round(rate),
        "steady_events_per_s": round(steady),
        "balanced_after_s": round(max(t_bal - t_first, 0.0), 3) if t_bal else -1,
        "seconds": round(t_end - t_first, 3),
        "replayed_events": max(events - expected, 0),
        "missing_events": max(expected - events, 0),
        "machine_cpu_cores": round((cpu1[0] - cpu0[0]) / wall, 2),
        "relay_cpu_cores": round((cpu1[1] - cpu0[1]) / wall, 2),
        "members_cpu_cores": round((sum(cpu1[2:]) - sum(cpu0[2:])) / wall, 2),
        "busiest_member_cpu_cores": round(
            max(b - a for a, b in zip(cpu0[2:], cpu1[2:], strict=True)) / wall, 2
        ),
    }


def scaling(bench: Bench, windows: int) -> dict[str, Any]:
    options = {
        "windows_per_s": 0,
        "max_windows": windows,
        "events_per_window": EVENTS_PER_WINDOW,
        "row_bytes": 200,
        "tables": 2,
        "keys": 1_000_000,
    }
    url, proc = bench.relay("backlog", options)
    wait_for(lambda: relay_status(url)["state"] == "finished", 600, "the backlog")
    st = relay_status(url)
    expected = int(st["windows"]) * EVENTS_PER_WINDOW  # data events (not the control events)
    one = scaling_run(bench, url, proc.pid, 1, expected)
    print(f"1 member: {one}", flush=True)
    four = scaling_run(bench, url, proc.pid, 4, expected)
    print(f"4 members: {four}", flush=True)
    _common.stop_relay(proc)
    bench.relays.remove(proc)
    used = four["relay_cpu_cores"] + four["members_cpu_cores"]
    machine, cores = four["machine_cpu_cores"], os.cpu_count() or 2
    if machine >= 0.85 * cores:
        limit = (
            f"the machine's {cores} cores ({machine} busy: relay {four['relay_cpu_cores']},"
            f" members {four['members_cpu_cores']}, other processes {max(machine - used, 0):.2f})"
        )
    elif four["relay_cpu_cores"] >= 0.85:
        limit = (
            f"the relay's one core ({four['relay_cpu_cores']} cores busy: it filters the buffer"
            " once per lane)"
        )
    elif four["busiest_member_cpu_cores"] >= 0.85:
        limit = f"one member's core ({four['busiest_member_cpu_cores']} busy: decoding)"
    else:
        limit = (
            f"no CPU is saturated ({machine} of {cores} cores busy, ours {used:.2f}):"
            " latency-bound (long polls, queues, lease holds)"
        )
    one_limit = (
        f"1 member: {one['busiest_member_cpu_cores']} cores (decoding), relay"
        f" {one['relay_cpu_cores']}, machine {one['machine_cpu_cores']}"
    )
    limit = f"{limit}; {one_limit}"
    whole = four["events_per_s"] / one["events_per_s"]
    ratio = four["steady_events_per_s"] / max(one["steady_events_per_s"], 1)
    print(
        f"scaling 1 -> 4 members over {expected:,} events: balanced group"
        f" {one['steady_events_per_s']:,} -> {four['steady_events_per_s']:,} events/s (ratio"
        f" {ratio:.2f}); whole backlog incl. group formation {one['events_per_s']:,} ->"
        f" {four['events_per_s']:,} events/s (ratio {whole:.2f}); limit: {limit}",
        flush=True,
    )
    return {
        "group_1_member_events_per_s": one["steady_events_per_s"],
        "group_4_members_events_per_s": four["steady_events_per_s"],
        "group_scaling_ratio": round(ratio, 3),
        "group_scaling_ratio_whole_backlog": round(whole, 3),
        "group_4_balanced_after_s": four["balanced_after_s"],
        "group_backlog_events": expected,
        "group_4_replayed_events": four["replayed_events"],
        "group_missing_events": one["missing_events"] + four["missing_events"],
        "relay_cpu_cores_1": one["relay_cpu_cores"],
        "relay_cpu_cores_4": four["relay_cpu_cores"],
        "members_cpu_cores_1": one["members_cpu_cores"],
        "members_cpu_cores_4": four["members_cpu_cores"],
        "machine_cpu_cores_1": one["machine_cpu_cores"],
        "machine_cpu_cores_4": four["machine_cpu_cores"],
        "scaling_limit": limit,
    }


# ---- kill -9 and joins ------------------------------------------------------------------------------


def first_at_others(others: list[Member], unit: str, after: float) -> float | None:
    times = [x["t"] for m in others for x in m.lines("first") if x["u"] == unit and x["t"] > after]
    return min(times) if times else None


def join_pauses(
    before: list[Member], joiner: Member, t_join: float, t_end: float
) -> dict[str, int]:
    """Moved and paused units of one join (module docstring)."""
    moved: dict[str, float] = {}  # unit -> its last delivery at the old member
    for m in before:
        for x in m.lines("revoked"):
            if t_join < x["t"] <= t_end:
                for u in x["units"]:
                    moved[u] = x.get("last", {}).get(u, x["t"])
    paused: set[str] = set()
    for u, last in moved.items():
        first = first_at_others([joiner, *before], u, t_join)
        if first is None or first - last > PAUSE_S:
            paused.add(u)
    stayed, held = set(), set()
    for m in before:
        holds = lease_holds(m)
        for x in m.lines("gap"):
            if x["u"] not in moved and x["t1"] > t_join and x["t0"] < t_end:
                stayed.add(x["u"])
                if any(a < x["t1"] and b > x["t0"] for a, b in holds):
                    held.add(x["u"])
    return {
        "moved": len(moved),
        "paused": len(paused | stayed),
        "paused_stayed": len(stayed),
        "paused_stayed_lease_held": len(held),
    }


def lease_holds(m: Member) -> list[tuple[float, float]]:
    """The periods in which member ``m`` held deliveries, its lease in doubt."""
    out, start = [], None
    for x in m.lines():
        if x["ev"] == "lease_hold" and start is None:
            start = x["t"]
        elif x["ev"] == "lease_back" and start is not None:
            out.append((start, x["t"]))
            start = None
    if start is not None:
        out.append((start, time.monotonic()))
    return out


def rebalancing(bench: Bench, rounds: int, rate: float) -> dict[str, Any]:
    options = {
        "windows_per_s": rate,
        "events_per_window": LIVE_EVENTS_PER_WINDOW,
        "row_bytes": 100,
        "tables": 2,
        "keys": 1_000_000,
    }
    url, _ = bench.relay("live", options)
    group = f"rebalance-{uuid.uuid4().hex[:6]}"
    live = [bench.member(group, url, f"r{i}") for i in range(3)]
    spares = [bench.member(group, url, f"j{i}") for i in range(rounds)]
    for m in live + spares:
        wait_for(lambda m=m: m.lines("ready"), 60, f"{m.name} ready")
    for m in live:
        m.go()
    wait_for(lambda: balanced(live), 60, "3 members balanced")
    time.sleep(1.0)
    # baseline: units whose deliveries pause that long with no rebalance at all (a bucket
    # without events for a while, a member starved of CPU)
    quiet_from = time.monotonic()
    time.sleep(3.0)
    quiet = {x["u"] for m in live for x in m.lines("gap") if x["t1"] > quiet_from}
    kills: list[float] = []
    joins: list[dict[str, int]] = []
    for i in range(rounds):
        ordered = sorted(live, key=lambda m: m.member_id)
        victim = ordered[0] if i % 2 == 0 else ordered[-1]  # the leader, then another
        moved = victim.owned()
        others = [m for m in live if m is not victim]
        killed_at = time.monotonic()
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        wait_for(
            lambda others=others, moved=moved, t=killed_at: all(
                first_at_others(others, u, t) is not None for u in moved
            ),
            60,
            "the killed member's units delivering elsewhere",
        )
        took = max(first_at_others(others, u, killed_at) or 0.0 for u in moved) - killed_at
        kills.append(round(took, 3))
        live = others
        wait_for(lambda live=live: balanced(live), 60, "2 members balanced")
        time.sleep(1.0)
        joiner = spares[i]
        t_join = time.monotonic()
        joiner.go()
        grown = [*live, joiner]
        wait_for(lambda grown=grown: balanced(grown), 60, "3 members balanced")
        time.sleep(1.5)
        pauses = join_pauses(live, joiner, t_join, time.monotonic())
        joins.append(pauses)
        live = grown
        print(
            f"round {i + 1}: kill -9 -> delivering elsewhere {took:.3f} s; join: {pauses}",
            flush=True,
        )
    for m in live:
        m.stop()
    worst = max(joins, key=lambda j: (j["paused_stayed"], j["paused"]))
    return {
        "rebalance_s_max": max(kills),
        "rebalance_s": kills,
        "session_timeout_s": SESSION_S,
        "paused_units_on_join": worst["paused"],
        "moved_units_on_join": worst["moved"],
        "paused_stayed_units_on_join": max(j["paused_stayed"] for j in joins),
        "paused_units_without_rebalance": len(quiet),
        "lease_holds": sum(
            len(lease_holds(m)) for m in bench.members if m.name.startswith(("r", "j"))
        ),
        "joins": joins,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backlog-windows", type=int, default=30_000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--rate", type=float, default=100.0, help="live windows/s (20 events each)")
    ap.add_argument("--member", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--zookeeper", help=argparse.SUPPRESS)
    ap.add_argument("--group", help=argparse.SUPPRESS)
    ap.add_argument("--relay", help=argparse.SUPPRESS)
    ap.add_argument("--buckets", type=int, default=BUCKETS, help=argparse.SUPPRESS)
    ap.add_argument("--log", help=argparse.SUPPRESS)
    ap.add_argument("--name", default="", help=argparse.SUPPRESS)
    ap.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.member:
        sys.exit(asyncio.run(member_main(args)))
    base = Path(tempfile.mkdtemp(prefix="changebus-bench-group-"))
    bench = Bench(base)
    try:
        bench.zk.start()
        result = scaling(bench, args.backlog_windows)
        result.update(rebalancing(bench, args.rounds, args.rate))
    finally:
        bench.close()
        shutil.rmtree(base, ignore_errors=True)
    print(
        f"kill -9 -> units delivering elsewhere: max {result['rebalance_s_max']} s over "
        f"{args.rounds} kills (session timeout {SESSION_S} s); join: {result['paused_units_on_join']} "
        f"units paused, {result['moved_units_on_join']} moved",
        flush=True,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
