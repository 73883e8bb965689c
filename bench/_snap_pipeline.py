"""The pipeline bench/snapshot.py times: a relay and a bootstrap server (subprocesses), a seed,
the source's longest seeder transaction, paced writers, and a row-by-row sample check.

Every process is started here and stopped by its pid; everything listens on
127.0.0.1. Blocking code (the benchmark's own threads), no event loop.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common

SEED_APP = "changebus-seed"  # application_name of the Postgres seeder's connections


def toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a TOML basic string


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(_common.PATHS)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_port(port: int, proc: subprocess.Popen[bytes], seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"process {proc.pid} did not listen on {port}") from None
            time.sleep(0.05)


#: set by ``--profile DIR``: bootstrap servers run under bench/_snap_profile.py into DIR/<name>
PROFILE_DIR: Path | None = None


@contextlib.contextmanager
def daemon(kind: str, config: Path, port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``changebus <kind> --config config`` (output to ``log``), stopped by pid at the end."""
    run = [sys.executable, "-m", "changebus.schemas"]
    if PROFILE_DIR is not None and kind == "bootstrap":
        where = PROFILE_DIR / config.parent.name
        run = [sys.executable, str(Path(__file__).with_name("_snap_profile.py")), str(where)]
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [*run, kind, "--config", str(config)],
            env=_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_port(port, proc)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def relay_toml(base: Path, port: int, part: str, fetcher: str, options: str) -> Path:
    """A relay config of one partition (id 1); ``options`` is a TOML inline table."""
    path = base / f"relay-{part}.toml"
    path.write_text(
        f"data_dir = {toml_str(str(base / f'relay-{part}'))}\nflush_interval_s = 0\n"
        f"[http]\nport = {port}\n"
        f'[[partitions]]\nname = "{part}"\nid = 1\ncapacity_bytes = "256MiB"\n'
        f'[partitions.fetcher]\nkind = "{fetcher}"\noptions = {options}\n'
    )
    return path


def bootstrap_toml(
    home: Path,
    port: int,
    relay_port: int,
    part: str,
    kind: str,
    dsn: str,
    chunk_rows: int,
    max_chunk_txn_s: float = 0.5,
) -> Path:
    """A bootstrap server config: SQLite store in ``home``, seed source ``dsn``."""
    home.mkdir(parents=True, exist_ok=True)
    chunk = f"chunk_rows = {chunk_rows}\n" if chunk_rows > 0 else ""
    chunk += f"max_chunk_txn_s = {max_chunk_txn_s}\n"
    path = home / "bootstrap.toml"
    path.write_text(
        f'relays = ["http://127.0.0.1:{relay_port}"]\npartitions = ["{part}"]\n'
        f"data_dir = {toml_str(str(home / 'data'))}\n"
        f'[store]\nkind = "sqlite"\npath = {toml_str(str(home / "boot.db"))}\n'
        f"[http]\nport = {port}\n"
        f'[seed]\nkind = "{kind}"\ndsn = {toml_str(dsn)}\npartition = "{part}"\n{chunk}'
        "log_every_chunks = 0\n"
    )
    return path


def http_json(url: str, method: str = "GET") -> Any:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def partition_status(boot_url: str, part: str) -> dict[str, Any]:
    for p in http_json(f"{boot_url}/v1/status")["partitions"]:
        if p["partition"] == part:
            return dict(p)
    raise RuntimeError(f"the bootstrap server has no partition {part}")


