"""The assembler's tables: what a TABLE_MAP event, a DDL statement or a TRUNCATE names.

A TABLE_MAP event gives the layout of a table valid at that position
(:func:`._layout.layout_from_table_map`, with the declared types of
:class:`._ddl.DeclaredTypes` and the column policy); :class:`TableCatalog`
turns it into a :class:`~._txn.MappedTable`: the layout's schema version in
the registry (a new or changed layout is a new version; one read again
after a rewind is found by content, as the relay knows it), its
:class:`~changebus.schemas.RowEncoder` and its compiled transcoder
(:func:`._layout.compile_transcoder`).

Compiling costs milliseconds, so mapped tables are kept:

* ``by_id``: the binlog's table id -> table (None: not captured), valid
  within one binlog file (cleared at each rotation);
* a cache by layout bytes and declared types, least recently used first, of
  at most :data:`_CACHED_LAYOUTS` tables;
* ``latest``: each table's newest one by ``db.table``, kept beside the cache
  (more tables than the cache holds are then not compiled again at every
  TABLE_MAP), and the same by lower-case name (DDL effects name tables in
  lower case): a DDL statement or a TRUNCATE finds its table without a walk
  over every table.

Not thread-safe: one catalog per assembler.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from changebus.schemas import RowEncoder, SchemaRegistry

from .._policy import ColumnPolicy
from ._ddl import DeclaredTypes
from ._layout import compile_transcoder, layout_from_table_map
from ._txn import MappedTable
from ._workers import layout_id

__all__ = ["TableCatalog"]

#: table layouts the catalog keeps compiled besides each table's last one
_CACHED_LAYOUTS = 4096


class TableCatalog:
    """The mapped tables of one assembler (see the module docstring).

    ``workers``: decode workers transcode the rows (each table gets its
    :func:`._workers.layout_id`).
    """

    def __init__(
        self,
        registry: SchemaRegistry,
        declared: DeclaredTypes,
        partition_id: int,
        *,
        checksum_bytes: int,
        tinyint1_as_boolean: bool,
        policy: ColumnPolicy | None,
        workers: bool,
    ) -> None:
        self.registry = registry
        self.declared = declared
        self.partition_id = partition_id
        self._checksum = checksum_bytes
        self._boolean = tinyint1_as_boolean
        self._policy = policy
        self._workers = workers
        #: table id -> table (None: not captured); valid within one binlog file
        self.by_id: dict[int, MappedTable | None] = {}
        #: layout bytes + declared -> table, least recently used first (at most
        #: :data:`_CACHED_LAYOUTS`; each table's last one stays in ``latest`` too)
        self._cache: OrderedDict[tuple[Any, ...], MappedTable] = OrderedDict()
        #: "db.table" -> newest table seen
        self.latest: dict[str, MappedTable] = {}
        #: the same by lower-case name (DDL finds)
        self._lower: dict[str, MappedTable] = {}

    def map(self, event: Any, replaying: Callable[[], bool]) -> tuple[MappedTable, bool]:
        """The table of a TABLE_MAP ``event`` of a captured database, and whether it
        was compiled now (a layout not seen before). ``replaying()``: the event is
        read again after a rewind (its schema version is found, not registered)."""
        raw = event.packet.packet._data
        declared = self.declared.get(event.schema, event.table) or {}
        key = (
            event.schema,
            event.table,
            bytes(raw[26 : len(raw) - self._checksum]),  # after the table id
            tuple(sorted(declared.items())),
        )
        table = self._cache.get(key)
        if table is not None:
            self._cache.move_to_end(key)
        else:  # (more tables than the cache holds: not compiled again at every TABLE_MAP)
            last = self.latest.get(f"{event.schema}.{event.table}")
            table = last if last is not None and last.key == key else None
        compiled = table is None
        if table is None:
            table = self._compile(event, declared, key, replaying)
        self.by_id[event.table_id] = table
        self.latest[table.layout.name] = self._lower[table.layout.name.lower()] = table
        return table, compiled

    def _compile(
        self,
        event: Any,
        declared: dict[str, str],
        key: tuple[Any, ...],
        replaying: Callable[[], bool],
    ) -> MappedTable:
        layout = layout_from_table_map(event, declared, tinyint1_as_boolean=self._boolean)
        layout = layout.with_policy(self._policy)
        wanted = layout.table_schema()
        found = self.registry.find(wanted) if replaying() else None
        schema = found if found is not None else self.registry.register(wanted)
        table = MappedTable(
            layout,
            RowEncoder(
                schema,
                source_id=self.registry.source_id(schema.name),
                partition=self.partition_id,
            ),
            compile_transcoder(layout),
            len(layout.columns),
            key,
            layout_id(layout) if self._workers else b"",
        )
        if len(self._cache) >= _CACHED_LAYOUTS:
            self._cache.popitem(last=False)
        self._cache[key] = table
        return table

    def find(self, db: str, name: str) -> MappedTable | None:
        """The newest table mapped as ``db.name`` (lower case, as DDL effects name them)."""
        return self._lower.get(f"{db}.{name}")

    def truncated(self, written: tuple[str, str]) -> str | None:
        """The ``db.table`` a TRUNCATE of ``written`` (its names as the statement gave
        them) empties: that name when a table of it was mapped or registered, else the
        one table whose name differs from it in case only (None: none, or several)."""
        exact = f"{written[0]}.{written[1]}"
        if exact in self.latest or self.registry.has(exact):
            return exact  # (the common case: no walk over every table)
        lowered = exact.lower()
        twins = {n for n in self.latest if n.lower() == lowered}
        twins |= {n for _, n in self.registry.sources() if n.lower() == lowered}
        return next(iter(twins)) if len(twins) == 1 else None

    def registered_encoder(self, name: str) -> RowEncoder | None:
        """An encoder of the registry's newest schema of ``name`` (None: never sent)."""
        reg = self.registry
        found = name if reg.has(name) else None
        if found is None:
            return None
        return RowEncoder(
            reg.latest(found), source_id=reg.source_id(found), partition=self.partition_id
        )
