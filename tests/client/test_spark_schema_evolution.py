"""Schema changes mid-stream: Postgres -> relay -> format("changebus") -> the example mirror job.

One Postgres table, one relay, the example job (deploy/spark/parquet_mirror.py,
schema kept under its checkpoint) on the session's local Spark:

* ``ALTER TABLE ADD COLUMN`` while the query streams stops it with the
  retriable ``SchemaChangedError`` before any row of the new version reaches
  the mirror; the documented restart continues with the new column, and the
  mirror equals the table row by row (old rows null in the new column);
* a ``DROP COLUMN`` is refused (``SchemaChangeRefusedError``) with the rows
  before it in the same range written, and mirrored by the example job's
  ``run_mirror`` with ``allowSchemaChanges=drop``, which restarts the query by
  itself over one more ``ADD COLUMN``.

The driver side alone (cuts, log entries, a refusal a restart without the
option meets again, the stop without a log) runs against a scripted relay;
the option parsing, the column diff and the schema log's checks run without
Spark.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from changebus.fetchers.postgres import message_scn
from changebus.schemas import (
    Column,
    ConfigError,
    SchemaChangedError,
    SchemaChangeRefusedError,
    TableSchema,
)
from fix_spark import ROOT, RelayThread, pg_relay_config

pytestmark = [pytest.mark.timeout(300)]


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location(
        "parquet_mirror_evol", ROOT / "deploy" / "spark" / "parquet_mirror.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sql(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for s in statements:
            conn.execute(s)


def caught_up(relay: RelayThread, dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        marker = conn.execute("SELECT pg_logical_emit_message(false, 'sync', 'x')::text").fetchone()
    assert marker is not None
    target = message_scn(marker[0])
    deadline = time.monotonic() + 60
    while relay.meta("pg").last_scn < target:
        assert time.monotonic() < deadline, "the relay did not catch up"
        time.sleep(0.05)


def source_rows(dsn: str, cols: list[str]) -> dict[int, tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(f"SELECT {', '.join(cols)} FROM t").fetchall()
    return {r[0]: tuple(r) for r in rows}


def mirror_rows(spark: Any, mirror: Any, cols: list[str]) -> dict[int, tuple[Any, ...]] | None:
    """The mirror's rows in ``cols`` (None while it lacks one of them)."""
    df = mirror.read(spark)
    if df is None or not set(cols) <= set(df.columns):
        return None
    return {r[0]: tuple(r) for r in df.select(*cols).collect()}


def wait_for(
    what: str, check: Callable[[], bool], query: Any, seen: list[Any], timeout: float = 90
) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert query.exception() is None, f"{what}: the query failed: {query.exception()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}: last {seen}"
        time.sleep(0.5)


def failure(query: Any, timeout: float = 90) -> BaseException:
    """The exception that stopped ``query`` (which must stop within ``timeout``)."""
    try:
        ended = query.awaitTermination(timeout)
    except Exception as exc:  # noqa: BLE001 - the query's failure is what the test checks
        return exc
    query.stop()
    raise AssertionError(f"the query did not fail (ended={ended})")


