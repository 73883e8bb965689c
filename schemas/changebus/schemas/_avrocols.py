"""Generated columnar Avro readers: change records straight into per-column lists.

The row reader of :mod:`._avroread` builds one dict per row image, the shape
applications want. A data-frame loader (the Spark source, a user filling
Arrow tables) wants the opposite shape: one list per column. A
:class:`ColumnReader` is a Python function written once per writer schema
(with :mod:`._avroread`'s code generator, so both read the same bytes the same
way) that appends every top-level field's value to its column's list as it
reads it: no dict per row, no key lookups, and top-level logical types left
in the form Arrow stores them (no ``datetime``/``date`` objects built only to
be taken apart again):

================================  ==========================================
Avro type of a column             value appended
================================  ==========================================
``timestamp-micros`` / ``-millis``  int, microseconds since the epoch (UTC)
``local-timestamp-micros``/``-millis``  int, microseconds since the epoch
``date``                          int, days since 1970-01-01
``time-micros`` / ``time-millis``   int, microseconds since midnight
``uuid``                          the canonical text (``str(UUID(...))``;
                                  lower-case 36-character text taken as is)
anything else                     what the row reader gives (nested types too)
================================  ==========================================

Layout of a read (:data:`ColumnReader`): ``reader(buf, starts, stops,
after, before)`` where ``after`` and ``before`` are lists of one list per
output column (the reader's columns, in its order); every record appends
exactly one value to every list of both (None for an absent image and for a
column the writer lacks), so after ``n`` records every list has grown by
``n``. It returns ``(present, not_sent)``: per record ``present`` is
``1`` (after-image), ``2`` (before-image), ``3`` (both) or ``0``; ``not_sent``
holds ``(index, after_not_sent, before_not_sent)`` for the records that name
not-sent columns (usually none).

Schema resolution and fallback are :mod:`._avroread`'s: columns added as
nullable and columns dropped are resolved here; anything else makes
:func:`compile_column_reader` return ``None`` and the caller decodes rows.
Errors are raised as by the row reader (the caller wraps them).

Thread-safety: generated functions keep no state and may be shared; the
lists passed in belong to the caller.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from ._avroread import _CANNOT_COMPILE, _plan, _Resolution, _Unsupported, _Writer

__all__ = ["ColumnReader", "compile_column_reader"]

ColumnReader = Callable[
    [bytes, Sequence[int], Sequence[int], list[list[Any]], list[list[Any]]],
    tuple[list[int], list[tuple[int, tuple[str, ...], tuple[str, ...]]]],
]
"""``(buf, starts, stops, after_cols, before_cols) -> (present, not_sent)`` (module docstring)."""

#: logical types of top-level columns read as Arrow's storage values: the
#: expression turning the base value ``x`` into it
_RAW: Final = {
    "long-timestamp-micros": "{}",
    "long-timestamp-millis": "{} * 1000",
    "long-local-timestamp-micros": "{}",
    "long-local-timestamp-millis": "{} * 1000",
    "int-date": "{}",
    "long-time-micros": "{}",
    "int-time-millis": "{} * 1000",
    # (any 36 lowercase characters passed as a uuid, where decode() refused them: review)
    "string-uuid": "{0} if _canonical_uuid({0}) else _uuid_text({0})",
}

#: whether a text is a uuid as Python writes it (else it is parsed, or refused)
_canonical_uuid: Final = re.compile(
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
).fullmatch


def _uuid_text(text: str) -> str:
    return str(uuid.UUID(text))


class _ColumnWriter(_Writer):
    """:class:`_Writer` with top-level logical types read raw (see the module docstring)."""

    def __init__(self, named: Mapping[str, Any]) -> None:
        super().__init__(named)
        self.consts["_uuid_text"] = _uuid_text
        self.consts["_canonical_uuid"] = _canonical_uuid
        self.top = False  # set while emitting a top-level field's value

    def complex(self, schema: dict[str, Any], target: str, ind: int) -> None:
        top, self.top = self.top, False  # nested values are read as the row reader reads them
        try:
            kind = schema.get("type")
            key = f"{kind}-{schema.get('logicalType')}" if isinstance(kind, str) else ""
            raw = _RAW.get(key) if top else None
            if raw is None:
                super().complex(schema, target, ind)
                return
            self.primitive(str(kind), target, ind)
            if raw != "{}":
                self.emit(ind, f"{target} = {raw.format(target)}")
        finally:
            self.top = top

    def value(self, schema: Any, target: str, ind: int) -> None:
        if self.top and isinstance(schema, str) and schema in self.named:
            # a named type at the top: its definition is read as nested
            self.top = False
            try:
                super().value(schema, target, ind)
            finally:
                self.top = True
            return
        super().value(schema, target, ind)

    def image(
        self,
        fields: Sequence[dict[str, Any]],
        slots: Sequence[str | None],
        added: Sequence[str],
        ind: int,
    ) -> None:
        """One row image: each field read and appended to its column (``slots``)."""
        for f, slot in zip(fields, slots, strict=True):
            var = self.name()
            self.top = True
            try:
                self.value(f["type"], var, ind)
            finally:
                self.top = False
            if slot is not None:
                self.emit(ind, f"{slot}({var})")
        for slot in added:
            self.emit(ind, f"{slot}(None)")


def compile_column_reader(
    parsed_row: Mapping[str, Any],
    reader: Mapping[str, Any] | None = None,
) -> ColumnReader | None:
    """A columnar reader of change records whose row record is ``parsed_row``.

    ``parsed_row`` is the writer's row schema as ``fastavro.parse_schema``
    returns it, ``reader`` (parsed) the row schema to resolve to; the output
    columns are the reader's fields in order (the writer's without one).
    ``None`` when the schemas hold something the generator does not handle.
    """
    named = dict(parsed_row.get("__named_schemas", {}))
    w = _ColumnWriter(named)
    try:
        resolve = _Resolution(frozenset(), ()) if reader is None else _plan(parsed_row, reader)
        out_fields = [f["name"] for f in (reader or parsed_row)["fields"]]
        index = {name: i for i, name in enumerate(out_fields)}
        wfields = list(parsed_row["fields"])
        ncols = len(out_fields)
        sides = {}
        for side in ("a", "b"):
            slots = [
                None if f["name"] in resolve.dropped else f"{side}{index[f['name']]}"
                for f in wfields
            ]
            added = [f"{side}{index[name]}" for name in resolve.added]
            sides[side] = (slots, added)
        w.emit(0, "def read_columns(buf, starts, stops, after_cols, before_cols):")
        for side, cols in (("a", "after_cols"), ("b", "before_cols")):
            if ncols:
                names = ", ".join(f"{side}{i}" for i in range(ncols))
                w.emit(1, f"{names}, = [c.append for c in {cols}]")
            w.emit(1, f"{side}_all = [c.append for c in {cols}]")
        w.emit(1, "present = []")
        w.emit(1, "mark = present.append")
        w.emit(1, "not_sent = []")
        w.emit(1, "for i, (pos, stop) in enumerate(zip(starts, stops)):")
        for side, flag in (("a", 1), ("b", 2)):
            w.emit(2, "b = buf[pos]")
            w.emit(2, "pos += 1")
            w.emit(2, "if b == 2:")
            w.image(wfields, *sides[side], 3)
            w.emit(3, f"p{side} = {flag}")
            w.emit(2, "elif b == 0:")
            w.emit(3, f"for ap in {side}_all:")
            w.emit(4, "ap(None)")
            w.emit(3, f"p{side} = 0")
            w.emit(2, "else:")
            w.emit(3, "raise _bad_branch(b, 'a change record')")
        w.emit(2, "mark(pa | pb)")
        w.emit(2, "if pos + 2 == stop and buf[pos] == 0 and buf[pos + 1] == 0:")
        w.emit(3, "continue")
        w.emit(2, "after_ns, pos = _string_array(buf, pos)")
        w.emit(2, "before_ns, pos = _string_array(buf, pos)")
        w.emit(2, "if pos != stop:")
        w.emit(3, "raise _Corrupt('change record does not end where its event ends')")
        w.emit(2, "if after_ns or before_ns:")
        w.emit(3, "not_sent.append((i, after_ns, before_ns))")
        w.emit(1, "return present, not_sent")
        compiled: ColumnReader = w.compile(
            "read_columns", f"<changebus column reader {parsed_row.get('name')}>"
        )
    except (_Unsupported, *_CANNOT_COMPILE):
        return None
    return compiled
