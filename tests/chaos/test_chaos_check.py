"""The chaos harness's invariant checkers: each catches what it must (a gap, a duplicate, a bad
sum, a backwards SCN, a replay before the checkpoint, a different row) and passes clean data;
the replica readers read what the product's own replicas (SqliteReplica, PostgresReplica) wrote,
under ``changebus replicate``'s naming, and tell bootstrapping replicas apart."""

from __future__ import annotations

import decimal
import json
import sqlite3
from pathlib import Path
from typing import Any

import psycopg
import pytest

from _chaos_check import (
    BankSampler,
    Diff,
    TailChecker,
    compare,
    ledger_gaps,
    ledger_high,
    ledger_reached,
    normalise,
    pg_bank_sample,
    pg_replica_ledger_high,
    pg_replica_rows,
    reached,
    replica_online,
    sqlite_bank_sample,
    sqlite_ledger_high,
    sqlite_rows,
    sqlite_table,
    tail_checkpoint_scn,
)
from changebus.client import ChangeEvent, ChangeOp, PostgresReplica, SqliteReplica, Window
from changebus.client._apply import Replica
from changebus.schemas import (
    BootstrapProgress,
    Checkpoint,
    Column,
    Mode,
    PartitionCheckpoint,
    TableSchema,
)

# ---- values, compare, ledger -------------------------------------------------------------


def test_normalise_makes_driver_values_alike() -> None:
    assert normalise(memoryview(b"ab")) == b"ab"
    assert normalise(bytearray(b"ab")) == b"ab"
    assert normalise(True) == 1
    assert type(normalise(True)) is int
    assert normalise(decimal.Decimal("5000")) == 5000
    assert normalise(decimal.Decimal("1.5")) == "1.5"
    assert normalise(None) is None
    assert normalise("x") == "x"


def test_compare_counts_and_names_keys_and_columns_never_values() -> None:
    src = {(1,): (1, "a", b"s3cret"), (2,): (2, "b", None), (3,): (3, "c", None)}
    assert compare(src, dict(src)).ok
    replica = {(1,): (1, "a", b"other"), (3,): (3, "c", None), (4,): (4, "d", None)}
    diff = compare(src, replica, table="kv", columns=("k", "v", "b"))
    assert (diff.missing, diff.extra, diff.different) == (1, 1, 1)
    assert not diff.ok
    assert "kv different (1,): b" in diff.examples
    assert "kv missing (2,)" in diff.examples
    assert "kv extra (4,)" in diff.examples
    assert not any("s3cret" in e or "other" in e for e in diff.examples)
    total = Diff()
    total.add(diff)
    total.add(diff)
    assert (total.missing, total.extra, total.different) == (2, 2, 2)


def test_ledger_gaps_finds_holes_and_duplicates() -> None:
    clean = {(1, s): (1, s, 0, "append") for s in range(1, 11)}
    clean |= {(2, s): (2, s, 0, "append") for s in range(1, 4)}
    assert ledger_gaps(clean) == []
    assert ledger_high(clean) == {1: 10, 2: 3}
    assert ledger_reached(clean, {1: 10, 2: 3})
    assert not ledger_reached(clean, {1: 11})
    assert not ledger_reached(clean, {3: 1})
    assert reached({1: 5}, {1: 5}) and not reached({1: 5}, {1: 6, 2: 0})
    holed = {k: v for k, v in clean.items() if k not in {(1, 4), (1, 5), (1, 8)}}
    assert ledger_gaps(holed) == ["writer 1: missing seq 4..5, 8 of 1..10"]
    rows = [(1, 1), (1, 2), (1, 2), (1, 3)]
    assert ledger_gaps(rows) == ["writer 1: duplicate seq 2"]
    assert ledger_gaps([(1, 2)]) == ["writer 1: missing seq 1 of 1..2"]


# ---- the bank sampler ----------------------------------------------------------------------


