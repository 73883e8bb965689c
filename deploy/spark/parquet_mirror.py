"""Example job: keep a Parquet mirror of one table up to date from a changebus relay.

    PYSPARK_PYTHON=$(which python) python deploy/spark/parquet_mirror.py \\
        --relays http://127.0.0.1:8080 --source public.accounts --key id \\
        --mirror /data/mirror/accounts --checkpoint /data/ckpt/accounts [--available-now] \\
        [--bootstrap http://127.0.0.1:8090] [--num-partitions 4] [--master spark://host:7077] \\
        [--allow-schema-changes drop,retype]

The query reads ``format("changebus")`` from the earliest SCN the relay keeps
(with ``--bootstrap``: from a snapshot of the bootstrap server, which also
recovers a position the relay no longer keeps) and applies every micro-batch with :class:`changebus.client.spark.ParquetMirror`
(MERGE-style upserts and deletes by key, idempotent per batch id). Stop it at
any time (Ctrl-C, kill -9 of the driver): started again with the same
``--checkpoint`` and ``--mirror`` it continues after the last committed batch
and replays an unfinished one with identical rows, so the mirror ends equal to
the table. ``--available-now`` catches up and exits (for a scheduler);
otherwise it runs every ``--trigger-s`` seconds. It runs the same on a cluster
(``--master spark://host:7077`` or ``local-cluster[2,1,1024]``, or through
``spark-submit``): executors read the relays themselves, the mirror directory
must be a file system every executor and the driver share. See docs/spark.md,
"Running on a cluster".

Schema changes: the query keeps its table schema in ``<checkpoint>/_changebus_schemas``
(the source's ``schemaTrackingLocation``). When the table gains a column the
query stops before the first row of the new version with a retriable
``SchemaChangedError``; this job then starts it again (the documented
restart), which continues with the new column (null in the rows the mirror
already holds). A dropped or retyped column stops it with
``SchemaChangeRefusedError`` unless ``--allow-schema-changes`` allows it.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from changebus.client.spark import ParquetMirror, schema_change_of

log = logging.getLogger("changebus.examples.parquet_mirror")


def start_mirror(
    spark: Any,
    *,
    relays: str,
    source: str,
    key: list[str],
    mirror: str,
    checkpoint: str,
    available_now: bool = False,
    trigger_s: float = 5.0,
    max_rows_per_trigger: int = 0,
    bootstrap: str = "",
    num_partitions: int = 1,
    allow_schema_changes: str = "",
) -> Any:
    """Start the mirroring query on ``spark``; returns the StreamingQuery.

    The query's schema is kept under the checkpoint (``_changebus_schemas``).
    """
    reader = (
        spark.readStream.format("changebus")
        .option("relays", relays)
        .option("sources", source)
        .option("startingScn", "earliest")
        .option("schemaTrackingLocation", f"{checkpoint.rstrip('/')}/_changebus_schemas")
    )
    if allow_schema_changes:
        reader = reader.option("allowSchemaChanges", allow_schema_changes)
    if bootstrap:
        reader = reader.option("bootstrapUrl", bootstrap)
    if max_rows_per_trigger:
        reader = reader.option("maxRowsPerTrigger", str(max_rows_per_trigger))
    if num_partitions > 1:
        reader = reader.option("numPartitions", str(num_partitions))
    writer = (
        reader.load()
        .writeStream.foreachBatch(ParquetMirror(mirror, key))
        .option("checkpointLocation", checkpoint)
        .queryName(f"mirror {source}")
    )
    if available_now:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{trigger_s:g} seconds")
    return writer.start()


def run_mirror(spark: Any, *, restarts: int = 20, **options: Any) -> None:
    """Run :func:`start_mirror` until it ends, starting it again after a schema change.

    A query stopped by a retriable ``SchemaChangedError`` is started again with
    the same options (it continues with the new schema kept in its checkpoint);
    any other failure, and more than ``restarts`` schema changes in a row, is raised.
    """
    for _ in range(restarts + 1):
        query = start_mirror(spark, **options)
        try:
            query.awaitTermination()
            return
        except Exception as exc:
            if schema_change_of(exc) != "schema_changed":
                raise
            log.warning("the table's schema changed; starting the query again: %s", exc)
    raise RuntimeError(f"more than {restarts} schema changes in a row")


def main() -> None:
    from pyspark.sql import SparkSession

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--relays", required=True, help="comma-separated relay URLs")
    p.add_argument("--source", required=True, help="the table, e.g. public.accounts")
    p.add_argument("--key", required=True, help="comma-separated key columns")
    p.add_argument("--mirror", required=True, help="directory of the Parquet mirror")
    p.add_argument("--checkpoint", required=True, help="Spark checkpoint directory")
    p.add_argument("--available-now", action="store_true", help="catch up, then exit")
    p.add_argument("--trigger-s", type=float, default=5.0, help="seconds between batches")
    p.add_argument("--max-rows-per-trigger", type=int, default=0)
    p.add_argument("--bootstrap", default="", help="comma-separated bootstrap server URLs")
    p.add_argument("--num-partitions", type=int, default=1, help="Spark tasks per batch")
    p.add_argument(
        "--allow-schema-changes",
        default="",
        help="non-additive schema changes to mirror: drop, retype (comma-separated)",
    )
    p.add_argument(
        "--master",
        default="",
        help="Spark master URL, e.g. spark://host:7077 (default: spark-submit's or local[*])",
    )
    args = p.parse_args()
    builder = SparkSession.builder.appName("changebus parquet mirror")
    if args.master:
        builder = builder.master(args.master)
    spark = builder.getOrCreate()
    logging.basicConfig(level=logging.INFO)
    run_mirror(
        spark,
        relays=args.relays,
        source=args.source,
        key=[k.strip() for k in args.key.split(",") if k.strip()],
        mirror=args.mirror,
        checkpoint=args.checkpoint,
        available_now=args.available_now,
        trigger_s=args.trigger_s,
        max_rows_per_trigger=args.max_rows_per_trigger,
        bootstrap=args.bootstrap,
        num_partitions=args.num_partitions,
        allow_schema_changes=args.allow_schema_changes,
    )


if __name__ == "__main__":
    main()
