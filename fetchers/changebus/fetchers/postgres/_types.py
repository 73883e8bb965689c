"""Column types from the Postgres catalog, for the Avro mapping and the decoders.

pgoutput's Relation message gives each column's type OID and typmod only.
:class:`TypeResolver` asks ``pg_type`` once per (OID, typmod) and answers
with a :class:`ColumnType`: the ``format_type`` text the Avro mapping reads
(for a domain: its base type), the OID whose binary format the value has,
whether it is an array, and enum labels. An array column's declared number of
dimensions (``int4[][]``: 2; from ``pg_attribute.attndims``, which the type
does not carry) nests its Avro array type. Results are cached; the resolver is
used from the fetcher's own thread only (it holds a blocking connection).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from changebus.schemas import AvroType, pg_avro_type

__all__ = ["ColumnType", "TypeResolver"]

_QUERY = """
SELECT t.typtype, t.typbasetype, t.typtypmod, t.typelem, t.typcategory,
       format_type(t.oid, %(typmod)s),
       CASE WHEN t.typtype = 'e' THEN ARRAY(
           SELECT enumlabel::text FROM pg_enum WHERE enumtypid = t.oid ORDER BY enumsortorder)
       END,
       e.typtype,
       CASE WHEN e.typtype = 'e' THEN ARRAY(
           SELECT enumlabel::text FROM pg_enum WHERE enumtypid = e.oid ORDER BY enumsortorder)
       END
FROM pg_type t LEFT JOIN pg_type e ON e.oid = t.typelem AND t.typcategory = 'A'
WHERE t.oid = %(oid)s
"""


@dataclass(frozen=True, slots=True)
class ColumnType:
    """How to map and decode one column type."""

    formatted: str
    decode_oid: int
    is_array: bool
    enum_labels: tuple[str, ...] | None
    #: array dimensions (sub-arrays are never NULL, elements may be)
    dims: int = 1

    @property
    def avro(self) -> AvroType:
        avro = pg_avro_type(self.formatted, enum_labels=self.enum_labels)
        for _ in range(self.dims - 1):
            avro = {"type": "array", "items": avro}
        return avro

    def with_dims(self, dims: int) -> ColumnType:
        """This type declared with ``dims`` dimensions (arrays only; 0 means 1)."""
        dims = max(1, dims)
        return self if not self.is_array or dims == self.dims else replace(self, dims=dims)


class TypeResolver:
    """Resolves (type OID, typmod) pairs through a psycopg connection."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._cache: dict[tuple[int, int], ColumnType] = {}

    def primary_key(self, relation_oid: int) -> tuple[str, ...] | None:
        """The table's primary key columns in key order, or None without one.

        pgoutput flags the *replica identity* columns, which under
        ``REPLICA IDENTITY FULL`` are all of them; the event key must be the
        real key.
        """
        row = self._conn.execute(
            "SELECT array_agg(a.attname::text ORDER BY k.ord) FROM pg_index i "
            "CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord) "
            "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum "
            "WHERE i.indrelid = %s AND i.indisprimary",
            (relation_oid,),
        ).fetchone()
        return tuple(row[0]) if row and row[0] else None

    def key_positions(self, relation_oid: int) -> tuple[int, ...] | None:
        """The primary key's places among the columns a Relation message lists.

        A Relation message lists the table's columns that are neither dropped
        nor generated, in ``attnum`` order, as they were when the change was
        written. Columns added since come after them, so while the table has
        no dropped column, the key's places among today's columns are its
        places in any older message too, whatever the columns were called
        then. None without a primary key or with a dropped column (whose
        place in older messages the catalog cannot tell).
        """
        row = self._conn.execute(
            "SELECT bool_or(a.attisdropped), array_agg(a.attnum ORDER BY a.attnum) "
            "FILTER (WHERE NOT a.attisdropped AND a.attgenerated = ''), "
            "(SELECT i.indkey::int2[] FROM pg_index i WHERE i.indrelid = %s AND i.indisprimary) "
            "FROM pg_attribute a WHERE a.attrelid = %s AND a.attnum > 0",
            (relation_oid, relation_oid),
        ).fetchone()
        if row is None or row[0] or not row[1] or not row[2]:
            return None
        order = {attnum: place for place, attnum in enumerate(row[1])}
        if not all(attnum in order for attnum in row[2]):
            return None
        return tuple(order[attnum] for attnum in row[2])

    def array_dims(self, relation_oid: int) -> dict[str, int]:
        """Declared dimensions of the table's array columns (by column name)."""
        rows = self._conn.execute(
            "SELECT attname::text, attndims FROM pg_attribute "
            "WHERE attrelid = %s AND attnum > 0 AND attndims > 1 AND NOT attisdropped",
            (relation_oid,),
        ).fetchall()
        return {str(name): int(dims) for name, dims in rows}

    def resolve(self, oid: int, typmod: int) -> ColumnType:
        key = (oid, typmod)
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = self._lookup(oid, typmod)
        return found

    def _lookup(self, oid: int, typmod: int) -> ColumnType:
        row = self._conn.execute(_QUERY, {"oid": oid, "typmod": typmod}).fetchone()
        if row is None:
            return ColumnType("text", oid, False, None)
        typtype, base, base_typmod, elem, category, formatted, labels, elem_type, elem_labels = row
        if typtype == "d":  # a domain travels as its base type
            return self.resolve(int(base), int(base_typmod))
        if typtype == "e":
            return ColumnType(formatted, oid, False, tuple(labels))
        if category == "A":
            if elem_type == "e":
                return ColumnType(formatted, oid, True, tuple(elem_labels))
            if elem_type == "d":
                inner = self.resolve(int(elem), -1)
                return ColumnType(inner.formatted + "[]", oid, True, inner.enum_labels)
            return ColumnType(formatted, oid, True, None)
        return ColumnType(formatted, oid, False, None)
