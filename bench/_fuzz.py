"""The HTTP fuzzing harness: the daemons, the run and its measures.

The pieces: :mod:`_fuzz_values` (seeded parameter values), :mod:`_fuzz_gen`
(structured requests per endpoint), :mod:`_fuzz_raw` (raw malformed HTTP),
:mod:`_fuzz_client` (a raw HTTP/1.1 client), :mod:`_fuzz_probe` (loop-block
and memory probes); ``bench/fuzz_http.py`` is the command line and
``tests/test_fuzz_http.py`` a short run in the test suite.

:func:`run_fuzz` starts a real relay process (two partitions fed by the
synthetic fetcher: ``fz`` at 100 windows/s for the whole run, ``fill``
pre-filled with 2,000 larger windows) and a real bootstrap server process
(SQLite store) following it (not when only the relay is fuzzed; its seed
DSN names a closed port, so ``POST /v1/seed`` runs its whole background path
and fails there), then sends ``requests`` cases from
:class:`_fuzz_gen.Generator` (seeded) over fresh TCP connections,
``concurrency`` at a time, and measures:

* ``server_errors`` -- answers with a 5xx status, except a 503 whose JSON
  body says ``"retriable": true`` with an error code other than
  ``internal`` (the documented "not yet" answers: ``not_yet`` from a
  bootstrap server without windows, an overloaded server) and ``/readyz``'s
  503 ``{"ready": false}``. A 500 ``internal`` always counts.
* ``hung`` -- a case that owes an answer and got neither an answer nor a
  closed connection within ``hang_s`` (10 s) plus its own wait, pauses and
  reading time; an answer whose body stalls that long counts too.
* ``max_rss_growth_mb`` -- the largest growth of a daemon's private memory
  (``RssAnon`` of ``/proc/<pid>/status``, sampled every 0.1 s) over its value
  when fuzzing began. ``RssAnon`` and not ``VmRSS``: the relay's ring buffer
  is a file mapping whose pages join ``VmRSS`` as the fetcher fills it, which
  is not growth caused by requests. ``VmRSS`` growth is reported alongside.
* ``max_loop_block_ms`` -- a probe thread per daemon asks ``/healthz`` every
  10 ms on its own keep-alive connection; a sample's block is its latency
  minus the median latency before fuzzing began (the probe shares this
  process's GIL: a sample may be late by up to one switch interval, 5 ms).
  ``max_loop_block_alone_ms`` leaves out the blocks during which the other
  daemon's probe was late too (a loaded machine stalls both at once).
* ``logged_tracebacks`` -- incidents in the daemons' stderr logs: a
  ``Traceback`` or an ``unexpected error`` / ``Error handling request`` line
  (one incident each, with its exception and innermost changebus frame).

plus per-endpoint counts by status (or outcome: ``closed`` without an
answer, ``cut`` body, ``aborted`` by the fuzzer, ``hung``), ``secret_leaks``
(the seed DSN's password seen in a log or a response) and the 5xx/hung
cases themselves (``failures``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import PATHS, free_port
from _fuzz_client import SECRET, Outcome, exchange
from _fuzz_gen import Generator, Request, Target
from _fuzz_probe import MemorySampler, Probe, blockers

__all__ = ["FuzzOptions", "run_fuzz"]


@dataclass(frozen=True)
class FuzzOptions:
    """One fuzzing run (see :func:`run_fuzz`)."""

    requests: int = 10_000
    seed: int = 17
    #: which daemons receive requests ("relay", "bootstrap"); the relay always runs (it feeds
    #: the bootstrap server), the bootstrap server when named
    daemons: tuple[str, ...] = ("relay", "bootstrap")
    concurrency: int = 8
    #: where the daemons keep data and logs (None: a temporary directory)
    workdir: Path | None = None
    hang_s: float = 10.0
    probe_interval_s: float = 0.01
    #: print progress lines to stdout
    verbose: bool = False


# ---- the daemons ------------------------------------------------------------


@dataclass
class Daemon:
    """A daemon process with its port and log file (stdout and stderr)."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path


