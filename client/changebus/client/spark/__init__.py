"""changebus.client.spark: a PySpark data source reading change events from relays.

Usage (PySpark >= 4.2, ``pip install changebus[spark]``)::

    from changebus.client.spark import register
    register(spark)                       # or nothing: Spark finds the source itself
    df = (spark.readStream.format("changebus")
          .option("relays", "http://127.0.0.1:8080")
          .option("sources", "public.orders")
          .option("startingScn", "earliest")
          .load())

One row per change with the table's columns plus ``_change_type``,
``_commit_scn``, ``_commit_timestamp``, ``_txn_seq``, ``_source`` and ``_partition``
(and ``_not_sent`` with the option ``includeNotSent``); offsets
are SCNs per physical partition, so Spark's checkpoint replays a batch with
identical rows. ``spark.read.format("changebus")`` reads an SCN range as a
batch. A table's new schema version stops a stream before its first row
(``SchemaChangedError``; :func:`schema_change_of` tells a restartable stop);
``schemaTrackingLocation`` keeps the query's schema across restarts.
Options, semantics and an example job: docs/spark.md.

The same layout without Spark (data frames from a consumer):
:func:`arrow_batches` turns a :class:`~changebus.client.Consumer`'s windows
into :class:`pyarrow.RecordBatch` objects, decoded column-wise
(:class:`ArrowDecoder`; ``ConsumerConfig(columnar=True)``).

This module imports pyspark and pyarrow; :mod:`changebus.client` itself
never does.
"""

from __future__ import annotations

from typing import Any

try:
    import pyarrow  # noqa: F401
    import pyspark  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "changebus.client.spark needs pyspark >= 4.2 and pyarrow: pip install 'changebus[spark]'"
    ) from exc

from ._arrow import union_schema as union_schema
from ._columns import ArrowDecoder as ArrowDecoder, arrow_batches as arrow_batches
from ._evolution import schema_change_of as schema_change_of
from ._mirror import ParquetMirror as ParquetMirror
from ._options import OPTION_NAMES as OPTION_NAMES, SourceOptions as SourceOptions
from ._plan import ScnRangePartition as ScnRangePartition
from ._source import (
    ChangebusBatchReader as ChangebusBatchReader,
    ChangebusDataSource as ChangebusDataSource,
    ChangebusStreamReader as ChangebusStreamReader,
    source_schema as source_schema,
)

__all__ = [
    "OPTION_NAMES",
    "ArrowDecoder",
    "ChangebusBatchReader",
    "ChangebusDataSource",
    "ChangebusStreamReader",
    "ParquetMirror",
    "ScnRangePartition",
    "SourceOptions",
    "arrow_batches",
    "register",
    "schema_change_of",
    "source_schema",
    "union_schema",
]


def register(spark: Any) -> None:
    """Register ``format("changebus")`` with a :class:`pyspark.sql.SparkSession`.

    Only needed where automatic discovery does not happen (the package is not
    importable by the Python that Spark starts, see docs/spark.md).
    """
    spark.dataSource.register(ChangebusDataSource)
