"""What the tests of format("changebus") in a real local Spark share.

Two table schemas (``shop.orders``, ``shop.items``) and random scripts of
windows over them, served by a scripted fetcher (kind ``spark-script``,
registered on import) behind a relay in a thread (the ``scripted`` fixture);
relay configs; waiting for a relay's fetcher to finish; the relay's content
read with the client library (``truth``), Spark rows in the same shape
(``as_changes``, ``project``); and a streaming query collecting its batches.
Used by test_spark_source.py, test_spark_pushdown.py and test_spark_splits.py.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from changebus.client import ChangeOp, ConsumerConfig, SyncConsumer
from changebus.fetchers import ResumePoint, Window, register_fetcher
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, RelayConfig
from changebus.schemas import Column, DataLoss, Op, TableSchema
from fix_spark import RelayThread

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
