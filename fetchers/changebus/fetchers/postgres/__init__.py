"""changebus.fetchers.postgres: Postgres logical decoding (pgoutput) building blocks.

The fetcher itself is kind ``postgres`` (docs/postgres.md), built by
:func:`fetcher_factory` (its entry in the ``changebus.fetchers`` group); this
package exposes its building blocks: the pgoutput message parser, the binary
value decoders, the catalog type resolver, the assembler that turns a message
stream into encoded windows, :func:`message_scn` (the SCN a non-transactional
marker message becomes), :func:`pg_connect` (a connection whose errors
never quote the DSN), :func:`pg_error_reason` (an error's first line without
connection details), and :class:`EmbeddedPostgres`, a private throwaway
server for demos and tests.
"""

from collections.abc import Mapping
from typing import Any

from .._base import Fetcher
from ._assembler import Assembler as Assembler, message_scn as message_scn
from ._config import PostgresConfig as PostgresConfig
from ._copyenc import CopyEncoder as CopyEncoder
from ._embedded import EmbeddedPostgres as EmbeddedPostgres, find_pg_bin as find_pg_bin
from ._pgoutput import (
    UNCHANGED as UNCHANGED,
    Begin as Begin,
    Commit as Commit,
    Delete as Delete,
    Insert as Insert,
    LogicalMessage as LogicalMessage,
    Origin as Origin,
    Relation as Relation,
    RelationColumn as RelationColumn,
    Truncate as Truncate,
    TypeInfo as TypeInfo,
    Update as Update,
    parse_message as parse_message,
)
from ._setup import (
    connect as pg_connect,
    reason as pg_error_reason,
    system_identifier as pg_system_identifier,
)
from ._transcode import Fallback as Fallback
from ._types import ColumnType as ColumnType, TypeResolver as TypeResolver
from ._values import TYPE_OIDS as TYPE_OIDS, decode_value as decode_value
from ._watchdog import Watchdog as PgWatchdog, cut_socket as pg_cut_socket


def fetcher_factory(name: str, partition_id: int, options: Mapping[str, Any]) -> Fetcher:
    """Build a ``postgres`` fetcher for a relay partition from its options table.

    The fetcher module (replication connection, stream thread) is imported
    on the first call, so the building blocks above stay light to import.
    """
    from ._fetcher import _factory

    return _factory(name, partition_id, options)


__all__ = [
    "TYPE_OIDS",
    "UNCHANGED",
    "Assembler",
    "Begin",
    "ColumnType",
    "Commit",
    "CopyEncoder",
    "Delete",
    "EmbeddedPostgres",
    "Fallback",
    "Insert",
    "LogicalMessage",
    "Origin",
    "PgWatchdog",
    "PostgresConfig",
    "Relation",
    "RelationColumn",
    "Truncate",
    "TypeInfo",
    "TypeResolver",
    "Update",
    "decode_value",
    "fetcher_factory",
    "find_pg_bin",
    "message_scn",
    "parse_message",
    "pg_connect",
    "pg_cut_socket",
    "pg_error_reason",
    "pg_system_identifier",
]
