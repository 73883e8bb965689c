"""An idempotent ``foreachBatch`` sink: a Parquet mirror of one table, MERGE-style.

:class:`ParquetMirror` keeps, under ``path``, full copies of the table as
Parquet directories ``v=<batch_id>`` and a small pointer file ``_current.json``
naming the newest complete one. Applying micro-batch ``batch_id``:

1. take the last change per key of the batch (ordered by ``_commit_scn``,
   ``_txn_seq``; an update that changed its row's key also deletes the old
   key, from its pre-image) and keep those newer than the version the copy
   holds of their key (each row of the copy keeps its change's position in
   the hidden columns ``_cb_scn``, ``_cb_seq``; a key the copy lacks takes
   any change). Idempotence by key and position, not by batch id: Spark
   replays the last batch after a crash, and a new query (a new checkpoint,
   whose batch ids start at 0 again) may start before the mirror's position.
   Not by one position per partition either: a batch read through a
   bootstrap server holds snapshot rows at their newest version, past the
   batch's end, and the changes between that end and those versions, which
   come in the next batches, were dropped as older than the batch (review);
2. drop the keys of the changes kept (NULL keys included: a table keyed by
   all its columns) from the current copy, add the rows whose last change is
   not a delete (a truncate in the batch first drops the copy's rows older than
   it, and its changes before it), and write the result to ``v=<batch_id>``
   in the batch's columns (after a schema change: a new column is null in the
   rows kept, a dropped one goes, a retyped one is cast); copies are numbered
   in order (``v=<n>``), whatever the batch ids;
3. replace the pointer atomically (write + rename), then remove older copies.

The pointer also records each partition's newest ``(_commit_scn, _txn_seq)``
applied (``applied``). The copy keeps no deleted keys: a new query started
before the mirror's position inserts again, for a while, a row the mirror
deleted later, until the query reads that delete again.

A crash between 2 and 3 leaves an unreferenced directory that the replay
overwrites. Readers use :meth:`ParquetMirror.read` (or the directory the
pointer names), never a glob. The pointer is a local file, so ``path`` must be
a local or mounted file system; on object stores use a table format with
MERGE (Delta Lake, Iceberg) instead. One query writes a mirror; the methods
are called by Spark one batch at a time.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pyspark.sql import (
    DataFrame,
    SparkSession,
    Window,
    functions as F,
)
from pyspark.sql.types import StructType

from ._arrow import META_COLUMNS

__all__ = ["ParquetMirror"]

log = logging.getLogger(__name__)

_META = [f.name for f in META_COLUMNS]
#: the copy's hidden columns: the position of each row's change
_SCN, _SEQ = "_cb_scn", "_cb_seq"


class ParquetMirror:
    """``query.foreachBatch(ParquetMirror(path, key=["id"]))`` (module docstring)."""

    def __init__(self, path: str | os.PathLike[str], key: Sequence[str]) -> None:
        if not key:
            raise ValueError("ParquetMirror needs the table's key columns")
        self.path = Path(path)
        self.key = list(key)

    # ---- pointer ------------------------------------------------------

    @property
    def _pointer(self) -> Path:
        return self.path / "_current.json"

    def current(self) -> dict[str, Any] | None:
        """``{"batch_id": applied, "version": directory number, "applied": {partition:
        [scn, seq]}}``, or None when empty."""
        try:
            data: dict[str, Any] = json.loads(self._pointer.read_text())
        except FileNotFoundError:
            return None
        return data

    def _set_current(
        self, batch_id: int, version: int | None, applied: dict[str, list[int]]
    ) -> None:
        tmp = self.path / "_current.json.tmp"
        doc = {"batch_id": batch_id, "version": version, "applied": applied}
        # durable before Spark records the batch as committed: a pointer lost to a power
        # cut (a rename not synced) came back empty or old, and Spark does not replay the
        # batch (review); the Parquet files are Spark's to sync (docs/spark.md)
        with tmp.open("w") as f:
            f.write(json.dumps(doc))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._pointer)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _dir(self, version: int) -> Path:
        return self.path / f"v={version}"

    # ---- reading ------------------------------------------------------

    def read(self, spark: SparkSession) -> DataFrame | None:
        """The mirror's current rows (None before the first non-empty batch)."""
        cur = self.current()
        if cur is None or cur.get("version") is None:
            return None
        df = spark.read.parquet(str(self._dir(int(cur["version"]))))
        return df.drop(_SCN, _SEQ)

    # ---- applying a batch ---------------------------------------------

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        cur = self.current()
        applied: dict[str, list[int]] = dict(cur.get("applied") or {}) if cur else {}
        if cur is not None and not applied and int(cur["batch_id"]) >= batch_id:
            # (a pointer of an older version: no positions, only the batch id)
            log.info("batch %d is in the mirror (at %d): skipped", batch_id, cur["batch_id"])
            return
        version = None if cur is None else cur.get("version")
        if "_partition" not in df.columns:  # (a stream read without it: one partition)
            df = df.withColumn("_partition", F.lit(""))
        df = df.persist()
        try:
            newest = df.groupBy("_partition").agg(
                F.max(F.struct(F.col("_commit_scn"), F.col("_txn_seq"))).alias("at")
            )
            seen = {
                str(r["_partition"]): [int(r["at"][0]), int(r["at"][1])] for r in newest.collect()
            }
            number = 0 if version is None else int(version) + 1
            new_version = self._apply(df, number, version)
        finally:
            df.unpersist()
        if new_version is _UNCHANGED:
            log.info("batch %d holds no change newer than the mirror's: skipped", batch_id)
            return
        assert not isinstance(new_version, str)
        for p, at in seen.items():  # (never backwards: a new query may start earlier)
            if p in applied and applied[p] > at:
                seen[p] = applied[p]
        self._set_current(batch_id, new_version, {**applied, **seen})
        for child in self.path.glob("v=*"):
            if new_version is None or child.name != f"v={new_version}":
                shutil.rmtree(child, ignore_errors=True)

    def _apply(self, df: DataFrame, batch_id: int, version: int | None) -> int | str | None:
        """Write the copy with the batch applied as ``v=<batch_id>``: its number, or
        :data:`_UNCHANGED` when no change is newer than the copy's."""
        spark = df.sparkSession
        # (the first action reads the batch once, into the cache: the moved keys'
        # self-join below would otherwise read the source twice, counted twice too)
        changes = df.where(F.col("_change_type") != "update_preimage")
        stats = changes.agg(
            F.count(F.lit(1)).alias("n"),
            F.max(
                F.when(
                    F.col("_change_type") == "truncate",
                    F.struct(F.col("_commit_scn"), F.col("_txn_seq")),
                )
            ).alias("truncate"),
            F.countDistinct("_source").alias("tables"),
        ).collect()[0]
        if stats["n"] == 0:
            return _UNCHANGED
        if stats["tables"] > 1:
            raise ValueError(
                "ParquetMirror mirrors one table: read the stream with option sources=<table>"
            )
        changes = changes.unionByName(self._moved(df))  # (no row count, truncate or table)
        data_cols = [c for c in df.columns if c not in _META]
        base = None
        if version is not None:
            base = spark.read.parquet(str(self._dir(version)))
        truncate = stats["truncate"]
        emptied = False
        if truncate is not None:
            # the table was emptied inside this batch: what came before it goes, in the
            # batch and in the copy, row by row (a replay's copy keeps what followed it; a
            # copy after a bootstrap batch holds rows of both sides: review)
            scn, seq = int(truncate[0]), int(truncate[1])
            later = (F.col("_commit_scn") > scn) | (
                (F.col("_commit_scn") == scn) & (F.col("_txn_seq") > seq)
            )
            changes = changes.where(later)
            if base is not None and _SCN in base.columns:
                after = F.coalesce(
                    (F.col(_SCN) > scn) | ((F.col(_SCN) == scn) & (F.col(_SEQ) > seq)),
                    F.lit(False),  # (a row without a version: older)
                )
                emptied = base.where(~after).limit(1).count() > 0
                base = base.where(after)
            else:
                emptied = base is not None  # (a copy without versions: all of it is older)
                base = None
        changes = changes.where(F.col("_change_type") != "truncate")
        order = Window.partitionBy(*self.key).orderBy(
            F.col("_commit_scn").desc(), F.col("_txn_seq").desc()
        )
        last = (
            changes.withColumn("_rank", F.row_number().over(order))
            .where(F.col("_rank") == 1)
            .drop("_rank")
        )
        if base is not None:
            last = self._newer(last, base)
        if last.limit(1).count() == 0 and not emptied:
            return _UNCHANGED
        upserts = last.where(F.col("_change_type") != "delete").select(
            *data_cols, F.col("_commit_scn").alias(_SCN), F.col("_txn_seq").alias(_SEQ)
        )
        if base is not None:
            # NULL-safe: a table keyed by all its columns may have NULLs in its key
            touched = last.select(*self.key)
            same = [base[k].eqNullSafe(touched[k]) for k in self.key]
            kept = base.join(touched, on=same, how="left_anti")
            result = _conform(kept, upserts.schema).unionByName(upserts)
        else:
            result = upserts
        result.write.mode("overwrite").parquet(str(self._dir(batch_id)))
        return batch_id

    def _newer(self, last: DataFrame, base: DataFrame) -> DataFrame:
        """The changes of ``last`` newer than the copy's version of their key (a key the
        copy lacks, or holds without a version: a copy written before versions, takes
        any change)."""
        if _SCN in base.columns:
            versions = base.select(*self.key, _SCN, _SEQ)
        else:
            versions = base.select(
                *self.key,
                F.lit(None).cast("long").alias(_SCN),
                F.lit(None).cast("long").alias(_SEQ),
            )
        c, b = last.alias("_c"), versions.alias("_b")
        same = F.lit(True)
        for k in self.key:
            same = same & F.col(f"_c.{k}").eqNullSafe(F.col(f"_b.{k}"))
        newer = (
            F.col(f"_b.{_SCN}").isNull()
            | (F.col("_c._commit_scn") > F.col(f"_b.{_SCN}"))
            | (
                (F.col("_c._commit_scn") == F.col(f"_b.{_SCN}"))
                & (F.col("_c._txn_seq") > F.col(f"_b.{_SEQ}"))
            )
        )
        return c.join(b, on=same, how="left").where(newer).select("_c.*")

    def _moved(self, df: DataFrame) -> DataFrame:
        """The old key of every update that changed its row's key, as a delete.

        An update's pre- and post-image share ``_commit_scn`` and ``_txn_seq``;
        where their keys differ (NULL-safely), the pre-image's key is gone from
        the table (it must not stay in the copy). Needs the pre-images
        (``includePreimage``, the default).
        """
        pre = df.where(F.col("_change_type") == "update_preimage")
        post = df.where(F.col("_change_type") == "update_postimage").select(
            "_commit_scn",
            "_txn_seq",
            *(F.col(k).alias(f"_cb_post_{i}") for i, k in enumerate(self.key)),
        )
        same = F.lit(True)
        for i, k in enumerate(self.key):
            same = same & F.col(k).eqNullSafe(F.col(f"_cb_post_{i}"))
        return (
            pre.join(post, on=["_commit_scn", "_txn_seq"])
            .where(~same)
            .drop(*(f"_cb_post_{i}" for i in range(len(self.key))))
            .withColumn("_change_type", F.lit("delete"))
            .select(*df.columns)
        )


#: what :meth:`ParquetMirror._apply` returns when no change is newer than the copy's
_UNCHANGED = "unchanged"


def _conform(df: DataFrame, schema: StructType) -> DataFrame:
    """``df`` (the copy so far) in the stream's columns: the copy follows schema changes.

    A column the stream added is null in the rows the copy already holds, a
    column it no longer has (an allowed drop) goes, and a retyped one is cast
    to the new type (null where a value does not convert).
    """
    have = set(df.columns)
    return df.select(
        *(
            (
                F.col(f.name).try_cast(f.dataType)
                if f.name in have
                else F.lit(None).cast(f.dataType)
            ).alias(f.name)
            for f in schema.fields
        )
    )
