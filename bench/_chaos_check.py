"""Invariant checkers of the chaos harness: replicas row by row, ledger, bank sums, tail SCNs.

Rows are compared as ``dict[key tuple, row tuple]`` of *normalised* values
(:func:`normalise`): integers as ``int`` (booleans and integral decimals too),
text as ``str``, binary as ``bytes`` (``memoryview``/``bytearray`` from the
drivers), NULL as ``None``; anything else as its ``str``. A row tuple holds
every column of :data:`~_chaos_workload.COLUMNS` in that order; a column a
table does not have (``kv.extra`` before the DDL reached it) reads as NULL,
which is what the source holds for rows older than the DDL.

Where the replicas are (``changebus replicate``'s naming, see
:mod:`changebus.client._apply_sqlite` / :mod:`changebus.client._apply_pg`):
a source ``<schema>.<table>`` (Postgres ``public.accounts``; MariaDB
``<database>.accounts``) becomes the SQLite table ``<schema>_<table>`` and
the Postgres table ``"<schema>"."<table>"`` in the target database; the
checkpoint is the JSON of a :class:`~changebus.schemas.Checkpoint` in
``changebus_checkpoints (consumer, checkpoint)``, written in the same
transaction as the rows.

* :func:`source_rows`, :func:`sqlite_rows`, :func:`pg_replica_rows` read a
  table; :func:`compare` gives a :class:`Diff` (counts and a few keys: never
  values); :func:`ledger_gaps` lists holes and duplicates in the ledger.
* :class:`BankSampler` samples a replica's ``count(*)`` and
  ``sum(balance)`` of accounts every ~50 ms in a thread; samples taken while
  the replica is bootstrapping (its stored checkpoint's mode is not
  ``online``: snapshot and catch-up are not transactionally consistent by
  design) are counted as exempt, not checked. :func:`sqlite_bank_sample` and
  :func:`pg_bank_sample` make the sample functions (checkpoint and sums read
  in one read transaction).
* :class:`TailChecker` checks ``changebus tail`` output files (JSON lines
  with ``scn`` and ``seq``) per incarnation of the process.

The readers block (call them from a thread in async code).
"""

from __future__ import annotations

import contextlib
import decimal
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _chaos_workload import COLUMNS, KEYS
from changebus.schemas import Checkpoint, CheckpointError, Mode

__all__ = [
    "CHECKPOINT_TABLE",
    "BankSampler",
    "Diff",
    "ReplicaSample",
    "TailChecker",
    "compare",
    "ledger_gaps",
    "ledger_high",
    "ledger_reached",
    "normalise",
    "pg_bank_sample",
    "pg_replica_rows",
    "replica_online",
    "source_rows",
    "sqlite_bank_sample",
    "sqlite_rows",
    "sqlite_table",
    "tail_checkpoint_scn",
]

log = logging.getLogger("changebus.bench.chaos.check")

#: the table where ``changebus replicate`` keeps its checkpoints (consumer -> JSON)
CHECKPOINT_TABLE = "changebus_checkpoints"
#: at most this many examples in a Diff, violations kept by a sampler
MAX_EXAMPLES = 5
MAX_VIOLATIONS = 200

Rows = dict[tuple[Any, ...], tuple[Any, ...]]


# ---- values and rows ------------------------------------------------------------


