"""format("changebus") with a bootstrap server: earliest = snapshot + live, and recovery.

Postgres -> relay with a tiny buffer (it evicts the early windows) ->
bootstrap server -> Spark (AvailableNow) -> Parquet mirror (the example job).
The mirror must equal the source table row by row

1. after a first run from ``startingScn=earliest`` when the relay no longer
   holds the first windows (the first micro-batch reads the snapshot), and
2. after a restart from the Spark checkpoint whose position the relay has
   evicted meanwhile (the batch is recovered through the bootstrap server,
   where without it the query would fail with failOnDataLoss).
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import test_spark_pg as base

from changebus.bootstrap import (
    BootstrapConfig,
    BootstrapServer,
    HttpConfig as BootHttp,
    StoreConfig,
)
from changebus.fetchers.postgres import message_scn
from fix_spark import RelayThread, pg_relay_config

pytestmark = [pytest.mark.spark, pytest.mark.pg, pytest.mark.timeout(600)]

TINY = 256 << 10  # relay buffer: a few hundred windows


def marker(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_logical_emit_message(false, 'sync', 'x')::text").fetchone()
    assert row is not None
    return message_scn(row[0])


def served(url: str, route: str) -> int:
    """How many requests of ``route`` the bootstrap server answered with 200 (its /metrics)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = 0
    for line in text.splitlines():
        if (
            line.startswith("changebus_bootstrap_http_requests")
            and f'route="{route}"' in line
            and 'status="200"' in line
        ):
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


