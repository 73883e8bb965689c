"""Table schemas: a source table as Avro records, with a fingerprint and a version.

A :class:`TableSchema` is the column list of one logical source (a table) at
one point in time, plus its key columns. From it derive:

* ``row_schema`` -- the Avro record of a row. Every field is
  ``["null", T]`` with default ``null`` (key columns too: a non-nullable
  column carries ``"changebus.nullable": false``), so that columns can be
  added and dropped while readers with older or newer schemas keep reading.
* ``key_schema`` -- the record of the key columns with non-null types (with
  ``nullable_key``: ``["null", T]``); its Avro encoding is an event's key
  bytes (and the input of the partition hash).
* ``change_schema`` -- the payload record of a data event (see
  :mod:`._payload`): ``after`` and ``before`` images (``["null", Row]``) and
  the ``after_not_sent`` / ``before_not_sent`` column lists.

Avro names. The record is named after the table (sanitised to Avro's name
rules, the same for every version of a table, so resolution matches records).
A column whose name is a valid Avro name is its own field name. Any other
column gets ``<sanitised>_<crc32 of the name, 8 hex digits>`` and keeps its
real name in the ``changebus.column`` attribute. That field name depends on
the column's name only, so it is the same in every version of the table and
Avro resolution pairs the right fields (a column ``Order_Date`` added later
cannot capture the data of an older ``Order Date``). Only if that name is
taken anyway (by a real column or a CRC collision) does a ``_2``, ``_3``, ...
suffix follow, in column order.

Named types (records such as ``changebus.Interval``) are defined at their
first use in a schema and referenced by full name afterwards, so a table may
have several interval columns. A column type that is itself a union has its
branches merged into the field's ``["null", ...]`` union (Avro forbids
nested unions); ``"null"`` cannot be a branch of a column type.

``fingerprint`` is the CRC-64-AVRO (Rabin) fingerprint of a normalised JSON
(sorted keys, no spaces) of the table name, the row schema with all its
attributes, and the key. Avro's own parsing canonical form would drop logical
types (a change from ``numeric(10,2)`` to ``numeric(12,4)``), so it is not
used. ``version`` is given by the :class:`SchemaRegistry` and is not part of
the fingerprint.

Invariants, checked on construction (:class:`SchemaError` otherwise): a name
of 1..512 characters; 1..65535 columns with unique non-empty names; key
columns exist and are distinct; ``version`` in 0..65535; the derived Avro
schemas parse; a ``fixed`` has a size of 1 at least; a ``decimal`` has a
precision of 1 to ``MAX_DECIMAL_PRECISION`` and a scale of 0 to its precision;
types nest at most ``MAX_TYPE_DEPTH`` levels; the items of an array
and the values of a map take bytes (not ``null`` or an empty record: a
payload's count of them would cost nothing per item). Instances are
immutable: a column's type is deep-copied (as JSON) when the :class:`Column`
is made, and the derived schemas are cached.
"""

from __future__ import annotations

import json
import re
import zlib
from collections import Counter
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import Any, Final, TypeGuard, Union, cast

import fastavro
from fastavro.schema import SchemaParseException, UnknownType

from ._avroread import takes_no_bytes
from ._crc import avro_fingerprint
from .errors import SchemaError

__all__ = ["AvroType", "Column", "TableSchema", "avro_name", "field_name"]

#: Avro type JSON for a non-null value
AvroType = Union[str, dict[str, Any], list[Any]]  # noqa: UP007

_AVRO_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NAMED: Final = frozenset({"record", "error", "enum", "fixed"})
MAX_COLUMNS: Final = 65535
#: how deep a column type may nest (unions, arrays, maps, records, each a level): the
#: readers generated per schema are Python code, which nests only so far
MAX_TYPE_DEPTH: Final = 32
#: a decimal's precision at most: Postgres' widest, numeric(1000, -1000) (MySQL's is 65).
#: A value's bytes are checked against its precision before Python's int parses them, in
#: time quadratic in their length: a precision of 10**9 let a 200 KB value take seconds
MAX_DECIMAL_PRECISION: Final = 2000
#: the derived Avro schemas :meth:`TableSchema.release_derived` drops (cached properties)
_DERIVED: Final = ("row_schema", "key_schema", "change_schema")


