"""The chaos harness's fault catalogue and its seeded schedule (pure: no I/O).

A round injects 1..``max_faults`` faults *at once* (each at a seeded offset in the
round's first half), holds them, then heals everything. :func:`plan_round` draws
them from one ``random.Random`` (the run's seed), so a run's whole fault sequence
is a function of the seed and the targets: ``bench/chaos.py --seed S`` replays it.

Catalogue (``Fault.kind``):

================  ===================  ==============================================
kind              target               what happens
================  ===================  ==============================================
``kill9``         a process            SIGKILL; the supervisor restarts it (~1 s);
                                       ``leader-pg``/``leader-my``: the relay leading
                                       that partition when the fault starts
``sigstop``       a process            SIGSTOP for ``param`` s, then SIGCONT
``db_restart``    ``pg`` / ``mysql``   immediate restart of the database
``zk_restart``    ``zk``               ZooKeeper stopped for ``param`` s, then started
``proxy_drop``    a proxy              every open connection reset (RST) once
``proxy_delay``   a proxy              every chunk held ``param`` s, for the hold
``proxy_throttle`` a proxy             ``param`` bytes/s both ways, for the hold
``proxy_half_open`` a proxy            nothing forwarded, sockets left open
``proxy_truncate`` a proxy             responses cut after ``param`` more bytes
``fall_off``      a consumer           SIGSTOP until every relay evicted its stored
                                       checkpoint, then kill -9: it restarts from a
                                       position no relay keeps (bootstrap)
================  ===================  ==============================================

At most one fault per target in a round (a proxy has one mode at a time; killing a
stopped process is no second fault). ``must_include`` puts given kinds first in the
first rounds (the short test makes sure it sees a fall-off and a relay kill); an entry
``kind@prefix`` picks its target among the names starting with ``prefix``
(``kill9@relay``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["KINDS", "Fault", "Targets", "plan_round"]

KINDS = (
    "kill9",
    "sigstop",
    "db_restart",
    "zk_restart",
    "proxy_drop",
    "proxy_delay",
    "proxy_throttle",
    "proxy_half_open",
    "proxy_truncate",
    "fall_off",
)


@dataclass(frozen=True)
class Targets:
    """What faults can hit."""

    processes: tuple[str, ...]  # daemons and consumers
    consumers: tuple[str, ...]  # fall_off candidates
    proxies: tuple[str, ...]
    databases: tuple[str, ...] = ("pg", "mysql")
    coordination: tuple[str, ...] = ("zk",)


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` on ``target`` from ``offset_s`` into the round; ``param`` per kind."""

    kind: str
    target: str
    offset_s: float
    param: float = 0.0

    def describe(self) -> str:
        extra = {
            "sigstop": f" for {self.param:.1f} s",
            "zk_restart": f" down {self.param:.1f} s",
            "proxy_delay": f" {self.param:.2f} s",
            "proxy_throttle": f" {int(self.param)} B/s",
            "proxy_truncate": f" after {int(self.param)} B",
        }.get(self.kind, "")
        return f"{self.kind}({self.target}{extra}) at +{self.offset_s:.1f} s"


def _target(
    rng: random.Random, kind: str, targets: Targets, used: set[str], prefix: str = ""
) -> str | None:
    pool: Sequence[str]
    if kind in ("kill9", "sigstop"):
        pool = targets.processes
    elif kind == "fall_off":
        pool = targets.consumers
    elif kind == "db_restart":
        pool = targets.databases
    elif kind == "zk_restart":
        pool = targets.coordination
    else:
        pool = targets.proxies
    free = [t for t in pool if t not in used and t.startswith(prefix)]
    return rng.choice(free) if free else None


def _param(rng: random.Random, kind: str, round_s: float) -> float:
    if kind == "sigstop":
        return round(rng.uniform(1.0, max(1.5, round_s * 0.8)), 1)
    if kind == "zk_restart":  # seconds down: below and above the relays' session timeout
        return round(rng.uniform(0.5, min(8.0, round_s * 0.5)), 1)
    if kind == "proxy_delay":
        return round(rng.choice((0.05, 0.2, 0.5, 1.5)), 2)
    if kind == "proxy_throttle":
        return float(rng.choice((2_000, 20_000, 200_000)))
    if kind == "proxy_truncate":
        return float(rng.choice((0, 100, 5_000, 60_000)))
    return 0.0


def plan_round(
    rng: random.Random,
    targets: Targets,
    *,
    round_s: float,
    max_faults: int = 3,
    kinds: Sequence[str] = KINDS,
    first: Sequence[str] = (),
) -> list[Fault]:
    """The faults of one round (module docstring); ``first``: kinds that must be among them
    (``kind`` or ``kind@target-prefix``)."""
    count = rng.randint(1, max(1, max_faults))
    count = max(count, len(first))
    chosen = list(first) + [rng.choice(kinds) for _ in range(count - len(first))]
    used: set[str] = set()
    faults: list[Fault] = []
    for entry in chosen:
        kind, _, prefix = entry.partition("@")
        target = _target(rng, kind, targets, used, prefix)
        if target is None:
            continue
        used.add(target)  # one fault per target: a consumer that falls off is not killed too
        offset = round(rng.uniform(0.0, round_s / 2), 1)
        faults.append(Fault(kind, target, offset, _param(rng, kind, round_s)))
    return faults
