"""The consumer groups' unit stores: one fencing contract, four stores (and replica group mode).

The contract (``changebus.schemas.UnitStore``) runs against FileUnitStore,
PostgresUnitStore, SqliteReplica and PostgresReplica: claims raise the
generation and fence older tokens, commits with the newest token succeed,
``read`` lists every unit. Two instances over one directory / database play
two members. Replicas also apply a unit's window and its fenced checkpoint in
one transaction: a window applied with a stale token writes no row.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from changebus.client import (
    CallbackResult,
    ChangeEvent,
    ChangeOp,
    FileUnitStore,
    PostgresReplica,
    PostgresUnitStore,
    Replica,
    SqliteReplica,
    Window,
)
from changebus.client._pgsession import session_lost
from changebus.schemas import (
    CheckpointError,
    Column,
    FencedError,
    PartitionCheckpoint,
    TableSchema,
    TransportError,
    Unit,
    UnitCommit,
    UnitStore,
)

G = "orders-indexer"
U = Unit("orders", 3)
U2 = Unit("orders", 17)

MakeStore = Callable[[], UnitStore]

KINDS = [
    pytest.param("file", id="file"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.pg),
    pytest.param("sqlite_replica", id="sqlite_replica"),
    pytest.param("pg_replica", id="pg_replica", marks=pytest.mark.pg),
]


def cp(scn: int) -> PartitionCheckpoint:
    return PartitionCheckpoint(window_scn=scn, prev_scn=scn, timestamp_ns=scn * 1000)


@pytest.fixture
async def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[MakeStore]:
    """New store instances (members) over one shared backing store of ``request.param``."""
    kind = request.param
    dsn = request.getfixturevalue("pg_dsn") if kind in ("postgres", "pg_replica") else ""
    made: list[UnitStore] = []

    def make() -> UnitStore:
        store: UnitStore
        if kind == "file":
            store = FileUnitStore(tmp_path / "units")
        elif kind == "postgres":
            store = PostgresUnitStore(dsn)
        elif kind == "sqlite_replica":
            store = SqliteReplica(tmp_path / "replica.db")
        else:
            store = PostgresReplica(dsn)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


@pytest.mark.parametrize("make_store", KINDS, indirect=True)
async def test_claims_fence_older_tokens_and_commits_need_the_newest(make_store: MakeStore) -> None:
    a, b = make_store(), make_store()
    assert isinstance(a, UnitStore)
    before = time.time_ns()

    first = await a.claim(G, U, "m-1")
    assert (first.unit, first.checkpoint, first.generation) == (U, None, 1)
    done = await a.commit(G, [UnitCommit(U, cp(10), first.token)])
    assert done.fenced == frozenset() and set(done.tokens) == {U}
    token = done.tokens[U]
    done = await a.commit(G, [UnitCommit(U, cp(20), token)])
    assert done.fenced == frozenset()
    token = done.tokens[U]

    # another member claims the unit: the first one's token is refused
    second = await b.claim(G, U, "m-2")
    assert second.checkpoint == cp(20) and second.generation == 2
    stale = await a.commit(G, [UnitCommit(U, cp(30), token)])
    assert stale.fenced == frozenset({U}) and U not in stale.tokens
    reader = make_store()
    stored = await reader.read(G)
    assert stored[U].checkpoint == cp(20)
    assert stored[U].owner == "m-2" and stored[U].generation == 2
    assert before - 10**6 <= stored[U].updated_ns <= time.time_ns() + 10**6

    # the new owner commits; a second unit; one call with a fenced and a good commit
    done = await b.commit(G, [UnitCommit(U, cp(30), second.token)])
    assert done.fenced == frozenset() and U in done.tokens
    other = await a.claim(G, U2, "m-1")
    assert (other.checkpoint, other.generation) == (None, 1)
    mixed = await a.commit(
        G, [UnitCommit(U, cp(40), first.token), UnitCommit(U2, cp(5), other.token)]
    )
    assert mixed.fenced == frozenset({U}) and set(mixed.tokens) == {U2}
    stored = await reader.read(G)
    assert set(stored) == {U, U2}
    assert (stored[U].checkpoint, stored[U].owner, stored[U].generation) == (cp(30), "m-2", 2)
    assert (stored[U2].checkpoint, stored[U2].owner, stored[U2].generation) == (cp(5), "m-1", 1)
    assert all(s.updated_ns >= before - 10**6 for s in stored.values())

    # a unit never claimed cannot be committed; other groups are apart
    never = await a.commit(G, [UnitCommit(Unit("orders", 9), cp(1), 1)])
    assert never.fenced == frozenset({Unit("orders", 9)})
    assert await reader.read("another-group") == {}
    assert await a.commit(G, []) == type(never)()
    third = await a.claim(G, U, "m-1")
    assert (third.checkpoint, third.generation) == (cp(30), 3)


@pytest.mark.parametrize("make_store", KINDS, indirect=True)
async def test_concurrent_claims_get_distinct_generations(make_store: MakeStore) -> None:
    stores = [make_store() for _ in range(3)]
    claims = await asyncio.gather(
        *(s.claim(G, U, f"m-{i}") for i, s in enumerate(stores) for _ in range(8))
    )
    assert sorted(c.generation for c in claims) == list(range(1, 25))
    won = []
    for i, claim in enumerate(claims):
        result = await stores[i // 8].commit(G, [UnitCommit(U, cp(claim.generation), claim.token)])
        if not result.fenced:
            won.append(claim.generation)
    assert won == [24]  # only the newest claim may write
    stored = (await stores[0].read(G))[U]
    assert (stored.generation, stored.checkpoint) == (24, cp(24))


@pytest.mark.parametrize("make_store", KINDS, indirect=True)
async def test_a_claim_with_an_older_fence_is_refused_and_writes_nothing(
    make_store: MakeStore,
) -> None:
    """A member paused between taking the unit's owner node and claiming it wakes
    after the next owner claimed: its claim (an older owner node's zxid) is refused,
    and the rightful owner's token still commits."""
    zombie, owner = make_store(), make_store()
    first = await zombie.claim(G, U, "m-zombie", 100)
    assert first.generation == 1
    second = await owner.claim(G, U, "m-owner", 250)
    assert second.generation == 2
    with pytest.raises(FencedError) as raised:
        await zombie.claim(G, U, "m-zombie", 100)
    assert raised.value.units == frozenset({str(U)}) and not raised.value.retriable
    with pytest.raises(FencedError):
        await zombie.claim(G, U, "m-zombie")  # (no fence at all: lower than any)
    stored = (await make_store().read(G))[U]
    assert (stored.owner, stored.generation, stored.fence) == ("m-owner", 2, 250)
    done = await owner.commit(G, [UnitCommit(U, cp(7), second.token)])
    assert done.fenced == frozenset()
    # the same fence again (a claim whose answer was lost, retried) and a newer one pass
    again = await owner.claim(G, U, "m-owner", 250)
    assert (again.checkpoint, again.generation) == (cp(7), 3)
    newer = await zombie.claim(G, U, "m-next", 300)
    assert newer.generation == 4
    assert (await make_store().read(G))[U].fence == 300


# ---- file store ---------------------------------------------------------------


def claims_in_thread(directory: Path, n: int, out: list[int]) -> None:
    store = FileUnitStore(directory)
    for _ in range(n):
        out.append(store._claim(G, U, threading.current_thread().name).generation)


CLAIMER = textwrap.dedent(
    """
    import asyncio, json, sys
    from changebus.client import FileUnitStore
    from changebus.schemas import Unit

    async def main() -> None:
        store = FileUnitStore(sys.argv[1])
        got = [(await store.claim("orders-indexer", Unit("orders", 3), sys.argv[2])).token
               for _ in range(int(sys.argv[3]))]
        print(json.dumps(got))

    asyncio.run(main())
    """
)


async def test_file_store_concurrent_claims_never_share_a_generation(tmp_path: Path) -> None:
    directory = tmp_path / "units"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            CLAIMER,
            str(directory),
            f"p{i}",
            "40",
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        for i in range(2)
    ]
    outs: list[list[int]] = [[] for _ in range(3)]
    threads = [
        threading.Thread(target=claims_in_thread, args=(directory, 40, outs[i]), name=f"t{i}")
        for i in range(3)
    ]
    for t in threads:
        t.start()
    tokens: list[int] = []
    for proc in procs:
        stdout, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0
        tokens += json.loads(stdout)
    for t in threads:
        await asyncio.to_thread(t.join, 60)
    tokens += [g for out in outs for g in out]
    assert sorted(tokens) == list(range(1, 201))  # every claim won a generation of its own
    store = FileUnitStore(directory)
    results = [await store.commit(G, [UnitCommit(U, cp(7), t)]) for t in sorted(tokens)]
    assert [r.fenced == frozenset() for r in results] == [False] * 199 + [True]

    # private files, a lock file; a corrupt file is an error, not a fresh start
    unit_file = directory / G / f"{U}.json"
    assert stat.S_IMODE(unit_file.stat().st_mode) == 0o600
    assert stat.S_IMODE((directory / G).stat().st_mode) == 0o700
    assert (directory / G / ".lock").exists()
    assert not (directory / G / f"{U}.json.tmp").exists()
    data = json.loads(unit_file.read_text())
    assert data["generation"] == 200 and data["checkpoint"] == cp(7).to_dict()
    unit_file.write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        await store.read(G)
    with pytest.raises(CheckpointError):
        await store.claim(G, U, "m-9")


