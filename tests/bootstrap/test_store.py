"""The bootstrap store (SQLite and Postgres run the same tests): log, applier,
snapshot pages, catch-up pages, consistency of snapshot + catch-up."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from changebus.bootstrap._store import Store
from changebus.schemas import (
    ChangeDecoder,
    Column,
    CorruptEventError,
    EndOfWindow,
    Op,
    ProtocolError,
    RowEncoder,
    SchemaRegistry,
    TableSchema,
    encode_control,
    event_at,
    parse_stream,
    verify_event,
)

REG = SchemaRegistry()
TABLES = [
    REG.register(
        TableSchema(
            f"public.t{i}",
            (Column("id", "long", nullable=False), Column("v", "string")),
            ("id",),
        )
    )
    for i in (1, 2)
]
ENC = {t.name: RowEncoder(t, source_id=REG.source_id(t.name), partition=1) for t in TABLES}
SID = {REG.source_id(t.name): t for t in TABLES}


def window(scn: int, changes: list[tuple[str, Op, int, str | None]]) -> bytes:
    out = []
    for seq, (table, op, key, v) in enumerate(changes):
        enc = ENC[table]
        if op == Op.TRUNCATE:
            out.append(enc.encode(op, scn, seq, scn * 10, None))
        elif op == Op.DELETE:
            out.append(enc.encode(op, scn, seq, scn * 10, None, {"id": key, "v": None}))
        else:
            out.append(enc.encode(op, scn, seq, scn * 10, {"id": key, "v": v}))
    out.append(encode_control(EndOfWindow(len(changes), ""), scn, len(changes), scn * 10))
    return b"".join(out)


def replay(data: bytes, state: dict[tuple[str, int], str | None]) -> None:
    offsets, _ = parse_stream(data)
    for off in offsets.tolist():
        h = verify_event(data, off)
        if h.op.is_control:
            continue
        table = SID[h.source_id]
        if h.op == Op.TRUNCATE:
            for k in [k for k in state if k[0] == table.name]:
                del state[k]
            continue
        ch = ChangeDecoder(table).decode(event_at(data, off, h)[1])
        if h.op == Op.DELETE:
            assert ch.before is not None
            state.pop((table.name, ch.before["id"]), None)
        else:
            assert ch.after is not None
            state[(table.name, ch.after["id"])] = ch.after["v"]


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: Any, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        s = Store.sqlite(tmp_path / "b.db")
    else:
        s = Store.postgres(request.getfixturevalue("pg_dsn"))
    yield s
    s.close()


def random_windows(seed: int, n: int, first_scn: int = 100) -> list[bytes]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        changes: list[tuple[str, Op, int, str | None]] = []
        for _ in range(rnd.randint(1, 4)):
            t = rnd.choice(TABLES).name
            r = rnd.random()
            if r < 0.01:
                changes.append((t, Op.TRUNCATE, 0, None))
            elif r < 0.2:
                changes.append((t, Op.DELETE, rnd.randint(1, 30), None))
            else:
                changes.append((t, Op.INSERT, rnd.randint(1, 30), f"v{i}"))
        out.append(window(first_scn + i * 10, changes))
    return out


def full_bootstrap(store: Store, since: int, have: dict[tuple[str, int], str | None]) -> int:
    """Snapshot (small pages) then catch-up, as a consumer would; returns the target SCN."""
    start = store.state("p").applier_scn
    pos = (0, 0)
    ids = sorted(SID)
    while True:
        page = store.snapshot_page(
            "p", ids, since_scn=since, start_scn=start, position=pos, max_bytes=300
        )
        if page.data:
            replay(page.data, have)
        pos = page.position
        if page.complete:
            break
    target = store.state("p").producer_scn
    after = start
    while True:
        cpage = store.catchup_page("p", after_scn=after, target_scn=target, max_bytes=500)
        if cpage.data:
            replay(cpage.data, have)
        after = cpage.last_scn
        if cpage.complete:
            return target


def test_snapshot_plus_catchup_equals_the_log(store: Store) -> None:
    wins = random_windows(1, 300)
    truth: dict[tuple[str, int], str | None] = {}
    for w in wins:
        replay(w, truth)
    # the producer appends in groups; the applier runs behind
    for i in range(0, 200, 7):
        store.append("p", b"".join(wins[i : min(i + 7, 200)]), start_scn=50)
    store.apply("p", max_events=150)
    mid = store.state("p")
    assert 0 < mid.applier_scn < mid.producer_scn
    # a new consumer: snapshot at the applier, then catch-up to the producer
    have: dict[tuple[str, int], str | None] = {}
    full_bootstrap(store, -1, have)
    expect: dict[tuple[str, int], str | None] = {}
    for w in wins[:200]:
        replay(w, expect)
    assert have == expect
    # the rest arrives; a consumer that was at window 150 gets only what changed
    store.append("p", b"".join(wins[200:]))
    while store.state("p").applier_scn < store.state("p").producer_scn:
        store.apply("p", max_events=100)
    partial: dict[tuple[str, int], str | None] = {}
    for w in wins[:150]:
        replay(w, partial)
    since = 100 + 149 * 10
    full_bootstrap(store, since, partial)
    assert partial == truth
    counts = store.counts("p")
    assert counts["log_events"] > 0 and counts["rows"] == len(truth)


def test_replayed_windows_are_skipped_and_state_survives_reopen(
    store: Store, tmp_path: Path
) -> None:
    wins = random_windows(2, 20)
    store.append("p", b"".join(wins[:10]), start_scn=0)
    n = store.counts("p")["log_events"]
    assert store.append("p", b"".join(wins[5:10])) == 100 + 9 * 10  # all seen: nothing added
    assert store.counts("p")["log_events"] == n
    store.append("p", b"".join(wins[5:20]))  # overlapping: only the new ones
    assert store.state("p").producer_scn == 100 + 19 * 10
    partial = window(1000, [("public.t1", Op.INSERT, 1, "x")])
    offsets, _ = parse_stream(partial)
    # whole events, but the window's END_OF_WINDOW is missing: refused
    with pytest.raises(ProtocolError, match="whole windows"):
        store.append("p", partial[: int(offsets[-1])])
    # bytes cut inside an event: corrupt, refused by validation
    with pytest.raises(CorruptEventError):
        store.append("p", partial[:-5])
    assert store.state("p").producer_scn == 100 + 19 * 10  # nothing was stored


def test_catchup_pages_hold_whole_windows(store: Store) -> None:
    wins = random_windows(3, 50)
    store.append("p", b"".join(wins), start_scn=0)
    after, seen = -1, []
    while True:
        page = store.catchup_page("p", after_scn=after, target_scn=100 + 49 * 10, max_bytes=1)
        _offsets, headers = parse_stream(page.data)
        assert int(headers["op"][-1]) == Op.END_OF_WINDOW
        assert len({int(s) for s in headers["scn"]}) == 1  # one window per page at 1 byte
        seen.append(page.last_scn)
        after = page.last_scn
        if page.complete:
            break
    assert seen == [100 + i * 10 for i in range(50)]


def test_tombstones_reach_only_consumers_that_saw_the_row(store: Store) -> None:
    store.append(
        "p",
        window(10, [("public.t1", Op.INSERT, 1, "a"), ("public.t1", Op.INSERT, 2, "b")])
        + window(20, [("public.t1", Op.DELETE, 1, None)]),
        start_scn=0,
    )
    store.apply("p")
    ids = sorted(SID)
    fresh = store.snapshot_page(
        "p", ids, since_scn=-1, start_scn=20, position=(0, 0), max_bytes=1 << 20
    )
    old = store.snapshot_page(
        "p", ids, since_scn=10, start_scn=20, position=(0, 0), max_bytes=1 << 20
    )
    assert fresh.events == 1 and fresh.complete
    _, h = parse_stream(fresh.data)
    assert int(h["op"][0]) == Op.INSERT
    _, h = parse_stream(old.data)
    assert [int(o) for o in h["op"]] == [Op.DELETE]


def test_prune_keeps_unapplied_windows(store: Store) -> None:
    wins = random_windows(4, 30)
    store.append("p", b"".join(wins), start_scn=0)
    store.apply("p", max_events=20)
    applied = store.state("p").applier_scn
    assert store.prune_log("p", 10**9) > 0
    st = store.state("p")
    assert st.log_min_scn == applied
    page = store.catchup_page("p", after_scn=applied, target_scn=st.producer_scn, max_bytes=1 << 30)
    _, h = parse_stream(page.data)
    assert int(h["scn"].min()) > applied and page.last_scn == st.producer_scn


def test_windows_appended_after_the_whole_log_was_pruned_are_applied(store: Store) -> None:
    """SQLite gives a new row ``max(rowid) + 1``: after a prune emptied the log (a window
    bigger than ``log_keep_events``) the next windows' rows got ids from 1, below the
    stored ``applier_id``, and the applier's ``id > applier_id`` left them out: the
    snapshot froze, then skipped windows for good (found by review). Whole windows
    are applied by SCN alone."""
    truth: dict[tuple[str, int], str | None] = {}
    first = random_windows(11, 30)
    store.append("p", b"".join(first), start_scn=-1)
    for w in first:
        replay(w, truth)
    store.apply("p")
    store.prune_to("p", 0)
    assert store.counts("p")["log_events"] == 0  # all of it, the newest window too
    later = random_windows(12, 30, first_scn=1000)
    store.append("p", b"".join(later), start_scn=-1)
    for w in later:
        replay(w, truth)
    store.apply("p")
    assert store.state("p").applier_scn == store.state("p").producer_scn
    have: dict[tuple[str, int], str | None] = {}
    full_bootstrap(store, -1, have)
    assert have == {k: v for k, v in truth.items() if v is not None}


def test_key_change_leaves_a_tombstone_and_unsent_columns_are_kept(store: Store) -> None:
    t = TABLES[0]
    sid = REG.source_id(t.name)
    store.put_schemas("p", [(sid, t.version, t.name, json.dumps(t.to_json()))])
    enc = ENC[t.name]

    def win(scn: int, event: bytes) -> bytes:
        return event + encode_control(EndOfWindow(1, ""), scn, 1, scn * 10)

    store.append(
        "p",
        win(10, enc.encode(Op.INSERT, 10, 0, 100, {"id": 1, "v": "a"}))
        + win(
            20,
            enc.encode(
                Op.UPDATE,
                20,
                0,
                200,
                {"id": 5, "v": "b"},
                {"id": 1, "v": None},
                before_not_sent=("v",),
            ),
        )
        + win(30, enc.encode(Op.UPDATE, 30, 0, 300, {"id": 5, "v": None}, after_not_sent=("v",))),
        start_scn=0,
    )
    store.apply("p")
    ids = sorted(SID)

    def rows(since: int) -> list[tuple[int, int, Any, tuple[str, ...]]]:
        page = store.snapshot_page(
            "p", ids, since_scn=since, start_scn=30, position=(0, 0), max_bytes=1 << 20
        )
        out = []
        offsets, _ = parse_stream(page.data)
        for off in offsets.tolist():
            h = verify_event(page.data, off)
            ch = ChangeDecoder(t).decode(event_at(page.data, off, h)[1])
            image = ch.after if ch.after is not None else ch.before
            assert image is not None
            out.append((int(h.op), image["id"], image["v"], ch.after_not_sent))
        return sorted(out, key=lambda r: r[1])

    assert rows(-1) == [(int(Op.UPDATE), 5, "b", ())]  # old key gone, v from before
    assert rows(10) == [(int(Op.DELETE), 1, None, ()), (int(Op.UPDATE), 5, "b", ())]


def test_a_key_moved_onto_a_deleted_key_behind_the_scan_is_sent_whole(store: Store) -> None:
    """An update moving a row onto a key deleted earlier reused that key's tombstone row,
    behind the position of a snapshot in progress: the next pages never sent the moved
    row, and the catch-up's UPDATE, without the columns Postgres left out (unchanged
    TOAST values), made a row without them in the consumer (review). The moved row is
    stored anew, after the scan."""
    t = TABLES[0]
    sid = REG.source_id(t.name)
    store.put_schemas("p", [(sid, t.version, t.name, json.dumps(t.to_json()))])
    enc = ENC[t.name]

    def win(scn: int, event: bytes) -> bytes:
        return event + encode_control(EndOfWindow(1, ""), scn, 1, scn * 10)

    store.append(
        "p",
        win(10, enc.encode(Op.INSERT, 10, 0, 100, {"id": 2, "v": "old"}))
        + win(20, enc.encode(Op.DELETE, 20, 0, 200, None, {"id": 2, "v": None}))
        + win(30, enc.encode(Op.INSERT, 30, 0, 300, {"id": 1, "v": "toasted"})),
        start_scn=0,
    )
    store.apply("p")
    ids = sorted(SID)

    def page(position: tuple[int, int], max_bytes: int) -> Any:
        return store.snapshot_page(
            "p", ids, since_scn=10, start_scn=30, position=position, max_bytes=max_bytes
        )

    first = page((0, 0), 1)  # (one event: key 2's tombstone)
    assert first.events == 1 and not first.complete
    store.append(
        "p",
        win(
            40,
            enc.encode(
                Op.UPDATE,
                40,
                0,
                400,
                {"id": 2, "v": None},
                {"id": 1, "v": None},
                after_not_sent=("v",),
                before_not_sent=("v",),
            ),
        ),
    )
    store.apply("p")
    rest = page(first.position, 1 << 20)
    sent = []
    offsets, _ = parse_stream(rest.data)
    for off in offsets.tolist():
        h = verify_event(rest.data, off)
        ch = ChangeDecoder(t).decode(event_at(rest.data, off, h)[1])
        image = ch.after if ch.after is not None else ch.before
        assert image is not None
        sent.append((int(h.op), image["id"], image["v"]))
    assert (int(Op.UPDATE), 2, "toasted") in sent, sent  # the moved row, whole
    assert (int(Op.DELETE), 1, None) in sent, sent


def _seed_first_table(store: Store) -> TableSchema:
    """Seed TABLES[0] with three rows at SCN 5 (its schema registered first)."""
    t = TABLES[0]
    store.put_schemas("p", [(REG.source_id(t.name), t.version, t.name, json.dumps(t.to_json()))])
    rows = [ENC[t.name].encode(Op.INSERT, 5, i, 50, {"id": 500 + i, "v": "s"}) for i in range(3)]
    store.seed_rows("p", t.name, rows, 5)
    store.seed_rows("p", t.name, [], 5)
    return t


def test_plan_chooses_catchup_or_snapshot(store: Store) -> None:
    from changebus.bootstrap._plan import plan_bootstrap as _plan
    from changebus.schemas import NotYetError

    with pytest.raises(NotYetError):
        _plan(store, "p", -1, 2.0)  # nothing yet
    wins = random_windows(5, 40)
    store.append("p", b"".join(wins), start_scn=-1)
    store.apply("p")
    # from nothing, replaying the log: start just before its first window (a valid SCN)
    plan = _plan(store, "p", -1, 1e18)
    assert plan["snapshot"] is False and 0 <= plan["start_scn"] < 100
    page = store.catchup_page(
        "p", after_scn=plan["start_scn"], target_scn=plan["producer_scn"], max_bytes=1 << 30
    )
    have: dict[tuple[str, int], str | None] = {}
    replay(page.data, have)
    truth: dict[tuple[str, int], str | None] = {}
    for w in wins:
        replay(w, truth)
    assert have == truth
    # a consumer a little behind: catch-up only; far behind with ratio 0: a snapshot
    last = 100 + 39 * 10
    assert _plan(store, "p", last - 10, 2.0)["snapshot"] is False
    far = _plan(store, "p", 100, 0.0)
    assert far["snapshot"] is True and far["start_scn"] == last
    # seeded rows are in the snapshot only: a consumer from nothing gets a snapshot, even
    # with the log cheaper to replay (it lacked them; review)
    _seed_first_table(store)
    assert _plan(store, "p", -1, 1e18)["snapshot"] is True


def test_a_consumer_from_nothing_gets_a_snapshot_while_tables_are_seeded_again(
    store: Store,
) -> None:
    """A re-seed marks its tables "not seeded" until it ends, and a snapshot of keys
    records no table seeded: with no seeded table left, a consumer from nothing was sent
    a catch-up from the log, which lacks every row only a copy brought (review)."""
    from changebus.bootstrap._plan import plan_bootstrap as _plan

    wins = random_windows(7, 20)
    store.append("p", b"".join(wins), start_scn=-1)
    store.apply("p")
    assert _plan(store, "p", -1, 1e18)["snapshot"] is False  # nothing copied: the log
    t = _seed_first_table(store)
    assert _plan(store, "p", -1, 1e18)["snapshot"] is True
    store.forget_seed("p", [t.name])  # a whole re-seed starts
    assert store.seeded("p") == {}
    assert _plan(store, "p", -1, 1e18)["snapshot"] is True


def test_a_snapshot_of_keys_alone_sends_consumers_from_nothing_to_the_snapshot(
    store: Store,
) -> None:
    from changebus.bootstrap._chunks import JobState
    from changebus.bootstrap._plan import plan_bootstrap as _plan

    store.append("p", b"".join(random_windows(8, 20)), start_scn=-1)
    store.apply("p")
    t = TABLES[0]
    store.put_schemas("p", [(REG.source_id(t.name), t.version, t.name, json.dumps(t.to_json()))])
    assert _plan(store, "p", -1, 1e18)["snapshot"] is False
    job = JobState(t.name, '{"keys": [[500]]}', first_tag=5, last_tag=5)
    store.finish_snapshot("p", job, seeded=False)
    assert store.seeded("p") == {} and store.never_seeded("p") == [t.name]
    assert _plan(store, "p", -1, 1e18)["snapshot"] is True


def test_a_page_of_big_rows_after_many_skipped_ones_holds_about_a_page(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows a page skips (unchanged since the consumer's position) counted little in the
    size of the next read, which asked Postgres for 2,000 rows; its client-side cursor
    held them all, 1 MiB rows included, for a 1 MiB page (review). A read now holds
    about what the page still takes; the pages after it still cover every row once."""
    t = TABLES[0].name
    store.append("p", window(100, [(t, Op.INSERT, k, "s") for k in range(3000)]), start_scn=-1)
    big = "x" * (1 << 20)
    for k in range(3000, 3030):
        store.append("p", window(300 + k, [(t, Op.INSERT, k, big)]))
    store.apply("p")
    sid = REG.source_id(t)
    read = _count_reads(store, monkeypatch)
    position, seen = (0, 0), 0
    while True:
        page = store.snapshot_page(
            "p", [sid], since_scn=200, start_scn=10_000, position=position, max_bytes=1 << 20
        )
        seen += page.events
        position = page.position
        if page.complete:
            break
    assert seen == 30
    assert max(read) < 3 << 20, read  # not 30 rows of 1 MiB in one read