def wait_for(pred: Any, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@contextlib.contextmanager
def relay_and_bootstrap(
    pg_dsn: str, tmp_path: Path
) -> Iterator[tuple[RelayThread, BootstrapServer, Callable[[int, int], int]]]:
    """The table created, a tiny-buffer relay and a bootstrap server reading it, and
    ``load(seed, txns)``: a workload, then its marker's SCN once both hold it."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(base.TABLE)
    with RelayThread(pg_relay_config(tmp_path, pg_dsn, TINY)) as relay:
        wait_for(lambda: relay.state("pg") == "streaming", "the relay")
        bcfg = BootstrapConfig(
            relays=(relay.url,),
            data_dir=tmp_path / "boot",
            store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
            http=BootHttp(port=0),
        )

        async def make() -> BootstrapServer:
            server = BootstrapServer(bcfg)
            await server.start()
            return server

        boot = relay.call(make())
        try:
            worker = boot.service.workers["pg"]

            def load(seed: int, txns: int) -> int:
                base.workload(pg_dsn, seed, txns)
                m = marker(pg_dsn)
                wait_for(lambda: relay.meta("pg").last_scn >= m, "the relay")
                wait_for(lambda: worker.applier_scn >= m, "the bootstrap server")
                return m

            yield relay, boot, load
        finally:
            relay.call(boot.stop())


def test_earliest_snapshots_and_an_evicted_checkpoint_recovers(
    spark: Any, pg_dsn: str, tmp_path: Path
) -> None:
    from changebus.client.spark import ParquetMirror

    example = base.load_example()
    mirror_dir, ck = tmp_path / "mirror", tmp_path / "ck"
    with relay_and_bootstrap(pg_dsn, tmp_path) as (relay, boot, load):
        first_scn = relay.relay.hosts["pg"].status()["max_scn"]
        load(1, 700)
        status = relay.relay.hosts["pg"].status()
        assert status["prev_scn"] > first_scn  # the early windows are gone from the relay

        def run(max_rows: int) -> None:
            q = example.start_mirror(
                spark,
                relays=relay.url,
                source="public.acct",
                key=["id"],
                mirror=str(mirror_dir),
                checkpoint=str(ck),
                available_now=True,
                max_rows_per_trigger=max_rows,
                bootstrap=boot.url,
            )
            assert q.awaitTermination(300)
            assert q.exception() is None

        mirror = ParquetMirror(mirror_dir, ["id"])
        run(400)  # the first batch is the snapshot, then row-limited relay batches
        expected = base.source_rows(pg_dsn)
        assert len(expected) > 20
        assert base.mirror_rows(spark, mirror) == expected
        first = mirror.current()
        assert first is not None
        snapshots = served(boot.url, "/v1/bootstrap/snapshot")
        assert snapshots >= 1  # the first batch came from the bootstrap server

        # a batch read from earliest: snapshot + log; its last change per key = the table
        rows = (
            spark.read.format("changebus")
            .option("relays", relay.url)
            .option("bootstrapUrl", boot.url)
            .option("sources", "public.acct")
            .load()
            .collect()
        )
        assert served(boot.url, "/v1/bootstrap/snapshot") > snapshots
        snapshots = served(boot.url, "/v1/bootstrap/snapshot")
        last: dict[int, Any] = {}
        for r in sorted(rows, key=lambda r: (r["_commit_scn"], r["_txn_seq"])):
            if r["_change_type"] != "update_preimage":
                last[r["id"]] = r
        cols = ["id", "bal", "name", "born", "seen", "tags", "doc", "flag", "u", "small"]
        got = {}
        for k, r in last.items():
            if r["_change_type"] == "delete":
                continue
            v = [r[c] for c in cols]
            v[4] = v[4].timestamp() if v[4] is not None else None
            got[k] = base.normalise(v)
        assert got == expected

        # the query is stopped; the relay evicts its checkpoint position meanwhile
        offsets = sorted(
            (p for p in (ck / "offsets").iterdir() if p.name.isdigit()),
            key=lambda p: int(p.name),
        )
        last_offset = int(json.loads(offsets[-1].read_text().splitlines()[-1])["pg"])
        load(2, 700)
        assert relay.relay.hosts["pg"].status()["prev_scn"] > last_offset
        run(0)  # restart from the checkpoint: recovered through the bootstrap server
        assert base.mirror_rows(spark, mirror) == base.source_rows(pg_dsn)
        second = mirror.current()
        assert second is not None and second["batch_id"] > first["batch_id"]
        assert served(boot.url, "/v1/bootstrap/snapshot") > snapshots  # recovered there


def test_an_evicted_scn_sub_range_is_read_from_the_bootstrap_log(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A task of one SCN sub-range (splitBy=scn) whose start the relays evicted during the
    batch reads the same windows from the bootstrap server's log (mode=catchup), never a
    snapshot: its rows equal what the relay gave for the range before the eviction. Once
    the bootstrap server pruned that part of its log too, the task fails and says so; it
    used to fail as soon as the relays evicted the start. (Tasks read as executors do; no
    Spark needed.)"""
    from changebus.client import FellOffRelayError
    from changebus.client.spark._evolution import query_tables
    from changebus.client.spark._options import SourceOptions
    from changebus.client.spark._read import RangeSpec, read_range
    from changebus.client.spark._source import source_schema
    from changebus.schemas import BootstrapFailedError

    with relay_and_bootstrap(pg_dsn, tmp_path) as (relay, boot, load):
        since = load(1, 50)
        until = load(2, 60)
        plain = SourceOptions.parse({"relays": relay.url, "sources": "public.acct"})
        booted = SourceOptions.parse(
            {"relays": relay.url, "sources": "public.acct", "bootstrapUrl": boot.url}
        )
        schema = source_schema(plain)
        tables = query_tables(plain, ["pg"])
        spec = RangeSpec("pg", since, until, may_bootstrap=False)

        def rows(opts: SourceOptions) -> list[tuple[Any, ...]]:
            out: list[tuple[Any, ...]] = []
            for batch in read_range(opts, spec, schema, tables):
                d = batch.to_pydict()
                out.extend(zip(*(d[n] for n in schema.names), strict=True))
            return out

        before = rows(plain)  # the relay still holds the range
        assert len(before) >= 60
        assert {r[schema.names.index("_commit_scn")] for r in before} <= set(
            range(since + 1, until + 1)
        )
        load(3, 700)
        assert relay.relay.hosts["pg"].status()["prev_scn"] > until  # all of it evicted
        with pytest.raises(FellOffRelayError):
            rows(plain)
        snapshots = served(boot.url, "/v1/bootstrap/snapshot")
        catchups = served(boot.url, "/v1/bootstrap/catchup")
        assert rows(booted) == before  # the same rows, in the same order
        assert served(boot.url, "/v1/bootstrap/catchup") > catchups
        assert served(boot.url, "/v1/bootstrap/snapshot") == snapshots  # never a snapshot

        # the bootstrap server prunes its log past the range's start: the task fails
        pruned = relay.call(boot.service.stores.write(lambda s: s.prune_log("pg", since + 1)))
        assert pruned > 0
        with pytest.raises(BootstrapFailedError, match="no longer holds it either"):
            rows(booted)
        assert served(boot.url, "/v1/bootstrap/snapshot") == snapshots
