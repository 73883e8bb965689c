"""The chaos run: workloads, seeded rounds of faults, convergence, and the final checks.

:func:`run_chaos` starts the :class:`~_chaos_topology.Topology` (databases,
ZooKeeper, three relays, two bootstrap servers, three replicas and a tail, every
network path through a fault proxy), creates the workload's tables and starts its
writers on both sources, then runs rounds until ``rounds`` or ``minutes`` are used:

1. **faults**: :func:`~_chaos_faults.plan_round` draws 1..3 faults from the seeded
   ``random.Random``; each starts at its offset and is held (at most the round);
2. **heal**: every proxy passes again, every stopped process continues (killed
   ones were restarted by the supervisor);
3. **convergence**: a marker row is committed in each source right after the
   heal; ``converge_s`` is the time until every replica (and the tail) has it --
   the source's high-water mark at heal, seen everywhere. A round that does not
   converge within ``converge_timeout_s`` is recorded with that time (a failure:
   the goal is ``max_converge_s <= 30``) and the run goes on.

At the end the writers stop, everything is healed, a last marker is awaited
(bounded: ``final_wait_s``), and then: every replica is compared with its source
row by row (``missing``, ``extra``, ``different``), the ledger of every replica
(and of the source) must have no gap, the bank samplers must have seen the
accounts' sum constant in every consistent sample, the tail's SCNs may only go
back where a restart replays after its checkpoint, and every process must be
running on its own (``manual_interventions``: a process the supervisor could not
keep up; self exits are reported in ``details``). Marker tables are the
harness's own and are not compared.

Result: a dict with the issue's keys (``rounds``, ``faults`` by kind,
``transactions``, ``invariant_violations``, ``missing``, ``extra``,
``different``, ``max_converge_s``, ``manual_interventions``) plus ``seed``,
``ok`` and ``details`` (examples of what went wrong, the fault log, the run's
directory with the logs of every process incarnation).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import random
import shutil
import sqlite3
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from _chaos_check import (
    BankSampler,
    ReplicaSample,
    TailChecker,
    compare,
    ledger_gaps,
    pg_bank_sample,
    pg_replica_rows,
    source_rows,
    sqlite_bank_sample,
    sqlite_rows,
)
from _chaos_faults import KINDS, Fault, Targets, plan_round
from _chaos_procs import Supervisor
from _chaos_topology import CONSUMER, PARTITIONS, ReplicaSpec, Topology, TopologyOptions
from _chaos_workload import SourceWorkload, WorkloadConfig

__all__ = ["GOAL_CONVERGE_S", "ChaosOptions", "run_chaos"]

log = logging.getLogger("chaos")

#: the issue's goal for ``max_converge_s``
GOAL_CONVERGE_S = 30.0
MARKS = "chaos_marks"


@dataclass(frozen=True)
class ChaosOptions:
    """One run. ``rounds`` or ``minutes`` (of rounds, after start-up) bound it."""

    seed: int
    rounds: int | None = None
    minutes: float | None = None
    #: how long a round's faults are held at most (each starts in the first half)
    round_s: float = 10.0
    max_faults: int = 3
    kinds: tuple[str, ...] = KINDS
    #: kinds the first rounds must include, in order (one per round)
    must_include: tuple[str, ...] = ()
    #: a round not converged after this long is recorded as this long
    converge_timeout_s: float = 60.0
    #: the end's bounded wait for convergence
    final_wait_s: float = GOAL_CONVERGE_S
    #: longest SIGSTOP of a fall-off (waiting for every relay to evict the position)
    fall_off_max_s: float = 60.0
    rate_tps: float = 20.0
    writers: int = 2
    ddl_after_s: float = 15.0
    relay_capacity_bytes: int = 512 << 10
    durability: str | None = None
    #: the run's directory (default: a new temporary one, removed when the run passed)
    base: Path | None = None
    keep: bool = False
    progress: Callable[[str], None] | None = None


@dataclass
class _Run:
    """One run's state: the loop's only (the samplers and workloads have their threads)."""

    opts: ChaosOptions
    topo: Topology
    rng: random.Random
    workloads: dict[str, SourceWorkload] = field(default_factory=dict)
    samplers: list[BankSampler] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    fault_log: list[str] = field(default_factory=list)
    converge: list[float] = field(default_factory=list)
    marks: int = 0
    problems: list[str] = field(default_factory=list)
    #: marker ids the tail printed, and how far each of its output files was read
    tail_seen: set[int] = field(default_factory=set)
    tail_offsets: dict[Path, int] = field(default_factory=dict)

    def say(self, text: str) -> None:
        log.info("%s", text)
        if self.opts.progress is not None:
            self.opts.progress(text)


# -- markers --------------------------------------------------------------------------------


def _create_marks(topo: Topology, kind: str) -> None:
    conn = topo.connect(kind)
    try:
        sql = f"CREATE TABLE IF NOT EXISTS {MARKS} (id int PRIMARY KEY, note varchar(40))"
        if kind == "pg":
            conn.execute(sql)
        else:
            with conn.cursor() as cur:
                cur.execute(sql)
    finally:
        conn.close()


def _write_mark(topo: Topology, kind: str, mark: int, deadline: float) -> None:
    """Commit marker ``mark`` (retrying while the database restarts); blocking."""
    while True:
        try:
            conn = topo.connect(kind)
            try:
                if kind == "pg":
                    conn.execute(
                        f"INSERT INTO {MARKS} VALUES (%s, 'heal') ON CONFLICT DO NOTHING", (mark,)
                    )
                else:
                    with conn.cursor() as cur:
                        cur.execute(f"INSERT IGNORE INTO {MARKS} VALUES (%s, 'heal')", (mark,))
                return
            finally:
                conn.close()
        except Exception as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not write marker {mark} to {kind}: {exc}") from exc
            time.sleep(0.3)


def _replica_has(rep: ReplicaSpec, mark: int) -> bool:
    """Whether the replica holds marker ``mark`` (blocking; False while unreadable)."""
    table = rep.table(MARKS)
    try:
        if rep.sink == "sqlite":
            assert rep.path is not None
            if not rep.path.exists():
                return False
            conn = sqlite3.connect(f"file:{rep.path}?mode=ro", uri=True, timeout=2)
            try:
                row = conn.execute(f'SELECT 1 FROM "{table}" WHERE id = ?', (mark,)).fetchone()
            finally:
                conn.close()
            return row is not None
        with psycopg.connect(rep.dsn, autocommit=True, connect_timeout=3) as pg:
            schema, name = table.split(".")
            found = pg.execute(
                f'SELECT 1 FROM "{schema}"."{name}" WHERE id = %s', (mark,)
            ).fetchone()
            return found is not None
    except (sqlite3.Error, psycopg.Error):
        return False


def _tail_marks(run: _Run) -> set[int]:
    """Marker ids the tail printed so far (reads only what was appended since last time)."""
    for path in run.topo.supervisor.outputs("tail-pg"):
        offset = run.tail_offsets.get(path, 0)
        try:
            with path.open("rb") as fh:
                fh.seek(offset)
                data = fh.read()
        except FileNotFoundError:
            continue
        end = data.rfind(b"\n") + 1
        run.tail_offsets[path] = offset + end
        for line in data[:end].splitlines():
            if MARKS.encode() not in line:
                continue
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                doc = json.loads(line)
                if str(doc.get("table", "")).endswith(MARKS) and doc.get("after"):
                    run.tail_seen.add(int(doc["after"]["id"]))
    return run.tail_seen


async def _converge(run: _Run, limit_s: float) -> tuple[float, list[str]]:
    """Commit a marker in each source now; seconds until every replica and the tail hold it.

    Returns (seconds, the consumers still lacking it at the limit_s).
    """
    run.marks += 1
    mark = run.marks
    t0 = time.monotonic()
    deadline = t0 + limit_s
    await asyncio.gather(
        *(
            asyncio.to_thread(_write_mark, run.topo, kind, mark, deadline)
            for kind in PARTITIONS.values()
        )
    )
    waiting = {rep.name for rep in run.topo.replicas} | {"tail-pg"}
    while True:
        for rep in run.topo.replicas:
            if rep.name in waiting and await asyncio.to_thread(_replica_has, rep, mark):
                waiting.discard(rep.name)
        if "tail-pg" in waiting and mark in await asyncio.to_thread(_tail_marks, run):
            waiting.discard("tail-pg")
        if not waiting:
            return time.monotonic() - t0, []
        if time.monotonic() > deadline:
            return limit_s, sorted(waiting)
        await asyncio.sleep(0.25)


# -- faults ---------------------------------------------------------------------------------


async def _apply(run: _Run, fault: Fault, hold_until: float) -> None:
    """Inject one fault at its offset and hold it (at most until ``hold_until``)."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(fault.offset_s)
    topo, sup = run.topo, run.topo.supervisor
    run.faults[fault.kind] += 1
    run.fault_log.append(fault.describe())
    kind, target = fault.kind, fault.target
    if target.startswith("leader-"):  # whichever relay leads that partition now
        target = await asyncio.to_thread(topo.leader, target.removeprefix("leader-"))
        run.fault_log.append(f"{fault.target} is {target}")
    if kind == "kill9":
        sup.kill9(target)
    elif kind == "sigstop":
        sup.stop(target)
        try:
            await asyncio.sleep(min(fault.param, max(0.0, hold_until - loop.time())))
        finally:
            sup.cont(target)
    elif kind == "fall_off":
        partition = topo.partition_of(target)
        sup.stop(target)
        t0 = loop.time()
        # where its next incarnation resumes: what it stored (read while it is stopped)
        scn = await asyncio.to_thread(topo.consumer_checkpoint_scn, target)
        try:
            while loop.time() < t0 + run.opts.fall_off_max_s:
                await asyncio.sleep(0.5)
                if await asyncio.to_thread(topo.evicted_past, partition, scn):
                    run.fault_log.append(
                        f"fall_off({target}): every relay evicted its checkpoint {scn} after "
                        f"{loop.time() - t0:.1f} s"
                    )
                    break
            else:
                run.fault_log.append(f"fall_off({target}): SCN {scn} not evicted in time")
        finally:
            # Continuing it would not do: what the relays pushed before the stop waits in
            # its socket buffers and queue (more than a small ring holds), so it would read
            # on from there. A consumer down that long is restarted: from its checkpoint,
            # which no relay keeps any more -- it must go through the bootstrap server.
            sup.kill9(target)
    elif kind == "db_restart":
        await asyncio.to_thread(topo.restart_db, target)
    elif kind == "zk_restart":
        await asyncio.to_thread(topo.restart_zk, fault.param)
    else:
        proxy = topo.proxies[target]
        if kind == "proxy_drop":
            proxy.drop()
            return
        if kind == "proxy_delay":
            proxy.delay(fault.param)
        elif kind == "proxy_throttle":
            proxy.throttle(int(fault.param))
        elif kind == "proxy_half_open":
            proxy.half_open()
        elif kind == "proxy_truncate":
            proxy.truncate(int(fault.param))
        try:
            await asyncio.sleep(max(0.0, hold_until - loop.time()))
        finally:
            proxy.heal()