def test_prune_to_keeps_about_n_events(store: Store) -> None:
    wins = random_windows(6, 60)
    store.append("p", b"".join(wins), start_scn=-1)
    store.apply("p")
    total = store.counts("p")["log_events"]
    assert store.prune_to("p", 50) > 0
    left = store.counts("p")["log_events"]
    assert 40 <= left <= 50 < total
    assert store.state("p").log_min_scn > 100


def test_rows_changed_after_the_snapshot_scn_come_whole(store: Store) -> None:
    """A row whose only change after the snapshot SCN is an UPDATE without some
    columns (unsent TOAST values) must still reach the consumer whole."""
    t = TABLES[0]
    sid = REG.source_id(t.name)
    store.put_schemas("p", [(sid, t.version, t.name, json.dumps(t.to_json()))])
    enc = ENC[t.name]
    eow = encode_control(EndOfWindow(1, ""), 10, 1, 100)
    store.append("p", enc.encode(Op.INSERT, 10, 0, 100, {"id": 1, "v": "big"}) + eow, start_scn=0)
    store.apply("p")
    start = store.state("p").applier_scn  # the consumer's snapshot SCN
    partial = enc.encode(Op.UPDATE, 20, 0, 200, {"id": 1, "v": None}, after_not_sent=("v",))
    store.append("p", partial + encode_control(EndOfWindow(1, ""), 20, 1, 200))
    store.apply("p")  # the applier moves on while the consumer reads its snapshot
    page = store.snapshot_page(
        "p", sorted(SID), since_scn=-1, start_scn=start, position=(0, 0), max_bytes=1 << 20
    )
    offsets, _ = parse_stream(page.data)
    assert len(offsets) == 1
    h = verify_event(page.data, int(offsets[0]))
    change = ChangeDecoder(t).decode(event_at(page.data, int(offsets[0]), h)[1])
    assert change.after == {"id": 1, "v": "big"} and change.after_not_sent == ()