async def test_file_store_concurrent_async_claims_in_one_process(tmp_path: Path) -> None:
    stores = [FileUnitStore(tmp_path) for _ in range(4)]
    claims = await asyncio.gather(
        *(s.claim(G, U2, f"m-{i}") for i, s in enumerate(stores) for _ in range(10))
    )
    assert sorted(c.generation for c in claims) == list(range(1, 41))
    wins = [
        (await s.commit(G, [UnitCommit(U2, cp(1), c.token)])).fenced == frozenset()
        for s, c in zip(stores * 10, claims, strict=False)
    ]
    assert sum(wins) == 1


# ---- Postgres store: the DSN stays secret -----------------------------------------


async def test_postgres_store_keeps_the_password_out_of_errors() -> None:
    store = PostgresUnitStore("postgresql://alice:s3cretpw@127.0.0.1:9/db", table="x.unit_cp")
    assert "s3cretpw" not in repr(store)
    try:
        with pytest.raises(TransportError) as info:
            await store.claim(G, U, "m-1")
    finally:
        await store.close()
    assert info.value.retriable
    assert "s3cretpw" not in str(info.value) and info.value.__cause__ is None
    assert "unit store x.unit_cp" in str(info.value)
    replica = PostgresReplica("host=127.0.0.1 port=9 user=alice password=s3cretpw dbname=db")
    try:
        with pytest.raises(TransportError) as info:
            await replica.claim(G, U, "m-1")
    finally:
        await replica.close()
    assert info.value.retriable and "s3cretpw" not in str(info.value)
    assert "s3cretpw" not in repr(replica)