@pytest.mark.spark
@pytest.mark.pg
def test_add_column_restart_and_drop_refused_unless_allowed(
    spark: Any, pg_dsn: str, tmp_path: Path
) -> None:
    from changebus.client.spark import ParquetMirror, schema_change_of

    example = load_example()
    sql(pg_dsn, "CREATE TABLE t (id int8 PRIMARY KEY, a text, n int4)")
    cfg = pg_relay_config(tmp_path, pg_dsn, 4 << 20)
    mirror_dir, ck = tmp_path / "mirror", tmp_path / "ck"
    mirror = ParquetMirror(mirror_dir, ["id"])
    schema_log = ck / "_changebus_schemas"
    seen: list[Any] = []  # the last comparison, for a failure's message
    v1, v2, v3 = ["id", "a", "n"], ["id", "a", "n", "c"], ["id", "a", "c"]

    def start(**extra: Any) -> Any:
        return example.start_mirror(
            spark,
            relays=relay.url,
            source="public.t",
            key=["id"],
            mirror=str(mirror_dir),
            checkpoint=str(ck),
            trigger_s=0.3,
            **extra,
        )

    def mirrored(cols: list[str]) -> Callable[[], bool]:
        compared: list[Any] = [None]  # the mirror's pointer at the last comparison

        def check() -> bool:
            pointer = mirror.current()
            if pointer == compared[0]:
                return False  # no new batch: spare Spark a read of the same copy
            try:
                got = mirror_rows(spark, mirror, cols)
            except Exception:  # noqa: BLE001 - a batch replaced the copy while it was read
                return False
            compared[0] = pointer
            want = source_rows(pg_dsn, cols)
            seen[:] = [got, want]
            return got == want

        return check

    with RelayThread(cfg) as relay:
        try:
            relay.wait_streaming()
            sql(
                pg_dsn,
                "INSERT INTO t SELECT i, 'a' || i, i * 10 FROM generate_series(1, 8) i",
                "UPDATE t SET a = 'b' || id WHERE id <= 2",
            )
            caught_up(relay, pg_dsn)

            # 1. ADD COLUMN while the query streams: it stops before the new version's rows
            q = start()
            wait_for("the first copy", mirrored(v1), q, seen)
            assert len(source_rows(pg_dsn, v1)) == 8
            sql(
                pg_dsn, "UPDATE t SET n = n + 1 WHERE id <= 3", "INSERT INTO t VALUES (9, 'a9', 90)"
            )
            before_add = source_rows(pg_dsn, v1)
            sql(
                pg_dsn,
                "ALTER TABLE t ADD COLUMN c text",
                "INSERT INTO t VALUES (10, 'a10', 100, 'c10')",
                "UPDATE t SET c = 'c2' WHERE id = 2",
            )
            exc = failure(q)
            text = str(exc)
            assert schema_change_of(exc) == "schema_changed", text
            assert "public.t v1 -> v2: added ['c']" in text, text
            assert "This is retriable: start the query again" in text, text
            assert str(schema_log) in text
            # no row of the new version was written; every change before it was
            assert mirror_rows(spark, mirror, v1) == before_add
            current = mirror.read(spark)
            assert current is not None and "c" not in current.columns
            assert sorted(p.name for p in schema_log.iterdir()) == [
                "00000000.json",
                "00000001.json",
            ]

            # 2. the documented restart: the new column, old rows null in it
            q = start()
            wait_for("the copy with column c", mirrored(v2), q, seen)
            got = mirror_rows(spark, mirror, v2)
            assert got is not None and got[10][3] == "c10" and got[2][3] == "c2"
            assert sorted(k for k, r in got.items() if r[3] is None) == [1, 3, 4, 5, 6, 7, 8, 9]
            q.stop()

            # 3. DROP COLUMN (while stopped, after more changes of the current version): the
            #    restarted query writes the changes before the drop, then refuses it
            sql(pg_dsn, "UPDATE t SET c = 'c5', n = 55 WHERE id = 5", "DELETE FROM t WHERE id = 6")
            before_drop = source_rows(pg_dsn, v2)
            sql(
                pg_dsn,
                "ALTER TABLE t DROP COLUMN n",
                "UPDATE t SET a = 'dropped' WHERE id = 7",
                "INSERT INTO t VALUES (11, 'a11', 'c11')",
            )
            caught_up(relay, pg_dsn)
            q = start()
            exc = failure(q)
            text = str(exc)
            assert schema_change_of(exc) == "schema_change_refused", text
            assert "public.t v2 -> v3: dropped ['n']" in text, text
            assert "allowSchemaChanges=drop" in text, text
            assert mirror_rows(spark, mirror, v2) == before_drop

            # 4. allowed, through the example job's run_mirror (AvailableNow): the mirror
            #    follows the table (the dropped column goes), and over one more ADD COLUMN
            #    on the way, which run_mirror restarts the query for by itself
            sql(pg_dsn, "ALTER TABLE t ADD COLUMN d int4", "UPDATE t SET d = 8 WHERE id = 8")
            caught_up(relay, pg_dsn)
            example.run_mirror(
                spark,
                relays=relay.url,
                source="public.t",
                key=["id"],
                mirror=str(mirror_dir),
                checkpoint=str(ck),
                available_now=True,
                allow_schema_changes="drop",
            )
            v4 = [*v3, "d"]
            got = mirror_rows(spark, mirror, v4)
            assert got == source_rows(pg_dsn, v4)
            assert got[7][1] == "dropped" and got[11] == (11, "a11", "c11", None)
            assert got[8][3] == 8 and got[5][2] == "c5"
            current = mirror.read(spark)
            assert current is not None and "n" not in current.columns
            # v1, v2, v3 (the refused drop), v4 (the stop run_mirror restarted over)
            assert len(list(schema_log.glob("*.json"))) == 4
        finally:
            for active in spark.streams.active:
                active.stop()


