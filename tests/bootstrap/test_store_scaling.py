"""The store's per-step work does not grow with the log or the snapshot behind it.

Each hot query of the SQLite store (an applier step, the lag count, a
catch-up page near the end of the log, folding a TRUNCATE of a small table)
is run twice: on a store with a short history and on one with a hundred
times more rows already applied. The work is counted in SQLite virtual
machine instructions (a progress handler), not timed: a query that reads
the whole log or partition (an index used for the partition only, then a
sort; a range that starts at the log's beginning) does a hundred times more
in the big store, while a bounded one does about the same.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from test_store import REG, TABLES, window

from changebus.bootstrap._store import Store
from changebus.schemas import ChangeDecoder, Op, event_at, parse_stream, verify_event

# (the store tests' tables: a big one and a small one beside it)
_BIG, _SMALL = TABLES


def _window(scn: int, table: str, op: Op, key: int) -> bytes:
    return bytes(window(scn, [(table, op, key, f"value {key}")]))


def _store(path: Path, history: int) -> tuple[Store, int]:
    """A store whose applier has folded ``history`` windows (one row each) of ``big``,
    plus five rows of ``small``; returns it and its last SCN."""
    s = Store.sqlite(path)
    scn = 100
    for first in range(0, history, 2000):
        batch = []
        for key in range(first, min(first + 2000, history)):
            scn += 1
            batch.append(_window(scn, _BIG.name, Op.INSERT, key))
        s.append("p", b"".join(batch), start_scn=100)
    for key in range(5):
        scn += 1
        s.append("p", _window(scn, _SMALL.name, Op.INSERT, key))
    while s.state("p").applier_scn < scn:
        s.apply("p", 50_000)
    return s, scn


def _work(s: Store, fn: Callable[[], Any]) -> int:
    """SQLite VM instructions ``fn`` runs (counted in steps of 100)."""
    steps = [0]

    def tick() -> int:
        steps[0] += 1
        return 0

    s._conn.set_progress_handler(tick, 100)
    try:
        fn()
    finally:
        s._conn.set_progress_handler(None, 0)
    return steps[0] * 100


def _hot_work(s: Store, scn: int) -> dict[str, int]:
    """The work of each hot operation on ``s`` (whose last SCN is ``scn``)."""
    new = b"".join(_window(scn + 1 + i, _BIG.name, Op.UPDATE, i) for i in range(20))
    s.append("p", new)
    work = {"lag": _work(s, lambda: s.unapplied_events("p"))}
    work["catch-up page"] = _work(
        s, lambda: s.catchup_page("p", after_scn=scn + 5, target_scn=scn + 20, max_bytes=1 << 20)
    )
    work["applier step"] = _work(s, lambda: s.apply("p", 50))
    s.append("p", _window(scn + 21, _SMALL.name, Op.TRUNCATE, 0))
    work["truncate"] = _work(s, lambda: s.apply("p", 50))
    assert s.state("p").applier_scn == scn + 21
    return work


def test_hot_queries_do_not_read_the_history(tmp_path: Path) -> None:
    small, small_scn = _store(tmp_path / "small.db", 200)
    big, big_scn = _store(tmp_path / "big.db", 20_000)
    try:
        assert big.unapplied_events("p") == 0
        few, many = _hot_work(small, small_scn), _hot_work(big, big_scn)
        # the same results: the big store's TRUNCATE kept every row of the other table
        assert big._one("SELECT count(*) FROM cb_snap WHERE part = 'p'")[0] == 20_000
        for what, n in few.items():
            assert many[what] < 3 * n + 2000, f"{what}: {many[what]} VM steps against {n}"
    finally:
        small.close()
        big.close()


def test_the_lag_count_stops_at_its_bound(tmp_path: Path, monkeypatch: Any) -> None:
    from changebus.bootstrap import _logstore

    monkeypatch.setattr(_logstore, "LAG_COUNT_MAX", 7)
    s = Store.sqlite(tmp_path / "b.db")
    try:
        s.append("p", b"".join(_window(101 + i, _BIG.name, Op.INSERT, i) for i in range(3)))
        assert s.unapplied_events("p") == 6  # (each window: a row and its END_OF_WINDOW)
        s.append("p", b"".join(_window(104 + i, _BIG.name, Op.INSERT, i) for i in range(3)))
        assert s.unapplied_events("p") == 8
        s.apply("p", 8)  # (four windows of the six)
        assert s.unapplied_events("p") == 4
    finally:
        s.close()


def test_a_snapshot_page_reads_a_bounded_part_of_a_source_it_mostly_skips(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Rows older than the consumer's position, and tombstones for a consumer from
    nothing, were filtered inside SQL: one page read the whole source to find a few
    rows. They now count in the page's scan budget (here 64 KiB: 256 skipped rows)."""
    from changebus.bootstrap import _pages

    monkeypatch.setattr(_pages, "MIN_SCAN_BYTES", 64 << 10)
    s, scn = _store(tmp_path / "b.db", 20_000)
    try:
        changed = b"".join(_window(scn + 1 + i, _BIG.name, Op.UPDATE, i) for i in range(3))
        s.append("p", changed)
        gone = range(3, 19_000)
        for first in range(gone.start, gone.stop, 2000):
            keys = range(first, min(first + 2000, gone.stop))
            s.append("p", b"".join(_window(scn + 1 + k, _BIG.name, Op.DELETE, k) for k in keys))
        s.apply("p", 1 << 20)
        st = s.state("p")
        sid = REG.source_id(_BIG.name)
        cases: tuple[tuple[int, set[int]], ...] = (
            (scn, set(range(3, 19_000)) | {0, 1, 2}),  # a position: changed rows, tombstones
            (scn + 19_000, set()),  # after every change: nothing, and 20,000 rows skipped
            (-1, {0, 1, 2} | set(range(19_000, 20_000))),  # from nothing: 16,997 tombstones skipped
        )
        for since, sent in cases:
            pos, pages, got = (0, 0), 0, set()
            while True:
                page = s.snapshot_page(
                    "p", [sid], since_scn=since, start_scn=st.applier_scn, position=pos,
                    max_bytes=4096,
                )  # fmt: skip
                got |= _keys(page.data)
                pages += 1
                pos = page.position
                if page.complete:
                    break
            assert got == sent
            if since > scn:  # only skipped rows: the budget ends each page
                assert pages >= 20_000 // 512
            elif since < 0:
                assert pages >= 16_997 // 512
    finally:
        s.close()


_DECODE = ChangeDecoder(_BIG).decode


def _keys(data: bytes) -> set[int]:
    out = set()
    offsets, _ = parse_stream(data)
    for off in offsets.tolist():
        h = verify_event(data, off)
        if h.op.is_control:
            continue
        ch = _DECODE(event_at(data, off, h)[1])
        image = ch.after if ch.after is not None else ch.before
        assert image is not None
        out.add(int(image["id"]))
    return out