def test_bank_sampler_checks_count_and_sum_exempts_and_errors() -> None:
    answers: list[Any] = [(3, 300), None, (3, 299), (2, 300), RuntimeError("down"), (3, 300)]

    def sample() -> tuple[int, int] | None:
        got = answers.pop(0)
        if isinstance(got, Exception):
            raise got
        return got  # type: ignore[no-any-return]

    sampler = BankSampler("r", sample, accounts=3, total=300)
    for _ in range(6):
        sampler.sample_once()
    assert (sampler.samples, sampler.exempt, sampler.errors) == (4, 1, 1)
    assert sampler.violation_count == 2
    assert "r: 3 accounts with sum 299" in sampler.violations[0]
    assert "r: 2 accounts with sum 300" in sampler.violations[1]


def test_bank_sampler_thread_samples_until_stopped() -> None:
    sampler = BankSampler("t", lambda: (2, 10), accounts=2, total=10, interval_s=0.01)
    sampler.start()
    import time

    deadline = time.monotonic() + 5
    while sampler.samples < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop()
    assert not sampler.is_alive()
    assert sampler.samples >= 5
    assert sampler.violations == []


def test_replica_online_reads_the_stored_checkpoint_mode() -> None:
    online = Checkpoint({"pg": PartitionCheckpoint(window_scn=5, prev_scn=5)})
    snap = Checkpoint(
        {
            "pg": PartitionCheckpoint(
                mode=Mode.SNAPSHOT, window_scn=3, bootstrap=BootstrapProgress(since_scn=3)
            )
        }
    )
    assert replica_online(online.to_json())
    assert replica_online(online.to_json(), "pg")
    assert not replica_online(online.to_json(), "my")
    assert not replica_online(snap.to_json())
    assert not replica_online(None)
    assert not replica_online("not json")


# ---- readers against the product's replicas ----------------------------------------------------

ACCOUNTS = TableSchema(
    "public.accounts",
    (Column("id", "int", nullable=False), Column("balance", "long", nullable=False)),
    ("id",),
    1,
)
KV1 = TableSchema(
    "public.kv",
    (
        Column("k", "int", nullable=False),
        Column("v", "string"),
        Column("n", "long"),
        Column("b", "bytes"),
    ),
    ("k",),
    1,
)
KV2 = TableSchema("public.kv", (*KV1.columns, Column("extra", "string")), ("k",), 2)
DOCS = TableSchema(
    "public.docs",
    (
        Column("id", "long", nullable=False),
        Column("small", "long", nullable=False),
        Column("note", "string"),
        Column("big", "string"),
    ),
    ("id",),
    1,
)


def ev(
    scn: int, seq: int, schema: TableSchema, op: ChangeOp, row: dict[str, Any], **kw: Any
) -> Any:
    key = {k: row[k] for k in schema.key}
    after = None if op is ChangeOp.DELETE else row
    before = row if op is ChangeOp.DELETE else None
    return ChangeEvent(scn, seq, op, schema.name, key, after, before, schema=schema, **kw)


async def apply(replica: Replica, window: Window) -> None:
    await replica.on_start_window(window)
    for event in window.events:
        await replica.on_event(event)
    assert await replica.on_end_window(window) is None


def windows() -> list[Window]:
    """A snapshot page (bootstrap), its end (online), then online windows with TOAST and DDL."""
    big = "B" * 3000
    snap = PartitionCheckpoint(
        mode=Mode.SNAPSHOT,
        window_scn=0,
        prev_scn=0,
        bootstrap=BootstrapProgress(since_scn=0, start_scn=10, snapshot_position="p1"),
    )
    ins = ChangeOp.INSERT
    page = Window(
        10,
        0,
        "pg",
        (
            ev(4, 0, ACCOUNTS, ins, {"id": 1, "balance": 100}),
            ev(3, 0, KV1, ins, {"k": 1, "v": "one", "n": 1, "b": b"\x00\x01"}),
            ev(7, 0, DOCS, ins, {"id": 1, "small": 0, "note": "n", "big": big}),
        ),
        phase="snapshot",
        checkpoint=snap,
    )
    done = PartitionCheckpoint(window_scn=10, prev_scn=10)
    rest = Window(
        10,
        0,
        "pg",
        (ev(5, 0, ACCOUNTS, ins, {"id": 2, "balance": 100}),),
        phase="snapshot",
        checkpoint=done,
    )
    upd = ChangeOp.UPDATE
    w11 = Window(
        11,
        0,
        "pg",
        (
            ev(11, 0, ACCOUNTS, upd, {"id": 1, "balance": 90}),
            ev(11, 1, ACCOUNTS, upd, {"id": 2, "balance": 110}),
            # TOAST unchanged: big not sent
            ev(
                11, 2, DOCS, upd, {"id": 1, "small": 1, "note": "m", "big": None}, not_sent=("big",)
            ),
        ),
    )
    w12 = Window(
        12,
        0,
        "pg",
        (
            ev(12, 0, KV2, ins, {"k": 2, "v": "two", "n": -5, "b": b"", "extra": "x"}),
            ev(
                12,
                1,
                KV2,
                ChangeOp.DELETE,
                {"k": 9, "v": None, "n": None, "b": None, "extra": None},
            ),
        ),
    )
    return [page, rest, w11, w12]


