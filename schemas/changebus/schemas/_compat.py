"""Can a reader schema read what a writer schema wrote? (Avro resolution rules)

Row fields are always ``["null", T]`` with default null, so added and dropped
columns resolve in both directions; what can break is a column whose type
changed. :func:`check_compatible` compares each column present in both
schemas, by Avro's schema resolution rules as fastavro applies them:

* the same type, or a promotion: ``int -> long -> float -> double`` (``int``
  and ``long`` also straight to ``float`` / ``double``), ``string <-> bytes``;
* unions: every writer branch must be readable by the reader (by one of its
  branches, if the reader is a union);
* arrays and maps by their items / values; records by name, field by field
  (a reader field missing in the writer needs a default); enums by name,
  with every writer symbol known to the reader unless it has a default;
  fixed types by name and size; named-type references by name;
* logical types: fastavro decodes with the *writer's* logical type, so only
  the one that changes the meaning of the bytes is checked -- a ``decimal``
  must keep its precision and scale, on both sides (Avro's rule).

Beyond Avro, the two tables must have the same record name (be the same
table) and each shared column the same field name.

Annotations. A few attributes of a column type only annotate it: they tell
how the source's type is built (a Postgres composite's or range's
``"changebus.kind"`` and ``"changebus.bound"``, recorded so that rows of a
type dropped later can still be read), not what its values are, how they
are encoded or what they mean (:data:`ANNOTATIONS`). A version that differs
from another only in them (the first one a fetcher registers for such a
table after an upgrade that began to record them) holds the same rows:
:func:`same_column_type` and :func:`same_but_annotations` say so, for a
seed that must write under the relay's version and a reader that must not
take it for a change of columns. Every other attribute counts:
``changebus.type`` (json or jsonb, a replica's column type),
``changebus.symbols`` (an enum's labels), ``changebus.bits``, logical
types, and the field properties of :class:`~._table.Column`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Final

from ._table import AvroType, Column, TableSchema
from .errors import IncompatibleSchemaError

__all__ = [
    "ANNOTATIONS",
    "bare_type",
    "check_compatible",
    "same_but_annotations",
    "same_column_type",
]

#: attributes of a column type (at any depth) that change nothing of its values
#: (module docstring, "Annotations")
ANNOTATIONS: Final = frozenset({"changebus.kind", "changebus.bound"})

_PRIMITIVES: Final = frozenset(
    {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}
)
_NAMED: Final = frozenset({"record", "enum", "fixed"})
_COMPLEX: Final = _NAMED | {"array", "map"}
_PROMOTIONS: Final = frozenset(
    {
        ("int", "long"),
        ("int", "float"),
        ("int", "double"),
        ("long", "float"),
        ("long", "double"),
        ("float", "double"),
        ("string", "bytes"),
        ("bytes", "string"),
    }
)


def _as_dict(t: Any) -> dict[str, Any]:
    """``t`` as ``{"type": kind, ...}`` with nested type objects unwrapped."""
    while isinstance(t, dict) and isinstance(t.get("type"), dict):
        t = t["type"]
    return t if isinstance(t, dict) else {"type": t}


def _short(name: Any) -> str:
    return str(name).rpartition(".")[2]


def _is_ref(kind: Any) -> bool:
    """Is ``kind`` the name of a named type (not a primitive or complex keyword)?"""
    return isinstance(kind, str) and kind not in _PRIMITIVES and kind not in _COMPLEX


def _ref_name(d: dict[str, Any]) -> str | None:
    kind = d["type"]
    if _is_ref(kind):
        return _short(kind)
    if kind in _NAMED:
        return _short(d.get("name"))
    return None


def _describe(t: Any) -> str:
    if isinstance(t, list):
        return "union[" + ", ".join(_describe(b) for b in t) + "]"
    d = _as_dict(t)
    kind = d["type"]
    if isinstance(kind, list):
        return _describe(kind)
    if d.get("logicalType") == "decimal":
        return f"decimal({d.get('precision')},{d.get('scale', 0)})"
    if kind in _NAMED:
        return f"{kind} {d.get('name')}"
    return str(kind)


def _decimal(d: dict[str, Any]) -> tuple[Any, Any] | None:
    if d.get("logicalType") != "decimal":
        return None
    return (d.get("precision"), d.get("scale", 0))


def _why_not(writer: AvroType, reader: AvroType) -> str | None:
    """Why data of type ``writer`` cannot be read as ``reader`` (None: it can)."""
    w, r = _as_dict(writer), _as_dict(reader)
    wk, rk = w["type"], r["type"]
    if isinstance(wk, list):
        for branch in wk:
            why = _why_not(branch, reader)
            if why:
                return why
        return None
    if isinstance(rk, list):
        if any(_why_not(writer, branch) is None for branch in rk):
            return None
        return f"{_describe(writer)} cannot be read as {_describe(reader)}"
    if _decimal(w) != _decimal(r):
        return f"{_describe(writer)} cannot be read as {_describe(reader)}"
    if wk != rk and (wk, rk) not in _PROMOTIONS:
        wn, rn = _ref_name(w), _ref_name(r)
        if (_is_ref(wk) or _is_ref(rk)) and wn is not None and wn == rn:
            return None  # a reference and a definition (or two references) of one name
        return f"{_describe(writer)} cannot be read as {_describe(reader)}"
    if wk == "array":
        why = _why_not(w["items"], r["items"])
        return f"array items: {why}" if why else None
    if wk == "map":
        why = _why_not(w["values"], r["values"])
        return f"map values: {why}" if why else None
    if wk in _NAMED and _short(w.get("name")) != _short(r.get("name")):
        return f"{_describe(writer)} cannot be read as {_describe(reader)}: names differ"
    if wk == "fixed" and w.get("size") != r.get("size"):
        return f"fixed size {w.get('size')} cannot be read as size {r.get('size')}"
    if wk == "enum" and "default" not in r:
        unknown = [s for s in w.get("symbols", []) if s not in set(r.get("symbols", []))]
        if unknown:
            return f"enum symbols {unknown} unknown to the reader"
    if wk == "record":
        wfields = {f["name"]: f for f in w.get("fields", [])}
        for f in r.get("fields", []):
            if f["name"] in wfields:
                why = _why_not(wfields[f["name"]]["type"], f["type"])
                if why:
                    return f"field {f['name']}: {why}"
            elif "default" not in f:
                return f"field {f['name']} is new and has no default"
    return None


def check_compatible(writer: TableSchema, reader: TableSchema) -> None:
    """Raise :class:`IncompatibleSchemaError` if ``reader`` cannot read ``writer``'s rows.

    The message names the first offending column and the reason.
    """
    if writer.record_name != reader.record_name:
        raise IncompatibleSchemaError(
            f"{reader.name!r} cannot read rows of another table {writer.name!r}"
        )
    wfield = dict(zip((c.name for c in writer.columns), writer.field_names, strict=True))
    rfield = dict(zip((c.name for c in reader.columns), reader.field_names, strict=True))
    rcolumn = {f: c for c, f in rfield.items()}
    rcols = {c.name: c for c in reader.columns}
    for col in writer.columns:
        where = f"{reader.name!r} v{reader.version} cannot read column {col.name!r} of v{writer.version}"
        owner = rcolumn.get(wfield[col.name], col.name)
        if owner != col.name:
            raise IncompatibleSchemaError(
                f"{where}: its field {wfield[col.name]!r} is column {owner!r} in the reader"
            )
        other = rcols.get(col.name)
        if other is None:
            continue  # dropped in the reader: skipped when reading
        if rfield[col.name] != wfield[col.name]:
            raise IncompatibleSchemaError(
                f"{where}: field name {wfield[col.name]!r} became {rfield[col.name]!r}"
            )
        why = _why_not(col.type, other.type)
        if why:
            raise IncompatibleSchemaError(f"{where}: {why}")


def bare_type(t: Any) -> Any:
    """The Avro type ``t`` without its :data:`ANNOTATIONS` (on it and on the types it holds:
    a union's branches, an array's items, a map's values, a record's fields' types);
    anything else (symbols, defaults, logical types) as it is. ``t`` is not changed."""
    if isinstance(t, list):
        return [bare_type(b) for b in t]
    if not isinstance(t, dict):
        return t
    out = {k: v for k, v in t.items() if k not in ANNOTATIONS}
    for k in ("type", "items", "values"):
        if isinstance(out.get(k), dict | list):
            out[k] = bare_type(out[k])
    if isinstance(out.get("fields"), list):
        out["fields"] = [
            {**f, "type": bare_type(f["type"])} if isinstance(f, dict) and "type" in f else f
            for f in out["fields"]
        ]
    return out


def same_column_type(a: AvroType, b: AvroType) -> bool:
    """Whether two column types differ at most in :data:`ANNOTATIONS` (the same values,
    the same bytes)."""
    return a == b or bare_type(a) == bare_type(b)


def _bare(t: TableSchema) -> TableSchema:
    return replace(
        t,
        columns=tuple(
            Column(c.name, bare_type(c.type), c.nullable, c.source_type, c.policy)
            for c in t.columns
        ),
        version=0,
    )


def same_but_annotations(a: TableSchema, b: TableSchema) -> bool:
    """Whether two table schemas differ at most in their column types' :data:`ANNOTATIONS`
    (their versions aside): the same name, key, columns, field names, nullability, source
    types and policies, so an event of one is, byte for byte, an event of the other."""
    if a.fingerprint == b.fingerprint:
        return True
    if a.name != b.name or len(a.columns) != len(b.columns):
        return False
    if not all(same_column_type(x.type, y.type) for x, y in zip(a.columns, b.columns, strict=True)):
        return False
    return _bare(a).fingerprint == _bare(b).fingerprint