def _heal_all(topo: Topology) -> None:
    for proxy in topo.proxies.values():
        proxy.heal()
    sup = topo.supervisor
    for name in [*topo.daemons, *topo.consumers]:
        if sup.is_stopped(name):
            sup.cont(name)


async def _round(run: _Run, number: int) -> None:
    opts = run.opts
    first = opts.must_include[number - 1 : number]
    topo = run.topo
    targets = Targets(
        processes=(*topo.daemons, *topo.consumers, *(f"leader-{p}" for p in PARTITIONS)),
        consumers=tuple(topo.consumers),
        proxies=tuple(sorted(topo.proxies)),
    )
    faults = plan_round(
        run.rng,
        targets,
        round_s=opts.round_s,
        max_faults=opts.max_faults,
        kinds=opts.kinds,
        first=first,
    )
    run.say(f"round {number}: " + ", ".join(f.describe() for f in faults))
    loop = asyncio.get_running_loop()
    hold_until = loop.time() + opts.round_s
    results = await asyncio.gather(
        *(_apply(run, f, hold_until) for f in faults), return_exceptions=True
    )
    for f, res in zip(faults, results, strict=True):
        if isinstance(res, BaseException):
            run.problems.append(f"round {number}: {f.describe()} failed: {res!r}")
    with contextlib.suppress(Exception):
        await asyncio.sleep(max(0.0, hold_until - loop.time()))
    _heal_all(topo)
    seconds, lacking = await _converge(run, opts.converge_timeout_s)
    run.converge.append(seconds)
    note = f" (not converged: {', '.join(lacking)})" if lacking else ""
    txns = sum(w.transactions for w in run.workloads.values())
    run.say(f"round {number}: healed, converged in {seconds:.1f} s{note}; {txns} transactions")
    if lacking:
        run.problems.append(f"round {number}: not converged in {seconds:.0f} s: {lacking}")


