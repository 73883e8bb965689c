"""Fault-injection run of the whole system (Jepsen style): ``bench/chaos.py --minutes N [--seed S]``.

Starts a real Postgres and MariaDB, ZooKeeper, three clustered relays, two
bootstrap servers, three effectively-once replicas (pg -> SQLite, pg -> Postgres,
MariaDB -> SQLite) and a ``changebus tail`` with a checkpoint, every network path
through a fault proxy; runs bank/ledger/kv/docs workloads on both sources and
seeded rounds of faults (kill -9, SIGSTOP, database restarts, dropped / delayed /
throttled / half-open / truncated connections, consumers falling off the relay
buffer), then checks the replicas row by row, the ledger, the bank samples and
the tail (see ``bench/_chaos.py``).

Prints the seed first (``--seed S`` replays the fault sequence), a line per round,
and a final JSON line: ``rounds``, ``faults`` (by kind), ``transactions``,
``invariant_violations``, ``missing``, ``extra``, ``different``,
``max_converge_s``, ``manual_interventions``, ``seed`` (goals: all 0 except the
counts, ``max_converge_s`` <= 30), plus ``ok``; the lines before it hold the
``details`` (fault log, convergence per round, examples of differences, self
exits, bootstraps per consumer, the run's directory). Exit status 0
when every goal is met, 1 otherwise. The run's directory (logs of every process
incarnation) is kept when a goal is missed, or with ``--keep``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
from pathlib import Path

from _chaos import ChaosOptions, run_chaos
from _chaos_faults import KINDS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=None, help="minutes of fault rounds")
    p.add_argument("--rounds", type=int, default=None, help="instead of --minutes: rounds")
    p.add_argument("--seed", type=int, default=None, help="the schedule's seed (default: random)")
    p.add_argument("--round-s", type=float, default=10.0, help="longest hold of a round's faults")
    p.add_argument("--max-faults", type=int, default=3, help="faults at once, at most")
    p.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help=f"fault kinds to draw from, comma-separated (default: all of {', '.join(KINDS)})",
    )
    p.add_argument(
        "--must-include",
        default="",
        help="fault kinds the first rounds start with, one per round, comma-separated"
        " (kind or kind@target-prefix, e.g. fall_off,kill9@leader)",
    )
    p.add_argument("--rate", type=float, default=20.0, help="transactions/s per database")
    p.add_argument("--durability", choices=("page_cache", "fsync"), default=None)
    p.add_argument("--base", type=Path, default=None, help="run directory (default: a temp one)")
    p.add_argument("--keep", action="store_true", help="keep the run directory")
    p.add_argument("-v", "--verbose", action="store_true", help="log the harness at INFO")
    args = p.parse_args(argv)
    if args.minutes is None and args.rounds is None:
        args.minutes = 5.0
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    must = tuple(k.strip() for k in args.must_include.split(",") if k.strip())
    unknown = (set(kinds) | {k.partition("@")[0] for k in must}) - set(KINDS)
    if unknown:
        p.error(f"unknown fault kinds: {', '.join(sorted(unknown))}")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    print(f"seed {seed}", flush=True)
    opts = ChaosOptions(
        seed=seed,
        rounds=args.rounds,
        minutes=args.minutes,
        round_s=args.round_s,
        max_faults=args.max_faults,
        kinds=kinds,
        must_include=must,
        rate_tps=args.rate,
        durability=args.durability,
        base=args.base,
        keep=args.keep,
        progress=lambda line: print(line, flush=True),
    )
    result = asyncio.run(run_chaos(opts))
    details = result.pop("details")
    print("details: " + json.dumps(details, default=str, indent=1), flush=True)
    print(json.dumps(result, default=str), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