@pytest.mark.parametrize("batch", [100, 400])
def test_snapshot_chunks_merge_by_scn_and_the_sweep_tombstones_what_no_chunk_rewrote(
    store: Store, batch: int
) -> None:
    """Chunks of more rows than one multi-row INSERT holds (SQLite batches them) merge
    unless the snapshot holds a newer state; the sweep tombstones the table's rows older
    than the first tag that no chunk rewrote, and only those: in steps of ``batch`` rows in
    id order when more than ``batch`` rows are that old (300 here), else in one step through
    the SCN index."""
    from changebus.bootstrap._chunks import JobState, SnapshotScope

    t = TABLES[0]
    sid = REG.source_id(t.name)
    store.put_schemas("p", [(sid, t.version, t.name, json.dumps(t.to_json()))])
    enc = ENC[t.name]
    # the log's state: keys 1..1500 at SCN 10, key 7 changed again at SCN 900 (after the tags)
    old = [
        enc.encode(Op.INSERT, 10, i, 100, {"id": k, "v": "old"})
        for i, k in enumerate(range(1, 1501))
    ]
    eow = encode_control(EndOfWindow(len(old), ""), 10, len(old), 100)
    store.append("p", b"".join(old) + eow, start_scn=0)
    newer = enc.encode(Op.UPDATE, 900, 0, 900, {"id": 7, "v": "newest"})
    store.append("p", newer + encode_control(EndOfWindow(1, ""), 900, 1, 900))
    store.apply("p")
    scope = SnapshotScope(t.name)
    job = JobState(t.name, scope.as_json())
    # the source holds keys 1..1200 (1201..1500 were deleted unseen) and 2001..2600 (new)
    keys = [*range(1, 1201), *range(2001, 2601)]
    for n, start in enumerate(range(0, len(keys), 700)):
        part = keys[start : start + 700]
        tag = 500 + n
        events = [
            enc.encode(Op.INSERT, tag, i, 0, {"id": k, "v": f"src{k}"}) for i, k in enumerate(part)
        ]
        job = JobState(
            t.name, scope.as_json(), json.dumps(part[-1]), n + 1, job.rows + len(part), 500, tag
        )
        store.snapshot_chunk("p", job, events, tag)
        assert store.snapshot_job("p", scope) == job
    after: int | None = 0
    steps = 0
    while after is not None:
        after = store.sweep_step("p", t.name, job.first_tag, after, batch=batch)
        steps += 1
    assert steps > 3 if batch < 300 else steps == 1
    store.finish_snapshot("p", job, seeded=True)
    assert store.snapshot_job("p", scope) is None
    assert store.seeded("p") == {t.name: 500}
    page = store.snapshot_page(
        "p",
        [sid],
        since_scn=-1,
        start_scn=store.state("p").applier_scn,
        position=(0, 0),
        max_bytes=16 << 20,
    )
    offsets, _ = parse_stream(page.data)
    live: dict[int, str] = {}
    for off in offsets.tolist():
        h = verify_event(page.data, off)
        change = ChangeDecoder(t).decode(event_at(page.data, off, h)[1])
        assert change.after is not None
        live[change.after["id"]] = change.after["v"]
    want = {k: f"src{k}" for k in keys}
    want[7] = "newest"  # the newer log state wins over the chunk
    assert live == want
    assert store.counts("p") == {"log_events": 1503, "rows": len(keys), "tombstones": 300}