# -- samplers -------------------------------------------------------------------------------


def _bank_sample(rep: ReplicaSpec) -> ReplicaSample:
    """count(*) and sum(balance) of the replica's accounts, with its checkpoint, in one read.

    None (exempt) while the replica is bootstrapping (its stored checkpoint is in
    snapshot or catch-up mode): a replica is transactionally consistent only online
    (a snapshot is read page by page while the source changes and the catch-up
    replays the log over it: docs/guarantees.md) -- by design, not leniency; the
    sampler counts those samples in ``exempt``.
    """
    schema = rep.schema
    if rep.sink == "sqlite":
        assert rep.path is not None
        return sqlite_bank_sample(
            rep.path, schema=schema, consumer=CONSUMER, partition=rep.partition
        )
    return pg_bank_sample(rep.dsn, schema=schema, consumer=CONSUMER, partition=rep.partition)


# -- the end --------------------------------------------------------------------------------


def _replica_rows(rep: ReplicaSpec, table: str) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    if rep.sink == "sqlite":
        assert rep.path is not None
        return sqlite_rows(rep.path, table, schema=rep.schema)
    return pg_replica_rows(rep.dsn, table, schema=rep.schema)


def _final_checks(run: _Run, result: dict[str, Any]) -> None:
    """Row-by-row comparison, ledger gaps, bank samples, tail (blocking)."""
    topo = run.topo
    examples: list[str] = []
    violations: list[str] = []
    totals = Counter[str]()
    sources: dict[tuple[str, str], dict[tuple[Any, ...], tuple[Any, ...]]] = {}
    for kind in PARTITIONS.values():
        for table in SourceWorkload.TABLES:
            sources[kind, table] = source_rows(kind, functools.partial(topo.connect, kind), table)
        for gap in ledger_gaps(sources[kind, "ledger"]):
            violations.append(f"source {kind} ledger: {gap}")
    for rep in topo.replicas:
        for table in SourceWorkload.TABLES:
            try:
                replica = _replica_rows(rep, table)
            except Exception as exc:  # noqa: BLE001 - a missing table is a failure too
                replica = {}
                examples.append(f"{rep.name} {table}: unreadable: {exc!r}"[:300])
            diff = compare(sources[rep.source_kind, table], replica, table=table)
            totals["missing"] += diff.missing
            totals["extra"] += diff.extra
            totals["different"] += diff.different
            if diff.missing or diff.extra or diff.different:
                examples.append(
                    f"{rep.name} {table}: missing {diff.missing} extra {diff.extra} "
                    f"different {diff.different}, e.g. {diff.examples[:3]}"
                )
            if table == "ledger":
                for gap in ledger_gaps(replica):
                    violations.append(f"{rep.name} ledger: {gap}")
    for sampler in run.samplers:
        violations.extend(f"bank: {v}" for v in sampler.violations)
        if sampler.violation_count > len(sampler.violations):
            violations.append(
                f"bank {sampler.replica}: {sampler.violation_count} violations in all"
            )
    tail = TailChecker().check(topo.supervisor.outputs("tail-pg"), topo.tail_checkpoints)
    violations.extend(f"tail: {v}" for v in tail)
    result.update(totals)
    result["invariant_violations"] = len(violations)
    result["details"]["violations"] = violations[:20]
    result["details"]["diff_examples"] = examples[:20]
    result["details"]["bank_samples"] = {
        s.replica: {"samples": s.samples, "exempt": s.exempt, "errors": s.errors}
        for s in run.samplers
    }


