"""Can a reader schema read what a writer schema wrote? (Avro resolution rules)

Row fields are always ``["null", T]`` with default null, so added and dropped
columns resolve in both directions; what can break is a column whose type
changed. Allowed, as Avro resolution (and fastavro) applies it: the same
type; ``int -> long -> float -> double`` promotions (``int``/``long`` also to
``float``/``double``); ``string <-> bytes``; arrays and records recursively
(records by name); for logical types, decimals must keep precision and scale.
"""

from __future__ import annotations

from typing import Any

from ._table import AvroType, TableSchema
from .errors import IncompatibleSchemaError

__all__ = ["check_compatible"]

_PROMOTIONS = {
    ("int", "long"),
    ("int", "float"),
    ("int", "double"),
    ("long", "float"),
    ("long", "double"),
    ("float", "double"),
    ("string", "bytes"),
    ("bytes", "string"),
}


def _base(t: AvroType) -> str:
    if isinstance(t, dict):
        return str(t["type"]) if not isinstance(t["type"], dict | list) else _base(t["type"])
    if isinstance(t, list):
        return "union"
    return t


def _why_not(writer: AvroType, reader: AvroType) -> str | None:
    wb, rb = _base(writer), _base(reader)
    if wb == "union" or rb == "union":
        return None if writer == reader else "union types differ"
    if wb != rb and (wb, rb) not in _PROMOTIONS:
        return f"{wb} cannot be read as {rb}"
    w: dict[str, Any] = writer if isinstance(writer, dict) else {"type": writer}
    r: dict[str, Any] = reader if isinstance(reader, dict) else {"type": reader}
    decimal = w.get("logicalType") == "decimal" or r.get("logicalType") == "decimal"
    if decimal and (w.get("precision"), w.get("scale")) != (r.get("precision"), r.get("scale")):
        return "decimal precision/scale changed"
    if wb == "array":
        return _why_not(w["items"], r["items"])
    if wb == "record":
        if w.get("name") != r.get("name"):
            return "record names differ"
        rfields = {f["name"]: f for f in r["fields"]}
        for f in w["fields"]:
            if f["name"] in rfields:
                why = _why_not(f["type"], rfields[f["name"]]["type"])
                if why:
                    return f"{f['name']}: {why}"
        wnames = {f["name"] for f in w["fields"]}
        for name, f in rfields.items():
            if name not in wnames and "default" not in f:
                return f"field {name} has no default"
    return None


def check_compatible(writer: TableSchema, reader: TableSchema) -> None:
    """Raise :class:`IncompatibleSchemaError` if ``reader`` cannot read ``writer``'s rows."""
    if writer.record_name != reader.record_name:
        raise IncompatibleSchemaError(
            f"{reader.name!r} cannot read rows of another table {writer.name!r}"
        )
    rcols = {c.name: c for c in reader.columns}
    for col in writer.columns:
        other = rcols.get(col.name)
        if other is None:
            continue  # dropped in the reader: skipped when reading
        why = _why_not(col.type, other.type)
        if why:
            raise IncompatibleSchemaError(
                f"{reader.name!r} v{reader.version} cannot read column {col.name!r} of v{writer.version}: {why}"
            )
