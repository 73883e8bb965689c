"""changebus.fetchers.mysql: the MySQL / MariaDB binlog fetcher (docs/mysql.md).

The fetcher is kind ``mysql``, built by :func:`fetcher_factory` (its entry in
the ``changebus.fetchers`` group; it needs the ``[mysql]`` extra:
mysql-replication and PyMySQL). This package exposes its configuration, its
building blocks (TABLE_MAP layouts, their compiled row decoders and
binlog-to-Avro transcoders, the
declared-type history that follows DDL, the binlog-to-window assembler), the
consistent-snapshot helper the bootstrap server seeds from,
:func:`open_connection` (every connection to a source: login, password
file, TLS), and
:class:`EmbeddedMariaDB`, a private throwaway server for tests and benchmarks.
"""

from collections.abc import Mapping
from typing import Any

from .._base import Fetcher
from ._assembler import BinlogAssembler as BinlogAssembler
from ._config import MySQLConfig as MySQLConfig
from ._connect import open_connection as open_connection
from ._ddl import DdlEffect as DdlEffect, DeclaredTypes as DeclaredTypes
from ._embedded import EmbeddedMariaDB as EmbeddedMariaDB, find_mariadb_bin as find_mariadb_bin
from ._fetcher import MySQLFetcher as MySQLFetcher, _factory
from ._layout import (
    ColumnLayout as ColumnLayout,
    RowsDecoder as RowsDecoder,
    RowsTranscoder as RowsTranscoder,
    TableLayout as TableLayout,
    compile_decoder as compile_decoder,
    compile_transcoder as compile_transcoder,
    layout_from_table_map as layout_from_table_map,
)
from ._position import format_position as format_position, parse_position as parse_position
from ._snapshot import MySQLSnapshot as MySQLSnapshot, consistent_snapshot as consistent_snapshot


def fetcher_factory(name: str, partition_id: int, options: Mapping[str, Any]) -> Fetcher:
    """Build a ``mysql`` fetcher for a relay partition from its options table."""
    return _factory(name, partition_id, options)


__all__ = [
    "BinlogAssembler",
    "ColumnLayout",
    "DdlEffect",
    "DeclaredTypes",
    "EmbeddedMariaDB",
    "MySQLConfig",
    "MySQLFetcher",
    "MySQLSnapshot",
    "RowsDecoder",
    "RowsTranscoder",
    "TableLayout",
    "compile_decoder",
    "compile_transcoder",
    "consistent_snapshot",
    "fetcher_factory",
    "find_mariadb_bin",
    "format_position",
    "layout_from_table_map",
    "open_connection",
    "parse_position",
]
