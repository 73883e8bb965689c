"""Table schemas: a source table as Avro records, with a fingerprint and a version.

A :class:`TableSchema` is the column list of one logical source (a table) at
one point in time, plus its key columns. From it derive:

* ``row_schema`` -- the Avro record of a row. Every field is
  ``["null", T]`` with default ``null`` (key columns too: their non-nullness is
  kept in the ``changebus.nullable`` attribute), so that columns can be added
  and dropped while readers with older or newer schemas keep reading.
* ``key_schema`` -- the record of the key columns with non-null types; its
  Avro encoding is an event's key bytes (and the input of the partition hash).
* ``change_schema`` -- the payload record of a data event (see
  :mod:`._payload`).

Avro names: the record is named after the table (sanitised to Avro's name
rules, the same for every version of a table, so resolution matches records);
a column whose name is not a valid Avro name gets a sanitised unique field
name and keeps its real name in the ``changebus.column`` attribute.

``fingerprint`` is the CRC-64-AVRO (Rabin) fingerprint of a normalised JSON
(sorted keys, no spaces) of the table name, the row schema with all its
attributes, and the key. Avro's own parsing canonical form would drop logical
types (a change from ``numeric(10,2)`` to ``numeric(12,4)``), so it is not
used. ``version`` is given by the :class:`SchemaRegistry` and is not part of
the fingerprint. Instances are immutable.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Final, Union

import fastavro

from .errors import SchemaError

__all__ = ["AvroType", "Column", "TableSchema", "avro_name"]

#: Avro type JSON for a non-null value
AvroType = Union[str, dict[str, Any], list[Any]]  # noqa: UP007

_AVRO_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def avro_name(text: str) -> str:
    """``text`` made into a valid Avro name (letters, digits, underscore)."""
    name = re.sub(r"[^A-Za-z0-9_]", "_", text)
    if not name or not (name[0].isalpha() or name[0] == "_"):
        name = "_" + name
    return name


@dataclass(frozen=True)
class Column:
    """One column: its name, its Avro type (for non-null values), nullability."""

    name: str
    type: AvroType
    nullable: bool = True
    source_type: str = ""


@dataclass(frozen=True)
class TableSchema:
    """A table's columns and key (see the module docstring)."""

    name: str
    columns: tuple[Column, ...]
    key: tuple[str, ...] = ()
    version: int = 0

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > 512:
            raise SchemaError("a table schema needs a name of 1..512 characters")
        if not self.columns:
            raise SchemaError(f"table {self.name!r} has no columns")
        if len(self.columns) > 65535:
            raise SchemaError(f"table {self.name!r} has more than 65535 columns")
        names = [c.name for c in self.columns]
        if len(set(names)) != len(names):
            raise SchemaError(f"table {self.name!r} has duplicate column names")
        missing = [k for k in self.key if k not in names]
        if missing:
            raise SchemaError(f"table {self.name!r}: key column(s) {missing} are not columns")
        if len(set(self.key)) != len(self.key):
            raise SchemaError(f"table {self.name!r}: duplicate key columns")
        if self.version < 0 or self.version > 65535:
            raise SchemaError(f"table {self.name!r}: version must be 0..65535")

    # ---- Avro names ---------------------------------------------------

    @cached_property
    def record_name(self) -> str:
        return avro_name(self.name.replace(".", "__"))

    @cached_property
    def field_names(self) -> tuple[str, ...]:
        """Avro field names, in column order."""
        used: set[str] = set()
        out = []
        for c in self.columns:
            base = c.name if _AVRO_NAME.fullmatch(c.name) else avro_name(c.name)
            name, i = base, 1
            while name in used or (name != c.name and name in {x.name for x in self.columns}):
                i += 1
                name = f"{base}_{i}"
            used.add(name)
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
        fields_ = []
        for fname, col in zip(self.field_names, self.columns, strict=True):
            f: dict[str, Any] = {"name": fname, "type": ["null", col.type], "default": None}
            if fname != col.name:
                f["changebus.column"] = col.name
            if col.source_type:
                f["changebus.source_type"] = col.source_type
            if not col.nullable:
                f["changebus.nullable"] = False
            fields_.append(f)
        return {
            "type": "record",
            "name": self.record_name,
            "namespace": "changebus.row",
            "changebus.source": self.name,
            "changebus.key": list(self.key),
            "fields": fields_,
        }

    @cached_property
    def key_schema(self) -> dict[str, Any]:
        by_name = dict(zip((c.name for c in self.columns), self.field_names, strict=True))
        cols = {c.name: c for c in self.columns}
        return {
            "type": "record",
            "name": self.record_name + "Key",
            "namespace": "changebus.key",
            "fields": [{"name": by_name[k], "type": cols[k].type} for k in self.key],
        }

    @cached_property
    def change_schema(self) -> dict[str, Any]:
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
        text = json.dumps(
            {"name": self.name, "row": self.row_schema, "key": list(self.key)},
            sort_keys=True,
            separators=(",", ":"),
        )
        return int(fastavro.schema.fingerprint(text, "CRC-64-AVRO"), 16)

    def with_version(self, version: int) -> TableSchema:
        return replace(self, version=version)

    # ---- JSON form ----------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """Lossless JSON form (used by the registry file and ``/v1/schemas``)."""
        return {
            "name": self.name,
            "version": self.version,
            "key": list(self.key),
            "columns": [
                {
                    "name": c.name,
                    "type": c.type,
                    "nullable": c.nullable,
                    "source_type": c.source_type,
                }
                for c in self.columns
            ],
        }

    @classmethod
    def from_json(cls, data: Any) -> TableSchema:
        try:
            cols = tuple(
                Column(
                    c["name"],
                    c["type"],
                    bool(c.get("nullable", True)),
                    str(c.get("source_type", "")),
                )
                for c in data["columns"]
            )
            return cls(
                str(data["name"]), cols, tuple(data.get("key", ())), int(data.get("version", 0))
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SchemaError(f"bad table schema JSON: {exc!r}") from None