def normalise(value: Any) -> Any:
    """One driver value in the form shared by every database (module docstring)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int | float):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, decimal.Decimal):
        return int(value) if value == value.to_integral_value() else str(value)
    return str(value)


def _layout(
    table: str, columns: Sequence[str] | None, key: Sequence[str] | None
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    cols = tuple(columns) if columns is not None else COLUMNS[table]
    keys = tuple(key) if key is not None else KEYS[table]
    return cols, tuple(cols.index(k) for k in keys)


def _read(cur: Any, relation: str, cols: tuple[str, ...], key_at: tuple[int, ...]) -> Rows:
    """Read ``cols`` of ``relation`` (absent columns as NULL) through a DB-API cursor."""
    cur.execute(f"SELECT * FROM {relation} WHERE 1 = 0")
    present = {str(d[0]).lower() for d in cur.description}
    exprs = [c if c.lower() in present else "NULL" for c in cols]
    cur.execute(f"SELECT {', '.join(exprs)} FROM {relation}")
    out: Rows = {}
    for raw in cur.fetchall():
        row = tuple(normalise(v) for v in raw)
        out[tuple(row[i] for i in key_at)] = row
    return out


def source_rows(
    kind: str,
    connect: Callable[[], Any],
    table: str,
    *,
    columns: Sequence[str] | None = None,
    key: Sequence[str] | None = None,
) -> Rows:
    """Key -> normalised row of ``table`` in the source (``connect()``: a new connection)."""
    if kind not in ("pg", "mysql"):
        raise ValueError(f"source kind must be 'pg' or 'mysql', not {kind!r}")
    cols, key_at = _layout(table, columns, key)
    conn = connect()
    try:
        cur = conn.cursor()
        try:
            return _read(cur, table, cols, key_at)
        finally:
            cur.close()
    finally:
        conn.close()


def sqlite_table(table: str, schema: str = "public") -> str:
    """The SQLite replica's table for source ``<schema>.<table>`` (``.`` becomes ``_``)."""
    source = table if "." in table else f"{schema}.{table}"
    return source.replace(".", "_")


def _sqlite_connect(path: Path) -> sqlite3.Connection:
    # read-only, never creates the file; a busy writer makes readers wait, not fail
    conn = sqlite3.connect(
        f"file:{os.fspath(path)}?mode=ro", uri=True, timeout=10.0, check_same_thread=False
    )
    conn.isolation_level = None
    return conn


def sqlite_rows(
    path: Path,
    table: str,
    *,
    schema: str = "public",
    columns: Sequence[str] | None = None,
    key: Sequence[str] | None = None,
) -> Rows:
    """Key -> normalised row of the SQLite replica's table for ``table`` ({} when absent).

    ``table`` is the workload's name (``accounts``) with the source's
    ``schema`` (``public`` for Postgres, the database name for MariaDB), or
    the full source name (``chaos.accounts``).
    """
    cols, key_at = _layout(table.rpartition(".")[2], columns, key)
    if not Path(path).exists():
        return {}
    conn = _sqlite_connect(Path(path))
    try:
        name = sqlite_table(table, schema)
        if not conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)
        ).fetchall():
            return {}
        return _read(conn.cursor(), _quote(name), cols, key_at)
    finally:
        conn.close()


def pg_replica_rows(
    dsn: str,
    table: str,
    *,
    schema: str = "public",
    columns: Sequence[str] | None = None,
    key: Sequence[str] | None = None,
) -> Rows:
    """Key -> normalised row of the Postgres replica's ``"<schema>"."<table>"`` ({} when absent)."""
    import psycopg

    if "." in table:
        schema, _, table = table.rpartition(".")
    cols, key_at = _layout(table, columns, key)
    with psycopg.connect(dsn, connect_timeout=10) as conn, conn.cursor() as cur:
        cur.execute("SELECT to_regclass(%s) IS NOT NULL", (f"{_quote(schema)}.{_quote(table)}",))
        row = cur.fetchone()
        if row is None or not row[0]:
            return {}
        return _read(cur, f"{_quote(schema)}.{_quote(table)}", cols, key_at)


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


# ---- comparing --------------------------------------------------------------------


@dataclass
class Diff:
    """How a replica differs from its source: counts and a few keys (never values)."""

    missing: int = 0
    extra: int = 0
    different: int = 0
    examples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No missing, extra or different row."""
        return not (self.missing or self.extra or self.different)

    def add(self, other: Diff) -> None:
        """Add ``other``'s counts (and examples, up to the limit) to this one."""
        self.missing += other.missing
        self.extra += other.extra
        self.different += other.different
        room = MAX_EXAMPLES * 4 - len(self.examples)
        self.examples.extend(other.examples[: max(room, 0)])