def test_options_diff_and_schema_log(tmp_path: Path) -> None:
    from changebus.client.spark import SourceOptions, schema_change_of
    from changebus.client.spark._schemalog import SchemaLog, diff_tables

    opts = SourceOptions.parse(
        {"relays": "http://127.0.0.1:1", "allowSchemaChanges": "Drop, retype"}
    )
    assert opts.allow_schema_changes == {"drop", "retype"}
    with pytest.raises(ConfigError, match="allowSchemaChanges: unknown kind"):
        SourceOptions.parse({"relays": "http://127.0.0.1:1", "allowSchemaChanges": "rename"})

    old = TableSchema(
        "public.t",
        (
            Column("id", "long", False),
            Column("n", "int"),
            Column("s", "string"),
            Column("f", "float"),
        ),
        ("id",),
        1,
    )
    new = TableSchema(
        "public.t",
        (
            Column("id", "long", False),
            Column("n", "long"),
            Column("s", "int"),
            Column("c", "string"),
        ),
        ("id",),
        2,
    )
    change = diff_tables(old, new)
    assert change.added == ("c",) and change.dropped == ("f",)
    assert change.widened == (("n", "int", "bigint"),)
    assert change.retyped == (("s", "string", "int"),)
    assert change.needs == {"drop", "retype"}
    assert diff_tables(old, old.with_version(3)).empty

    log = SchemaLog(tmp_path / "s", ("public.t",), ())
    assert log.latest() is None
    log.append({"public.t": old})
    entry = log.append({"public.t": new}, {"pg": 100}, (change,))
    back = log.latest()
    assert back is not None and back.seq == entry.seq == 1
    assert back.tables["public.t"] == new and back.changes == (change,)
    assert back.pending({"pg": 100}) and not back.pending({"pg": 101})
    with pytest.raises(ConfigError, match="belongs to a query of sources"):
        SchemaLog(tmp_path / "s", ("public.other",), ()).latest()

    assert schema_change_of(SchemaChangedError("x")) == "schema_changed"
    assert schema_change_of(RuntimeError("... SchemaChangeRefusedError: no")) == (
        "schema_change_refused"
    )
    assert schema_change_of(RuntimeError("other")) is None
    assert SchemaChangedError("x").retriable and not SchemaChangeRefusedError("x").retriable


def _schemas() -> tuple[TableSchema, TableSchema, TableSchema]:
    key = (Column("id", "long", False),)
    t1 = TableSchema("s.t", (*key, Column("a", "string"), Column("n", "int")), ("id",), 1)
    t2 = TableSchema("s.t", (*t1.columns, Column("c", "string")), ("id",), 2)
    t3 = TableSchema("s.t", (*key, Column("a", "string"), Column("c", "string")), ("id",), 3)
    return t1, t2, t3