def _interventions(run: _Run, result: dict[str, Any]) -> None:
    """Processes that did not keep running by themselves; self exits for the report."""
    sup = run.topo.supervisor
    self_exits = [e for e in sup.exits if not e.killed_by_harness]
    result["details"]["self_exits"] = [
        f"{e.name}#{e.incarnation} status {e.returncode}: {e.log_tail[-300:]}"
        for e in self_exits[:20]
    ]
    down = [n for n in [*run.topo.daemons, *run.topo.consumers] if not sup.is_running(n)]
    # a process that kept dying by itself (3 self exits in a row at the end) is a restart loop
    loops = []
    for name in [*run.topo.daemons, *run.topo.consumers]:
        mine = [e for e in sup.exits if e.name == name]
        if len(mine) >= 3 and all(not e.killed_by_harness for e in mine[-3:]):
            last = mine[-1]
            if sup.incarnations.get(name, 0) <= last.incarnation + 1:
                loops.append(name)
    result["manual_interventions"] = len(set(down) | set(loops))
    result["details"]["bootstraps"] = {n: _bootstraps(sup, n) for n in run.topo.consumers}
    result["details"]["not_running"] = down
    result["details"]["restart_loops"] = loops


def _bootstraps(sup: Supervisor, name: str) -> int:
    """How often a consumer read from a bootstrap server (its log lines say so)."""
    count = 0
    for n in range(1, sup.incarnations.get(name, 0) + 1):
        with contextlib.suppress(FileNotFoundError):
            text = sup.log_path(name, n).read_text(errors="replace")
            count += text.count(": bootstrap from ")
    return count


# -- the run --------------------------------------------------------------------------------