def compare(
    source: Mapping[tuple[Any, ...], tuple[Any, ...]],
    replica: Mapping[tuple[Any, ...], tuple[Any, ...]],
    *,
    table: str = "",
    columns: Sequence[str] = (),
) -> Diff:
    """Row-by-row comparison; examples name the table, the key and the differing columns."""
    diff = Diff()
    where = f"{table} " if table else ""

    def example(text: str) -> None:
        if len(diff.examples) < MAX_EXAMPLES:
            diff.examples.append(where + text)

    for k, row in source.items():
        other = replica.get(k)
        if other is None:
            diff.missing += 1
            example(f"missing {k}")
        elif other != row:
            diff.different += 1
            cols = [
                columns[i] if i < len(columns) else str(i)
                for i in range(max(len(row), len(other)))
                if i >= len(row) or i >= len(other) or row[i] != other[i]
            ]
            example(f"different {k}: {', '.join(cols)}")
    for k in replica:
        if k not in source:
            diff.extra += 1
            example(f"extra {k}")
    return diff


def _ledger_keys(rows: Mapping[tuple[Any, ...], Any] | Iterable[Sequence[Any]]) -> list[Any]:
    if isinstance(rows, Mapping):
        return [(int(k[0]), int(k[1])) for k in rows]
    return [(int(r[0]), int(r[1])) for r in rows]


def ledger_gaps(rows: Mapping[tuple[Any, ...], Any] | Iterable[Sequence[Any]]) -> list[str]:
    """Holes and duplicates in a ledger: per writer, seq must be exactly 1..max.

    ``rows``: the ledger as read by the readers (keys ``(writer, seq)``), or
    an iterable of rows starting with ``writer, seq`` (duplicates count).
    """
    by_writer: dict[int, list[int]] = {}
    for writer, seq in _ledger_keys(rows):
        by_writer.setdefault(writer, []).append(seq)
    problems: list[str] = []
    for writer, seqs in sorted(by_writer.items()):
        seqs.sort()
        seen: set[int] = set()
        dups = sorted({s for s in seqs if s in seen or seen.add(s)})  # type: ignore[func-returns-value]
        if dups:
            problems.append(f"writer {writer}: duplicate seq {_ranges(dups)}")
        holes = sorted(set(range(1, seqs[-1] + 1)) - seen)
        if holes:
            problems.append(f"writer {writer}: missing seq {_ranges(holes)} of 1..{seqs[-1]}")
        if seqs[0] < 1:
            problems.append(f"writer {writer}: seq {seqs[0]} below 1")
    return problems


def _ranges(values: list[int], limit: int = 8) -> str:
    """``1..3, 7, 9..12`` (at most ``limit`` ranges, then a count)."""
    spans: list[list[int]] = []
    for v in values:
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    text = ", ".join(f"{a}..{b}" if a != b else str(a) for a, b in spans[:limit])
    if len(spans) > limit:
        text += f" and {len(spans) - limit} more ranges"
    return text


def ledger_high(rows: Mapping[tuple[Any, ...], Any] | Iterable[Sequence[Any]]) -> dict[int, int]:
    """Writer -> highest seq in a ledger."""
    high: dict[int, int] = {}
    for writer, seq in _ledger_keys(rows):
        high[writer] = max(high.get(writer, 0), seq)
    return high


def ledger_reached(
    rows: Mapping[tuple[Any, ...], Any] | Iterable[Sequence[Any]], high_water: Mapping[int, int]
) -> bool:
    """Whether a replica's ledger holds every writer's seq up to ``high_water``'s."""
    high = ledger_high(rows)
    return all(high.get(w, 0) >= s for w, s in high_water.items())


# ---- the replica's checkpoint and bank samples --------------------------------------