SOURCE_AFTER: dict[str, dict[tuple[Any, ...], tuple[Any, ...]]] = {
    "accounts": {(1,): (1, 90), (2,): (2, 110)},
    "kv": {(1,): (1, "one", 1, b"\x00\x01", None), (2,): (2, "two", -5, b"", "x")},
    "docs": {(1,): (1, 1, "m", "B" * 3000)},
}


async def check_replica(replica: Replica, rows: Any, bank: Any, high: Any) -> None:
    ws = windows()
    assert bank() is None  # nothing yet: exempt
    await apply(replica, ws[0])
    assert bank() is None  # snapshot in progress: exempt, though the sum is not 200 yet
    await apply(replica, ws[1])
    assert bank() == (2, 200)
    for w in ws[2:]:
        await apply(replica, w)
    assert bank() == (2, 200)
    for table, expected in SOURCE_AFTER.items():
        got = rows(table)
        assert compare(expected, got, table=table).ok, (table, got)
    assert rows("ledger") == {}
    assert high("ledger") == {}


async def test_sqlite_reader_and_sampler_follow_the_sqlite_replica(tmp_path: Path) -> None:
    path = tmp_path / "replica.db"
    assert sqlite_rows(path, "accounts") == {}  # no file yet
    replica = SqliteReplica(path)
    try:
        bank = sqlite_bank_sample(path, partition="pg")
        await check_replica(
            replica, lambda t: sqlite_rows(path, t), bank, lambda _: sqlite_ledger_high(path)
        )
        bank.close()
    finally:
        await replica.close()
    assert sqlite_table("accounts") == "public_accounts"
    assert sqlite_table("chaos.accounts") == "chaos_accounts"
    assert sqlite_rows(path, "public.accounts") == SOURCE_AFTER["accounts"]
    assert sqlite_rows(path, "accounts", schema="chaos") == {}
    names = {r[0] for r in sqlite3.connect(path).execute("SELECT name FROM sqlite_master")}
    assert {"public_accounts", "public_kv", "public_docs"} <= names


@pytest.mark.pg
async def test_pg_reader_and_sampler_follow_the_postgres_replica(pg_dsn: str) -> None:
    assert pg_replica_rows(pg_dsn, "accounts") == {}
    replica = PostgresReplica(pg_dsn)
    try:
        bank = pg_bank_sample(pg_dsn, partition="pg")
        await check_replica(
            replica,
            lambda t: pg_replica_rows(pg_dsn, t),
            bank,
            lambda _: pg_replica_ledger_high(pg_dsn),
        )
        bank.close()
    finally:
        await replica.close()
    assert pg_replica_rows(pg_dsn, "public.accounts") == SOURCE_AFTER["accounts"]
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute("SELECT to_regclass('public.accounts') IS NOT NULL").fetchone()
    assert row == (True,)


# ---- the tail checker --------------------------------------------------------------------------