def avro_name(text: str) -> str:
    """``text`` made into a valid Avro name (letters, digits, underscore)."""
    name = re.sub(r"[^A-Za-z0-9_]", "_", text)
    if not name or not (name[0].isalpha() or name[0] == "_"):
        name = "_" + name
    return name


def field_name(column: str) -> str:
    """The preferred Avro field name of a column (see the module docstring)."""
    if _AVRO_NAME.fullmatch(column):
        return column
    crc = zlib.crc32(column.encode("utf-8", "surrogatepass"))
    return f"{avro_name(column)}_{crc:08x}"


def _normalise_type(column: str, avro_type: Any) -> AvroType:
    """A private JSON copy of ``avro_type``; rejects null and nested unions."""
    try:
        copy = json.loads(json.dumps(avro_type))
    except (TypeError, ValueError) as exc:
        raise SchemaError(f"column {column!r}: type is not JSON: {exc}") from None
    except RecursionError:
        raise SchemaError(f"column {column!r}: type nested too deeply") from None
    branches = copy if isinstance(copy, list) else [copy]
    if not branches:
        raise SchemaError(f"column {column!r}: empty union type")
    for b in branches:
        if b == "null" or (isinstance(b, dict) and b.get("type") == "null"):
            raise SchemaError(f"column {column!r}: the type must not include null")
        if isinstance(b, list):
            raise SchemaError(f"column {column!r}: nested union type")
        if not isinstance(b, str | dict):
            raise SchemaError(f"column {column!r}: {b!r} is not an Avro type")
    result: AvroType = copy
    return result


def _check_type(column: str, t: Any, depth: int = 0) -> None:
    """What fastavro lets pass in the type ``t`` but the readers cannot take: a ``fixed``
    of no int size of 1 at least; a ``decimal`` without a precision of 1 to
    ``MAX_DECIMAL_PRECISION`` and a scale of 0 to that; nesting beyond ``MAX_TYPE_DEPTH``."""
    if depth > MAX_TYPE_DEPTH:
        raise SchemaError(f"column {column!r}: type nested more than {MAX_TYPE_DEPTH} levels deep")
    if isinstance(t, list):
        for b in t:
            _check_type(column, b, depth + 1)
        return
    if not isinstance(t, dict):
        return
    kind = t.get("type")
    if kind == "fixed":
        size = t.get("size")
        if not _is_int(size) or size < 1:
            raise SchemaError(f"column {column!r}: fixed size {size!r} is not an int of 1 or more")
    if kind in ("bytes", "fixed") and t.get("logicalType") == "decimal":
        precision, scale = t.get("precision"), t.get("scale", 0)
        if not _is_int(precision) or not 1 <= precision <= MAX_DECIMAL_PRECISION:
            raise SchemaError(
                f"column {column!r}: decimal precision {precision!r} is not an int"
                f" of 1 to {MAX_DECIMAL_PRECISION}"
            )
        if not _is_int(scale) or not 0 <= scale <= precision:
            raise SchemaError(
                f"column {column!r}: decimal scale {scale!r} is not an int of 0 to its precision"
            )
    for k in ("type", "items", "values"):
        _check_type(column, t.get(k), depth + 1)
    fields_ = t.get("fields")
    if isinstance(fields_, list):
        for f in fields_:
            if isinstance(f, dict):
                _check_type(column, f.get("type"), depth + 1)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _empty_items(t: Any, named: dict[str, Any], seen: frozenset[str]) -> str | None:
    """``"array"`` or ``"map"`` if the (parsed) type ``t`` has one whose items or
    values take no bytes; None otherwise."""
    if isinstance(t, str):
        if t in named and t not in seen:
            return _empty_items(named[t], named, seen | {t})
        return None
    if isinstance(t, list):
        return next((e for b in t if (e := _empty_items(b, named, seen)) is not None), None)
    if not isinstance(t, dict):
        return None
    kind = t.get("type")
    if kind in ("array", "map"):
        item = t["items" if kind == "array" else "values"]
        if takes_no_bytes(item, named):
            return str(kind)
        return _empty_items(item, named, seen)
    if kind in ("record", "error"):
        inner = seen | {t["name"]} if isinstance(t.get("name"), str) else seen
        types = [f["type"] for f in t["fields"]]
        return next((e for f in types if (e := _empty_items(f, named, inner)) is not None), None)
    return _empty_items(kind, named, seen) if isinstance(kind, dict | list) else None