def replica_online(text: str | None, partition: str | None = None) -> bool:
    """Whether a stored checkpoint (JSON) says the replica reads online (not bootstrapping).

    ``partition``: the partition to look at (None: every partition in the
    checkpoint must be online). No checkpoint: False (nothing applied yet).
    """
    if not text:
        return False
    try:
        cp = Checkpoint.parse(text)
    except CheckpointError:
        return False
    if partition is not None:
        return partition in cp.partitions and cp.get(partition).mode is Mode.ONLINE
    return bool(cp.partitions) and all(pc.mode is Mode.ONLINE for pc in cp.partitions.values())


Sample = Callable[[], "tuple[int, int] | None"]


class ReplicaSample:
    """A bank sample function over one replica, keeping its connection between calls.

    Called from one thread at a time (the sampler's); :meth:`close` closes
    the connection (the sampler calls it when it ends).
    """

    def __init__(self, checkpoint_table: str, consumer: str, partition: str | None) -> None:
        self.checkpoint_table = checkpoint_table
        self.consumer = consumer
        self.partition = partition
        self._conn: Any = None

    def _connect(self) -> Any:
        raise NotImplementedError

    def _read(self, conn: Any) -> tuple[int, int] | None:
        raise NotImplementedError

    def __call__(self) -> tuple[int, int] | None:
        if self._conn is None:
            self._conn = self._connect()
            if self._conn is None:
                return None
        try:
            return self._read(self._conn)
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


class _SqliteSample(ReplicaSample):
    def __init__(self, path: Path, schema: str, *args: Any) -> None:
        super().__init__(*args)
        self.path = Path(path)
        self.table = sqlite_table("accounts", schema)

    def _connect(self) -> Any:
        if not self.path.exists():
            return None
        conn = _sqlite_connect(self.path)
        return conn

    def _read(self, conn: Any) -> tuple[int, int] | None:
        conn.execute("BEGIN")  # one read snapshot for the checkpoint and the sums
        try:
            names = {
                r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            }
            if self.checkpoint_table not in names or self.table not in names:
                return None
            row = conn.execute(
                f"SELECT checkpoint FROM {_quote(self.checkpoint_table)} WHERE consumer = ?",
                (self.consumer,),
            ).fetchone()
            if not replica_online(row[0] if row else None, self.partition):
                return None
            count, total = conn.execute(
                f"SELECT count(*), coalesce(sum(balance), 0) FROM {_quote(self.table)}"
            ).fetchone()
            return int(count), int(total)
        finally:
            conn.execute("COMMIT")


class _PgSample(ReplicaSample):
    def __init__(self, dsn: str, schema: str, *args: Any) -> None:
        super().__init__(*args)
        self._dsn = dsn
        self.table = f"{_quote(schema)}.{_quote('accounts')}"

    def __repr__(self) -> str:
        return f"_PgSample({self.table})"  # no DSN: it may hold a password

    def _connect(self) -> Any:
        import psycopg

        return psycopg.connect(self._dsn, autocommit=True, connect_timeout=5)

    def _read(self, conn: Any) -> tuple[int, int] | None:
        with conn.transaction(), conn.cursor() as cur:
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            cur.execute(
                "SELECT to_regclass(%s) IS NOT NULL, to_regclass(%s) IS NOT NULL",
                (_quote(self.checkpoint_table), self.table),
            )
            have = cur.fetchone()
            if have is None or not (have[0] and have[1]):
                return None
            cur.execute(
                f"SELECT checkpoint FROM {_quote(self.checkpoint_table)} WHERE consumer = %s",
                (self.consumer,),
            )
            row = cur.fetchone()
            if not replica_online(row[0] if row else None, self.partition):
                return None
            cur.execute(f"SELECT count(*), coalesce(sum(balance), 0) FROM {self.table}")
            count, total = cur.fetchone()
            return int(count), int(total)


def sqlite_bank_sample(
    path: Path,
    *,
    schema: str = "public",
    consumer: str = "default",
    partition: str | None = None,
    checkpoint_table: str = CHECKPOINT_TABLE,
) -> ReplicaSample:
    """A sample function for :class:`BankSampler` over a SQLite replica.

    Returns ``(count, sum)`` of the accounts table, or None (exempt) while the
    replica has no accounts table or its checkpoint (``consumer``'s row;
    ``partition`` as in :func:`replica_online`) is not online -- both read in
    one read transaction. The connection is opened lazily in the calling
    (sampler) thread and kept; an error closes it and propagates. ``close()``
    closes it.
    """
    return _SqliteSample(path, schema, checkpoint_table, consumer, partition)