def wait_for_source(boot_url: str, part: str, table: str, seconds: float = 120) -> None:
    """Until the bootstrap server holds the relay's schema of ``table``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, KeyError):
            for p in http_json(f"{boot_url}/v1/sources")["partitions"]:
                if p["partition"] == part and any(s["name"] == table for s in p["sources"]):
                    return
        time.sleep(0.1)
    raise RuntimeError(f"the bootstrap server did not see {table} from the relay")


def run_seed(
    boot_url: str, part: str, table: str, on_tick: Callable[[dict[str, Any]], None] | None = None
) -> tuple[float, dict[str, Any]]:
    """POST /v1/seed for ``table``; poll /v1/status until done. Returns (seconds, final seed)."""
    t0 = time.perf_counter()
    http_json(f"{boot_url}/v1/seed?partition={part}&tables={table}", "POST")
    last_print = t0
    while True:
        seed = partition_status(boot_url, part)["seed"]
        if seed["state"] == "done":
            return time.perf_counter() - t0, seed
        if seed["state"] in ("failed", "stopped"):
            raise RuntimeError(f"the seed {seed['state']}: {seed.get('error')}")
        now = time.perf_counter()
        if now - last_print >= 5:
            last_print = now
            print(
                f"  ... {seed['rows']:,} rows, {seed.get('chunks', 0)} chunks, "
                f"{seed.get('rows_per_s', 0):,.0f} rows/s ({now - t0:.0f} s)",
                flush=True,
            )
            if on_tick is not None:
                on_tick(seed)
        time.sleep(0.05)


@dataclass
class LongestTxn:
    """Samples the seeder's open source transactions every ``every_s`` in a thread.

    ``sample()`` returns ``[(txn id, age seconds)]`` for the seeder's open
    transactions; the longest = the largest age seen, or for sources whose
    start times are coarse, the span between a transaction's first and last
    sighting in consecutive samples, plus one period (``span=True``:
    MariaDB's ``trx_started`` has 1 s resolution, and its
    ``information_schema.innodb_trx`` is a cache refreshed only when it was
    not read for 100 ms: sample it every 110 ms or it never changes).
    """

    sample: Callable[[], list[tuple[Any, float]]]
    every_s: float = 0.02
    span: bool = False
    longest_s: float = 0.0
    samples: int = 0
    _seen: dict[Any, tuple[float, int]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            for txn, age in self.sample():
                if self.span:
                    first, last = self._seen.get(txn, (now, -2))
                    if last != self.samples - 1:  # not seen in the previous sample: a new one
                        first = now
                    self._seen[txn] = (first, self.samples)
                    age = now - first + self.every_s
                self.longest_s = max(self.longest_s, age)
            self.samples += 1
            self._stop.wait(self.every_s)

    def __enter__(self) -> LongestTxn:
        self._thread = threading.Thread(target=self._run, name="longest-txn", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(10)


@dataclass
class PacedWriter:
    """Runs ``tick(n)`` (writing ``rows_per_tick`` rows) ``rows_per_s / rows_per_tick`` times
    a second in a thread until stopped; counts the rows written."""

    tick: Callable[[int], int]
    rows_per_s: float
    rows_per_tick: int = 20
    rows: int = 0
    seconds: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    error: BaseException | None = None

    def _run(self) -> None:
        period = self.rows_per_tick / self.rows_per_s
        t0 = next_at = time.perf_counter()
        n = 0
        try:
            while not self._stop.is_set():
                self.rows += self.tick(n)
                n += 1
                next_at += period
                delay = next_at - time.perf_counter()
                if delay > 0:
                    self._stop.wait(delay)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            self.error = exc
        self.seconds = time.perf_counter() - t0

    def __enter__(self) -> PacedWriter:
        self._thread = threading.Thread(target=self._run, name="writer", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(30)
        if self.error is not None:
            raise RuntimeError(f"the writer failed: {self.error!r}")

    @property
    def rate(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0


def writer_plan(
    rnd: random.Random, max_id: int, next_id: int, rows: int
) -> tuple[list[int], list[int], list[int]]:
    """(update ids, insert ids, delete ids) for one tick of ``rows`` changes: 60/25/15 %."""
    n_ins = max(1, rows * 25 // 100)
    n_del = max(1, rows * 15 // 100)
    n_upd = rows - n_ins - n_del
    upd = [rnd.randint(1, max_id) for _ in range(n_upd)]
    dels = [rnd.randint(1, max_id) for _ in range(n_del)]
    return upd, list(range(next_id, next_id + n_ins)), dels


def zigzag_long(value: int) -> bytes:
    """The Avro encoding of a long (the store key of a one-``long``-column key)."""
    n = (value << 1) ^ (value >> 63)
    out = bytearray()
    while n & ~0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def store_rows(db: Path, part: str, table: str, ids: list[int]) -> dict[int, dict[str, Any]]:
    """Live snapshot rows of ``table`` for ``ids`` in a SQLite store, decoded (id -> columns)."""
    from changebus.schemas import ChangeDecoder, TableSchema, event_at, verify_event

    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        schemas = conn.execute(
            "SELECT source_id, version, schema FROM cb_schema WHERE part = ? AND name = ?",
            (part, table),
        ).fetchall()
        sid = schemas[0][0]
        decoders = {
            int(v): ChangeDecoder(TableSchema.from_json(json.loads(j))) for _s, v, j in schemas
        }
        out: dict[int, dict[str, Any]] = {}
        for k in ids:
            row = conn.execute(
                "SELECT event FROM cb_snap WHERE part = ? AND source_id = ? AND key = ? "
                "AND deleted = 0",
                (part, sid, zigzag_long(k)),
            ).fetchone()
            if row is None:
                continue
            event = bytes(row[0])
            h = verify_event(event, 0)
            change = decoders[h.schema_version].decode(bytes(event_at(event, 0, h)[1]))
            assert change.after is not None
            out[k] = dict(change.after)
        return out
    finally:
        conn.close()


def live_count(db: Path, part: str, table: str) -> int:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        sid = conn.execute(
            "SELECT source_id FROM cb_schema WHERE part = ? AND name = ?", (part, table)
        ).fetchone()[0]
        return int(
            conn.execute(
                "SELECT count(*) FROM cb_snap WHERE part = ? AND source_id = ? AND deleted = 0",
                (part, sid),
            ).fetchone()[0]
        )
    finally:
        conn.close()


def check_sample(
    source: Callable[[list[int]], dict[int, dict[str, Any]]],
    db: Path,
    part: str,
    table: str,
    ids: list[int],
    normalize: Callable[[str, Any], Any],
    seconds: float = 60,
) -> tuple[int, int]:
    """Compare source and store rows of ``ids`` until equal (the applier catching up) or
    ``seconds`` passed; returns (rows compared, rows that differ)."""
    deadline = time.monotonic() + seconds
    while True:
        want = source(ids)
        got = store_rows(db, part, table, ids)
        bad = [
            k
            for k in ids
            if (k in want) != (k in got)
            or (
                k in want
                and {c: normalize(c, v) for c, v in want[k].items()}
                != {c: normalize(c, got[k].get(c)) for c in want[k]}
            )
        ]
        if not bad or time.monotonic() > deadline:
            if bad:
                k = bad[0]
                print(
                    f"  sample check: {len(bad)} of {len(ids)} differ, e.g. id {k}: "
                    f"source {want.get(k)} store {got.get(k)}",
                    flush=True,
                )
            return len(ids), len(bad)
        time.sleep(1)
