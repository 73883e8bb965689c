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
  values), :func:`compare_tables` every table; :func:`ledger_gaps` lists
  holes and duplicates in the ledger; :func:`source_ledger_high`,
  :func:`sqlite_ledger_high`, :func:`pg_replica_ledger_high` read each
  writer's highest seq (one cheap query, for convergence polls) and
  :func:`reached` compares them with a workload's ``high_water()``.
* :class:`BankSampler` samples a replica's ``count(*)`` and
  ``sum(balance)`` of accounts every ~50 ms in a thread; samples taken while
  the replica is bootstrapping (its stored checkpoint's mode is not
  ``online``: snapshot and catch-up are not transactionally consistent by
  design) are counted as exempt, not checked. :func:`sqlite_bank_sample` and
  :func:`pg_bank_sample` make the sample functions (checkpoint and sums read
  in one read transaction).
* :class:`TailChecker` checks ``changebus tail`` output files (JSON lines
  with ``scn`` and ``seq``) per incarnation of the process (it lives in
  :mod:`_chaos_tail`, with :func:`tail_checkpoint_scn`).

The readers block (call them from a thread in async code).
"""

from __future__ import annotations

import decimal
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _chaos_bank import (
    CHECKPOINT_TABLE as CHECKPOINT_TABLE,
    BankSampler as BankSampler,
    ReplicaSample as ReplicaSample,
    pg_bank_sample as pg_bank_sample,
    quote,
    replica_online as replica_online,
    sqlite_bank_sample as sqlite_bank_sample,
    sqlite_connect,
    sqlite_table as sqlite_table,
)
from _chaos_tail import TailChecker as TailChecker, tail_checkpoint_scn as tail_checkpoint_scn
from _chaos_workload import COLUMNS, KEYS, TABLES

__all__ = [
    "CHECKPOINT_TABLE",
    "BankSampler",
    "Diff",
    "ReplicaSample",
    "TailChecker",
    "compare",
    "compare_tables",
    "ledger_gaps",
    "ledger_high",
    "ledger_reached",
    "normalise",
    "pg_bank_sample",
    "pg_replica_ledger_high",
    "pg_replica_rows",
    "reached",
    "replica_online",
    "source_ledger_high",
    "source_rows",
    "sqlite_bank_sample",
    "sqlite_ledger_high",
    "sqlite_rows",
    "sqlite_table",
    "tail_checkpoint_scn",
]


#: at most this many examples in a Diff
MAX_EXAMPLES = 5

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
    conn = sqlite_connect(Path(path))
    try:
        name = sqlite_table(table, schema)
        if not conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)
        ).fetchall():
            return {}
        return _read(conn.cursor(), quote(name), cols, key_at)
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
        cur.execute("SELECT to_regclass(%s) IS NOT NULL", (f"{quote(schema)}.{quote(table)}",))
        row = cur.fetchone()
        if row is None or not row[0]:
            return {}
        return _read(cur, f"{quote(schema)}.{quote(table)}", cols, key_at)


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


def compare_tables(
    source: Callable[[str], Mapping[tuple[Any, ...], tuple[Any, ...]]],
    replica: Callable[[str], Mapping[tuple[Any, ...], tuple[Any, ...]]],
    tables: Sequence[str] = TABLES,
) -> Diff:
    """:func:`compare` of every table (``source(table)``/``replica(table)`` read one), summed."""
    total = Diff()
    for table in tables:
        total.add(compare(source(table), replica(table), table=table, columns=COLUMNS[table]))
    return total


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
    return reached(ledger_high(rows), high_water)


_LEDGER_HIGH = "SELECT writer, max(seq) FROM {} GROUP BY writer"


def _high(rows: Iterable[Sequence[Any]]) -> dict[int, int]:
    return {int(w): int(s) for w, s in rows}


def source_ledger_high(kind: str, connect: Callable[[], Any]) -> dict[int, int]:
    """Writer -> highest seq in the source's ledger (one cheap query)."""
    if kind not in ("pg", "mysql"):
        raise ValueError(f"source kind must be 'pg' or 'mysql', not {kind!r}")
    conn = connect()
    try:
        cur = conn.cursor()
        cur.execute(_LEDGER_HIGH.format("ledger"))
        return _high(cur.fetchall())
    finally:
        conn.close()


def sqlite_ledger_high(path: Path, *, schema: str = "public") -> dict[int, int]:
    """Writer -> highest seq in a SQLite replica's ledger ({} before it exists)."""
    if not Path(path).exists():
        return {}
    conn = sqlite_connect(Path(path))
    try:
        name = sqlite_table("ledger", schema)
        if not conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)
        ).fetchall():
            return {}
        return _high(conn.execute(_LEDGER_HIGH.format(quote(name))).fetchall())
    finally:
        conn.close()


def pg_replica_ledger_high(dsn: str, *, schema: str = "public") -> dict[int, int]:
    """Writer -> highest seq in a Postgres replica's ledger ({} before it exists)."""
    import psycopg

    relation = f"{quote(schema)}.{quote('ledger')}"
    with psycopg.connect(dsn, connect_timeout=10) as conn, conn.cursor() as cur:
        cur.execute("SELECT to_regclass(%s) IS NOT NULL", (relation,))
        row = cur.fetchone()
        if row is None or not row[0]:
            return {}
        cur.execute(_LEDGER_HIGH.format(relation))
        return _high(cur.fetchall())


def reached(high: Mapping[int, int], high_water: Mapping[int, int]) -> bool:
    """Whether ledger highs ``high`` are at or past every writer's ``high_water``."""
    return all(high.get(w, 0) >= s for w, s in high_water.items())