@pytest.mark.pg
async def test_postgres_store_own_table_name(pg_dsn: str) -> None:
    import psycopg

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA grp")
    store = PostgresUnitStore(pg_dsn, table="grp.units")
    try:
        claim = await store.claim(G, U, "m-1")
        await store.commit(G, [UnitCommit(U, cp(3), claim.token)])
    finally:
        await store.close()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT unit, owner, generation FROM grp.units").fetchone()
    assert row == (str(U), "m-1", 1)


@pytest.mark.pg
async def test_a_frozen_members_transaction_does_not_hold_the_units_for_ever(pg_dsn: str) -> None:
    """A member stopped inside a window's transaction: the server ends its session, locks go."""
    import psycopg

    store = PostgresUnitStore(pg_dsn)
    frozen = PostgresReplica(pg_dsn, idle_in_transaction_s=1.0)._connect()
    try:
        first = await store.claim(G, U, "m-1")
        frozen.execute("BEGIN")  # what a member stopped mid-window leaves behind
        frozen.execute(
            "SELECT * FROM changebus_unit_checkpoints WHERE unit = %s FOR UPDATE", (str(U),)
        )
        t0 = time.monotonic()
        second = await asyncio.wait_for(store.claim(G, U, "m-2"), 20)
        took = time.monotonic() - t0
        assert second.token > first.token
        assert 0.5 < took < 10, took  # it waited for the lock, then the server cut the session
        with pytest.raises(psycopg.Error) as gone:
            frozen.execute("SELECT 1")  # the frozen process finds its session gone ...
        assert session_lost(gone.value)  # ... a retriable transport error: it connects again
    finally:
        frozen.close()
        await store.close()


# ---- replicas in group mode ---------------------------------------------------------

