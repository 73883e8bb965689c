"""Automatic discovery of ``format("changebus")`` by PySpark.

On its first Python data source look-up Spark imports every top-level module
whose name starts with ``pyspark_`` and registers its ``DefaultSource``. This
shim is that module for changebus; it only re-exports the source class.
"""

from changebus.client.spark import ChangebusDataSource as DefaultSource

__all__ = ["DefaultSource"]