def pg_bank_sample(
    dsn: str,
    *,
    schema: str = "public",
    consumer: str = "default",
    partition: str | None = None,
    checkpoint_table: str = CHECKPOINT_TABLE,
) -> ReplicaSample:
    """Like :func:`sqlite_bank_sample` for a Postgres replica (one REPEATABLE READ transaction)."""
    return _PgSample(dsn, schema, checkpoint_table, consumer, partition)


class BankSampler(threading.Thread):
    """Samples a replica's accounts every ``interval_s`` in a thread; checks count and sum.

    ``sample()`` returns ``(count, sum)`` or None for an exempt sample (the
    replica is bootstrapping or has nothing yet); an exception is an error (the
    replica's database is restarting, say), counted and not a violation.
    Counters: ``samples`` (checked), ``exempt``, ``errors``; ``violations``
    (messages, the first :data:`MAX_VIOLATIONS`; ``violation_count`` counts
    all). Written by the sampler thread only; read them after :meth:`stop`
    (or as approximate progress while running).
    """

    def __init__(
        self,
        name: str,
        sample: Sample,
        accounts: int,
        total: int,
        *,
        interval_s: float = 0.05,
    ) -> None:
        super().__init__(name=f"bank-sampler-{name}", daemon=True)
        self.replica = name
        self._sample = sample
        self.accounts = accounts
        self.total = total
        self.interval_s = interval_s
        self.samples = 0
        self.exempt = 0
        self.errors = 0
        self.violations: list[str] = []
        self.violation_count = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                self.sample_once()
                self._stop_event.wait(self.interval_s)
        finally:
            close = getattr(self._sample, "close", None)
            if callable(close):
                close()

    def sample_once(self) -> None:
        """Take one sample now (the thread's step; callable directly in tests)."""
        try:
            got = self._sample()
        except Exception:
            self.errors += 1
            log.debug("sample of %s failed", self.replica, exc_info=True)
            return
        if got is None:
            self.exempt += 1
            return
        self.samples += 1
        count, total = got
        if count != self.accounts or total != self.total:
            self.violation_count += 1
            if len(self.violations) < MAX_VIOLATIONS:
                self.violations.append(
                    f"{self.replica}: {count} accounts with sum {total}"
                    f" (expected {self.accounts} with sum {self.total}) at {time.time():.3f}"
                )

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the thread (waits for it when it was started)."""
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout_s)


# ---- the tail's output ------------------------------------------------------------------


def tail_checkpoint_scn(path: Path, partition: str | None = None) -> int:
    """The SCN a ``changebus tail --checkpoint FILE`` resumes after (-1: no file yet).

    The partition's ``window_scn`` (bootstrapping: the snapshot's ``since``
    or the catch-up's last window -- what follows is newer in both cases);
    ``partition`` None: the only (or highest) partition of the checkpoint.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return -1
    cp = Checkpoint.parse(text)
    if partition is not None:
        return cp.get(partition).window_scn
    return max((pc.window_scn for pc in cp.partitions.values()), default=-1)


@dataclass
class _Line:
    scn: int
    seq: int
    snapshot_like: bool  # a row state (no before-image) or a delete: may come from a snapshot