def _get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def _spawn(name: str, config: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(PATHS)}
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "changebus.schemas", name, "--config", str(config)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _wait(what: str, check: Any, proc: subprocess.Popen[bytes], seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while True:
        with contextlib.suppress(OSError, ValueError, KeyError):
            if check():
                return
        if proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def start_daemons(work: Path, *, bootstrap: bool = True) -> list[Daemon]:
    """A relay (partitions ``fz`` and ``fill``) and a bootstrap server following it."""
    rport, bport = free_port(), free_port()
    relay_cfg = work / "relay.toml"
    relay_cfg.write_text(
        f'data_dir = "{work / "relay"}"\nlog_level = "info"\n[http]\nport = {rport}\n'
        '[[partitions]]\nname = "fz"\nid = 1\ncapacity_bytes = "64MiB"\n'
        '[partitions.fetcher]\nkind = "synthetic"\n'
        "options = { windows_per_s = 100, events_per_window = 5, row_bytes = 200, tables = 3,"
        " keys = 10000 }\n"
        '[[partitions]]\nname = "fill"\nid = 2\ncapacity_bytes = "64MiB"\n'
        '[partitions.fetcher]\nkind = "synthetic"\n'
        "options = { windows_per_s = 0, max_windows = 2000, events_per_window = 5,"
        " row_bytes = 1000, tables = 2, keys = 5000, seed = 2 }\n"
    )
    daemons: list[Daemon] = []
    relay = Daemon(
        "relay", _spawn("relay", relay_cfg, work / "relay.log"), rport, work / "relay.log"
    )
    daemons.append(relay)
    try:
        base = f"http://127.0.0.1:{rport}"

        def relay_ready() -> bool:
            parts = {p["name"]: p for p in _get_json(f"{base}/v1/status")["partitions"]}
            return bool(parts["fz"]["windows"] >= 50 and parts["fill"]["windows"] >= 2000)

        _wait("relay start", relay_ready, relay.proc)
        if not bootstrap:
            return daemons
        boot_cfg = work / "bootstrap.toml"
        boot_cfg.write_text(
            f'relays = ["{base}"]\ndata_dir = "{work / "bootstrap"}"\nlog_level = "info"\n'
            f'[store]\nkind = "sqlite"\n[http]\nport = {bport}\n'
            f'[seed]\ndsn = "postgresql://fuzz:{SECRET}@127.0.0.1:9/nodb"\n'
        )
        boot = Daemon(
            "bootstrap",
            _spawn("bootstrap", boot_cfg, work / "bootstrap.log"),
            bport,
            work / "bootstrap.log",
        )
        daemons.append(boot)
        bbase = f"http://127.0.0.1:{bport}"

        fill_scn = int(_get_json(f"{base}/v1/status")["partitions"][1]["max_scn"])

        def boot_ready() -> bool:  # both partitions served, the pre-filled one wholly applied
            fz = _get_json(f"{bbase}/v1/bootstrap/status?partition=fz")
            fill = _get_json(f"{bbase}/v1/bootstrap/status?partition=fill")
            return bool(fz["applier_scn"] > 0 and fill["applier_scn"] >= fill_scn)

        _wait("bootstrap start", boot_ready, boot.proc)
    except BaseException:
        stop_daemons(daemons)
        raise
    return daemons


def stop_daemons(daemons: list[Daemon]) -> dict[str, int | None]:
    """Stop them; the exit status of each one that had exited on its own (None: it ran)."""
    exits: dict[str, int | None] = {}
    for d in daemons:
        exits[d.name] = d.proc.poll()
        if exits[d.name] is None:
            d.proc.terminate()
    for d in daemons:
        try:
            d.proc.wait(30)
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait()
    return exits


def read_target(daemons: list[Daemon]) -> Target:
    """What the generators need to know: partitions, SCN ranges, sources, ports."""
    ports = {d.name: d.port for d in daemons}
    relay = _get_json(f"http://127.0.0.1:{ports['relay']}/v1/status")["partitions"]
    scns = {p["name"]: (int(p["min_scn"]), int(p["max_scn"])) for p in relay}
    srcs = _get_json(f"http://127.0.0.1:{ports['relay']}/v1/sources")["partitions"]
    sources = sorted({s["name"] for p in srcs for s in p["sources"]})
    boot: dict[str, tuple[int, int, int]] = {}
    if "bootstrap" in ports:
        for p in _get_json(f"http://127.0.0.1:{ports['bootstrap']}/v1/status")["partitions"]:
            boot[p["partition"]] = (p["log_min_scn"], p["applier_scn"], p["producer_scn"])
    return Target(tuple(sorted(scns)), tuple(sources), scns, boot, ports)


# ---- classification and the run ------------------------------------------------


def is_server_error(status: int, body: bytes) -> bool:
    """A 5xx that is not a documented retriable 503 (module docstring)."""
    if status < 500:
        return False
    if status == 503:
        try:
            data = json.loads(body)
        except ValueError:
            return True
        if isinstance(data, dict):
            if data.get("ready") is False:
                return False
            if data.get("retriable") is True and data.get("error") not in (None, "internal"):
                return False
    return True


@dataclass
class Tally:
    """The counts of a run (touched by the fuzzer's event loop only)."""

    cases: int = 0
    messages: int = 0
    server_errors: int = 0
    hung: int = 0
    closed_without_answer: int = 0
    cut: int = 0
    connect_errors: int = 0
    leaks: int = 0
    by_endpoint: defaultdict[str, Counter[str]] = field(
        default_factory=lambda: defaultdict(Counter)
    )
    failures: list[dict[str, Any]] = field(default_factory=list)
    #: (daemon, start, end, request head) of every case, for the loop-block culprits
    spans: list[tuple[str, float, float, str]] = field(default_factory=list)

    def record(self, req: Request, out: Outcome) -> None:
        self.cases += 1
        self.messages += max(1, len(req.methods))
        counts = self.by_endpoint[f"{req.daemon} {req.endpoint}"]
        for status, body in zip(out.statuses, out.bodies, strict=False):
            counts[str(status)] += 1
            if is_server_error(status, body):
                self.server_errors += 1
                self._fail("5xx", req, out, status, body)
        for flag in ("closed", "cut", "aborted", "follow_cut", "hung"):
            if getattr(out, flag):
                counts[flag] += 1
        if out.connect_error:
            counts["connect_error"] += 1
            self.connect_errors += 1
        if out.hung:
            self.hung += 1
            self._fail("hung", req, out, out.statuses[-1] if out.statuses else 0, b"")
        if out.cut:
            self.cut += 1
        if out.closed and not out.statuses and req.methods:
            self.closed_without_answer += 1
            if self.closed_without_answer <= 50:  # reported, not counted as an error
                self._fail("closed", req, out, 0, out.bad_answer)
        self.leaks += out.leaked

    def _fail(self, kind: str, req: Request, out: Outcome, status: int, body: bytes) -> None:
        if len(self.failures) < 500:
            self.failures.append(
                {
                    "kind": kind,
                    "daemon": req.daemon,
                    "endpoint": req.endpoint,
                    "status": status,
                    "seconds": round(out.seconds, 2),
                    "request": req.data[:400].decode("latin-1"),
                    "request_bytes": len(req.data),
                    "answer": body[:300].decode("utf-8", "replace"),
                }
            )


async def _fuzz(gen: Generator, opts: FuzzOptions, tally: Tally) -> None:
    ports = gen.t.ports
    issued = 0
    t0 = time.monotonic()

    async def worker() -> None:
        nonlocal issued
        while issued < opts.requests:
            issued += 1
            req = gen.next()
            began = time.monotonic()
            out = await exchange(ports[req.daemon], req, opts.hang_s)
            tally.spans.append((req.daemon, began, time.monotonic(), _head(req.data)))
            tally.record(req, out)
            if opts.verbose and tally.cases % 1000 == 0:
                rate = tally.cases / (time.monotonic() - t0)
                print(
                    f"{tally.cases:,} cases ({rate:.0f}/s): {tally.server_errors} server "
                    f"errors, {tally.hung} hung",
                    flush=True,
                )

    await asyncio.gather(*(worker() for _ in range(opts.concurrency)))


def _head(data: bytes) -> str:
    return data[:160].decode("latin-1").split("\r\n", 1)[0]


def scan_log(path: Path) -> tuple[list[dict[str, str]], int]:
    """(Incidents, lines holding the secret) of a daemon log (module docstring)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return [], 0
    leaks = sum(SECRET in line for line in lines)
    incidents: list[dict[str, str]] = []
    i = 0
    marks = ("Traceback (most recent call last)", "unexpected error", "Error handling request")
    while i < len(lines):
        line = lines[i]
        if not any(m in line for m in marks):
            i += 1
            continue
        header, j = line, i + 1
        frames: list[str] = []
        exc = ""
        if "Traceback" in line or (j < len(lines) and lines[j].startswith("Traceback")):
            while True:
                while j < len(lines) and not lines[j].strip():
                    j += 1
                if j < len(lines) and lines[j].startswith("Traceback"):
                    j += 1
                while j < len(lines) and lines[j].startswith((" ", "\t")):
                    frames.append(lines[j].strip())
                    j += 1
                exc = lines[j] if j < len(lines) else ""
                j += 1
                k = j
                while k < len(lines) and not lines[k].strip():
                    k += 1
                if k < len(lines) and lines[k].startswith(("During handling", "The above")):
                    j = k + 1
                    continue
                break
        files = [f for f in frames if f.startswith("File ")]
        ours = [f for f in files if "changebus" in f]
        incidents.append(
            {
                "log": path.name,
                "line": header[:300],
                "exception": exc[:300],
                "where": (ours[-1] if ours else files[-1] if files else "")[:300],
            }
        )
        i = j
    return incidents, leaks


def run_fuzz(opts: FuzzOptions) -> dict[str, Any]:
    """Start the daemons, fuzz them, stop them; the result (module docstring)."""
    with contextlib.ExitStack() as stack:
        work = opts.workdir
        if work is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="changebus-fuzz-")))
        work.mkdir(parents=True, exist_ok=True)
        daemons = start_daemons(work, bootstrap="bootstrap" in opts.daemons)
        try:
            return _run(opts, daemons)
        finally:
            stop_daemons(daemons)
    raise AssertionError("unreachable")


def _run(opts: FuzzOptions, daemons: list[Daemon]) -> dict[str, Any]:
    target = read_target(daemons)
    fuzzed = [d for d in daemons if d.name in opts.daemons]
    probes = {d.name: Probe(d.port, opts.probe_interval_s) for d in fuzzed}
    memory = MemorySampler({d.name: d.proc.pid for d in fuzzed})
    for thread in (*probes.values(), memory):
        thread.start()
    time.sleep(1.0)  # probe baselines
    memory.mark_start()
    started = time.monotonic()
    tally = Tally()
    gen = Generator(opts.seed, target, tuple(d.name for d in fuzzed))
    try:
        asyncio.run(_fuzz(gen, opts, tally))
    finally:
        seconds = time.monotonic() - started
        time.sleep(1.0)  # what stays after the requests left
        for probe in probes.values():
            probe.stop()
        memory.stop()
    exits = {d.name: d.proc.poll() for d in daemons}
    incidents: list[dict[str, str]] = []
    leaks = tally.leaks
    for d in daemons:
        found, leaked = scan_log(d.log)
        incidents += found
        leaks += leaked
    blocks = {name: p.figures(started) for name, p in probes.items()}
    worst = blockers(probes, started, tally.spans)
    rss = memory.figures()
    return {
        "requests": tally.cases,
        "server_errors": tally.server_errors,
        "hung": tally.hung,
        "max_rss_growth_mb": max(r["anon_max_growth_mb"] for r in rss.values()),
        "max_loop_block_ms": max((b["max_ms"] for b in blocks.values()), default=0.0),
        # the same, leaving out the stalls of every daemon at once (the machine's)
        "max_loop_block_alone_ms": max(
            (b["block_ms"] for b in worst if not b["also_late"]), default=0
        ),
        "logged_tracebacks": len(incidents),
        "requests_per_s": round(tally.cases / seconds, 1),
        "seed": opts.seed,
        "daemons": [d.name for d in fuzzed],
        "http_messages": tally.messages,
        "closed_without_answer": tally.closed_without_answer,
        "cut_bodies": tally.cut,
        "connect_errors": tally.connect_errors,
        "secret_leaks": leaks,
        "daemon_exits": {k: v for k, v in exits.items() if v is not None},
        "rss": rss,
        "loop_block": blocks,
        "by_endpoint": {k: dict(sorted(v.items())) for k, v in sorted(tally.by_endpoint.items())},
        "failures": tally.failures,
        "incidents": incidents,
        "blocks": worst,
    }


def summary(result: dict[str, Any]) -> Iterator[str]:
    """Human-readable lines: failures and log incidents grouped by cause."""
    groups: Counter[tuple[str, str, str, int]] = Counter()
    example: dict[tuple[str, str, str, int], dict[str, Any]] = {}
    for f in result["failures"]:
        key = (f["kind"], f["daemon"], f["endpoint"], f["status"])
        groups[key] += 1
        example.setdefault(key, f)
    for key, n in groups.most_common():
        f = example[key]
        yield f"{n:5d} x {key[0]} {key[1]} {key[2]} -> {key[3]}: {f['answer'][:120]!r}"
        yield f"        e.g. {f['request'][:200]!r}"
    seen: Counter[tuple[str, str, str]] = Counter()
    for inc in result["incidents"]:
        seen[(inc["log"], inc["exception"], inc["where"])] += 1
    for (log, exc, where), n in seen.most_common():
        yield f"{n:5d} x {log}: {exc} at {where}"
    for block in result["blocks"][:8]:  # the worst; the culprit is among those in flight
        late = f" (the {', '.join(block['also_late'])} late as well)" if block["also_late"] else ""
        yield f"loop block of {block['block_ms']} ms in the {block['daemon']}{late}; in flight:"
        for head in block["in_flight"][:10]:
            yield f"        {head[:150]!r}"
