"""Column types from the Postgres catalog, for the Avro mapping and the decoders.

pgoutput's Relation message gives each column's type OID and typmod only.
:class:`TypeResolver` asks ``pg_type`` once per (OID, typmod) and answers
with a :class:`ColumnType`: the ``format_type`` text the Avro mapping reads
(for a domain: its base type), the decoder of the type's binary form, whether
it is an array, and enum labels. An array column's declared number of
dimensions (``int4[][]``: 2; from ``pg_attribute.attndims``, which the type
does not carry) nests its Avro array type. Results are cached; the resolver is
used from the fetcher's own thread only (it holds a blocking connection).

Binary forms. pgoutput ``binary 'true'`` sends every value whose type has a
binary send function in that binary form, so each type needs a decoder of
its own; the resolver picks it once per type, never per row:

* built-in types with a value decoder (:data:`._values.DECODERS`: integers,
  dates, ``pg_lsn``, ``bit``, geometric types, the built-in ranges, ...);
* types whose send function sends UTF-8 text (``textsend`` and the like:
  ``citext``, enums, ``refcursor``): the text;
* ranges and multiranges of any bound type, and composite types, whose
  bounds or fields have a text form (:mod:`._pgtext`, :mod:`._textcompose`): Postgres' text form;
* arrays of any of these: lists of the element's values;
* types without a send function: Postgres sends their text, used as is.

Structure. The Avro type of a composite carries ``"changebus.kind":
"composite"``, a range's (multirange's) ``"changebus.kind": "range"``
(``"multirange"``) and ``"changebus.bound"``, its bounds' type text: a type
dropped from the catalog while rows of it wait in the WAL is rebuilt from
the table's registered schema (:func:`recovered`), as it was before the drop.

Any other type (``money`` inside a range or composite, the ``reg*`` types,
extension types with a binary format of their own such as ``hstore`` or
PostGIS ``geometry``) gets :attr:`ColumnType.unsupported`: the assembler
refuses a table with such a column when it first sees it (a non-retriable
:class:`~changebus.schemas.SourceConfigError`), unless the column policy
excludes the column. Nothing is ever decoded by guesswork.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from struct import error as struct_error
from typing import Any, Final

import psycopg

from changebus.schemas import AvroType, CorruptEventError, pg_avro_type

from . import _textcompose as compose
from ._pgoutput import UNCHANGED, Cell
from ._values import DECODERS, TEXT_FORMS, array_decoder, decode_value, money_decoder

__all__ = ["ColumnType", "TypeResolver", "recovered"]

_MONEY: Final = 790
#: the first OID a database gives its own objects: types below it are built into Postgres
#: (their binary forms never change)
_FIRST_NORMAL_OID: Final = 16384
#: the Avro attributes that tell a type's structure (see the module docstring)
_KIND: Final = "changebus.kind"
_BOUND: Final = "changebus.bound"

_QUERY = """
SELECT t.typtype, t.typbasetype, t.typtypmod, t.typelem, t.typcategory,
       format_type(t.oid, %(typmod)s),
       CASE WHEN t.typtype = 'e' THEN ARRAY(
           SELECT enumlabel::text FROM pg_enum WHERE enumtypid = t.oid ORDER BY enumsortorder)
       END,
       e.typtype, s.prosrc, t.typrelid, t.typdelim::text,
       (SELECT rngsubtype FROM pg_range WHERE rngtypid = t.oid),
       (SELECT rngtypid FROM pg_range WHERE rngmultitypid = t.oid)
FROM pg_type t LEFT JOIN pg_type e ON e.oid = t.typelem AND t.typcategory = 'A'
LEFT JOIN pg_proc s ON s.oid = t.typsend
WHERE t.oid = %(oid)s
"""

_FIELDS = """
SELECT attname::text, atttypid, atttypmod FROM pg_attribute
WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped ORDER BY attnum
"""

#: send functions (their C symbol, ``pg_proc.prosrc``) whose binary form is the UTF-8 text
_TEXT_SENDS: Final = frozenset(
    {"textsend", "varcharsend", "bpcharsend", "namesend", "enum_send", "json_send", "xml_send",
     "unknownsend", "cstring_send"}
)  # fmt: skip


def _utf8(b: bytes) -> str:
    return b.decode()


def enum_type(formatted: str, oid: int, labels: Sequence[str]) -> ColumnType:
    """An enum: its binary form is the label's UTF-8 text."""
    return ColumnType(formatted, oid, False, tuple(labels), decoder=_utf8, render=_utf8, utf8=True)