async def test_driver_cuts_batches_at_the_change_and_logs_it(
    scripted_relay: Any, window_type: Any, tmp_path: Path
) -> None:
    """The driver side alone against a scripted relay: v1 at 10, 20; v2 at 30, 40; v3 at 50."""
    import asyncio

    import pyarrow as pa
    from pyspark.sql.pandas.types import from_arrow_schema
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    from changebus.client.spark import _source
    from changebus.client.spark._evolution import SchemaGuard
    from changebus.client.spark._options import SourceOptions
    from changebus.client.spark._relay import run_sync
    from changebus.client.spark._schemalog import SchemaLog
    from changebus.schemas import Op

    t1, t2, t3 = _schemas()
    w = window_type
    windows = [
        w(10, rows=[(t1, 1, Op.INSERT, {"id": 1, "a": "x", "n": 1}, None)], announce=[(1, t1)]),
        w(20, rows=[(t1, 1, Op.INSERT, {"id": 2, "a": "y", "n": 2}, None)]),
        w(
            30,
            rows=[(t2, 1, Op.INSERT, {"id": 3, "a": "z", "n": 3, "c": "c3"}, None)],
            announce=[(1, t2)],
        ),
        w(40, rows=[(t2, 1, Op.UPDATE, {"id": 1, "a": "x", "n": 1, "c": "c1"}, None)]),
        w(50, rows=[(t3, 1, Op.INSERT, {"id": 4, "a": "w", "c": "c4"}, None)], announce=[(1, t3)]),
    ]
    where = tmp_path / "schemas"
    SchemaLog(where, ("s.t",), ()).append({"s.t": t1})  # the query was defined at v1
    async with scripted_relay(windows) as relay:

        def reader(**extra: str) -> Any:
            opts = SourceOptions.parse(
                {"relays": relay.url, "sources": "s.t", "schemaTrackingLocation": str(where)}
                | extra
            )
            schema = from_arrow_schema(_source.source_schema(opts), prefer_timestamp_ntz=True)
            return _source.ChangebusStreamReader(opts, schema)

        def plan() -> None:
            r = reader()
            assert "c" not in r.arrow_schema.names
            assert r.latestOffset({"syn": 9}, ReadAllAvailable()) == {"syn": 20}  # cut before v2
            with pytest.raises(SchemaChangedError, match=r"s.t v1 -> v2: added \['c'\]") as info:
                r.latestOffset({"syn": 20}, ReadAllAvailable())
            assert info.value.retriable and info.value.details["at"] == {"syn": 20}

            r = reader()  # the restart: the new column; rows of v1 read null in it
            assert "c" in r.arrow_schema.names
            assert r.latestOffset({"syn": 20}, ReadAllAvailable()) == {"syn": 40}  # cut before v3
            rows = pa.Table.from_batches(
                [b for p in r.partitions({"syn": 9}, {"syn": 40}) for b in r.read(p)]
            ).to_pylist()
            assert [(x["id"], x["n"], x["c"]) for x in rows] == [
                (1, 1, None),
                (2, 2, None),
                (3, 3, "c3"),
                (1, 1, "c1"),
            ]
            with pytest.raises(SchemaChangeRefusedError, match=r"dropped \['n'\]") as refused:
                r.latestOffset({"syn": 40}, ReadAllAvailable())
            assert not refused.value.retriable
            assert "allowSchemaChanges=drop" in str(refused.value)
            with pytest.raises(SchemaChangeRefusedError):  # the log remembers the refusal
                reader().latestOffset({"syn": 40}, ReadAllAvailable())
            r = reader(allowSchemaChanges="drop")
            assert "n" not in r.arrow_schema.names
            assert r.latestOffset({"syn": 40}, ReadAllAvailable()) == {"syn": 50}
            assert len(list(where.glob("*.json"))) == 3

            # without a log: the same stop, and the message says what a restart takes
            plain = SourceOptions.parse({"relays": relay.url, "sources": "s.t"})
            guard = SchemaGuard(plain, {"s.t": t1})
            with pytest.raises(SchemaChangedError, match="set the option schemaTrackingLocation"):
                run_sync(guard.check({"syn": 20}, {"syn": 50}, set()))
            assert run_sync(guard.check({"syn": 10}, {"syn": 50}, set())) == {"syn": 20}
            guard = SchemaGuard(plain, {"s.t": t3})  # the newest: nothing to do
            assert run_sync(guard.check({"syn": 9}, {"syn": 50}, set())) == {"syn": 50}

            # the range was evicted while the driver scanned it: with a bootstrap server the
            # batch would read it there, newer rows and all (it cannot be cut): it stops
            booted = SourceOptions.parse(
                {"relays": relay.url, "sources": "s.t", "bootstrapUrl": "http://127.0.0.1:9"}
            )
            guard = SchemaGuard(booted, {"s.t": t1})
            with pytest.raises(SchemaChangedError, match=r"s.t v1 -> v3"):  # (the newest)
                run_sync(guard.check({"syn": 5}, {"syn": 50}, set()))
            # a batch replayed after a restart (not planned by latestOffset here) whose
            # range the relay evicted meanwhile goes through the bootstrap server: held
            # against the guard too (its snapshot rows come at their newest version)
            replay = _source.ChangebusStreamReader(
                booted, from_arrow_schema(_source.source_schema(booted), prefer_timestamp_ntz=True)
            )
            replay._guard = SchemaGuard(booted, {"s.t": t1})
            with pytest.raises(SchemaChangedError, match=r"s.t v1 -> v3"):
                replay.partitions({"syn": 5}, {"syn": 20})
            # (without one the batch's read fails on the evicted range: failOnDataLoss)
            guard = SchemaGuard(plain, {"s.t": t1})
            assert run_sync(guard.check({"syn": 5}, {"syn": 50}, set())) == {"syn": 50}

        await asyncio.to_thread(plan)