class TailChecker:
    """Checks ``changebus tail`` outputs, one file per incarnation of the process, in order.

    Rules, for the events (lines) of each incarnation:

    * ``(scn, seq)`` strictly increases (no window twice, nothing backwards) --
      except inside a bootstrap snapshot, whose rows come at their own SCNs in
      key order. A step back is accepted as a snapshot only when it and the
      lines before it back to where they started look like snapshot rows (no
      ``before`` image, or a delete), and its SCN is above every SCN printed
      before those lines (a snapshot holds only rows changed after the
      consumer's position). Accepted steps are counted in
      ``snapshot_steps``;
    * incarnation ``n`` >= 1 prints only SCNs above the checkpoint its process
      read at start: ``checkpoints_at_restart`` has one entry per restart
      (``len(outputs) - 1``: entry ``i`` for ``outputs[i + 1]``), or one per
      output (the first for the first incarnation; -1: none). Replays of what
      came after the checkpoint are what at-least-once allows.

    A last line without its newline (killed while writing) is ignored.
    ``lines``, ``incarnations``, ``snapshot_steps`` count what the last
    :meth:`check` saw. Not thread-safe.
    """

    def __init__(self) -> None:
        self.lines = 0
        self.incarnations = 0
        self.snapshot_steps = 0

    def check(self, outputs: Sequence[Path], checkpoints_at_restart: Sequence[int]) -> list[str]:
        """The violations (empty: all rules hold)."""
        self.lines = self.incarnations = self.snapshot_steps = 0
        if len(checkpoints_at_restart) == len(outputs):
            floors = list(checkpoints_at_restart)
        elif len(checkpoints_at_restart) == max(len(outputs) - 1, 0):
            floors = [-1, *checkpoints_at_restart]
        else:
            return [
                f"{len(checkpoints_at_restart)} checkpoints for {len(outputs)} outputs:"
                " give one per restart (or one per output)"
            ]
        problems: list[str] = []
        for n, (path, floor) in enumerate(zip(outputs, floors, strict=True)):
            self.incarnations += 1
            lines, bad = _read_tail(Path(path))
            problems += [f"{Path(path).name}: {b}" for b in bad]
            self.lines += len(lines)
            problems += self._incarnation(Path(path).name, n, lines, floor)
        return problems

    def _incarnation(self, name: str, n: int, lines: list[_Line], floor: int) -> list[str]:
        problems: list[str] = []
        below = [i for i, line in enumerate(lines) if line.scn <= floor]
        if floor >= 0 and below:
            i = below[0]
            problems.append(
                f"{name} (incarnation {n}): line {i + 1} has SCN {lines[i].scn}, not after the"
                f" checkpoint {floor} it started from ({len(below)} such lines)"
            )
        run_start = 0  # where the current run of snapshot-like lines began
        high_before_run = floor  # the highest SCN printed before that run
        high = floor
        for i, line in enumerate(lines):
            if not line.snapshot_like:
                run_start = i + 1
                high_before_run = max(high, line.scn)
            elif i == run_start:
                high_before_run = high
            if i > 0:
                prev = lines[i - 1]
                if (line.scn, line.seq) <= (prev.scn, prev.seq):
                    if line.snapshot_like and run_start < i and line.scn > high_before_run:
                        self.snapshot_steps += 1
                    else:
                        problems.append(
                            f"{name} (incarnation {n}): line {i + 1} goes back from"
                            f" (scn {prev.scn}, seq {prev.seq}) to (scn {line.scn}, seq {line.seq})"
                        )
                        if len(problems) >= MAX_EXAMPLES * 4:
                            break
            high = max(high, line.scn)
        return problems


def _read_tail(path: Path) -> tuple[list[_Line], list[str]]:
    """The events of one output file, and problems with its lines."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], []
    text = data.decode("utf-8", errors="replace")
    parts = text.split("\n")
    if parts and parts[-1] == "":
        parts.pop()
    elif parts:
        parts.pop()  # torn: killed while writing it
    lines: list[_Line] = []
    bad: list[str] = []
    for number, raw in enumerate(parts, 1):
        if not raw.strip():
            continue
        try:
            doc = json.loads(raw)
            scn = int(doc["scn"])
            seq = int(doc.get("seq", 0))
        except (ValueError, KeyError, TypeError):
            if len(bad) < MAX_EXAMPLES:
                bad.append(f"line {number} is not an event line")
            continue
        op = doc.get("op")
        lines.append(_Line(scn, seq, doc.get("before") is None or op in ("delete", "truncate")))
    return lines, bad