def _no_binary(b: bytes) -> Any:
    raise ValueError("a binary value of a type without a binary send function")


@dataclass(frozen=True, slots=True)
class ColumnType:
    """How to map and decode one column type.

    ``decoder`` turns a binary value into the value the Avro mapping of
    ``formatted`` takes (None: :func:`~._values.decode_value` by
    ``decode_oid``); ``render`` into Postgres' text form (None: no text form
    known, so the type cannot be a range bound or a composite field);
    ``utf8``: the binary form is the UTF-8 text itself; ``unsupported``: why
    values of this type cannot be captured (None: they can).
    """

    formatted: str
    decode_oid: int
    is_array: bool
    enum_labels: tuple[str, ...] | None
    #: array dimensions (sub-arrays are never NULL, elements may be)
    dims: int = 1
    decoder: Callable[[bytes], Any] | None = field(default=None, compare=False, repr=False)
    render: Callable[[bytes], str] | None = field(default=None, compare=False, repr=False)
    utf8: bool = False
    unsupported: str | None = None
    #: Avro attributes of the (element) type telling its structure: ``((name, text), ...)``
    attrs: tuple[tuple[str, str], ...] = ()

    @property
    def avro(self) -> AvroType:
        avro = pg_avro_type(self.formatted, enum_labels=self.enum_labels)
        if self.attrs:
            leaf = avro
            while isinstance(leaf, dict) and leaf.get("type") == "array":
                leaf = leaf["items"][-1] if isinstance(leaf["items"], list) else leaf["items"]
            if isinstance(leaf, dict):
                leaf.update(self.attrs)
        for _ in range(self.dims - 1):
            avro = {"type": "array", "items": avro}
        return avro

    def with_dims(self, dims: int) -> ColumnType:
        """This type declared with ``dims`` dimensions (arrays only; 0 means 1)."""
        dims = max(1, dims)
        return self if not self.is_array or dims == self.dims else replace(self, dims=dims)

    def decode(self, cell: Cell) -> Any:
        """The value of one cell: NULL, unchanged and text-format cells as they are."""
        decoder = self.decoder
        if decoder is None:
            return decode_value(self.decode_oid, cell, is_array=self.is_array)
        if cell is None or cell is UNCHANGED or isinstance(cell, str):
            return cell
        assert isinstance(cell, bytes)
        try:
            return decoder(cell)
        except (struct_error, ValueError, IndexError, UnicodeDecodeError, ArithmeticError) as exc:
            raise CorruptEventError(
                f"cannot decode a value of type {self.formatted} (oid {self.decode_oid}): {exc}"
            ) from exc


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

    def key_positions(self, relation_oid: int) -> tuple[tuple[int, int], ...] | None:
        """The primary key's places among the columns a Relation message lists, with
        each key column's type OID: ``((place, type oid), ...)`` in key order.

        A Relation message lists the table's columns that are neither dropped
        nor generated, in ``attnum`` order, as they were when the change was
        written. Columns added since come after them, so while the table has
        no dropped column, the key's places among today's columns are its
        places in any older message too, whatever the columns were called
        then (the caller checks the types: a publication's column list, which
        leaves columns out, moves the places). None without a primary key or
        with a dropped column (whose place in older messages the catalog
        cannot tell).
        """
        row = self._conn.execute(
            "SELECT bool_or(a.attisdropped), "
            "array_agg(a.attnum ORDER BY a.attnum) "
            "FILTER (WHERE NOT a.attisdropped AND a.attgenerated = ''), "
            "array_agg(a.atttypid::int8 ORDER BY a.attnum) "
            "FILTER (WHERE NOT a.attisdropped AND a.attgenerated = ''), "
            "(SELECT i.indkey::int2[] FROM pg_index i WHERE i.indrelid = %s AND i.indisprimary) "
            "FROM pg_attribute a WHERE a.attrelid = %s AND a.attnum > 0",
            (relation_oid, relation_oid),
        ).fetchone()
        if row is None or row[0] or not row[1] or not row[3]:
            return None
        order = {attnum: place for place, attnum in enumerate(row[1])}
        if not all(attnum in order for attnum in row[3]):
            return None
        return tuple((order[a], int(row[2][order[a]])) for a in row[3])

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
            return ColumnType(
                f"oid {oid}", oid, False, None, unsupported=f"type oid {oid} is not in pg_type"
            )
        (typtype, base, base_typmod, elem, category, formatted, labels, elem_type, send,
         relid, delim, subtype, multi_of) = row  # fmt: skip
        if typtype == "d":  # a domain travels as its base type
            return self.resolve(int(base), int(base_typmod))
        if typtype == "e":
            return enum_type(formatted, oid, labels)
        if category == "A" and send == "array_send":
            inner = self.resolve(int(elem), -1)
            if inner.decoder is _no_binary:
                inner = replace(inner, unsupported="they have no binary send function")
            if elem_type == "d":
                formatted = inner.formatted + "[]"
            render = None if inner.render is None else compose.array_text(inner.render, delim)
            return ColumnType(
                formatted,
                oid,
                True,
                inner.enum_labels,
                decoder=array_decoder(_element(inner)),
                render=render,
                unsupported=inner.unsupported and f"its elements: {inner.unsupported}",
                attrs=inner.attrs,
            )
        if send is None:  # no binary form: Postgres sends the text
            return ColumnType(formatted, oid, False, None, decoder=_no_binary)
        if send in _TEXT_SENDS:
            return ColumnType(formatted, oid, False, None, decoder=_utf8, render=_utf8, utf8=True)
        if oid == _MONEY:  # its decimals are lc_monetary's (the database's default)
            scale = self._conn.execute("SELECT scale('0'::money::numeric)").fetchone()
            decoder = money_decoder(int(scale[0]) if scale and scale[0] is not None else 2)
            return ColumnType(formatted, oid, False, None, decoder=decoder)
        if oid in DECODERS:
            return ColumnType(
                formatted, oid, False, None, decoder=DECODERS[oid], render=TEXT_FORMS.get(oid)
            )
        if typtype == "r":
            bound = self.resolve(int(subtype), -1)
            if bound.render is None:
                return self._refused(formatted, oid, f"its bounds' type {bound.formatted}", bound)
            render = compose.range_text(bound.render)
            return _text_form(formatted, oid, render, ((_KIND, "range"), (_BOUND, bound.formatted)))
        if typtype == "m":
            one = self.resolve(int(multi_of), -1)
            if one.render is None:
                return self._refused(formatted, oid, f"its ranges' type {one.formatted}", one)
            of = tuple(a for a in one.attrs if a[0] == _BOUND)  # (the range's bound type)
            render = compose.multirange_text(one.render)
            return _text_form(formatted, oid, render, ((_KIND, "multirange"), *of))
        if typtype == "c":
            fields = []
            for name, field_oid, field_typmod in self._conn.execute(_FIELDS, (relid,)).fetchall():
                ftype = self.resolve(int(field_oid), int(field_typmod))
                if ftype.render is None:
                    return self._refused(
                        formatted, oid, f"its field {name} of type {ftype.formatted}", ftype
                    )
                fields.append((int(field_oid), ftype.render))
            render = compose.record_text(fields, self._field_render)
            return _text_form(formatted, oid, render, ((_KIND, "composite"),))
        return ColumnType(
            formatted,
            oid,
            False,
            None,
            unsupported=f"its binary format (send function {send}) is not one changebus decodes",
        )

    def _field_render(self, oid: int) -> Callable[[bytes], str] | None:
        """The renderer of a composite field of type ``oid`` (None: none known)."""
        return self.resolve(oid, -1).render

    def named(self, text: str) -> ColumnType | None:
        """The type ``text`` names (``format_type``'s text, as a registered schema keeps
        it) when its binary form is known whatever became of that name since: a type built
        into Postgres, or one whose binary form is its UTF-8 text; else None."""
        try:
            row = self._conn.execute("SELECT to_regtype(%s)::oid", (text,)).fetchone()
        except (psycopg.ProgrammingError, psycopg.DataError):  # not a type's text at all
            return None
        if row is None or row[0] is None:
            return None
        found = self.resolve(int(row[0]), -1)
        trusted = int(row[0]) < _FIRST_NORMAL_OID or found.utf8
        return found if trusted and found.unsupported is None else None

    @staticmethod
    def _refused(formatted: str, oid: int, part: str, inner: ColumnType) -> ColumnType:
        why = inner.unsupported or "has no text form changebus writes"
        return ColumnType(formatted, oid, False, None, unsupported=f"{part}: {why}")