def _fullname(name: str, namespace: Any, enclosing: str) -> str:
    if "." in name:
        return name
    ns = namespace if isinstance(namespace, str) else enclosing
    return f"{ns}.{name}" if ns else name


def _share_named(t: Any, seen: set[str], namespace: str) -> Any:
    """``t`` with every named type defined once: later uses become references."""
    if isinstance(t, list):
        return [_share_named(b, seen, namespace) for b in t]
    if not isinstance(t, dict):
        return t
    kind = t.get("type")
    if kind in _NAMED and isinstance(t.get("name"), str):
        full = _fullname(t["name"], t.get("namespace"), namespace)
        if full in seen:
            return full
        seen.add(full)
        if kind in ("record", "error"):
            inner = full.rpartition(".")[0]
            fields = [{**f, "type": _share_named(f["type"], seen, inner)} for f in t["fields"]]
            return {**t, "fields": fields}
        return t
    if kind == "array":
        return {**t, "items": _share_named(t["items"], seen, namespace)}
    if kind == "map":
        return {**t, "values": _share_named(t["values"], seen, namespace)}
    if isinstance(kind, dict | list):
        return {**t, "type": _share_named(kind, seen, namespace)}
    return t


@dataclass(frozen=True)
class Column:
    """One column: its source name, its Avro type (for non-null values), nullability.

    ``name`` is the source's column name verbatim; ``type`` an Avro type JSON
    (never ``null``; a union's branches join the field's nullable union);
    ``source_type`` the source's own type text, kept for information;
    ``policy`` the column policy the fetcher applied at ingest (``""``: none,
    ``"hmac-sha256"``: the value is a keyed hash, ``"truncate:<n>"``: values
    are cut to n characters or bytes), shown as the ``changebus.policy``
    field property of the row schema.
    """

    name: str
    type: AvroType
    nullable: bool = True
    source_type: str = ""
    policy: str = ""

    def __post_init__(self) -> None:
        name: object = self.name
        if not isinstance(name, str) or not name:
            raise SchemaError(f"a column name must be a non-empty string, not {name!r}")
        object.__setattr__(self, "type", _normalise_type(self.name, self.type))
        _check_type(self.name, self.type)
        object.__setattr__(self, "nullable", bool(self.nullable))
        object.__setattr__(self, "source_type", str(self.source_type))
        object.__setattr__(self, "policy", str(self.policy))

    def __hash__(self) -> int:
        return hash((self.name, json.dumps(self.type, sort_keys=True), self.nullable, self.policy))