def _live_rows(store: Store, t: TableSchema) -> dict[int, tuple[Any, tuple[str, ...]]]:
    """The snapshot's live rows of ``t``: id -> (v, columns not sent)."""
    page = store.snapshot_page(
        "p",
        [REG.source_id(t.name)],
        since_scn=-1,
        start_scn=store.state("p").applier_scn,
        position=(0, 0),
        max_bytes=16 << 20,
    )
    offsets, _ = parse_stream(page.data)
    out = {}
    for off in offsets.tolist():
        h = verify_event(page.data, off)
        change = ChangeDecoder(t).decode(event_at(page.data, off, h)[1])
        if change.after is not None and h.op != int(Op.DELETE):
            out[change.after["id"]] = (change.after["v"], change.after_not_sent)
    return out


def test_a_chunk_read_before_a_truncate_the_applier_folded_brings_no_row_back(
    store: Store,
) -> None:
    """The chunk (tag 50) was read before the TRUNCATE at 60 but stored after the applier
    folded it: its rows were written as if live, and lived on though the source has none."""
    from changebus.bootstrap._chunks import JobState, SnapshotScope

    t = TABLES[0]
    store.put_schemas("p", [(REG.source_id(t.name), t.version, t.name, json.dumps(t.to_json()))])
    enc = ENC[t.name]
    eow = encode_control(EndOfWindow(1, ""), 10, 1, 100)
    store.append("p", enc.encode(Op.INSERT, 10, 0, 100, {"id": 1, "v": "a"}) + eow, start_scn=0)
    truncate = enc.encode(Op.TRUNCATE, 60, 0, 600, None)
    store.append("p", truncate + encode_control(EndOfWindow(1, ""), 60, 1, 600))
    store.apply("p")
    scope = SnapshotScope(t.name)
    job = JobState(t.name, scope.as_json(), None, 1, 2, 50, 50)
    rows = [enc.encode(Op.INSERT, 50, i, 0, {"id": k, "v": "src"}) for i, k in enumerate((1, 2))]
    store.snapshot_chunk("p", job, rows, 50)
    assert _live_rows(store, t) == {}
    # a chunk read after the truncate is written as usual
    later = [enc.encode(Op.INSERT, 70, 0, 0, {"id": 3, "v": "new"})]
    store.snapshot_chunk("p", JobState(t.name, scope.as_json(), None, 2, 3, 50, 70), later, 70)
    assert _live_rows(store, t) == {3: ("new", ())}


