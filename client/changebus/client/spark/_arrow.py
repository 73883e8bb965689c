"""Table schemas to Arrow, and decoded windows to Arrow record batches.

Column layout of the Spark source (one row per change; see docs/spark.md):

* the table's columns, typed from the Avro schema of the newest table
  version (:func:`arrow_type`), always nullable (a delete without a
  before-image carries only the key; a truncate no row at all; a value the
  source did not send, Postgres' unchanged TOAST, is taken from the
  before-image when there is one, else null);
* ``_change_type`` -- ``insert``, ``update_preimage``, ``update_postimage``,
  ``delete`` (Delta Lake's change data feed names) or ``truncate``;
* ``_commit_scn`` (long), ``_commit_timestamp`` (timestamp, UTC),
  ``_txn_seq`` (long: the event's ``seq`` in its transaction), ``_source``
  (the table name) and ``_partition`` (the relay's physical partition; with
  ``_commit_scn`` and ``_txn_seq`` a key unique in the stream);
* opt-in (:data:`NOT_SENT_COLUMN`, option ``includeNotSent``): ``_not_sent``,
  the names of the columns whose value in this row the source did not send
  (Postgres' unchanged TOAST not recovered from a before-image, the non-key
  columns of a key-only before-image); empty for complete rows.

With several tables the data columns are the union by name
(:func:`union_schema`); a column two tables type differently is an error
(read them as separate streams then). :class:`BatchBuilder` gathers rows
column by column and turns them into a :class:`pyarrow.RecordBatch` of exactly
the declared schema (Spark rejects any difference). A builder belongs to one
thread.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import pyarrow as pa

from changebus.schemas import ConfigError, TableSchema

from .._model import ChangeEvent, ChangeOp, Window

__all__ = [
    "META_COLUMNS",
    "META_NAMES",
    "NOT_SENT_COLUMN",
    "BatchBuilder",
    "arrow_converter",
    "arrow_type",
    "column_array",
    "union_schema",
]

_UTC = dt.UTC

#: metadata columns, after the data columns
META_COLUMNS: tuple[pa.Field, ...] = (
    pa.field("_change_type", pa.string(), nullable=False),
    pa.field("_commit_scn", pa.int64(), nullable=False),
    pa.field("_commit_timestamp", pa.timestamp("us", tz="UTC"), nullable=False),
    pa.field("_txn_seq", pa.int64(), nullable=False),
    pa.field("_source", pa.string(), nullable=False),
    pa.field("_partition", pa.string(), nullable=False),
)
META_NAMES = frozenset(f.name for f in META_COLUMNS)
#: the opt-in column naming the values the source did not send (after the metadata)
NOT_SENT_COLUMN: pa.Field = pa.field("_not_sent", pa.list_(pa.string()), nullable=False)

_PRIMITIVE: dict[str, pa.DataType] = {
    "int": pa.int32(),
    "long": pa.int64(),
    "float": pa.float32(),
    "double": pa.float64(),
    "boolean": pa.bool_(),
    "string": pa.string(),
    "bytes": pa.binary(),
}

#: values of these Arrow types need converting before pa.array (see arrow_converter)
_MICROS = pa.int64()


def arrow_type(avro: Any, named: dict[str, pa.DataType] | None = None) -> pa.DataType:
    """The Arrow type of an Avro type of a column's non-null values.

    Logical types: decimal (precision <= 38) -> decimal128, wider -> string;
    date -> date32; time-millis/-micros -> int64 microseconds since midnight
    (Spark has no time-of-day type before 4.1); timestamp-* -> timestamp(us,
    UTC); local-timestamp-* -> timestamp(us) (Spark TIMESTAMP_NTZ); uuid ->
    string. Records become structs, arrays lists, enums strings, fixed binary;
    a union of several non-null types becomes a JSON string.
    """
    named = {} if named is None else named
    if isinstance(avro, str):
        if avro in _PRIMITIVE:
            return _PRIMITIVE[avro]
        if avro in named:
            return named[avro]
        raise ConfigError(f"unknown Avro type {avro!r}")
    if isinstance(avro, list):
        branches = [b for b in avro if b != "null"]
        if len(branches) == 1:
            return arrow_type(branches[0], named)
        return pa.string()
    if not isinstance(avro, dict):
        raise ConfigError(f"unsupported Avro type {avro!r}")
    logical = avro.get("logicalType")
    base = avro.get("type")
    if logical == "decimal":
        precision = int(avro.get("precision", 0))
        scale = int(avro.get("scale", 0))
        return pa.decimal128(precision, scale) if 0 < precision <= 38 else pa.string()
    if logical == "date":
        return pa.date32()
    if logical in ("time-millis", "time-micros"):
        return _MICROS
    if logical in ("timestamp-millis", "timestamp-micros", "timestamp-nanos"):
        return pa.timestamp("us", tz="UTC")
    if logical in ("local-timestamp-millis", "local-timestamp-micros", "local-timestamp-nanos"):
        return pa.timestamp("us")
    if logical == "uuid":
        return pa.string()
    if base == "record":
        fields = [pa.field(f["name"], arrow_type(f["type"], named)) for f in avro["fields"]]
        t: pa.DataType = pa.struct(fields)
        _remember(avro, t, named)
        return t
    if base == "array":
        return pa.list_(arrow_type(avro["items"], named))
    if base == "map":
        return pa.map_(pa.string(), arrow_type(avro["values"], named))
    if base == "enum":
        _remember(avro, pa.string(), named)
        return pa.string()
    if base == "fixed":
        _remember(avro, pa.binary(), named)
        return pa.binary()
    return arrow_type(base, named)


def _remember(avro: dict[str, Any], t: pa.DataType, named: dict[str, pa.DataType]) -> None:
    name = str(avro.get("name", ""))
    namespace = avro.get("namespace")
    if name:
        named[name] = t
        if namespace and "." not in name:
            named[f"{namespace}.{name}"] = t
        named[name.rsplit(".", 1)[-1]] = t


def table_fields(schema: TableSchema) -> list[pa.Field]:
    """The data columns of one table (all nullable; see the module docstring)."""
    named: dict[str, pa.DataType] = {}
    out = []
    for col in schema.columns:
        if col.name in META_NAMES:
            raise ConfigError(
                f"table {schema.name!r} has a column {col.name!r}, a name the Spark source"
                " uses for its metadata columns"
            )
        out.append(pa.field(col.name, arrow_type(col.type, named), nullable=True))
    return out


def union_schema(schemas: Iterable[TableSchema]) -> pa.Schema:
    """Data columns of every table (union by name, first appearance first) + metadata.

    ``int`` and ``long`` (and ``float`` and ``double``) of one name widen to
    the larger type; any other difference is an error.
    """
    fields: dict[str, pa.Field] = {}
    owner: dict[str, str] = {}
    widen = {(pa.int32(), pa.int64()): pa.int64(), (pa.float32(), pa.float64()): pa.float64()}
    for schema in schemas:
        for f in table_fields(schema):
            seen = fields.get(f.name)
            if seen is None:
                fields[f.name] = f
                owner[f.name] = schema.name
            elif seen.type != f.type:
                wider = widen.get((seen.type, f.type)) or widen.get((f.type, seen.type))
                if wider is None:
                    raise ConfigError(
                        f"column {f.name!r} is {seen.type} in {owner[f.name]!r} but {f.type} in"
                        f" {schema.name!r}: read these tables as separate streams (option sources)"
                    )
                fields[f.name] = pa.field(f.name, wider, nullable=True)
    return pa.schema([*fields.values(), *META_COLUMNS])


def _time_micros(v: Any) -> Any:
    if isinstance(v, dt.time):
        return ((v.hour * 60 + v.minute) * 60 + v.second) * 1_000_000 + v.microsecond
    return v


def _to_text(v: Any) -> Any:
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, decimal.Decimal):
        # positional, as Postgres prints it: str() gave "0E-10" for a numeric(40,10)
        # zero, where an unconstrained numeric's text says "0.0000000000" (review)
        return format(v, "f")
    if isinstance(v, uuid.UUID):
        return str(v)
    return json.dumps(v, default=str, separators=(",", ":"))


def arrow_converter(t: pa.DataType) -> Callable[[Any], Any] | None:
    """A per-value conversion making decoded Avro values acceptable to ``pa.array``."""
    if t == _MICROS:
        return _time_micros
    if t == pa.string():
        return _to_text
    if pa.types.is_list(t):
        inner = arrow_converter(t.value_type)
        if inner is None:
            return None
        return lambda v: None if v is None else [None if x is None else inner(x) for x in v]
    if pa.types.is_map(t):
        # (values Arrow does not take as they are: a map's every task failed; review)
        values = arrow_converter(t.item_type)
        if values is None:
            return None

        def pairs(v: Any) -> Any:
            if not isinstance(v, dict):
                return v
            return [(k, None if x is None else values(x)) for k, x in v.items()]

        return pairs
    if pa.types.is_struct(t):
        convs = {t.field(i).name: arrow_converter(t.field(i).type) for i in range(t.num_fields)}
        if all(c is None for c in convs.values()):
            return None

        def struct(v: Any) -> Any:
            if not isinstance(v, dict):
                return v
            return {
                k: (c(v[k]) if c is not None and v.get(k) is not None else v.get(k))
                for k, c in convs.items()
            }

        return struct
    return None


def column_array(values: list[Any], t: pa.DataType, conv: Callable[[Any], Any] | None) -> pa.Array:
    """``values`` as an Arrow array of type ``t``, through ``conv`` (:func:`arrow_converter`)
    only when Arrow does not take them as they are (UUIDs, times, unions): the
    conversion costs only the batches that hold such values."""
    try:
        return pa.array(values, type=t)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError):
        if conv is None:
            raise
        return pa.array([None if v is None else conv(v) for v in values], type=t)


_CHANGE_TYPES = {
    ChangeOp.INSERT: "insert",
    ChangeOp.DELETE: "delete",
    ChangeOp.TRUNCATE: "truncate",
}


class BatchBuilder:
    """Collects the rows of windows column-wise into record batches of ``schema``.

    ``schema`` may hold any subset of the data columns and metadata columns
    (a user-given schema narrower than the source's); every row fills exactly
    those. ``include_preimage`` adds an ``update_preimage`` row before each
    update that carries a before-image. With ``include_not_sent`` a
    ``_not_sent`` column of ``schema`` is :data:`NOT_SENT_COLUMN`, not a data
    column. Not thread-safe.
    """

    def __init__(
        self, schema: pa.Schema, *, include_preimage: bool = True, include_not_sent: bool = False
    ) -> None:
        self.schema = schema
        self.include_preimage = include_preimage
        meta = META_NAMES | {NOT_SENT_COLUMN.name} if include_not_sent else META_NAMES
        self._data = [f.name for f in schema if f.name not in meta]
        self._cols: dict[str, list[Any]] = {f.name: [] for f in schema}
        #: the _not_sent column's values when it is read, else None
        self._not_sent = self._cols.get(NOT_SENT_COLUMN.name) if include_not_sent else None
        self._convs = {f.name: arrow_converter(f.type) for f in schema if f.name not in meta}
        self.rows = 0

    def add_window(self, window: Window) -> None:
        """Append one row per change of ``window`` (two for an update with preimage)."""
        before = self.rows
        for event in window.events:
            self._add_event(event)
        if "_partition" in self._cols:
            self._cols["_partition"].extend([window.partition] * (self.rows - before))

    def _add_event(self, e: ChangeEvent) -> None:
        ns = self._not_sent
        if e.op is ChangeOp.UPDATE:
            if self.include_preimage and e.before is not None:
                self._row(e, e.before, "update_preimage")
                if ns is not None:
                    ns.append(e.before_not_sent)
            after = e.after
            missing = e.not_sent
            if missing and after is not None and e.before is not None:
                # values the source did not send (unchanged TOAST) are the old ones
                # when the before-image has them
                after = dict(after)
                for name in missing:
                    if name not in e.before_not_sent and name in e.before:
                        after[name] = e.before[name]
                missing = tuple(n for n in missing if n in e.before_not_sent or n not in e.before)
            self._row(e, after, "update_postimage")
            if ns is not None:
                ns.append(missing)
        elif e.op is ChangeOp.DELETE:
            self._row(e, e.before if e.before is not None else e.key, "delete")
            if ns is not None:
                ns.append(e.before_not_sent if e.before is not None else ())
        elif e.op is ChangeOp.INSERT:
            self._row(e, e.after, "insert")
            if ns is not None:
                ns.append(e.not_sent)
        else:
            self._row(e, None, _CHANGE_TYPES[e.op])
            if ns is not None:
                ns.append(())

    def _row(self, e: ChangeEvent, image: dict[str, Any] | None, change: str) -> None:
        cols = self._cols
        if image is None:
            for name in self._data:
                cols[name].append(None)
        else:
            get = image.get
            for name in self._data:
                cols[name].append(get(name))
        if "_change_type" in cols:
            cols["_change_type"].append(change)
        if "_commit_scn" in cols:
            cols["_commit_scn"].append(e.scn)
        if "_commit_timestamp" in cols:
            cols["_commit_timestamp"].append(e.timestamp_ns // 1000)
        if "_txn_seq" in cols:
            cols["_txn_seq"].append(e.seq)
        if "_source" in cols:
            cols["_source"].append(e.table)
        self.rows += 1

    def flush(self) -> pa.RecordBatch:
        """The rows gathered so far as one batch (and start a new one)."""
        arrays = []
        for f in self.schema:
            arrays.append(column_array(self._cols[f.name], f.type, self._convs.get(f.name)))
            self._cols[f.name] = []
        if self._not_sent is not None:
            self._not_sent = self._cols[NOT_SENT_COLUMN.name]
        self.rows = 0
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)