@dataclass(frozen=True)
class TableSchema:
    """A table's columns and key at one version (see the module docstring)."""

    name: str
    columns: tuple[Column, ...]
    key: tuple[str, ...] = ()
    version: int = 0
    #: the key columns may be NULL (a table keyed by all its columns, such as a
    #: Postgres ``REPLICA IDENTITY FULL`` table without a primary key): their
    #: key record fields are ``["null", T]``, the row field's bytes
    nullable_key: bool = False

    def __post_init__(self) -> None:
        name: object = self.name
        if not isinstance(name, str) or not 1 <= len(name) <= 512:
            raise SchemaError("a table schema needs a name of 1..512 characters")
        key: object = self.key
        if isinstance(key, str):
            raise SchemaError(f"table {name!r}: key must be a sequence of column names")
        object.__setattr__(self, "columns", tuple(self.columns))
        object.__setattr__(self, "key", tuple(self.key))
        if not self.columns:
            raise SchemaError(f"table {self.name!r} has no columns")
        if len(self.columns) > MAX_COLUMNS:
            raise SchemaError(f"table {self.name!r} has more than {MAX_COLUMNS} columns")
        if not all(isinstance(c, Column) for c in self.columns):
            raise SchemaError(f"table {self.name!r}: columns must be Column instances")
        names = [c.name for c in self.columns]
        if len(set(names)) != len(names):
            dups = sorted(n for n, count in Counter(names).items() if count > 1)
            raise SchemaError(f"table {self.name!r} has duplicate column names {dups}")
        known = set(names)
        missing = [k for k in self.key if k not in known]
        if missing:
            raise SchemaError(f"table {self.name!r}: key column(s) {missing} are not columns")
        if len(set(self.key)) != len(self.key):
            raise SchemaError(f"table {self.name!r}: duplicate key columns {list(self.key)}")
        version: object = self.version
        if not isinstance(version, int) or not 0 <= version <= 65535:
            raise SchemaError(f"table {self.name!r}: version must be 0..65535")
        try:
            change = cast(dict[str, Any], fastavro.parse_schema(self.change_schema))
            fastavro.parse_schema(self.key_schema)
        except (SchemaParseException, UnknownType, KeyError, TypeError, ValueError) as exc:
            raise SchemaError(f"table {self.name!r}: invalid Avro column types: {exc}") from None
        # items of zero bytes: a payload's few bytes of counts could stand for millions
        named = change["__named_schemas"]
        row = named[f"changebus.row.{self.record_name}"]
        for col, f in zip(self.columns, row["fields"], strict=True):
            kind = _empty_items(f["type"], named, frozenset())
            if kind is not None:
                raise SchemaError(
                    f"column {col.name!r}: {kind} {'items' if kind == 'array' else 'values'}"
                    " must not be of a type that takes no bytes (null, an empty record)"
                )
        self.release_derived()

    def __hash__(self) -> int:
        return hash((self.fingerprint, self.version))

    def release_derived(self) -> None:
        """Drop the derived Avro schemas cached on this instance; the next use makes
        them again (equal, not the same objects).

        They are most of an instance's memory (about 5 KB for ten columns) and
        are needed only to build encoders and readers: a relay of a source with
        thousands of tables held every version's for ever. The constructor
        drops them after validating them; the Postgres assembler drops them
        again with a table's encoder. Thread-safety: a reader racing with this
        gets the cached dict or a new, equal one.
        """
        for name in _DERIVED:
            self.__dict__.pop(name, None)

    def __getstate__(self) -> dict[str, Any]:
        """What a pickle holds: the fields only. The derived Avro schemas cached on
        the instance (most of its bytes, and most of the time to unpickle it) are made
        again when used: a Spark task unpickles every table of its query and reads few."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # ---- Avro names ---------------------------------------------------

    @cached_property
    def record_name(self) -> str:
        """The row record's name (namespace ``changebus.row``), from the table name."""
        return avro_name(self.name.replace(".", "__"))

    @cached_property
    def field_names(self) -> tuple[str, ...]:
        """Avro field names, in column order."""
        taken = {c.name for c in self.columns if _AVRO_NAME.fullmatch(c.name)}
        out = []
        for c in self.columns:
            name = field_name(c.name)
            if name != c.name:
                base, i = name, 1
                while name in taken:
                    i += 1
                    name = f"{base}_{i}"
                taken.add(name)
            out.append(name)
        return tuple(out)

    @cached_property
    def column_for_field(self) -> dict[str, str]:
        """Renamed fields only: ``{field name: column name}`` (usually empty)."""
        return {
            f: c.name for f, c in zip(self.field_names, self.columns, strict=True) if f != c.name
        }

    # ---- derived schemas ----------------------------------------------

    @cached_property
    def row_schema(self) -> dict[str, Any]:
        """The Avro record of a row: every field ``["null", T]``, default null."""
        seen: set[str] = set()
        fields_ = []
        for fname, col in zip(self.field_names, self.columns, strict=True):
            t = _share_named(col.type, seen, "changebus.row")
            branches = t if isinstance(t, list) else [t]
            f: dict[str, Any] = {"name": fname, "type": ["null", *branches], "default": None}
            if fname != col.name:
                f["changebus.column"] = col.name
            if col.source_type:
                f["changebus.source_type"] = col.source_type
            if not col.nullable:
                f["changebus.nullable"] = False
            if col.policy:
                f["changebus.policy"] = col.policy
            fields_.append(f)
        return {
            "type": "record",
            "name": self.record_name,
            "namespace": "changebus.row",
            "changebus.source": self.name,
            "changebus.key": list(self.key),
            **({"changebus.nullable_key": True} if self.nullable_key else {}),
            "fields": fields_,
        }

    @cached_property
    def key_schema(self) -> dict[str, Any]:
        """The record of the key columns, in key order.

        A key field has its column's type, or with :attr:`nullable_key` the
        row field's ``["null", T]`` (so its bytes are the row field's).
        """
        field_of = dict(zip((c.name for c in self.columns), self.field_names, strict=True))
        cols = {c.name: c for c in self.columns}
        seen: set[str] = set()
        fields_ = []
        for k in self.key:
            t = _share_named(cols[k].type, seen, "changebus.key")
            if self.nullable_key:
                t = ["null", *(t if isinstance(t, list) else [t])]
            fields_.append({"name": field_of[k], "type": t})
        return {
            "type": "record",
            "name": self.record_name + "Key",
            "namespace": "changebus.key",
            "fields": fields_,
        }

    @cached_property
    def change_schema(self) -> dict[str, Any]:
        """The payload record of one change event (row images and not-sent lists)."""
        full = f"changebus.row.{self.record_name}"
        return {
            "type": "record",
            "name": self.record_name + "Change",
            "namespace": "changebus.change",
            "fields": [
                {"name": "after", "type": ["null", self.row_schema], "default": None},
                {"name": "before", "type": ["null", full], "default": None},
                {
                    "name": "after_not_sent",
                    "type": {"type": "array", "items": "string"},
                    "default": [],
                },
                {
                    "name": "before_not_sent",
                    "type": {"type": "array", "items": "string"},
                    "default": [],
                },
            ],
        }

    @cached_property
    def fingerprint(self) -> int:
        """64-bit CRC-64-AVRO of name, row schema (all attributes) and key."""
        cached = "row_schema" in self.__dict__
        text = json.dumps(
            {"name": self.name, "row": self.row_schema, "key": list(self.key)},
            sort_keys=True,
            separators=(",", ":"),
        )
        if not cached:  # (made for this only: not kept, see release_derived)
            self.__dict__.pop("row_schema", None)
        return avro_fingerprint(text)

    def with_version(self, version: int) -> TableSchema:
        """This schema with another version number (the content is unchanged, and so is
        the fingerprint, which is not computed again: about 0.35 ms for ten columns)."""
        out = replace(self, version=version)
        if "fingerprint" in self.__dict__:
            out.__dict__["fingerprint"] = self.__dict__["fingerprint"]
        return out

    # ---- JSON form ----------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """Lossless JSON form (used by the registry file and ``/v1/schemas``)."""
        return {
            "name": self.name,
            "version": self.version,
            "key": list(self.key),
            **({"nullable_key": True} if self.nullable_key else {}),
            "columns": [
                {
                    "name": c.name,
                    "type": c.type,
                    "nullable": c.nullable,
                    "source_type": c.source_type,
                    **({"policy": c.policy} if c.policy else {}),
                }
                for c in self.columns
            ],
        }

    @classmethod
    def from_json(cls, data: Any) -> TableSchema:
        """The inverse of :meth:`to_json`; :class:`SchemaError` if malformed."""
        try:
            cols = []
            for c in data["columns"]:
                nullable = c.get("nullable", True)
                if not isinstance(nullable, bool) or not isinstance(c["name"], str):
                    raise TypeError(f"bad column {c!r}")
                cols.append(
                    Column(
                        c["name"],
                        c["type"],
                        nullable,
                        str(c.get("source_type", "")),
                        str(c.get("policy", "")),
                    )
                )
            key = data.get("key", [])
            if not isinstance(key, list) or not all(isinstance(k, str) for k in key):
                raise TypeError(f"bad key {key!r}")
            version = data.get("version", 0)
            if not isinstance(version, int) or isinstance(version, bool):
                raise TypeError(f"bad version {version!r}")
            nullable_key = data.get("nullable_key", False)
            if not isinstance(nullable_key, bool):
                raise TypeError(f"bad nullable_key {nullable_key!r}")
            return cls(str(data["name"]), tuple(cols), tuple(key), version, nullable_key)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SchemaError(f"bad table schema JSON: {exc!r}") from None