async def test_a_version_adding_only_type_annotations_does_not_stop_the_query(
    scripted_relay: Any, window_type: Any, tmp_path: Path
) -> None:
    """A version whose column types differ only in the annotations a Postgres fetcher
    began to record (``changebus.kind`` / ``changebus.bound`` of composites and ranges:
    the first version it registers after its upgrade) is harmless: the query reads past it
    with its schema, every row. It stopped every stream of such a table once, with
    SchemaChangedError and no change listed (review)."""
    import asyncio

    import pyarrow as pa
    from pyspark.sql.pandas.types import from_arrow_schema
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    from changebus.client.spark import _source
    from changebus.client.spark._options import SourceOptions
    from changebus.client.spark._schemalog import SchemaLog
    from changebus.schemas import Op

    def column(name: str, of: str, **notes: str) -> Column:
        items = {"type": "string", "changebus.type": of, **notes}
        return Column(name, {"type": "array", "items": ["null", items]} if name == "rs" else items)

    key = Column("id", "long", False)
    t1 = TableSchema(
        "s.t",
        (key, column("r", "int4range"), column("c", "pair"), column("rs", "int4range")),
        ("id",),
        1,
    )
    bound = {"changebus.kind": "range", "changebus.bound": "integer"}
    t2 = TableSchema(
        "s.t",
        (
            key,
            column("r", "int4range", **bound),
            column("c", "pair", **{"changebus.kind": "composite"}),
            column("rs", "int4range", **bound),
        ),
        ("id",),
        2,
    )
    assert t1.fingerprint != t2.fingerprint
    row = {"id": 1, "r": "[1,5)", "c": '(1,"a,b")', "rs": ["[1,2)", None]}
    w = window_type
    windows = [
        w(10, rows=[(t1, 1, Op.INSERT, row, None)], announce=[(1, t1)]),
        w(20, rows=[(t2, 1, Op.INSERT, {**row, "id": 2}, None)], announce=[(1, t2)]),
        w(30, rows=[(t2, 1, Op.UPDATE, {**row, "r": "empty"}, None)]),
    ]
    where = tmp_path / "schemas"
    SchemaLog(where, ("s.t",), ()).append({"s.t": t1})  # the query was defined at v1
    async with scripted_relay(windows) as relay:

        def plan() -> None:
            opts = SourceOptions.parse(
                {"relays": relay.url, "sources": "s.t", "schemaTrackingLocation": str(where)}
            )
            schema = from_arrow_schema(_source.source_schema(opts), prefer_timestamp_ntz=True)
            r: Any = _source.ChangebusStreamReader(opts, schema)
            assert r.latestOffset({"syn": 9}, ReadAllAvailable()) == {"syn": 30}  # not cut
            rows = pa.Table.from_batches(
                [b for p in r.partitions({"syn": 9}, {"syn": 30}) for b in r.read(p)]
            ).to_pylist()
            assert [(x["id"], x["r"], x["c"], x["rs"]) for x in rows] == [
                (1, "[1,5)", '(1,"a,b")', ["[1,2)", None]),
                (2, "[1,5)", '(1,"a,b")', ["[1,2)", None]),
                (1, "empty", '(1,"a,b")', ["[1,2)", None]),
            ]
            assert len(list(where.glob("*.json"))) == 1  # no new entry in the schema log

        await asyncio.to_thread(plan)


