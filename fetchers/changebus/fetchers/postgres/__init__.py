"""changebus.fetchers.postgres: Postgres logical decoding (pgoutput) building blocks.

Work in progress (issue 4): the pgoutput message parser and the binary value
decoders. The streaming fetcher built on them is not here yet.
"""

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
from ._values import TYPE_OIDS as TYPE_OIDS, decode_value as decode_value

__all__ = [
    "TYPE_OIDS",
    "UNCHANGED",
    "Begin",
    "Commit",
    "Delete",
    "Insert",
    "LogicalMessage",
    "Origin",
    "Relation",
    "RelationColumn",
    "Truncate",
    "TypeInfo",
    "Update",
    "decode_value",
    "parse_message",
]