T = TableSchema(
    "app.users", (Column("id", "long", nullable=False), Column("name", "string")), ("id",), 1
)


def window(scn: int, rows: dict[int, str], unit: Unit = U) -> Window:
    events = tuple(
        ChangeEvent(
            scn=scn,
            seq=i,
            op=ChangeOp.INSERT,
            table=T.name,
            key={"id": k},
            after={"id": k, "name": v},
            before=None,
            schema=T,
        )
        for i, (k, v) in enumerate(rows.items())
    )
    return Window(
        scn=scn, timestamp_ns=scn * 1000, partition=unit.partition, events=events, unit=str(unit)
    )


async def deliver(replica: Replica, w: Window) -> Any:
    assert await replica.on_start_window(w) is None
    for e in w.events:
        assert await replica.on_event(e) is None
    return await replica.on_end_window(w)


def rows_of(replica: Replica) -> dict[int, str]:
    table = replica._qualified(replica.table_for(T.name))
    return {int(k): str(v) for k, v in replica.query(f"SELECT id, name FROM {table}")}


REPLICAS = [
    pytest.param("sqlite_replica", id="sqlite"),
    pytest.param("pg_replica", id="postgres", marks=pytest.mark.pg),
]


@pytest.mark.parametrize("make_store", REPLICAS, indirect=True)
async def test_a_fenced_apply_does_not_fence_the_units_new_claim(make_store: MakeStore) -> None:
    """A window applied under a claim another member took in the meantime is refused;
    when this replica claimed the unit again before that answer came back, the refusal
    fenced the new claim, whose windows were then skipped (review)."""
    from changebus.client._apply_units import UnitReplica

    a, b = make_store(), make_store()
    assert isinstance(a, UnitReplica) and isinstance(b, UnitReplica)
    await a.claim(G, U, "m-a")
    await b.claim(G, U, "m-b")  # a's session expired; b took the unit
    run = a._in_thread
    reclaimed: list[Any] = []

    async def in_thread(fn: Any, *args: Any) -> Any:
        result = await run(fn, *args)
        if getattr(fn, "__name__", "") == "_apply_unit":  # a claims it again meanwhile
            reclaimed.append(await a.claim(G, U, "m-a"))
        return result

    a._in_thread = in_thread  # type: ignore[method-assign]
    assert await deliver(a, window(20, {2: "bob"})) is None  # the stale claim's window
    a._in_thread = run  # type: ignore[method-assign]
    assert rows_of(a) == {} and a.windows_applied == 0
    assert await deliver(a, window(20, {2: "bob"})) is None  # the new claim's, applied
    assert rows_of(a) == {2: "bob"} and a.windows_applied == 1
    assert (await a.read(G))[U].owner == "m-a"
    result = await a.commit(G, [UnitCommit(U, cp(20), reclaimed[0].token)])
    assert not result.fenced and U in result.tokens


@pytest.mark.parametrize("make_store", REPLICAS, indirect=True)
async def test_replica_applies_unit_windows_fenced(make_store: MakeStore) -> None:
    a, b = make_store(), make_store()
    assert isinstance(a, Replica) and isinstance(b, Replica)
    claim_a = await a.claim(G, U, "m-a")
    assert await deliver(a, window(10, {1: "ann"})) is None
    assert rows_of(a) == {1: "ann"} and a.windows_applied == 1

    # b claims the unit: the checkpoint written with a's rows comes along
    claim_b = await b.claim(G, U, "m-b")
    assert claim_b.checkpoint is not None and claim_b.checkpoint.window_scn == 10
    assert claim_b.checkpoint.timestamp_ns == 10_000

    # a zombie window with the stale token: no row, reported fenced once
    assert await deliver(a, window(20, {2: "bob"})) is None
    assert rows_of(b) == {1: "ann"} and a.windows_applied == 1
    lost = await a.commit(G, [UnitCommit(U, cp(20), claim_a.token)])
    assert lost.fenced == frozenset({U}) and not lost.tokens
    stored = await b.read(G)
    assert stored[U].checkpoint == claim_b.checkpoint and stored[U].owner == "m-b"
    assert await deliver(a, window(30, {3: "cy"})) is None  # still not its unit
    assert (await a.commit(G, [])).fenced == frozenset({U})
    assert rows_of(b) == {1: "ann"}

    # b replays from its claim: a window at the stored checkpoint is skipped (the
    # row changed since stays changed), later ones applied
    b.query(f"UPDATE {b._qualified(b.table_for(T.name))} SET name = 'changed' WHERE id = 1")
    assert await deliver(b, window(10, {1: "ann"})) is None
    assert b.windows_skipped == 1 and b.windows_applied == 0
    assert await deliver(b, window(20, {2: "bob"})) is None
    assert rows_of(b) == {1: "changed", 2: "bob"} and b.windows_applied == 1
    after_20 = (await b.read(G))[U].checkpoint
    assert after_20 is not None and after_20.window_scn == 20

    # an empty window's position goes through commit (same fence); never backwards
    done = await b.commit(G, [UnitCommit(U, cp(25), claim_b.token)])
    assert done.fenced == frozenset() and U in done.tokens
    assert (await b.read(G))[U].checkpoint == cp(25)
    done = await b.commit(G, [UnitCommit(U, cp(15), claim_b.token)])
    assert done.fenced == frozenset()
    assert (await b.read(G))[U].checkpoint == cp(25)

    # a window of a unit the replica never claimed is a fatal misuse
    assert await deliver(b, window(40, {4: "dee"}, unit=U2)) is CallbackResult.FATAL
    # the single-consumer checkpoint row is not touched by group mode
    assert b.checkpoint is None
    assert b.query(f"SELECT count(*) FROM {b._quote(b.checkpoint_table)}") == [(0,)]


