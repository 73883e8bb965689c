"""From a Relation message to what the assembler keeps per table.

:func:`choose_key` picks a table's event key (and whether its columns are
NOT NULL); :class:`Table` is the assembler's per-table state;
:func:`adapter` converts decoded values to what fastavro takes;
:func:`apply_rules` applies the column policy to a decoded row;
:func:`column_types` resolves a Relation message's column types, those
dropped from the catalog since from the registered schema
(:func:`dropped_type`); :func:`refuse_unsupported` stops at a column of a
type changebus cannot decode. Pure functions and a plain data class: no
thread-safety of their own.
"""

from __future__ import annotations

import decimal
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from changebus.schemas import (
    RowEncoder,
    SchemaRegistry,
    SourceConfigError,
    TableSchema,
    UnknownSchemaError,
    pg_numeric_text,
)

from .._policy import ColumnRule
from ._pgoutput import Relation
from ._transcode import Transcoder
from ._types import ColumnType, recovered

__all__ = [
    "Table",
    "adapter",
    "apply_rules",
    "choose_key",
    "column_types",
    "depth",
    "dropped_type",
    "old_key",
    "refuse_unsupported",
]

log = logging.getLogger("changebus.fetchers.postgres")


@dataclass
class Table:
    """What the assembler holds per table (relation OID) at its current version.

    ``types``, ``adapters``, ``names`` and ``key_flags`` follow the Relation
    message's column order; ``announced`` is whether this assembler's windows
    carried the schema already (see the assembler's module docstring).
    ``transcoder`` and ``encoder`` are made when rows come (``make_transcoder``,
    ``make_encoder``; get them through :class:`Transcoders`), and dropped again
    when many other tables had rows since. Owned by one assembler (not
    thread-safe).
    """

    schema: TableSchema
    #: the table's source id (what its encoder writes in event headers)
    source_id: int
    make_encoder: Callable[[], RowEncoder]
    types: tuple[ColumnType, ...]
    adapters: tuple[Callable[[Any], Any] | None, ...]
    names: tuple[str, ...]
    key_flags: tuple[bool, ...]
    make_transcoder: Callable[[], Transcoder]
    transcoder: Transcoder | None = None
    encoder: RowEncoder | None = None
    announced: bool = False
    #: the column policy's rule per column (None: the table has no policy)
    rules: tuple[ColumnRule | None, ...] | None = None
    #: the not-sent list of a key-only before-image (non-key, non-excluded columns)
    key_only_not_sent: tuple[str, ...] = ()
    #: the columns the column policy excludes (never decoded)
    excluded: frozenset[str] = frozenset()
    #: (type OID, typmod) per column, as the Relation message gave them
    type_ids: tuple[tuple[int, int], ...] = ()


#: tables whose transcoder and row encoder an assembler keeps (a 10-column table's
#: are about 12 KB and 5 KB)
MAX_TRANSCODERS = 1024


class Transcoders:
    """The compiled transcoders and row encoders of the tables that had rows last, of
    at most :data:`MAX_TRANSCODERS` tables (least recently used dropped first).

    A source with thousands of relations (a partitioned table's partitions
    each are one) kept both, and each schema's derived Avro schemas, per
    relation for ever: about 15 KB a 10-column table. What every table keeps
    is its Relation's shape (about 3 KB); a dropped table's schema releases
    its derived schemas (:meth:`TableSchema.release_derived`), and its
    transcoder and encoder are made again when its rows come back.

    Data structure: relation OID -> its :class:`Table`, least recently used
    first. Invariant: a table is in here exactly while its ``transcoder`` or
    its ``encoder`` is set. Rows of the same table in a row skip the
    reordering (``_last``). Owned by one assembler (not thread-safe).
    """

    def __init__(self) -> None:
        self._lru: OrderedDict[int, Table] = OrderedDict()
        self._last = -1
        #: transcoders compiled, and row encoders made (again, after being dropped, too)
        self.compiled = 0
        self.encoders_made = 0

    def __len__(self) -> int:
        return len(self._lru)

    def of(self, oid: int, table: Table) -> Transcoder:
        """``table``'s transcoder (the table of relation ``oid``), compiled when it has none."""
        found = table.transcoder
        if found is None:
            found = table.transcoder = table.make_transcoder()
            self.compiled += 1
            self._keep(oid, table)
        elif oid != self._last:
            self._keep(oid, table)
        return found

    def encoder(self, oid: int, table: Table) -> RowEncoder:
        """``table``'s row encoder (the table of relation ``oid``), made when it has none."""
        found = table.encoder
        if found is None:
            found = table.encoder = table.make_encoder()
            self.encoders_made += 1
            self._keep(oid, table)
        elif oid != self._last:
            self._keep(oid, table)
        return found

    def _keep(self, oid: int, table: Table) -> None:
        """``table`` was used, or just got its transcoder or encoder: the most recently
        used (kept, the least recently used dropped past the bound)."""
        self._last = oid
        if oid in self._lru:
            self._lru.move_to_end(oid)
            return
        self._lru[oid] = table
        while len(self._lru) > MAX_TRANSCODERS:
            _oid, dropped = self._lru.popitem(last=False)
            dropped.transcoder = dropped.encoder = None
            dropped.schema.release_derived()

    def forget(self, oid: int) -> None:
        """Relation ``oid`` has a new :class:`Table`: its old one leaves."""
        old = self._lru.pop(oid, None)
        if old is not None:
            old.transcoder = old.encoder = None
        if self._last == oid:
            self._last = -1