def test_a_filtered_consumer_from_nothing_gets_the_truncate_first(store: Store) -> None:
    """Writers of other keys may share its tables (a group's units, filtered replicas):
    one still before the TRUNCATE must learn from this one that it was applied, or it
    empties the table again later, rows of this snapshot with it. An unfiltered
    consumer from nothing needs no TRUNCATE (its tables are its own)."""
    from changebus.schemas import PartitionFilter

    t = TABLES[0]
    store.append("p", window(10, [(t.name, Op.INSERT, 1, "a")]), start_scn=0)
    store.append("p", window(60, [(t.name, Op.TRUNCATE, 0, None), (t.name, Op.INSERT, 2, "b")]))
    store.apply("p")
    ids = sorted(SID)
    start = store.state("p").applier_scn

    def ops(key_filter: PartitionFilter | None) -> list[Op]:
        page = store.snapshot_page(
            "p",
            ids,
            since_scn=-1,
            start_scn=start,
            position=(0, 0),
            max_bytes=1 << 20,
            key_filter=key_filter,
        )
        _offsets, headers = parse_stream(page.data)
        return [Op(int(o)) for o in headers["op"].tolist()]

    assert ops(None) == [Op.INSERT]
    assert ops(PartitionFilter.mod(1, 0)) == [Op.TRUNCATE, Op.INSERT]


def test_an_update_without_unsent_columns_is_completed_by_an_older_chunk(store: Store) -> None:
    """A row the applier has no image of is updated (Postgres sends its TOAST column as
    unchanged, so not at all) after the chunk holding it was read (tag 70) but before that
    chunk is stored: the newer UPDATE wins, and it lacked the column for good."""
    from changebus.bootstrap._chunks import JobState, SnapshotScope

    t = TABLES[0]
    store.put_schemas("p", [(REG.source_id(t.name), t.version, t.name, json.dumps(t.to_json()))])
    enc = ENC[t.name]
    partial = enc.encode(Op.UPDATE, 80, 0, 800, {"id": 1, "v": None}, after_not_sent=("v",))
    store.append("p", partial + encode_control(EndOfWindow(1, ""), 80, 1, 800), start_scn=0)
    store.apply("p")
    assert _live_rows(store, t) == {1: (None, ("v",))}  # (nothing to take "v" from yet)
    scope = SnapshotScope(t.name)
    job = JobState(t.name, scope.as_json(), None, 1, 2, 70, 70)
    rows = [
        enc.encode(Op.INSERT, 70, i, 0, {"id": k, "v": f"big{k}"}) for i, k in enumerate((1, 2))
    ]
    store.snapshot_chunk("p", job, rows, 70)
    assert _live_rows(store, t) == {1: ("big1", ()), 2: ("big2", ())}