@pytest.mark.spark
@pytest.mark.pg
def test_a_version_between_load_and_start_stops_the_query(
    spark: Any, pg_dsn: str, tmp_path: Path
) -> None:
    """Spark asks for the schema at load() and hands it back at start(), where the reader
    read the tables again: a new column in between was the guard's baseline but not the
    query's, and its values were dropped silently (found by review). The schema of load()
    is marked, and the reader stops with the retriable SchemaChangedError; a schema the
    user gives is theirs (not marked, not checked)."""
    from changebus.client.spark import schema_change_of
    from changebus.client.spark._evolution import MARK

    sql(pg_dsn, "CREATE TABLE t (id int8 PRIMARY KEY, a text)", "INSERT INTO t VALUES (1, 'x')")
    cfg = pg_relay_config(tmp_path, pg_dsn, 4 << 20)
    with RelayThread(cfg) as relay:
        relay.wait_streaming()
        sql(pg_dsn, "INSERT INTO t VALUES (2, 'y')")
        caught_up(relay, pg_dsn)

        def load(**schema: Any) -> Any:
            reader = spark.readStream.format("changebus")
            if schema:
                reader = reader.schema(schema["schema"])
            return (
                reader.option("relays", relay.url)
                .option("sources", "public.t")
                .option("startingScn", "earliest")
                .load()
            )

        df = load()
        assert MARK in df.schema.fields[0].metadata
        assert "c" not in df.columns
        user = load(schema="id long, a string")  # the user's own subset: theirs
        sql(pg_dsn, "ALTER TABLE t ADD COLUMN c text", "INSERT INTO t VALUES (3, 'z', 'c3')")
        caught_up(relay, pg_dsn)
        q = df.writeStream.format("memory").queryName("stale").start()
        try:
            exc = failure(q)
        finally:
            q.stop()
        text = str(exc)
        assert schema_change_of(exc) == "schema_changed", text
        assert "between the DataFrame's load() and the query's start" in text, text
        q = user.writeStream.format("memory").queryName("subset").start()
        try:
            q.processAllAvailable()
            assert q.exception() is None
        finally:
            q.stop()
        assert sorted(tuple(r) for r in spark.sql("SELECT id, a FROM subset").collect()) == [
            (2, "y"),
            (3, "z"),
        ]
        q = load().writeStream.format("memory").queryName("fresh").start()  # loaded again
        try:
            q.processAllAvailable()
            assert q.exception() is None
        finally:
            q.stop()
        rows = spark.sql("SELECT id, a, c FROM fresh").collect()
        assert sorted(tuple(r) for r in rows) == [(2, "y", None), (3, "z", "c3")]


