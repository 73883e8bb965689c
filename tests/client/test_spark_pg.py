"""Postgres -> relay -> format("changebus") -> Parquet mirror (the example job), row by row.

The mirror is kept by deploy/spark/parquet_mirror.py (ParquetMirror, MERGE-style
upserts in foreachBatch); after catching up it must equal the source table,
and again after more changes (a TRUNCATE among them) and a restart from the
Spark checkpoint.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import random
import time
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest

from changebus.fetchers.postgres import message_scn
from fix_spark import ROOT, RelayThread, pg_relay_config

pytestmark = [pytest.mark.spark, pytest.mark.pg, pytest.mark.timeout(600)]

TABLE = """CREATE TABLE acct (
    id int8 PRIMARY KEY, bal numeric(12, 2), name text, born date, seen timestamptz,
    tags text[], doc jsonb, flag boolean, u uuid, small int4)"""


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location(
        "parquet_mirror", ROOT / "deploy" / "spark" / "parquet_mirror.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def workload(dsn: str, seed: int, txns: int, *, truncate_first: bool = False) -> None:
    rnd = random.Random(seed)
    with psycopg.connect(dsn, autocommit=True) as conn:
        if truncate_first:
            conn.execute("TRUNCATE acct")
        for _ in range(txns):
            with conn.transaction():
                for _ in range(rnd.randint(1, 5)):
                    k = rnd.randint(1, 60)
                    r = rnd.random()
                    row = (
                        k,
                        Decimal(rnd.randint(-99999, 99999)) / 100,
                        rnd.choice([None, f"n{k}", "äö"]),
                        dt.date(2000, 1, 1) + dt.timedelta(days=rnd.randint(0, 9000)),
                        dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
                        + dt.timedelta(seconds=rnd.randint(0, 10**8)),
                        [f"t{rnd.randint(0, 5)}" for _ in range(rnd.randint(0, 3))],
                        json.dumps({"k": k, "v": rnd.random()}),
                        rnd.random() < 0.5,
                        uuid.UUID(int=rnd.getrandbits(128)),
                        rnd.randint(-(2**31), 2**31 - 1),
                    )
                    if r < 0.55:
                        conn.execute(
                            "INSERT INTO acct VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s) ON CONFLICT (id) DO UPDATE"
                            " SET bal = EXCLUDED.bal, name = EXCLUDED.name, tags = EXCLUDED.tags",
                            row,
                        )
                    elif r < 0.85:
                        conn.execute(
                            "UPDATE acct SET bal = bal + 1, flag = NOT flag WHERE id = %s", (k,)
                        )
                    else:
                        conn.execute("DELETE FROM acct WHERE id = %s", (k,))


def caught_up(relay: RelayThread, dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        marker = conn.execute("SELECT pg_logical_emit_message(false, 'sync', 'x')::text").fetchone()
    assert marker is not None
    target = message_scn(marker[0])
    deadline = time.monotonic() + 60
    while relay.meta("pg").last_scn < target:
        assert time.monotonic() < deadline, "the relay did not catch up"
        time.sleep(0.05)


def source_rows(dsn: str) -> dict[int, tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT id, bal, name, born, seen, tags, doc, flag, u, small FROM acct")
        return {r[0]: normalise(r) for r in rows}


def normalise(r: Any) -> tuple[Any, ...]:
    id_, bal, name, born, seen, tags, doc, flag, u, small = r
    return (
        id_,
        bal,
        name,
        born,
        seen.timestamp() if isinstance(seen, dt.datetime) else seen,
        list(tags) if tags is not None else None,
        doc if isinstance(doc, dict) else json.loads(doc) if doc is not None else None,
        flag,
        str(u) if u is not None else None,
        small,
    )


def mirror_rows(spark: Any, mirror: Any) -> dict[int, tuple[Any, ...]]:
    df = mirror.read(spark)
    assert df is not None
    cols = ["id", "bal", "name", "born", "seen", "tags", "doc", "flag", "u", "small"]
    out = {}
    for row in df.select(*cols).collect():
        r = list(row)
        # Spark hands out naive datetimes in the Python process's local time zone
        r[4] = r[4].timestamp() if r[4] is not None else None
        out[r[0]] = normalise(r)
    return out


def test_parquet_mirror_equals_the_table_across_restart(
    spark: Any, pg_dsn: str, tmp_path: Path
) -> None:
    from changebus.client.spark import ParquetMirror

    example = load_example()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(TABLE)
    cfg = pg_relay_config(tmp_path, pg_dsn, 16 << 20)
    mirror_dir, ck = tmp_path / "mirror", tmp_path / "ck"
    with RelayThread(cfg) as relay:
        relay.wait_streaming()
        workload(pg_dsn, 1, 120)
        caught_up(relay, pg_dsn)
        df = (
            spark.readStream.format("changebus")
            .option("relays", relay.url)
            .option("sources", "public.acct")
            .load()
        )
        types = {f.name: f.dataType.simpleString() for f in df.schema.fields}
        assert types == {
            "id": "bigint",
            "bal": "decimal(12,2)",
            "name": "string",
            "born": "date",
            "seen": "timestamp",
            "tags": "array<string>",
            "doc": "string",
            "flag": "boolean",
            "u": "string",
            "small": "int",
            "_change_type": "string",
            "_commit_scn": "bigint",
            "_commit_timestamp": "timestamp",
            "_txn_seq": "bigint",
            "_source": "string",
            "_partition": "string",
        }

        def run() -> None:
            q = example.start_mirror(
                spark,
                relays=relay.url,
                source="public.acct",
                key=["id"],
                mirror=str(mirror_dir),
                checkpoint=str(ck),
                available_now=True,
                max_rows_per_trigger=150,
            )
            assert q.awaitTermination(300)
            assert q.exception() is None

        run()
        mirror = ParquetMirror(mirror_dir, ["id"])
        first = mirror.current()
        expected = source_rows(pg_dsn)
        assert len(expected) > 20
        assert mirror_rows(spark, mirror) == expected
        assert first is not None and first["batch_id"] >= 2  # several batches (row limit)

        workload(pg_dsn, 2, 80, truncate_first=True)
        caught_up(relay, pg_dsn)
        run()  # restart from the checkpoint
        second = mirror.current()
        expected = source_rows(pg_dsn)
        assert mirror_rows(spark, mirror) == expected
        assert second is not None and second["batch_id"] > first["batch_id"]


def test_not_sent_column_byte_limit_and_min_rows(spark: Any, pg_dsn: str, tmp_path: Path) -> None:
    """includeNotSent names unchanged TOAST values; maxBytesPerTrigger and minRowsPerTrigger."""
    big = {k: uuid.UUID(int=random.Random(k).getrandbits(128)).hex * 400 for k in range(1, 6)}
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE doc (id int8 PRIMARY KEY, n int4, body text)")
        conn.execute("ALTER TABLE doc ALTER body SET STORAGE EXTERNAL")  # TOASTed, uncompressed
    cfg = pg_relay_config(tmp_path, pg_dsn, 16 << 20)
    with RelayThread(cfg) as relay:
        relay.wait_streaming()
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for k, body in big.items():  # one transaction each, ~12.8 kB of body
                conn.execute("INSERT INTO doc VALUES (%s, 0, %s)", (k, body))
            for k in big:
                conn.execute("UPDATE doc SET n = n + 1 WHERE id = %s", (k,))  # body not sent
        caught_up(relay, pg_dsn)

        def reader() -> Any:
            return (
                spark.readStream.format("changebus")
                .option("relays", relay.url)
                .option("sources", "public.doc")
                .option("includeNotSent", "true")
            )

        df = reader().option("startingScn", "earliest").option("maxBytesPerTrigger", "30000").load()
        assert df.schema.fields[-1].name == "_not_sent"
        assert df.schema.fields[-1].dataType.simpleString() == "array<string>"
        batches: list[list[Any]] = []
        q = (
            df.writeStream.foreachBatch(lambda b, _: batches.append(b.collect()))
            .option("checkpointLocation", str(tmp_path / "ck"))
            .trigger(availableNow=True)
            .start()
        )
        assert q.awaitTermination(300) and q.exception() is None
        rows = [r.asDict() for b in batches for r in b]
        inserts = {r["id"]: r for r in rows if r["_change_type"] == "insert"}
        updates = {r["id"]: r for r in rows if r["_change_type"] == "update_postimage"}
        assert len(rows) == 2 * len(big) and set(inserts) == set(updates) == set(big)
        for k, body in big.items():
            assert inserts[k]["body"] == body and inserts[k]["_not_sent"] == []
            assert updates[k]["n"] == 1 and updates[k]["body"] is None
            assert updates[k]["_not_sent"] == ["body"]
        # ~12.8 kB per insert transaction, 30 kB a batch: two inserts a batch at most;
        # every batch holds whole transactions only
        inserted = [sum(r["_change_type"] == "insert" for r in b) for b in batches if b]
        assert len(inserted) >= 3 and max(inserted) == 2
        assert all(len({r["_commit_scn"] for r in b}) == len(b) for b in batches)

        # minRowsPerTrigger: fewer rows than the minimum wait (the delay is long)
        seen: list[list[Any]] = []
        q = (
            reader()
            .option("minRowsPerTrigger", "5")
            .option("maxTriggerDelay", "1h")
            .load()
            .writeStream.foreachBatch(lambda b, _: seen.append(b.collect()))
            .option("checkpointLocation", str(tmp_path / "ck2"))
            .trigger(processingTime="200 milliseconds")
            .start()
        )
        try:
            deadline = time.monotonic() + 60
            while q.lastProgress is None:  # the first trigger (never skipped) has run
                assert time.monotonic() < deadline and q.exception() is None
                time.sleep(0.1)
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                for k in range(1, 5):
                    conn.execute("UPDATE doc SET n = n + 1 WHERE id = %s", (k,))
            caught_up(relay, pg_dsn)
            time.sleep(2)  # ten triggers: each finds 4 < 5 rows
            assert [r for b in seen for r in b] == []
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute("UPDATE doc SET n = n + 1 WHERE id = 5")
            deadline = time.monotonic() + 60
            while not any(seen):
                assert time.monotonic() < deadline and q.exception() is None
                time.sleep(0.1)
            got = [r for b in seen for r in b]
            assert sorted(r["id"] for r in got) == [1, 2, 3, 4, 5]  # one batch of all five
            assert all(r["_not_sent"] == ["body"] for r in got)
        finally:
            q.stop()