def _blob_bytes(row: Any) -> int:
    """Bytes of a row's events (its bytes-like columns: the event is not always last)."""
    return sum(len(v) for v in row if isinstance(v, bytes | memoryview))


def _count_reads(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes of the event rows each page read holds: all its rows when the store's
    cursor holds them (Postgres), those taken when it steps the query (SQLite)."""
    read: list[int] = []
    real = getattr(store, "_each", None)

    def counting(sql: str, params: Any = ()) -> Any:
        assert real is not None
        rows = real(sql, params)
        if "event" not in sql:
            return rows
        if store.dialect != "sqlite":
            held = list(rows)
            read.append(sum(_blob_bytes(r) for r in held))
            rows.close()
            return _Closing(iter(held))
        read.append(0)

        def taken() -> Any:
            for row in rows:
                read[-1] += _blob_bytes(row)
                yield row

        return _Closing(taken(), rows.close)

    every = store._all

    def counting_all(sql: str, params: Any = ()) -> Any:  # (reads that hold their rows)
        rows = every(sql, params)
        if "event" in sql:
            read.append(sum(_blob_bytes(r) for r in rows))
        return rows

    if real is not None:
        monkeypatch.setattr(store, "_each", counting)
    monkeypatch.setattr(store, "_all", counting_all)
    return read


class _Closing:
    """An iterator with ``close()`` (a cursor's stand-in)."""

    def __init__(self, it: Any, close: Any = None) -> None:
        self._it, self._close = it, close

    def __iter__(self) -> Any:
        return self._it

    def close(self) -> None:
        if self._close is not None:
            self._close()


def test_a_page_that_moves_from_small_rows_to_big_ones_holds_about_max_bytes(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read was sized by the rows read before it in the page: after a table of small
    rows (or rows unchanged since the consumer's position) it asked for 2,000 rows,
    and the next table's rows were 100 KB each: 200 MB held for one 1 MiB page
    (review). The rows are taken as the page needs them (SQLite), or reads grow from
    16 rows per table (Postgres)."""
    small = [window(100 + i, [("public.t1", Op.INSERT, k, "s") for k in range(i * 100, i * 100 + 100)])
             for i in range(10)]  # fmt: skip
    big = "x" * 100_000
    large = [window(200 + i, [("public.t2", Op.INSERT, i, big)]) for i in range(60)]
    for data in small + large:
        store.append("p", data)
    store.apply("p")
    read = _count_reads(store, monkeypatch)
    sids = sorted(REG.source_id(t) for t in ("public.t1", "public.t2"))
    st = store.state("p")
    page = store.snapshot_page(
        "p", sids, since_scn=-1, start_scn=st.applier_scn, position=(0, 0), max_bytes=1 << 20
    )
    assert not page.complete and 1 << 20 <= len(page.data) < 3 << 20
    assert max(read) < 3 << 20, read  # not 60 big rows (6 MB) in one read


def test_a_page_of_big_rows_reads_about_max_bytes(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page read 2,000 rows at a time whatever their size: 2,000 rows of several MB
    held GBs for one request. Reads now follow the rows' average size."""
    big = "x" * 100_000
    windows = [window(100 + i * 10, [("public.t1", Op.INSERT, i, big)]) for i in range(60)]
    for data in windows:
        store.append("p", data)
    store.apply("p")
    read = _count_reads(store, monkeypatch)
    sid = REG.source_id("public.t1")
    st = store.state("p")
    page = store.snapshot_page(
        "p", [sid], since_scn=-1, start_scn=st.applier_scn, position=(0, 0), max_bytes=1 << 20
    )
    assert not page.complete and 1 << 20 <= len(page.data) < 3 << 20
    assert sum(read) < 3 << 20, read  # not the 60 rows (6 MB) at once
    read.clear()
    cpage = store.catchup_page("p", after_scn=99, target_scn=st.producer_scn, max_bytes=1 << 20)
    assert not cpage.complete and sum(read) < 3 << 20, read


def test_a_page_whose_filter_matches_little_reads_a_bounded_part_of_the_store(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key filter that matches almost nothing (``range:0:1``) made one page read the
    whole partition: with two store reader threads, two such requests held every
    store-backed endpoint for as long (found by review). A page now stops after
    reading SCAN_PAGES times its size (at least MIN_SCAN_BYTES), not complete, at its
    position; the pages after it go on from there and cover every row once."""
    from changebus.bootstrap import _pages
    from changebus.schemas import PartitionFilter

    monkeypatch.setattr(_pages, "MIN_SCAN_BYTES", 64 << 10)
    body = "y" * 1000
    windows = [
        window(
            100 + i * 10, [("public.t1", Op.INSERT, k, body) for k in range(i * 20, i * 20 + 20)]
        )
        for i in range(30)
    ]  # 600 rows of about 1 KB
    for data in windows:
        store.append("p", data)
    store.apply("p")
    sid = REG.source_id("public.t1")
    st = store.state("p")
    nothing = PartitionFilter.parse("range:0:1")
    kwargs: dict[str, Any] = {"since_scn": -1, "start_scn": st.applier_scn, "max_bytes": 4096}
    page = store.snapshot_page("p", [sid], position=(0, 0), key_filter=nothing, **kwargs)
    assert not page.complete and page.events == 0  # stopped: 64 KiB read, not 600 KB
    assert page.position[0] == sid and 50 <= page.position[1] < 200
    keys: set[int] = set()
    everything = PartitionFilter.parse("mod:1:0")
    pos = (0, 0)
    while True:  # pages from the start cover every row once
        part = store.snapshot_page("p", [sid], position=pos, key_filter=everything, **kwargs)
        have: dict[tuple[str, int], str | None] = {}
        if part.data:
            replay(part.data, have)
        assert not {k for _t, k in have} & keys  # once
        keys |= {k for _t, k in have}
        pos = part.position
        if part.complete:
            break
    assert keys == set(range(600))


def test_a_page_over_many_small_tables_keeps_to_its_scan_budget(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scan budget was checked only after a read that came back full: tables of fewer
    rows than a read asks for were each read to their end, and one request read every
    table of the store (review). A page now stops before a new table once the budget is
    spent; the pages after it go on from there, every table's rows once."""
    from changebus.bootstrap import _pages

    monkeypatch.setattr(_pages, "MIN_SCAN_BYTES", 16 << 10)
    monkeypatch.setattr(_pages, "SCAN_PAGES", 1)
    reg = SchemaRegistry()
    tables = [
        reg.register(TableSchema(f"public.m{i}", (Column("id", "long", nullable=False),), ("id",)))
        for i in range(100)
    ]
    events = []
    for t in tables:
        enc = RowEncoder(t, source_id=reg.source_id(t.name), partition=1)
        events += [enc.encode(Op.INSERT, 100, k, 1000, {"id": k}) for k in range(12)]
    changed = RowEncoder(tables[-1], source_id=reg.source_id(tables[-1].name), partition=1)
    store.append(
        "p", b"".join(events) + encode_control(EndOfWindow(len(events), ""), 100, len(events), 1000)
    )
    store.append(
        "p",
        changed.encode(Op.INSERT, 300, 0, 3000, {"id": 99})
        + encode_control(EndOfWindow(1, ""), 300, 1, 3000),
    )
    store.apply("p")
    sids = sorted(reg.source_id(t.name) for t in tables)
    position, pages, sent = (0, 0), 0, 0
    while True:
        page = store.snapshot_page(
            "p", sids, since_scn=200, start_scn=300, position=position, max_bytes=16 << 10
        )
        pages += 1
        sent += page.events
        position = page.position
        if page.complete:
            break
    assert pages >= 10  # 1,200 skipped rows of 256 bytes, 16 KiB of them a page
    assert sent == 1  # the one row changed after 200, in the last table, once


def test_a_truncate_that_fills_a_page_is_followed_by_its_tables_rows(store: Store) -> None:
    """A table's TRUNCATE (after the consumer's position) is taken into the page before its
    rows; when it filled the page, the Postgres read had no byte left, read no row, and the
    table was taken as done: its rows never sent (review of this session's change)."""
    t1, t2 = TABLES[0].name, TABLES[1].name
    store.append(
        "p",
        window(100, [(t1, Op.INSERT, k, "a") for k in range(3)]),
        start_scn=-1,
    )
    store.append("p", window(200, [(t2, Op.TRUNCATE, 0, None)]))
    store.append("p", window(300, [(t2, Op.INSERT, k, "b") for k in range(5)]))
    store.append("p", window(400, [(t1, Op.INSERT, k, "c") for k in range(3)]))
    store.apply("p")
    sids = sorted(REG.source_id(t) for t in (t1, t2))
    truth: dict[tuple[str, int], str | None] = {(t1, k): "a" for k in range(3)}
    for max_bytes in (1, 50, 120, 200, 400):
        have = dict(truth)
        position = (0, 0)
        while True:
            page = store.snapshot_page(
                "p", sids, since_scn=150, start_scn=400, position=position, max_bytes=max_bytes
            )
            if page.data:
                replay(page.data, have)
            position = page.position
            if page.complete:
                break
        want = {**{(t1, k): "c" for k in range(3)}, **{(t2, k): "b" for k in range(5)}}
        assert have == want, max_bytes


def test_a_plan_counts_a_bounded_part_of_the_store(store: Store) -> None:
    """``/v1/bootstrap/start`` chose between a catch-up and a snapshot by counting every
    log event and snapshot row after ``since``: with the log never pruned, each request
    read the whole history (found by review). The counts stop at what the choice needs."""
    for data in random_windows(5, 60):
        store.append("p", data)
    store.apply("p")
    st = store.state("p")
    everything = store.changed_since("p", -1, st.producer_scn, 1 << 40)
    assert everything > 20
    assert store.changed_since("p", -1, st.producer_scn, 7) == 7
    rows = store.snapshot_changed("p", -1, st.applier_scn, 1 << 40)
    assert rows > 5 and store.snapshot_changed("p", -1, st.applier_scn, 3) == 3


def test_a_chunk_read_before_a_row_moved_to_its_key_does_not_complete_that_row(
    store: Store,
) -> None:
    """Key 2 held row X when a chunk read it (tag 90); X was deleted (100) and row Y moved
    from key 1 to key 2 without its TOAST column (110, the applier had no image of Y). The
    chunk, stored after, completed Y with X's value, a deleted row's data, and the row no
    longer counted as lacking, so the refill never mended it (review). It stays lacking
    until a read after the move."""
    from changebus.bootstrap._chunks import JobState, SnapshotScope

    t = TABLES[0]
    store.put_schemas("p", [(REG.source_id(t.name), t.version, t.name, json.dumps(t.to_json()))])
    enc = ENC[t.name]
    gone = enc.encode(Op.DELETE, 100, 0, 1000, None, {"id": 2, "v": None})
    moved = enc.encode(
        Op.UPDATE, 110, 0, 1100, {"id": 2, "v": None}, {"id": 1, "v": None},
        after_not_sent=("v",), before_not_sent=("v",),
    )  # fmt: skip
    store.append("p", gone + encode_control(EndOfWindow(1, ""), 100, 1, 1000), start_scn=0)
    store.append("p", moved + encode_control(EndOfWindow(1, ""), 110, 1, 1100), start_scn=0)
    store.apply("p")
    assert _live_rows(store, t) == {2: (None, ("v",))}
    scope = SnapshotScope(t.name)
    early = enc.encode(Op.INSERT, 90, 0, 0, {"id": 2, "v": "X-secret"})
    store.snapshot_chunk("p", JobState(t.name, scope.as_json(), None, 1, 1, 90, 90), [early], 90)
    assert _live_rows(store, t) == {2: (None, ("v",))}
    assert [k for k, _v, _s in store.unfilled_keys("p", t.name)] == [enc.key_bytes({"id": 2})]
    # the refill's read, after the move
    after = enc.encode(Op.INSERT, 111, 0, 0, {"id": 2, "v": "Y-own"})
    store.snapshot_chunk("p", JobState(t.name, scope.as_json(), None, 3, 3, 111, 111), [after], 111)
    assert _live_rows(store, t) == {2: ("Y-own", ())}


def test_a_catchup_update_that_moved_a_row_is_served_with_the_columns_it_lacked(
    store: Store,
) -> None:
    """Planned at SCN 10, a bootstrap's pages are read after the applier folded a DELETE of
    key 2 (20) and an UPDATE moving key 1 to key 2 without its TOAST column (30): the
    snapshot holds key 2 whole at 30, and the catch-up replays 20 (deleting it) and 30,
    whose UPDATE a consumer that never held key 1 could only store without the column
    (review). The log now serves that UPDATE as the fold filled it in."""
    t = TABLES[0]
    store.put_schemas("p", [(REG.source_id(t.name), t.version, t.name, json.dumps(t.to_json()))])
    enc = ENC[t.name]
    eow = encode_control
    first = enc.encode(Op.INSERT, 10, 0, 100, {"id": 1, "v": "X"}) + enc.encode(
        Op.INSERT, 10, 1, 100, {"id": 2, "v": "Y"}
    )
    store.append("p", first + eow(EndOfWindow(2, ""), 10, 2, 100), start_scn=0)
    store.apply("p")
    start = store.state("p").applier_scn
    gone = enc.encode(Op.DELETE, 20, 0, 200, None, {"id": 2, "v": None})
    moved = enc.encode(
        Op.UPDATE, 30, 0, 300, {"id": 2, "v": None}, {"id": 1, "v": None},
        after_not_sent=("v",), before_not_sent=("v",),
    ) + enc.encode(Op.DELETE, 30, 1, 300, None, {"id": 1, "v": None})  # fmt: skip
    store.append("p", gone + eow(EndOfWindow(1, ""), 20, 1, 200), start_scn=0)
    store.append("p", moved + eow(EndOfWindow(2, ""), 30, 2, 300), start_scn=0)
    store.apply("p")
    have: dict[tuple[str, int], str | None] = {}
    pos = (0, 0)
    while True:
        page = store.snapshot_page(
            "p", sorted(SID), since_scn=-1, start_scn=start, position=pos, max_bytes=300
        )
        if page.data:
            replay(page.data, have)
        pos = page.position
        if page.complete:
            break
    assert have == {(t.name, 2): "X"}
    after = start
    while True:
        cpage = store.catchup_page("p", after_scn=after, target_scn=30, max_bytes=500)
        if cpage.data:
            replay(cpage.data, have)
        after = cpage.last_scn
        if cpage.complete:
            break
    assert have == {(t.name, 2): "X"}
    # an UPDATE that moved nothing stays as Postgres sent it (a consumer completes it
    # from the row it holds; filled in, a bulk UPDATE of TOASTed rows grew many times)
    plain = enc.encode(Op.UPDATE, 40, 0, 400, {"id": 2, "v": None}, after_not_sent=("v",))
    store.append("p", plain + eow(EndOfWindow(1, ""), 40, 1, 400), start_scn=0)
    store.apply("p")
    cpage = store.catchup_page("p", after_scn=30, target_scn=40, max_bytes=1 << 20)
    offsets, _ = parse_stream(cpage.data)
    h = verify_event(cpage.data, int(offsets[0]))
    logged = ChangeDecoder(t).decode(event_at(cpage.data, int(offsets[0]), h)[1])
    assert h.op == Op.UPDATE and tuple(logged.after_not_sent) == ("v",)


def test_a_big_window_past_max_bytes_is_read_in_few_queries(store: Store) -> None:
    """A catch-up page past ``max_bytes`` inside a window reads the rest of it in
    doubling batches: it read one row a query, so a reader asking ``max_bytes=1`` made
    the store run a query per event of a big window (review)."""
    rows: list[tuple[str, Op, int, str | None]] = [
        (TABLES[0].name, Op.INSERT, k, f"v{k}") for k in range(3000)
    ]
    store.append("p", bytes(window(101, rows)), start_scn=100)
    store.append("p", bytes(window(102, rows[:5])))
    calls: list[str] = []
    real = store._all

    def counted(sql: str, params: Any) -> Any:
        calls.append(sql)
        return real(sql, params)

    store._all = counted  # type: ignore[method-assign,assignment]
    page = store.catchup_page("p", after_scn=100, target_scn=102, max_bytes=1)
    assert page.events == 3001 and page.last_scn == 101 and not page.complete
    assert len(calls) <= 12, len(calls)
    _offsets, headers = parse_stream(page.data)
    assert {int(x) for x in headers["scn"]} == {101}
    assert int(headers["op"][-1]) == Op.END_OF_WINDOW


def test_the_applier_folds_a_bounded_number_of_bytes_at_once(store: Store) -> None:
    """The applier took 20,000 log events at once whatever their size: 1 MB events made
    a 20 GB transaction in memory (review). It stops at ``max_bytes`` (whole windows)."""
    big = "x" * 100_000
    windows = [window(100 + i * 10, [("public.t1", Op.INSERT, i, big)]) for i in range(10)]
    for data in windows:
        store.append("p", data)
    st = store.apply("p", 10_000, 250_000)  # the third window passes 250 KB: up to it
    assert st.applier_scn == 120
    st = store.apply("p", 10_000, 250_000)
    assert st.applier_scn == 150
    st = store.apply("p", 2, 1 << 30)  # (and the count still bounds it: an event and
    assert st.applier_scn == 160  # its window's end)
    st = store.apply("p")
    assert st.applier_scn == st.producer_scn == 190
    assert len(_live_rows(store, TABLES[0])) == 10
