"""ParquetMirror on hand-made micro-batches: key changes and NULL keys.

An update that changes its row's key leaves the old key behind unless the
mirror deletes it (Postgres sends the old key as the pre-image, MariaDB the
whole old row); a table keyed by all its columns has NULLs in its key, which
an equality join never matches.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]

COLUMNS = ["id", "v", "_change_type", "_commit_scn", "_commit_timestamp", "_txn_seq",
           "_source", "_partition"]  # fmt: skip


def batch(spark: Any, rows: list[tuple[Any, ...]]) -> Any:
    from pyspark.sql.types import (
        LongType,
        StringType,
        StructField,
        StructType,
        TimestampType,
    )

    schema = StructType(
        [
            StructField("id", LongType()),
            StructField("v", StringType()),
            StructField("_change_type", StringType(), False),
            StructField("_commit_scn", LongType(), False),
            StructField("_commit_timestamp", TimestampType()),
            StructField("_txn_seq", LongType(), False),
            StructField("_source", StringType()),
            StructField("_partition", StringType()),
        ]
    )
    now = dt.datetime(2026, 1, 1)
    full = [(*r[:4], now, r[4], "public.t", "pg") for r in rows]
    return spark.createDataFrame(full, schema)


def rows(spark: Any, mirror: Any) -> list[tuple[Any, ...]]:
    df = mirror.read(spark)
    assert df is not None
    return sorted((tuple(r) for r in df.select("id", "v").collect()), key=repr)


def test_a_key_change_and_null_keys(spark: Any, tmp_path: Path) -> None:
    from changebus.client.spark import ParquetMirror

    # keyed by id alone: an update moves row 1 to key 3
    mirror = ParquetMirror(tmp_path / "by_id", ["id"])
    mirror(batch(spark, [(1, "a", "insert", 10, 0), (2, "b", "insert", 10, 1)]), 0)
    mirror(
        batch(
            spark,
            [
                (1, "a", "update_preimage", 20, 0),
                (3, "a", "update_postimage", 20, 0),
                (2, "b", "update_preimage", 21, 0),  # same key: an ordinary update
                (2, "c", "update_postimage", 21, 0),
            ],
        ),
        1,
    )
    assert rows(spark, mirror) == [(2, "c"), (3, "a")]

    # keyed by all its columns (no primary key), NULLs included
    whole = ParquetMirror(tmp_path / "whole", ["id", "v"])
    whole(
        batch(
            spark,
            [(None, "x", "insert", 10, 0), (5, None, "insert", 10, 1), (6, "y", "insert", 10, 2)],
        ),
        0,
    )
    whole(
        batch(
            spark,
            [
                (None, "x", "delete", 20, 0),
                (5, None, "update_preimage", 21, 0),
                (5, "now", "update_postimage", 21, 0),
            ],
        ),
        1,
    )
    assert rows(spark, whole) == sorted([(5, "now"), (6, "y")], key=repr)


def test_replays_and_a_new_query_are_told_apart_by_position(spark: Any, tmp_path: Path) -> None:
    """A replayed batch changes nothing; a new query at the same path (a new checkpoint:
    batch ids from 0 again) has its changes applied when they are newer than the
    mirror's, and dropped when they are not. By batch id alone, the new query's first
    batches were skipped, changes and all (found by review)."""
    from changebus.client.spark import ParquetMirror

    mirror = ParquetMirror(tmp_path / "m", ["id"])
    first = [(1, "a", "insert", 10, 0), (2, "b", "insert", 10, 1)]
    mirror(batch(spark, first), 0)
    mirror(batch(spark, [(1, "a2", "update_postimage", 20, 0)]), 1)
    mirror(batch(spark, [(1, "a2", "update_postimage", 20, 0)]), 1)  # the replay
    assert rows(spark, mirror) == [(1, "a2"), (2, "b")]
    # a new query from the start: its first batch holds changes the mirror has
    mirror(batch(spark, first), 0)
    assert rows(spark, mirror) == [(1, "a2"), (2, "b")]
    # ... and then newer ones, under batch ids the old query used already
    mirror(batch(spark, [(3, "c", "insert", 30, 0), (2, "b", "delete", 31, 0)]), 1)
    assert rows(spark, mirror) == [(1, "a2"), (3, "c")]
    current = mirror.current()
    assert current is not None and current["applied"] == {"pg": [31, 0]}
    # a stream read without the _partition column: one partition
    bare = ParquetMirror(tmp_path / "bare", ["id"])
    bare(batch(spark, first).drop("_partition"), 0)
    bare(batch(spark, first).drop("_partition"), 0)
    assert rows(spark, bare) == [(1, "a"), (2, "b")]
    assert (bare.current() or {})["applied"] == {"": [10, 1]}


def test_changes_between_a_bootstrap_batch_end_and_its_snapshot_rows_are_applied(
    spark: Any, tmp_path: Path
) -> None:
    """A batch read through a bootstrap server ends at the relay's newest SCN when it was
    planned (here 150), but its snapshot rows are at their newest version (row 2 at 210).
    Row 1's change at 200 and row 3's insert at 205 come in the next batch: the mirror
    took 210 as applied and dropped both as older (review)."""
    from changebus.client.spark import ParquetMirror

    mirror = ParquetMirror(tmp_path / "m", ["id"])
    mirror(batch(spark, [(1, "a", "insert", 100, 0), (2, "b2", "update_postimage", 210, 0)]), 0)
    later = [
        (1, "a", "update_preimage", 200, 0),
        (1, "a2", "update_postimage", 200, 0),
        (3, "c", "insert", 205, 0),
        (2, "b1", "update_postimage", 208, 0),  # older than the snapshot row: kept out
        (2, "b2", "update_postimage", 210, 0),
        (4, "d", "insert", 220, 0),
    ]
    mirror(batch(spark, later), 1)
    assert rows(spark, mirror) == [(1, "a2"), (2, "b2"), (3, "c"), (4, "d")]
    mirror(batch(spark, later), 1)  # replayed: nothing changes
    assert rows(spark, mirror) == [(1, "a2"), (2, "b2"), (3, "c"), (4, "d")]
    assert (mirror.current() or {})["applied"] == {"pg": [220, 0]}
    # a truncate, replayed: what followed it stays, what preceded it does not come back
    emptied = [(5, "e", "insert", 300, 0), (None, None, "truncate", 301, 0),
               (6, "f", "insert", 302, 0)]  # fmt: skip
    mirror(batch(spark, emptied), 2)
    assert rows(spark, mirror) == [(6, "f")]
    mirror(batch(spark, emptied), 2)
    assert rows(spark, mirror) == [(6, "f")]
    cur = mirror.current() or {}
    assert "_cb_scn" not in (mirror.read(spark) or spark.range(0)).columns
    assert cur["applied"] == {"pg": [302, 0]}


def test_a_truncate_alone_and_one_between_a_bootstrap_batch_end_and_its_rows(
    spark: Any, tmp_path: Path
) -> None:
    """A batch holding only a truncate left the copy as it was (nothing followed it, so
    the batch looked empty); a truncate between a bootstrap batch's end and its snapshot
    rows' versions kept every row, the older ones too (review of this session's mirror).
    A truncate now drops the copy's rows older than it, one by one."""
    from changebus.client.spark import ParquetMirror

    mirror = ParquetMirror(tmp_path / "alone", ["id"])
    mirror(batch(spark, [(1, "a", "insert", 10, 0), (2, "b", "insert", 10, 1)]), 0)
    mirror(batch(spark, [(None, None, "truncate", 20, 0)]), 1)
    df = mirror.read(spark)
    assert df is not None and df.count() == 0
    mirror(batch(spark, [(None, None, "truncate", 20, 0)]), 1)  # replayed
    mirror(batch(spark, [(3, "c", "insert", 30, 0)]), 2)
    assert rows(spark, mirror) == [(3, "c")]

    # a bootstrap batch: row 1 at 100 (its page read before the truncate), row 2 at 210
    boot = ParquetMirror(tmp_path / "boot", ["id"])
    boot(batch(spark, [(1, "a", "insert", 100, 0), (2, "b2", "update_postimage", 210, 0)]), 0)
    boot(batch(spark, [(None, None, "truncate", 205, 0), (2, "b2", "insert", 210, 0)]), 1)
    assert rows(spark, boot) == [(2, "b2")]


def test_the_pointer_is_synced_before_the_batch_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pointer replaced without a sync came back empty or old after a power cut, and
    Spark, which had recorded the batch as committed, did not replay it (review)."""
    import os

    from changebus.client.spark import ParquetMirror

    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    mirror = ParquetMirror(tmp_path / "m", ["id"])
    mirror.path.mkdir(parents=True)
    monkeypatch.setattr(os, "fsync", fsync)
    mirror._set_current(3, 1, {"p": [10, 0]})
    assert synced == [str(mirror.path / "_current.json.tmp"), str(mirror.path)]
    assert mirror.current() == {"batch_id": 3, "version": 1, "applied": {"p": [10, 0]}}