async def run_chaos(opts: ChaosOptions) -> dict[str, Any]:
    """One chaos run (module docstring); returns the result dict."""
    if opts.rounds is None and opts.minutes is None:
        raise ValueError("give rounds or minutes")
    base = opts.base or Path(tempfile.mkdtemp(prefix="changebus-chaos-"))
    topo = Topology(
        TopologyOptions(
            base=base,
            relay_capacity_bytes=opts.relay_capacity_bytes,
            durability=opts.durability,
        )
    )
    run = _Run(opts, topo, random.Random(opts.seed))
    result: dict[str, Any] = {
        "seed": opts.seed,
        "rounds": 0,
        "faults": {},
        "transactions": 0,
        "invariant_violations": 0,
        "missing": 0,
        "extra": 0,
        "different": 0,
        "max_converge_s": 0.0,
        "manual_interventions": 0,
        "details": {"base": str(base)},
    }
    watch: asyncio.Task[None] | None = None
    t_start = time.monotonic()
    try:
        run.say(f"seed {opts.seed}: starting in {base}")
        await topo.start()
        watch = asyncio.create_task(topo.supervisor.watch(), name="chaos-watch")
        wcfg = WorkloadConfig(
            rate_tps=opts.rate_tps, writers=opts.writers, ddl_after_s=opts.ddl_after_s
        )
        for i, kind in enumerate(PARTITIONS.values()):
            await asyncio.to_thread(_create_marks, topo, kind)
            wl = SourceWorkload(
                kind, functools.partial(topo.connect, kind), wcfg, opts.seed * 10 + i
            )
            await asyncio.to_thread(wl.create_tables)
            run.workloads[kind] = wl
        for rep in topo.replicas:
            sampler = BankSampler(
                rep.name,
                _bank_sample(rep),
                wcfg.accounts,
                wcfg.accounts * wcfg.initial_balance,
            )
            run.samplers.append(sampler)
        seconds, lacking = await _converge(run, 120)
        if lacking:
            raise RuntimeError(f"the replicas never started: {lacking} (logs in {base})")
        run.say(f"started in {time.monotonic() - t_start:.0f} s; first marker in {seconds:.1f} s")
        for wl in run.workloads.values():
            wl.start()
        for sampler in run.samplers:
            sampler.start()
        t_rounds = time.monotonic()
        number = 0
        while True:
            if opts.rounds is not None and number >= opts.rounds:
                break
            if opts.minutes is not None and time.monotonic() - t_rounds > opts.minutes * 60:
                break
            number += 1
            await _round(run, number)
            _check_watch(watch)
        result["rounds"] = number
        run.say("stopping the writers")
        for wl in run.workloads.values():
            await asyncio.to_thread(wl.stop)
        _heal_all(topo)
        seconds, lacking = await _converge(run, opts.final_wait_s)
        run.converge.append(seconds)
        if lacking:
            run.problems.append(f"end: not converged in {seconds:.0f} s: {lacking}")
        run.say(f"end: converged in {seconds:.1f} s" + (f" (lacking {lacking})" if lacking else ""))
        for sampler in run.samplers:
            await asyncio.to_thread(sampler.stop)
        await asyncio.to_thread(_final_checks, run, result)
        _interventions(run, result)
    finally:
        for sampler in run.samplers:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(sampler.stop)
        for wl in run.workloads.values():
            with contextlib.suppress(Exception):
                await asyncio.to_thread(wl.stop)
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(BaseException):
                await watch
        await topo.close()
    result["faults"] = dict(sorted(run.faults.items()))
    result["transactions"] = sum(w.transactions for w in run.workloads.values())
    result["max_converge_s"] = round(max(run.converge, default=0.0), 1)
    result["details"]["fault_log"] = run.fault_log
    result["details"]["problems"] = run.problems
    result["details"]["converge_s"] = [round(c, 1) for c in run.converge]
    result["details"]["workload_errors"] = {k: dict(w.errors) for k, w in run.workloads.items()}
    result["ok"] = (
        result["invariant_violations"] == 0
        and result["missing"] == 0
        and result["extra"] == 0
        and result["different"] == 0
        and result["manual_interventions"] == 0
        and result["max_converge_s"] <= GOAL_CONVERGE_S
        and not run.problems
    )
    if result["ok"] and opts.base is None and not opts.keep:
        shutil.rmtree(base, ignore_errors=True)
    return result


def _check_watch(watch: asyncio.Task[None]) -> None:
    if watch.done() and not watch.cancelled() and watch.exception() is not None:
        raise RuntimeError("the supervisor's watcher failed") from watch.exception()