def choose_key(
    rel: Relation,
    name: str,
    registry: SchemaRegistry,
    primary_key: Callable[[int], tuple[str, ...] | None] | None,
    key_positions: Callable[[int], tuple[tuple[int, int], ...] | None] | None,
) -> tuple[tuple[str, ...], bool]:
    """The event key of a Relation message's table, and whether its columns are NOT NULL.

    The key is the replica identity index under ``REPLICA IDENTITY USING
    INDEX``, else the catalog's primary key, else the replica identity the
    message flags. Their columns are NOT NULL, except under ``REPLICA
    IDENTITY FULL`` without a primary key: the table is keyed by all its
    columns, any of which may be NULL.

    The catalog's primary key is today's, while the message may come from
    older WAL (a restart, a lagging slot): a key column renamed or added
    since is not among its columns. Then the key is, in this order: the
    previous version's (when its columns are all still there); the
    columns at the key's places (``key_positions``, when the catalog can
    tell them); the replica identity the message flags, which under
    ``REPLICA IDENTITY DEFAULT`` is the primary key of that time.
    """
    names = {c.name for c in rel.columns}
    identity = tuple(c.name for c in rel.columns if c.key)
    full = len(identity) == len(rel.columns)
    if rel.replica_identity == "i" and identity and not full:
        # REPLICA IDENTITY USING INDEX: the old keys pgoutput sends (a DELETE's, an
        # UPDATE's that changed them) hold that index's columns only, so they key the
        # events; keyed by another primary key, a DELETE's key was NULL (the partition
        # failed) and an UPDATE of the primary key alone came without the old key
        # (review). The index is unique, not partial, on NOT NULL columns (Postgres').
        return identity, True
    pk = primary_key(rel.oid) if primary_key is not None else None
    if not pk:
        return identity, not full
    if set(pk) <= names:
        return pk, True
    try:
        key = registry.latest(name).key
    except UnknownSchemaError:
        key = ()
    if not key or not set(key) <= names:
        places = key_positions(rel.oid) if key_positions is not None else None
        if places and all(
            p < len(rel.columns) and rel.columns[p].type_oid == oid for p, oid in places
        ):
            key = tuple(rel.columns[p].name for p, _ in places)
        else:
            key = identity
    log.warning(
        "table %s: the primary key %s is not among the columns of a Relation message "
        "from older WAL (renamed since?); key %s used for that version",
        name,
        ",".join(pk),
        ",".join(key) or "(none)",
    )
    return key, key != identity or not full


def adapter(avro: Any) -> Callable[[Any], Any] | None:
    """A converter from decoded values to what fastavro takes, where needed."""
    if isinstance(avro, dict):
        if avro.get("changebus.type") == "numeric":
            return lambda v: pg_numeric_text(v) if isinstance(v, decimal.Decimal) else v
        if avro.get("type") == "array":
            items = avro["items"][1] if isinstance(avro["items"], list) else avro["items"]
            inner = adapter(items)
            if inner is not None:
                return lambda v: _deep(v, inner)
    return None


