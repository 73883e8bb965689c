"""A Spark driver for test_spark_crash.py: runs in its own process (and JVM) so it can be killed.

    python spark_crash_job.py RELAY_URL CHECKPOINT OUT HANG_AT MARKER

foreachBatch writes each batch to OUT/batch_id=<id> (overwrite: idempotent by
batch id) and appends "<id> <rows>" to OUT/ledger. In batch HANG_AT (when
MARKER does not exist yet), after writing, it creates MARKER and sleeps: the
test kills the driver there, with the batch written but not committed. With
HANG_AT = -1 it runs with Trigger.AvailableNow and exits when drained.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession


def main() -> None:
    url, checkpoint, out, hang_at, marker = sys.argv[1:6]
    hang = int(hang_at)
    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)

    def sink(df: Any, batch_id: int) -> None:
        df = df.persist()
        n = df.count()
        df.write.mode("overwrite").parquet(str(outdir / f"batch_id={batch_id}"))
        with open(outdir / "ledger", "a") as f:
            f.write(f"{batch_id} {n}\n")
        df.unpersist()
        if batch_id == hang and not Path(marker).exists():
            Path(marker).write_text("hanging")
            time.sleep(600)

    stream = (
        spark.readStream.format("changebus")
        .option("relays", url)
        .option("startingScn", "earliest")
        .option("maxRowsPerTrigger", "1500")
        .option("numPartitions", "2")
        .load()
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", checkpoint)
    )
    if hang < 0:
        q = stream.trigger(availableNow=True).start()
    else:
        q = stream.trigger(processingTime="0 seconds").start()
    q.awaitTermination()
    spark.stop()


if __name__ == "__main__":
    main()
