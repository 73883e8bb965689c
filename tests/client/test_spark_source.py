"""format("changebus") in a real local Spark against real relays (scripted and synthetic).

Every test compares what Spark delivered with what the relay holds (read with
the client library): same changes, each exactly once, in whole transactions.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from changebus.client import ChangeOp, ConsumerConfig, SyncConsumer
from changebus.fetchers import ResumePoint, Window, register_fetcher
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, RelayConfig
from changebus.schemas import Column, DataLoss, Op, TableSchema
from fix_spark import RelayThread

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]

ORDERS = TableSchema(
    "shop.orders",
    (
        Column("id", "long", nullable=False),
        Column("qty", "int"),
        Column("note", "string"),
        Column("price", {"type": "bytes", "logicalType": "decimal", "precision": 9, "scale": 2}),
    ),
    ("id",),
    1,
)
ITEMS = TableSchema(
    "shop.items",
    (Column("id", "long", nullable=False), Column("qty", "long"), Column("sku", "string")),
    ("id",),
    1,
)

_SCRIPTS: dict[str, Sequence[Any]] = {}
_ids = itertools.count()


class _Script:
    """A fetcher serving prepared windows (``ScriptedWindow`` objects), then finishing."""

    def __init__(self, name: str, partition_id: int, options: Mapping[str, Any]) -> None:
        self.name = name
        self._pid = partition_id
        self._script = _SCRIPTS[str(options["script"])]
        self._after = -1

    async def start(self, resume: ResumePoint) -> int:
        self._after = resume.scn
        first: int = self._script[0].scn
        return max(resume.scn, first - 1)

    async def windows(self) -> AsyncIterator[Window]:
        for w in self._script:
            if w.scn > self._after:
                yield w.encode(self._pid)

    async def acknowledge(self, scn: int) -> None:
        return None

    async def close(self) -> None:
        return None

    def status(self) -> dict[str, Any]:
        return {"kind": "spark-script"}


register_fetcher("spark-script", _Script)


def relay_config(
    tmp: Path, kind: str, options: dict[str, Any], capacity: int = 8 << 20
) -> RelayConfig:
    return RelayConfig(
        data_dir=tmp / f"relay{next(_ids)}",
        http=HttpConfig(port=0, max_wait_s=10),
        partitions=(
            PartitionConfig(
                "syn", 1, capacity_bytes=capacity, fetcher=FetcherConfig(kind, options)
            ),
        ),
        flush_interval_s=0,
    )


def wait_finished(relay: RelayThread, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while relay.state("syn") != "finished":
        assert time.monotonic() < deadline, "the relay's fetcher did not finish"
        time.sleep(0.05)


def truth(url: str, **kw: Any) -> list[tuple[Any, ...]]:
    """Every change the relay holds, as (scn, seq, change_type, row) via the client library."""
    out: list[tuple[Any, ...]] = []
    cfg = ConsumerConfig(relays=(url,), partition="syn", follow=False, wait_s=0.2, **kw)
    last = None
    with SyncConsumer(cfg) as consumer:
        status_last = None
        for window in consumer:
            for e in window.events:
                if e.op is ChangeOp.UPDATE:
                    if e.before is not None:
                        out.append((e.scn, e.seq, "update_preimage", e.table, e.before))
                    out.append((e.scn, e.seq, "update_postimage", e.table, e.after))
                elif e.op is ChangeOp.DELETE:
                    out.append((e.scn, e.seq, "delete", e.table, e.before or e.key))
                else:
                    out.append((e.scn, e.seq, e.op.value, e.table, e.after))
            last = window.scn
            if status_last is None:
                status_last = _last_scn(url)
            if last >= status_last:
                break
    return out


def _last_scn(url: str) -> int:
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/status", timeout=10) as resp:
        data: Any = json.load(resp)
        return int(data["partitions"][0]["max_scn"])


def as_changes(rows: list[Any], columns: Sequence[str]) -> list[tuple[Any, ...]]:
    out = []
    for r in rows:
        d = r.asDict()
        image = {c: d[c] for c in columns}
        out.append((d["_commit_scn"], d["_txn_seq"], d["_change_type"], d["_source"], image))
    return out


def project(changes: list[tuple[Any, ...]], columns: Sequence[str]) -> list[tuple[Any, ...]]:
    return [(s, q, t, src, {c: img.get(c) for c in columns}) for s, q, t, src, img in changes]


def script(n_windows: int, seed: int) -> tuple[list[Any], dict[int, int]]:
    """Windows of 1..7 changes over two tables; returns (windows, events per SCN)."""
    from decimal import Decimal

    rnd = random.Random(seed)
    windows = []
    sizes: dict[int, int] = {}
    live: dict[str, dict[int, dict[str, Any]]] = {"o": {}, "i": {}}
    for w in range(n_windows):
        scn = 100 + 10 * w
        rows: list[Any] = []
        for _ in range(rnd.randint(1, 7)):
            which = rnd.choice("oi")
            table = ORDERS if which == "o" else ITEMS
            k = rnd.randint(1, 30)
            old = live[which].get(k)
            if which == "o":
                new = {
                    "id": k,
                    "qty": rnd.randint(0, 9),
                    "note": rnd.choice([None, "x", "ünï"]),
                    "price": Decimal(rnd.randint(0, 99999)) / 100,
                }
            else:
                new = {"id": k, "qty": rnd.randint(0, 1 << 40), "sku": f"s{rnd.randint(0, 99)}"}
            if old is None:
                rows.append((table, 1 if which == "o" else 2, Op.INSERT, new, None))
                live[which][k] = new
            elif rnd.random() < 0.7:
                rows.append(
                    (
                        table,
                        1 if which == "o" else 2,
                        Op.UPDATE,
                        new,
                        old if rnd.random() < 0.5 else None,
                    )
                )
                live[which][k] = new
            else:
                rows.append((table, 1 if which == "o" else 2, Op.DELETE, None, old))
                del live[which][k]
        sizes[scn] = len(rows)
        windows.append((scn, rows))
    return windows, sizes


@pytest.fixture
def scripted(tmp_path: Path, window_type: Any) -> Any:
    started: list[RelayThread] = []

    def start(
        n_windows: int, seed: int, loss_at: int | None = None
    ) -> tuple[RelayThread, dict[int, int]]:
        raw, sizes = script(n_windows, seed)
        W = window_type
        windows = [
            W(
                scn,
                rows=rows,
                announce=[(1, ORDERS), (2, ITEMS)] if i == 0 else [],
                loss=DataLoss(scn - 5, scn - 1, "test gap") if i == loss_at else None,
            )
            for i, (scn, rows) in enumerate(raw)
        ]
        name = f"s{next(_ids)}"
        _SCRIPTS[name] = windows
        relay = RelayThread(relay_config(tmp_path, "spark-script", {"script": name}))
        started.append(relay)
        wait_finished(relay)
        return relay, sizes

    yield start
    for r in started:
        r.stop()


def collect_stream(
    spark: Any, df: Any, checkpoint: Path, **trigger: Any
) -> tuple[Any, list[tuple[int, list[Any]]]]:
    batches: list[tuple[int, list[Any]]] = []

    def sink(bdf: Any, batch_id: int) -> None:
        batches.append((batch_id, bdf.collect()))

    q = (
        df.writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(**trigger)
        .start()
    )
    return q, batches


COLS = ["id", "qty", "note", "price", "sku"]


def test_available_now_row_limit_whole_transactions(
    spark: Any, scripted: Any, tmp_path: Path
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


def test_batch_read_of_an_scn_range_and_user_schema(spark: Any, scripted: Any) -> None:
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


def test_register_helper(spark: Any, scripted: Any) -> None:
    from changebus.client.spark import register

    relay, _ = scripted(5, seed=1)
    register(spark)
    n = spark.read.format("changebus").option("relays", relay.url).load().count()
    assert n == len(truth(relay.url))


def test_data_loss_window_fails_or_is_skipped(spark: Any, scripted: Any) -> None:
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
        want = {s for s, t in times.items() if start_ms * 1_000_000 <= t <= end_ms * 1_000_000}
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


def test_relay_failover_on_driver_and_executors(spark: Any, scripted: Any) -> None:
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
    spark: Any, scripted: Any, zk_hosts: str, zk_cluster: str
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
