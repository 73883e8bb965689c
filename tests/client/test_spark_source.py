"""format("changebus") in a real local Spark against real relays (scripted and synthetic).

Every test compares what Spark delivered with what the relay holds (read with
the client library): same changes, each exactly once, in whole transactions.
The relays, scripts and readers are in spark_source_support.py.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from spark_source_support import (  # noqa: F401 - scripted: a fixture the tests take
    COLS,
    as_changes,
    collect_stream,
    project,
    relay_config,
    scripted,
    truth,
    wait_finished,
)

from changebus.client import ConsumerConfig, SyncConsumer
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, RelayConfig
from fix_spark import RelayThread

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]


def test_available_now_row_limit_whole_transactions(
    spark: Any,
    scripted: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    relay, sizes = scripted(80, seed=3)
    expected = project(truth(relay.url), COLS)
    df = (
        spark.readStream.format("changebus")
        .option("relays", relay.url)
        .option("startingScn", "earliest")
        .option("maxRowsPerTrigger", "10")
        .option("numPartitions", "2")
        .load()
    )
    assert df.columns == [
        *COLS,
        "_change_type",
        "_commit_scn",
        "_commit_timestamp",
        "_txn_seq",
        "_source",
        "_partition",
    ]
    q, batches = collect_stream(spark, df, tmp_path / "ck", availableNow=True)
    assert q.awaitTermination(300)  # AvailableNow drains and stops by itself
    assert q.exception() is None
    got = [c for _, rows in batches for c in as_changes(rows, COLS)]
    assert sorted(got, key=lambda c: (c[0], c[1], c[2])) == sorted(
        expected, key=lambda c: (c[0], c[1], c[2])
    )
    assert len(got) == len(expected) and len({(c[0], c[1], c[2]) for c in got}) == len(got)
    seen_scns: set[int] = set()
    for _, rows in batches:
        per_scn = defaultdict(set)
        for r in rows:
            per_scn[r["_commit_scn"]].add(r["_txn_seq"])
        # whole transactions: every event of each window in this batch, and no window twice
        for scn, seqs in per_scn.items():
            assert len(seqs) == sizes[scn], f"window {scn} split"
        assert not (seen_scns & set(per_scn))
        seen_scns |= set(per_scn)
        n_events = sum(len(s) for s in per_scn.values())
        assert n_events <= 10 or len(per_scn) == 1, "maxRowsPerTrigger exceeded"
    assert seen_scns == set(sizes)
    assert len([b for b in batches if b[1]]) >= sum(sizes.values()) // 10
    progress = q.lastProgress
    assert progress is not None
    assert json.loads(progress["sources"][0]["latestOffset"]) == {"syn": max(sizes)}  # lag


def test_batch_read_of_an_scn_range_and_user_schema(spark: Any, scripted: Any) -> None:  # noqa: F811
    relay, sizes = scripted(30, seed=5)
    expected = project(truth(relay.url), COLS)
    scns = sorted(sizes)
    lo, hi = scns[4], scns[20]
    df = (
        spark.read.format("changebus")
        .option("relays", relay.url)
        .option("startingScn", str(lo))
        .option("endingScn", str(hi))
        .option("numPartitions", "3")
        .load()
    )
    got = as_changes(df.collect(), COLS)
    want = [c for c in expected if lo < c[0] <= hi]
    assert sorted(got, key=lambda c: (c[0], c[1], c[2])) == sorted(
        want, key=lambda c: (c[0], c[1], c[2])
    )
    # the same range cut into SCN sub-ranges (cuts fall between window SCNs)
    by_scn = (
        spark.read.format("changebus")
        .option("relays", relay.url)
        .option("startingScn", str(lo))
        .option("endingScn", str(hi))
        .option("numPartitions", "4")
        .option("splitBy", "scn")
        .load()
    )
    assert by_scn.rdd.getNumPartitions() == 4
    got = as_changes(by_scn.collect(), COLS)
    assert sorted(got, key=lambda c: (c[0], c[1], c[2])) == sorted(
        want, key=lambda c: (c[0], c[1], c[2])
    )
    # one table, a user schema narrower than the source's
    one = (
        spark.read.format("changebus")
        .schema("id LONG, price DECIMAL(9,2), _commit_scn LONG, _change_type STRING")
        .option("relays", relay.url)
        .option("sources", "shop.orders")
        .load()
    )
    assert one.columns == ["id", "price", "_commit_scn", "_change_type"]
    got_o = sorted(
        (r["_commit_scn"], r["_change_type"], r["id"], r["price"]) for r in one.collect()
    )
    want_o = sorted(
        (c[0], c[2], c[4]["id"], c[4]["price"]) for c in expected if c[3] == "shop.orders"
    )
    assert got_o == want_o
    with pytest.raises(Exception, match="not a column"):
        spark.read.format("changebus").schema("nope LONG").option(
            "relays", relay.url
        ).load().collect()
    with pytest.raises(Exception, match="unknown option"):
        spark.read.format("changebus").option("relays", relay.url).option("startScn", "1").load()


def test_restart_from_checkpoint_no_loss_no_duplicates(spark: Any, tmp_path: Path) -> None:
    synthetic = {
        "windows_per_s": 100,
        "max_windows": 3000,  # 30 s: the first query's start took over 20 s on a loaded machine
        "events_per_window": 3,
        "row_bytes": 40,
        "tables": 2,
        "keys": 500,
    }
    with RelayThread(relay_config(tmp_path, "synthetic", synthetic)) as relay:
        df = (
            spark.readStream.format("changebus")
            .option("relays", relay.url)
            .option("startingScn", "earliest")
            .load()
        )
        ck = tmp_path / "ck"
        q, batches = collect_stream(spark, df, ck, processingTime="500 milliseconds")
        deadline = time.monotonic() + 120
        while len([b for b in batches if b[1]]) < 2:
            assert time.monotonic() < deadline and q.isActive, q.exception()
            time.sleep(0.2)
        q.stop()
        first = list(batches)
        assert relay.state("syn") != "finished"  # still producing: the restart has new data
        wait_finished(relay)
        q2, batches2 = collect_stream(spark, df, ck, availableNow=True)
        assert q2.awaitTermination(300)
        assert q2.exception() is None
        cols = ["id", "n", "payload"]
        # an idempotent sink keyed by batch id: a replayed batch replaces its first run
        by_id = dict(first + batches2)
        got = [c for _, rows in sorted(by_id.items()) for c in as_changes(rows, cols)]
        expected = project(truth(relay.url), cols)
    assert batches2
    assert batches2[0][0] in (first[-1][0], first[-1][0] + 1)  # continues the batch ids
    keys = [(c[0], c[1], c[2]) for c in got]
    assert len(keys) == len(set(keys)), "a change was delivered twice"
    assert sorted(got, key=lambda c: (c[0], c[1], c[2])) == sorted(
        expected, key=lambda c: (c[0], c[1], c[2])
    )
    assert len(expected) == 3000 * 3


def test_evicted_range_fails_loudly_or_is_skipped(spark: Any, tmp_path: Path) -> None:
    synthetic = {
        "windows_per_s": 0,
        "max_windows": 3000,
        "events_per_window": 3,
        "row_bytes": 60,
        "tables": 2,
        "keys": 1000,
    }
    with RelayThread(relay_config(tmp_path, "synthetic", synthetic, capacity=64 << 10)) as relay:
        wait_finished(relay)
        meta = relay.meta("syn")
        assert meta.min_scn > 1000  # the buffer is too small for the stream: windows were evicted
        base = (
            spark.readStream.format("changebus")
            .option("relays", relay.url)
            .option("startingScn", "999")
        )
        q, _ = collect_stream(spark, base.load(), tmp_path / "ck1", availableNow=True)
        with pytest.raises(Exception, match="older than the relays keep"):
            q.awaitTermination(300)
        expected = {(c[0], c[1]) for c in truth(relay.url)}
        lenient = base.option("failOnDataLoss", "false")
        q2, batches = collect_stream(spark, lenient.load(), tmp_path / "ck2", availableNow=True)
        assert q2.awaitTermination(300)
        got = {(r["_commit_scn"], r["_txn_seq"]) for _, rows in batches for r in rows}
        assert got == expected and min(s for s, _ in got) == meta.min_scn
        # the same with a row limit (the planner meets the evicted range first)
        limited = lenient.option("maxRowsPerTrigger", "100").load()
        q3, batches = collect_stream(spark, limited, tmp_path / "ck3", availableNow=True)
        assert q3.awaitTermination(300)
        got = {(r["_commit_scn"], r["_txn_seq"]) for _, rows in batches for r in rows}
        assert got == expected and len([b for b in batches if b[1]]) > 1
        # a start time older than every window kept: it began at the oldest kept one,
        # silently, though windows after that time had been evicted (review)
        by_time = spark.read.format("changebus").option("relays", relay.url)
        with pytest.raises(Exception, match="startingTimestamp 0: partition syn: every window"):
            by_time.option("startingTimestamp", "0").load().collect()
        rows = by_time.option("startingTimestamp", "0").option("failOnDataLoss", "false")
        got = {(r["_commit_scn"], r["_txn_seq"]) for r in rows.load().collect()}
        assert got == expected
        # after the newest evicted window's time nothing is lost: no error
        import urllib.request

        with urllib.request.urlopen(f"{relay.url}/v1/status", timeout=10) as answer:
            status = json.load(answer)["partitions"][0]
        assert status["evicted"] and status["evicted_timestamp_ns"] == relay.meta("syn").prev_ts > 0
        after = status["evicted_timestamp_ns"] // 1_000_000 + 1
        rows = by_time.option("startingTimestamp", str(after)).load()
        assert {(r["_commit_scn"], r["_txn_seq"]) for r in rows.collect()} <= expected


def test_register_helper(spark: Any, scripted: Any) -> None:  # noqa: F811
    from changebus.client.spark import register

    relay, _ = scripted(5, seed=1)
    register(spark)
    n = spark.read.format("changebus").option("relays", relay.url).load().count()
    assert n == len(truth(relay.url))


def test_data_loss_window_fails_or_is_skipped(spark: Any, scripted: Any) -> None:  # noqa: F811
    relay, sizes = scripted(10, seed=9, loss_at=6)
    read = spark.read.format("changebus").option("relays", relay.url)
    with pytest.raises(Exception, match=r"were lost \(test gap\)"):
        read.load().collect()
    rows = read.option("failOnDataLoss", "false").load().collect()
    assert {(r["_commit_scn"], r["_txn_seq"]) for r in rows} == {
        (c[0], c[1]) for c in truth(relay.url, on_data_loss="deliver")
    }
    assert {r["_commit_scn"] for r in rows} == set(sizes)  # the loss window's rows too


def test_relay_without_tables_needs_a_schema(spark: Any, tmp_path: Path) -> None:
    with RelayThread(relay_config(tmp_path, "none", {})) as relay:
        read = spark.read.format("changebus").option("relays", relay.url)
        with pytest.raises(Exception, match="no table schemas yet"):
            read.load()
        assert read.schema("id LONG, _commit_scn LONG").load().count() == 0


def test_two_physical_partitions_offsets_per_partition(spark: Any, tmp_path: Path) -> None:
    def part(name: str, pid: int, start: int, seed: int) -> PartitionConfig:
        options = {
            "windows_per_s": 0,
            "max_windows": 400,
            "events_per_window": 3,
            "row_bytes": 30,
            "tables": 2,
            "keys": 300,
            "start_scn": start,
            "seed": seed,
        }
        return PartitionConfig(
            name, pid, capacity_bytes=4 << 20, fetcher=FetcherConfig("synthetic", options)
        )

    cfg = RelayConfig(
        data_dir=tmp_path / "relay2",
        http=HttpConfig(port=0, max_wait_s=10),
        partitions=(part("east", 1, 1000, 1), part("west", 2, 5000, 2)),
        flush_interval_s=0,
    )
    with RelayThread(cfg) as relay:
        deadline = time.monotonic() + 60
        while relay.state("east") != "finished" or relay.state("west") != "finished":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        expected = set()
        for name in ("east", "west"):
            cfgc = ConsumerConfig(relays=(relay.url,), partition=name, follow=False, wait_s=0.2)
            with SyncConsumer(cfgc) as consumer:
                for i, window in enumerate(consumer):
                    expected |= {(name, e.scn, e.seq) for e in window.events}
                    if i + 1 == 400:
                        break
        df = (
            spark.readStream.format("changebus")
            .option("relays", relay.url)
            .option("startingScn", "earliest")
            .option("maxRowsPerTrigger", "600")
            .load()
        )
        q, batches = collect_stream(spark, df, tmp_path / "ck", availableNow=True)
        assert q.awaitTermination(300)
        got = [
            (r["_partition"], r["_commit_scn"], r["_txn_seq"]) for _, rows in batches for r in rows
        ]
        offsets = json.loads(q.lastProgress["sources"][0]["endOffset"])
    assert len(got) == len(set(got)) and set(got) == expected
    assert offsets == {"east": 1399, "west": 5399}
    # the row limit is shared between the partitions: 300 events each per batch
    assert max(len(rows) for _, rows in batches) <= 600


def test_starting_and_ending_timestamp(spark: Any, tmp_path: Path) -> None:
    synthetic = {
        "windows_per_s": 200,
        "max_windows": 400,
        "events_per_window": 3,
        "row_bytes": 30,
        "tables": 2,
        "keys": 300,
    }
    with RelayThread(relay_config(tmp_path, "synthetic", synthetic)) as relay:
        wait_finished(relay)
        times: dict[int, int] = {}
        cfg = ConsumerConfig(relays=(relay.url,), partition="syn", follow=False, wait_s=0.2)
        with SyncConsumer(cfg) as consumer:
            for i, window in enumerate(consumer):
                times[window.scn] = window.timestamp_ns
                if i + 1 == 400:
                    break
        scns = sorted(times)
        start_ms = times[scns[100]] // 1_000_000 + 1  # inside the gap after window 100
        end_ms = times[scns[300]] // 1_000_000
        # (the end is exclusive, as Kafka's endingTimestamp)
        want = {s for s, t in times.items() if start_ms * 1_000_000 <= t < end_ms * 1_000_000}
        assert 150 < len(want) < 210
        rows = (
            spark.read.format("changebus")
            .option("relays", relay.url)
            .option("startingTimestamp", str(start_ms))
            .option("endingTimestamp", str(end_ms))
            .load()
            .select("_commit_scn")
            .collect()
        )
        assert {r[0] for r in rows} == want
        assert len(rows) == 3 * len(want)
        # before everything: from the oldest window; after everything: nothing
        early = spark.read.format("changebus").option("relays", relay.url)
        assert early.option("startingTimestamp", "0").load().count() == 3 * 400
        late = str(times[scns[-1]] // 1_000_000 + 10_000)
        assert early.option("startingTimestamp", late).load().count() == 0


def test_relay_failover_on_driver_and_executors(spark: Any, scripted: Any) -> None:  # noqa: F811
    import socket

    relay, _ = scripted(8, seed=11)
    with socket.socket() as s:  # a port with nothing listening: the first relay is down
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    rows = (
        spark.read.format("changebus")
        .option("relays", f"{dead},{relay.url}")
        .option("numPartitions", "2")
        .load()
        .collect()
    )
    assert sorted((r["_commit_scn"], r["_txn_seq"], r["_change_type"]) for r in rows) == sorted(
        (c[0], c[1], c[2]) for c in truth(relay.url)
    )
    with pytest.raises(Exception, match="no relay of 1 answered"):
        spark.read.format("changebus").option("relays", dead).load()


@pytest.mark.zk
def test_relays_from_a_zookeeper_cluster(
    spark: Any,
    scripted: Any,  # noqa: F811
    zk_hosts: str,
    zk_cluster: str,
) -> None:
    """Options zookeeper + cluster instead of relays: driver and executors read the table."""
    from kazoo.client import KazooClient

    from changebus.cluster import MemberInfo, PartitionState, member_path
    from changebus.cluster._layout import encode_member

    relay, _ = scripted(8, seed=13)
    zk = KazooClient(hosts=zk_hosts)
    zk.start(timeout=15)
    try:
        info = MemberInfo("r1", "relay", relay.url, {"syn": PartitionState("leader", 1, 0, 0)})
        zk.create(member_path(zk_cluster, "r1"), encode_member(info), ephemeral=True, makepath=True)
        rows = (
            spark.read.format("changebus")
            .option("zookeeper", zk_hosts)
            .option("cluster", zk_cluster)
            .option("preferFollowers", "true")
            .option("numPartitions", "2")
            .load()
            .collect()
        )
    finally:
        zk.stop()
        zk.close()
    assert sorted((r["_commit_scn"], r["_txn_seq"], r["_change_type"]) for r in rows) == sorted(
        (c[0], c[1], c[2]) for c in truth(relay.url)
    )


@pytest.mark.zk
def test_stream_sub_ranges_take_the_clusters_relays_of_each_plan(
    scripted: Any,  # noqa: F811
    zk_hosts: str,
    zk_cluster: str,
) -> None:
    """SCN sub-ranges do not follow the cluster's table themselves: they read the relays
    resolved when the query started, so once those were all replaced every task failed
    while the driver planned on (found by review). Each plan now gives them the table's
    relays as they are then. (No Spark needed: the reader plans as the driver would.)"""
    from kazoo.client import KazooClient

    from changebus.client.spark._relay import partition_bounds, resolve_cluster, run_sync
    from changebus.client.spark._source import ChangebusDataSource
    from changebus.cluster import MemberInfo, PartitionState, member_path
    from changebus.cluster._layout import encode_member

    relay, _ = scripted(8, seed=13)
    zk = KazooClient(hosts=zk_hosts)
    zk.start(timeout=15)
    try:
        path = member_path(zk_cluster, "r1")
        info = MemberInfo("r1", "relay", relay.url, {"syn": PartitionState("leader", 1, 0, 0)})
        zk.create(path, encode_member(info), ephemeral=True, makepath=True)
        source = ChangebusDataSource(
            {"zookeeper": zk_hosts, "cluster": zk_cluster, "numPartitions": "2"}
        )
        reader: Any = source.streamReader(source.schema())
        assert reader.opts.relays == (relay.url,)
        moved = MemberInfo("r1", "relay", "http://127.0.0.1:9", info.partitions)
        zk.set(path, encode_member(moved))  # (the relay's new address)
        deadline = time.monotonic() + 15  # (until the routing table says so)
        while run_sync(resolve_cluster(reader.opts)).relays[0] != "http://127.0.0.1:9":
            assert time.monotonic() < deadline, "the routing table kept the old address"
            time.sleep(0.2)
        b = run_sync(partition_bounds(reader.opts))["syn"]
        parts = reader.partitions({"syn": b.prev_scn}, {"syn": b.max_scn})
    finally:
        zk.stop()
        zk.close()
    assert len(parts) == 2 and all(not p.spec.may_bootstrap for p in parts)
    assert {p.spec.relays for p in parts} == {("http://127.0.0.1:9", relay.url)}


@pytest.mark.zk
def test_a_cluster_whose_relays_serve_different_partitions(
    spark: Any, tmp_path: Path, zk_hosts: str, zk_cluster: str
) -> None:
    """Relay A serves east, relay B west. Without option partitions the driver planned
    from the first relay that answered, so the query read only its partitions; every
    partition is now asked of the relays serving it, as the routing table says."""
    from kazoo.client import KazooClient

    from changebus.cluster import MemberInfo, PartitionState, member_path
    from changebus.cluster._layout import encode_member

    def config(name: str, pid: int, start: int) -> RelayConfig:
        options = {
            "windows_per_s": 0,
            "max_windows": 60,
            "events_per_window": 3,
            "row_bytes": 30,
            "tables": 2,
            "keys": 100,
            "start_scn": start,
        }
        part = PartitionConfig(
            name, pid, capacity_bytes=4 << 20, fetcher=FetcherConfig("synthetic", options)
        )
        return RelayConfig(
            data_dir=tmp_path / name,
            http=HttpConfig(port=0, max_wait_s=10),
            partitions=(part,),
            flush_interval_s=0,
        )

    with (
        RelayThread(config("east", 1, 1000)) as east,
        RelayThread(config("west", 2, 5000)) as west,
    ):
        deadline = time.monotonic() + 60
        while east.state("east") != "finished" or west.state("west") != "finished":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        expected = set()
        for relay, name in ((east, "east"), (west, "west")):
            cfgc = ConsumerConfig(relays=(relay.url,), partition=name, follow=False, wait_s=0.2)
            with SyncConsumer(cfgc) as consumer:
                for i, window in enumerate(consumer):
                    expected |= {(name, e.scn, e.seq) for e in window.events}
                    if i + 1 == 60:
                        break
        zk = KazooClient(hosts=zk_hosts)
        zk.start(timeout=15)
        try:
            for member, relay, name in (("ra", east, "east"), ("rb", west, "west")):
                info = MemberInfo(
                    member, "relay", relay.url, {name: PartitionState("leader", 1, 0, 0)}
                )
                path = member_path(zk_cluster, member)
                zk.create(path, encode_member(info), ephemeral=True, makepath=True)
            reader = (
                spark.read.format("changebus")
                .option("zookeeper", zk_hosts)
                .option("cluster", zk_cluster)
            )
            rows = reader.load().select("_partition", "_commit_scn", "_txn_seq").collect()
            named = reader.option("partitions", "west,east").load().select("_partition").collect()
        finally:
            zk.stop()
            zk.close()
    assert len(expected) == 2 * 60 * 3
    got = [(r[0], r[1], r[2]) for r in rows]
    assert len(got) == len(set(got)) and set(got) == expected
    assert sorted({r[0] for r in named}) == ["east", "west"] and len(named) == len(expected)


def test_a_replayed_first_batch_of_a_moving_start_loses_nothing(spark: Any, tmp_path: Path) -> None:
    """startingScn=latest (the default): the first batch failed in the sink, before its
    commit, and the restarted query replayed it from a start resolved again -- the
    newest SCN by then, past the batch's logged end: its rows were never delivered
    (found by review). The first batch of such a start is now empty, so every batch
    with rows starts at an end Spark logged."""
    synthetic = {"windows_per_s": 500, "max_windows": 200_000, "events_per_window": 2,
                 "row_bytes": 20, "tables": 1, "keys": 100}  # fmt: skip
    with RelayThread(relay_config(tmp_path, "synthetic", synthetic, capacity=64 << 20)) as relay:
        time.sleep(1)
        df = spark.readStream.format("changebus").option("relays", relay.url).load()
        ck = tmp_path / "ck"

        seen: list[int] = []  # rows the failing batch held (none now: it is empty)

        def failing(batch: Any, batch_id: int) -> None:
            seen.extend(r[0] for r in batch.select("_commit_scn").collect())
            raise RuntimeError("the sink is down")

        q = (
            df.writeStream.foreachBatch(failing)
            .option("checkpointLocation", str(ck))
            .trigger(processingTime="1 second")
            .start()
        )
        with pytest.raises(Exception, match="the sink is down"):
            q.awaitTermination(120)
        first_end = json.loads((ck / "offsets" / "0").read_text().splitlines()[-1])["syn"]
        time.sleep(2)  # the relay's newest moves on
        got: dict[int, list[int]] = {}

        def keep(batch: Any, batch_id: int) -> None:
            got[batch_id] = [r[0] for r in batch.select("_commit_scn").collect()]

        q2 = (
            df.writeStream.foreachBatch(keep)
            .option("checkpointLocation", str(ck))
            .trigger(processingTime="1 second")
            .start()
        )
        deadline = time.monotonic() + 120
        while not any(got.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        q2.stop()
    scns = sorted(s for rows in got.values() for s in rows)
    # from the first row the failed batch held on, or (empty) from the window after its end
    assert scns and scns[0] == (min(seen) if seen else first_end + 1), (seen[:3], scns[:3])
    assert not seen


def test_key_slices_give_a_truncate_once(tmp_path: Path, window_type: Any) -> None:
    """A TRUNCATE passes every key filter: with splitBy=key each slice's task made it a
    row, so one batch held it numPartitions times under one (_partition, _commit_scn,
    _txn_seq), which the docs call unique (found by review). The first slice alone
    keeps it now. (No Spark needed: the planned tasks are read as executors would.)"""
    from collections import Counter

    from spark_source_support import _SCRIPTS, ORDERS

    from changebus.client.spark._evolution import query_tables
    from changebus.client.spark._options import SourceOptions
    from changebus.client.spark._plan import _range_partitions
    from changebus.client.spark._read import read_range
    from changebus.client.spark._source import source_schema
    from changebus.schemas import Op

    row = {"qty": 1, "note": None, "price": None}
    _SCRIPTS["truncate-slices"] = [
        window_type(
            100,
            rows=[(ORDERS, 1, Op.INSERT, {"id": i, **row}, None) for i in range(1, 9)],
            announce=[(1, ORDERS)],
        ),
        window_type(110, rows=[(ORDERS, 1, Op.TRUNCATE, None, None)]),
        window_type(120, rows=[(ORDERS, 1, Op.INSERT, {"id": 50, **row}, None)]),
    ]
    cfg = relay_config(tmp_path, "spark-script", {"script": "truncate-slices"})
    with RelayThread(cfg) as relay:
        wait_finished(relay)
        for split in ("key", "scn"):
            opts = SourceOptions.parse(
                {"relays": relay.url, "splitBy": split, "numPartitions": "3"}
            )
            schema = source_schema(opts)
            tables = query_tables(opts, ["syn"])
            cuts = {"syn": [105, 115]} if split == "scn" else None
            parts = _range_partitions(opts, {"syn": 99}, {"syn": 120}, cuts=cuts)
            assert len(parts) == 3
            seen: Counter[tuple[str, int, int]] = Counter()
            for p in parts:
                for batch in read_range(opts, p.spec, schema, tables):
                    d = batch.to_pydict()
                    seen.update(
                        zip(d["_change_type"], d["_commit_scn"], d["_txn_seq"], strict=True)
                    )
            assert seen[("truncate", 110, 0)] == 1, split
            assert sum(seen.values()) == 10 and max(seen.values()) == 1, split
