"""The chaos harness, short version (about 2 minutes): every goal of the issue is asserted.

Real Postgres, MariaDB and ZooKeeper, three clustered relays, two bootstrap
servers, three replicas and a tail, every network path through a fault proxy (see
``bench/_chaos.py``); a few rounds of seeded faults, always including a consumer
falling off the small relay buffer (so it goes through the bootstrap server) and a
kill -9 of a partition's leader relay. The seed is printed with the command that
replays the same fault sequence (``bench/chaos.py --seed S ...``); set
``CHAOS_SEED`` to pin it here.
"""

from __future__ import annotations

import json
import os
import random

import pytest

from _chaos import GOAL_CONVERGE_S, ChaosOptions, run_chaos
from _chaos_faults import KINDS, Targets, plan_round
from _chaos_topology import free_port

pytestmark = [pytest.mark.pg, pytest.mark.mysql, pytest.mark.zk, pytest.mark.slow]

TARGETS = Targets(
    processes=("relay-1", "relay-2", "boot-pg", "rep-a", "tail"),
    consumers=("rep-a", "tail"),
    proxies=("c-relay-1", "b-relay-1", "pg-relay-1"),
)


def test_the_schedule_is_a_function_of_the_seed() -> None:
    def plan(seed: int) -> list[list[str]]:
        rng = random.Random(seed)
        return [
            [f.describe() for f in plan_round(rng, TARGETS, round_s=10, first=first)]
            for first in ((KINDS[0],), ("kill9@relay",), ())
        ]

    assert plan(7) == plan(7)
    assert plan(7)[1][0].startswith("kill9(relay-")
    assert plan(7) != plan(8)
    rng = random.Random(1)
    for _ in range(200):
        faults = plan_round(rng, TARGETS, round_s=10, max_faults=3, first=("fall_off",))
        assert 1 <= len(faults) <= 3
        assert faults[0].kind == "fall_off"
        assert faults[0].target in TARGETS.consumers
        assert len({f.target for f in faults}) == len(faults)  # one fault per target
        assert all(0 <= f.offset_s <= 5 for f in faults)
    assert free_port() > 0


@pytest.mark.timeout(600)
async def test_chaos_short() -> None:
    seed = int(os.environ.get("CHAOS_SEED") or random.SystemRandom().randrange(1, 10**6))
    print(
        f"chaos seed {seed} (reproduce: bench/chaos.py --seed {seed} --rounds 5 --round-s 8"
        " --must-include fall_off,kill9@leader,zk_restart)"
    )
    result = await run_chaos(
        ChaosOptions(
            seed=seed,
            rounds=5,
            round_s=8.0,
            must_include=("fall_off", "kill9@leader", "zk_restart"),
            # base: a new temporary directory the databases' users can enter (pytest's
            # tmp_path is not), removed when the run passed, kept (and named) when not
            progress=print,
        )
    )
    print(json.dumps(result, default=str))
    assert result["rounds"] == 5
    assert sum(result["faults"].values()) >= 5
    assert result["faults"].get("fall_off", 0) >= 1
    assert result["faults"].get("zk_restart", 0) >= 1
    assert result["transactions"] > 0
    details = result["details"]
    assert result["invariant_violations"] == 0, details["violations"]
    assert (result["missing"], result["extra"], result["different"]) == (0, 0, 0), details[
        "diff_examples"
    ]
    assert result["manual_interventions"] == 0, (details["not_running"], details["restart_loops"])
    assert result["max_converge_s"] <= GOAL_CONVERGE_S, details["converge_s"]
    assert not details["problems"], details["problems"]
    assert all(s["samples"] > s["exempt"] for s in details["bank_samples"].values()), details[
        "bank_samples"
    ]
    assert result["ok"]