def _deep(value: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(value, list):
        return [_deep(v, fn) for v in value]
    return None if value is None else fn(value)


def apply_rules(
    names: tuple[str, ...],
    rules: tuple[ColumnRule | None, ...],
    row: dict[str, Any],
    not_sent: list[str],
) -> None:
    """The column policy on a decoded row: excluded columns go, the others are
    hashed or truncated; a value not sent (unchanged TOAST) stays not sent."""
    for name, rule in zip(names, rules, strict=True):
        if rule is None:
            continue
        if rule.action == "exclude":
            row.pop(name, None)
            if name in not_sent:
                not_sent.remove(name)
        elif name not in not_sent:
            row[name] = rule.apply(row.get(name))


def column_types(
    rel: Relation,
    table: str,
    registry: SchemaRegistry,
    resolve: Callable[[int, int], ColumnType],
    array_dims: Callable[[int], dict[str, int]] | None,
    named: Callable[[str], ColumnType | None] | None,
) -> tuple[ColumnType, ...]:
    """The types of a Relation message's columns (``resolve``: through the catalog), arrays
    with their declared dimensions (``array_dims``), types dropped since from the table's
    registered schema (:func:`dropped_type`)."""
    types = tuple(resolve(c.type_oid, c.typmod) for c in rel.columns)
    if array_dims is not None and any(t.is_array for t in types):
        dims = array_dims(rel.oid)
        types = tuple(
            t.with_dims(dims.get(c.name, 1)) for c, t in zip(rel.columns, types, strict=True)
        )
    return tuple(
        dropped_type(registry, table, c.name, t, resolve, named)
        for c, t in zip(rel.columns, types, strict=True)
    )


def dropped_type(
    registry: SchemaRegistry,
    table: str,
    column: str,
    ctype: ColumnType,
    resolve: Callable[[int, int], ColumnType],
    named: Callable[[str], ColumnType | None] | None = None,
) -> ColumnType:
    """The type of a column whose type OID today's catalog lacks (dropped since the WAL
    being read was written: ``ALTER ... TYPE text; DROP TYPE``, with rows of the old type
    still to stream): the column's type in the table's newest known version, rebuilt from
    its Avro type (:func:`~._types.recovered`: an enum, a composite, a range, a domain's
    base type ``named`` finds), with a warning; else ``ctype``, refused with the reason.
    A relay restart empties the type cache, and every restart met the same WAL: the
    partition stopped for good (review)."""
    if ctype.unsupported is None or not ctype.formatted.startswith("oid "):
        return ctype
    try:
        col = next((c for c in registry.latest(table).columns if c.name == column), None)
    except UnknownSchemaError:
        col = None
    found = None
    if col is not None and not col.policy.startswith("hmac"):  # (hashed: its type is gone)
        found = recovered(
            col.type,
            col.source_type,
            ctype.decode_oid,
            lambda oid: resolve(oid, -1).render,
            named or (lambda _text: None),
        )
    if found is None:
        why = "no registered version of the table has the column" if col is None else (
            f"the table's last known version has it as {col.source_type or col.type}, "
            "whose structure its schema does not tell"
        )  # fmt: skip
        return replace(
            ctype,
            unsupported=f"the type was dropped before these rows were read, and {why}",
        )
    log.warning(
        "column %s.%s: its type (oid %d) is gone from the catalog; read as %s, its type "
        "in the table's last known version",
        table,
        column,
        ctype.decode_oid,
        found.formatted,
    )
    return found


def refuse_unsupported(
    table: str, rel: Relation, types: tuple[ColumnType, ...], excluded: frozenset[str]
) -> None:
    """A :class:`SourceConfigError` for the first column of a type changebus cannot
    decode (:attr:`ColumnType.unsupported`) that the column policy does not exclude."""
    for column, ctype in zip(rel.columns, types, strict=True):
        if ctype.unsupported is None or column.name in excluded:
            continue
        raise SourceConfigError(
            f"column {table}.{column.name} has type {ctype.formatted}, which changebus cannot "
            f'capture ({ctype.unsupported}): exclude the column (column_policy."{table}".'
            f'{column.name} = "exclude"), leave it out of the publication (a column list), '
            "or change its type"
        )


def depth(value: Any) -> int:
    """Dimensions of a decoded (non-empty) array: nested lists."""
    depth = 0
    while isinstance(value, list) and value:
        depth += 1
        value = value[0]
    return depth


def old_key(table: Table, encoder: RowEncoder, before: dict[str, Any]) -> bytes | None:
    """The event key of an update's before-image; None when it does not hold the key
    (REPLICA IDENTITY USING INDEX on other columns than the key: no old key is known,
    and the update goes without the old key's DELETE)."""
    schema = table.schema
    if not schema.nullable_key and any(before.get(k) is None for k in schema.key):
        return None
    key: bytes = encoder.key_bytes(before)
    return key