@pytest.mark.parametrize("make_store", REPLICAS, indirect=True)
async def test_a_commit_prepared_while_a_window_applied_does_not_write_behind_it(
    make_store: MakeStore,
) -> None:
    """The commit timer prepared position 10 on the loop while window 20 was being applied
    in the worker thread; the loop's "never behind" check saw 10 still, and the commit,
    run after window 20's transaction, wrote 10 back over it (found by review). The
    worker thread checks again where the commit runs."""
    from changebus.client._apply_units import UnitReplica

    replica = make_store()
    assert isinstance(replica, UnitReplica)
    claim = await replica.claim(G, U, "m-a")
    assert await deliver(replica, window(20, {2: "bob"})) is None
    # what the commit timer prepared before window 20 ended, as it reaches the thread
    result = await replica._in_thread(
        replica._commit_units, G, [UnitCommit(U, cp(10), claim.token)]
    )
    assert U in result.tokens
    stored = (await replica.read(G))[U].checkpoint
    assert stored is not None and stored.window_scn == 20


@pytest.mark.parametrize("make_store", KINDS[1:], indirect=True)
async def test_a_unit_table_of_an_older_version_gets_its_fence_column(
    make_store: MakeStore, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A table made before claims had fences (no ``fence`` column) keeps its rows and
    takes fenced claims after the store adds the column."""
    kind = request.node.callspec.params["make_store"]
    old = (
        "CREATE TABLE changebus_unit_checkpoints (group_name text NOT NULL,"
        " unit text NOT NULL, checkpoint text, owner text NOT NULL, generation bigint NOT NULL,"
        " updated_at {t} NOT NULL, PRIMARY KEY (group_name, unit))"
    )
    row = (G, str(U), json.dumps(cp(9).to_dict()), "m-old", 4)
    if kind == "sqlite_replica":
        import sqlite3

        with sqlite3.connect(tmp_path / "replica.db") as conn:
            conn.execute(old.format(t="INTEGER"))
            conn.execute("INSERT INTO changebus_unit_checkpoints VALUES (?, ?, ?, ?, ?, 1)", row)
    else:
        import psycopg

        with psycopg.connect(request.getfixturevalue("pg_dsn"), autocommit=True) as conn:
            conn.execute(old.format(t="timestamptz"))
            conn.execute(
                "INSERT INTO changebus_unit_checkpoints VALUES (%s, %s, %s, %s, %s, now())", row
            )
    store = make_store()
    stored = (await store.read(G))[U]
    assert (stored.checkpoint, stored.owner, stored.generation, stored.fence) == (
        cp(9),
        "m-old",
        4,
        -1,
    )
    claim = await store.claim(G, U, "m-new", 42)
    assert (claim.checkpoint, claim.generation) == (cp(9), 5)
    with pytest.raises(FencedError):
        await make_store().claim(G, U, "m-late", 41)
    assert (await store.read(G))[U].fence == 42