def line(scn: int, seq: int = 0, *, before: bool = True, op: str = "update") -> str:
    doc = {
        "scn": scn,
        "seq": seq,
        "op": op,
        "table": "public.accounts",
        "key": {"id": 1},
        "before": {"id": 1, "balance": 1} if before else None,
        "after": {"id": 1, "balance": 2},
        "not_sent": [],
    }
    return json.dumps(doc) + "\n"


def out(tmp: Path, n: int, *lines: str, torn: str = "") -> Path:
    path = tmp / f"tail.{n}.out"
    path.write_text("".join(lines) + torn)
    return path


def test_tail_checker_passes_clean_output_and_allowed_replays(tmp_path: Path) -> None:
    first = out(tmp_path, 0, line(5), line(5, 1), line(6), line(8), torn='{"scn": 9, "se')
    # restarted from checkpoint 6: window 8 again is a replay after the checkpoint
    second = out(tmp_path, 1, line(8), line(9), line(9, 1))
    checker = TailChecker()
    assert checker.check([first, second], [6]) == []
    assert checker.check([first, second], [-1, 6]) == []
    assert (checker.lines, checker.incarnations) == (7, 2)


def test_tail_checker_catches_backwards_and_duplicates(tmp_path: Path) -> None:
    back = out(tmp_path, 0, line(5), line(7), line(6))
    problems = TailChecker().check([back], [])
    assert len(problems) == 1
    assert "goes back from (scn 7, seq 0) to (scn 6, seq 0)" in problems[0]
    dup = out(tmp_path, 1, line(5), line(5, 1), line(5), line(5, 1))  # a window twice
    assert len(TailChecker().check([dup], [])) == 1
    same = out(tmp_path, 2, line(5), line(5))
    assert len(TailChecker().check([same], [])) == 1


def test_tail_checker_catches_a_replay_before_the_checkpoint(tmp_path: Path) -> None:
    first = out(tmp_path, 0, line(5), line(6), line(7))
    second = out(tmp_path, 1, line(6), line(7), line(8))  # checkpoint was 7: 6 and 7 again
    problems = TailChecker().check([first, second], [7])
    assert len(problems) == 1
    assert "SCN 6, not after the checkpoint 7" in problems[0]
    assert "(2 such lines)" in problems[0]
    assert TailChecker().check([first, second], [1, 2, 3])[0].startswith("3 checkpoints")


def test_tail_checker_tolerates_a_bootstrap_snapshot_but_not_below_it(tmp_path: Path) -> None:
    # online up to 20, then a snapshot of rows changed after 20 (own SCNs, no before-image),
    # then catch-up and online windows again
    snapshot = [line(s, before=False, op="insert") for s in (30, 24, 41, 22)]
    ok = out(tmp_path, 0, line(10), line(20), *snapshot, line(45), line(50))
    checker = TailChecker()
    assert checker.check([ok], []) == []
    assert checker.snapshot_steps == 2
    # a "snapshot" row at or below what was printed before it is a regression
    bad = out(tmp_path, 1, line(10), line(20), line(30, before=False), line(20, before=False))
    assert len(TailChecker().check([bad], [])) == 1
    # a step back to a row with a before-image is never a snapshot row
    worse = out(tmp_path, 2, line(10), line(20), line(30, before=False), line(25))
    assert len(TailChecker().check([worse], [])) == 1


def test_tail_checkpoint_scn_reads_the_tail_checkpoint_file(tmp_path: Path) -> None:
    path = tmp_path / "tail.cp"
    assert tail_checkpoint_scn(path) == -1
    path.write_text(Checkpoint({"pg": PartitionCheckpoint(window_scn=42, prev_scn=42)}).to_json())
    assert tail_checkpoint_scn(path) == 42
    assert tail_checkpoint_scn(path, "pg") == 42
    assert tail_checkpoint_scn(path, "my") == -1
    # bootstrapping: a restarted snapshot sends the rows changed after its since again
    prog = BootstrapProgress(since_scn=30, start_scn=50, target_scn=60)
    catchup = PartitionCheckpoint(mode=Mode.CATCHUP, window_scn=55, prev_scn=55, bootstrap=prog)
    path.write_text(Checkpoint({"pg": catchup}).to_json())
    assert tail_checkpoint_scn(path) == 30