def _text_form(
    formatted: str, oid: int, render: Callable[[bytes], str], attrs: tuple[tuple[str, str], ...]
) -> ColumnType:
    return ColumnType(formatted, oid, False, None, decoder=render, render=render, attrs=attrs)


def recovered(
    avro: AvroType,
    formatted: str,
    oid: int,
    field_render: Callable[[int], Callable[[bytes], str] | None],
    named: Callable[[str], ColumnType | None],
) -> ColumnType | None:
    """The column type whose Avro type is ``avro`` and whose text is ``formatted`` (a
    registered column's), rebuilt without the type's catalog entry (type ``oid``, dropped
    since); None when they do not tell how its binary form reads.

    An enum's labels are its Avro type's symbols (its binary form is the label); a
    composite's value names its fields' type OIDs (``field_render`` renders them); a
    range's (multirange's) bounds are of the type ``"changebus.bound"`` names
    (``named``); any other type, a domain's (registered as its base type), is the type
    ``formatted`` names (``named``: built into Postgres, or text). The result's Avro type
    is ``avro`` exactly, else None: never a value of another type.
    """
    dims, base = 1, avro
    while (
        isinstance(base, dict) and base.get("type") == "array" and isinstance(base["items"], dict)
    ):
        dims, base = dims + 1, base["items"]
    is_array = isinstance(base, dict) and base.get("type") == "array"
    elem = base["items"][-1] if is_array and isinstance(base, dict) else base
    inner = _structured(elem, formatted.removesuffix("[]"), oid, field_render, named)
    found: ColumnType | None
    if inner is None:
        found = named(formatted)  # a domain's base type, or the type itself
        found = None if found is None else replace(found, formatted=formatted)
    elif is_array:
        assert inner.render is not None
        found = ColumnType(
            formatted,
            oid,
            True,
            inner.enum_labels,
            decoder=array_decoder(_element(inner)),
            render=compose.array_text(inner.render),
            attrs=inner.attrs,
        )
    else:
        found = inner
    if found is None or (dims > 1 and not found.is_array):
        return None
    found = found.with_dims(dims)
    return found if found.unsupported is None and found.avro == avro else None