async def test_a_range_evicted_while_a_limited_batch_is_planned_goes_to_the_bootstrap_server(
    scripted_relay: Any, window_type: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a read limit the driver scans the batch's range after reading the bounds; the
    relay evicting its start in between raised FellOffRelayError and the query died,
    although a bootstrap server was configured (found by review). The batch now goes
    through the bootstrap server, planned as one task."""
    import asyncio
    import dataclasses

    from pyspark.sql.pandas.types import from_arrow_schema
    from pyspark.sql.streaming.datasource import ReadMaxRows

    from changebus.client import FellOffRelayError
    from changebus.client.spark import _source
    from changebus.client.spark._options import SourceOptions
    from changebus.schemas import Op

    t1, _t2, _t3 = _schemas()
    windows = [
        window_type(
            scn,
            rows=[(t1, 1, Op.INSERT, {"id": scn, "a": "x", "n": 1}, None)],
            announce=[(1, t1)] if scn == 10 else [],
        )
        for scn in (10, 20, 30, 40, 50)
    ]
    async with scripted_relay(windows) as relay:
        from changebus.client.spark._relay import partition_bounds as real_bounds

        scans: list[int] = []

        async def evicted_scan(opts: Any, name: str, since: int, *a: Any, **k: Any) -> Any:
            scans.append(since)
            raise FellOffRelayError(
                "evicted",
                partition=name,
                requested_scn=since,
                oldest_scn=40,
                prev_scn=30,
                relay="r",
            )

        async def bounds_after(opts: Any) -> Any:  # the second look sees the eviction
            found = await real_bounds(opts)
            if scans:
                found = {n: dataclasses.replace(b, prev_scn=30) for n, b in found.items()}
            return found

        async def target(opts: Any, name: str) -> int:
            return 50

        monkeypatch.setattr(_source, "end_within", evicted_scan)
        monkeypatch.setattr(_source, "partition_bounds", bounds_after)
        monkeypatch.setattr(_source, "bootstrap_target", target)

        from changebus.client.spark import ScnRangePartition

        def plan() -> None:
            opts = SourceOptions.parse(
                {"relays": relay.url, "sources": "s.t", "bootstrapUrl": "http://127.0.0.1:9"}
                | {"numPartitions": "4"}
            )
            schema = from_arrow_schema(_source.source_schema(opts), prefer_timestamp_ntz=True)
            reader = _source.ChangebusStreamReader(opts, schema)
            end = reader.latestOffset({"syn": 20}, ReadMaxRows(1))
            assert end == {"syn": 50} and scans == [20]
            (part,) = reader.partitions({"syn": 20}, end)  # one task: it may bootstrap
            assert (
                isinstance(part, ScnRangePartition)
                and part.spec.may_bootstrap
                and (part.spec.since, part.spec.until) == (20, 50)
            )

        await asyncio.to_thread(plan)


async def test_a_replayed_relay_batch_holding_a_newer_version_stops_and_logs_it(
    scripted_relay: Any, window_type: Any, tmp_path: Path
) -> None:
    """A batch planned without seeing v2 (a lagging relay answered the driver's scan) and
    logged, then replayed after a restart: Spark does not plan it again, so only its
    executors met the v2 rows and refused them, on every replay, and the schema log never
    learnt v2 (review). The replay is held against the guard: it stops and logs v2, and
    the next start reads the batch with the new column."""
    import asyncio

    import pyarrow as pa
    from pyspark.sql.pandas.types import from_arrow_schema

    from changebus.client.spark import _source
    from changebus.client.spark._options import SourceOptions
    from changebus.client.spark._schemalog import SchemaLog
    from changebus.schemas import Op

    t1, t2, _t3 = _schemas()
    w = window_type
    windows = [
        w(10, rows=[(t1, 1, Op.INSERT, {"id": 1, "a": "x", "n": 1}, None)], announce=[(1, t1)]),
        w(
            30,
            rows=[(t2, 1, Op.INSERT, {"id": 3, "a": "z", "n": 3, "c": "c3"}, None)],
            announce=[(1, t2)],
        ),
    ]
    where = tmp_path / "schemas"
    SchemaLog(where, ("s.t",), ()).append({"s.t": t1})
    async with scripted_relay(windows) as relay:

        def reader() -> Any:
            opts = SourceOptions.parse(
                {"relays": relay.url, "sources": "s.t", "schemaTrackingLocation": str(where)}
            )
            schema = from_arrow_schema(_source.source_schema(opts), prefer_timestamp_ntz=True)
            return _source.ChangebusStreamReader(opts, schema)

        def replay() -> list[dict[str, Any]]:
            with pytest.raises(SchemaChangedError, match=r"s.t v1 -> v2: added \['c'\]"):
                reader().partitions({"syn": 9}, {"syn": 30})  # (logged before the restart)
            r = reader()  # the next start: v2 logged
            assert "c" in r.arrow_schema.names
            parts = r.partitions({"syn": 9}, {"syn": 30})
            got: list[dict[str, Any]] = pa.Table.from_batches(
                [b for p in parts for b in r.read(p)]
            ).to_pylist()
            return got

        rows = await asyncio.to_thread(replay)
    assert [(x["id"], x["c"]) for x in rows] == [(1, None), (3, "c3")]
    assert len(list(where.glob("*.json"))) == 2