def _structured(
    avro: Any,
    formatted: str,
    oid: int,
    field_render: Callable[[int], Callable[[bytes], str] | None],
    named: Callable[[str], ColumnType | None],
) -> ColumnType | None:
    """An enum, composite, range or multirange whose Avro type ``avro`` tells its structure
    (see :func:`recovered`); None for any other."""
    if not isinstance(avro, dict):
        return None
    if avro.get("changebus.type") == "enum":
        return enum_type(formatted, oid, [str(s) for s in avro.get("changebus.symbols", ())])
    kind = avro.get(_KIND)
    attrs = tuple((k, str(avro[k])) for k in (_KIND, _BOUND) if k in avro)
    if kind == "composite":
        return _text_form(formatted, oid, compose.record_text((), field_render), attrs)
    if kind in ("range", "multirange"):
        bound = named(str(avro.get(_BOUND, "")))
        if bound is None or bound.render is None:
            return None
        render = compose.range_text(bound.render)
        if kind == "multirange":
            render = compose.multirange_text(render)
        return _text_form(formatted, oid, render, attrs)
    return None


def _element(inner: ColumnType) -> Callable[[bytes], Any]:
    """The decoder of one array element of type ``inner``."""
    if inner.decoder is not None:
        return inner.decoder
    oid = inner.decode_oid
    return lambda b: decode_value(oid, b)
