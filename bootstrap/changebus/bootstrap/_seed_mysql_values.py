"""Values of a MySQL/MariaDB seed: rows to the fetcher's Avro values, key values to JSON and back.

* :func:`converter` / :func:`policy_converter` -- from a PyMySQL value of a
  column to the value the mysql fetcher encodes for the same column (the
  same Avro values, so a seeded row is byte for byte the fetcher's row);
  :data:`NOT_SENT` marks a value with no Avro value (a zero date), sent as
  null and listed in ``after_not_sent`` as the fetcher does.
* :class:`RowConverter` -- rows of ``SELECT *`` (tuples in the result's
  column order) into INSERT events of the relay's newest schema version,
  under the fetcher's column policy; refuses (retriably) a table whose
  columns differ from that version.
* :func:`key_json` / :func:`key_values` -- a row's key values as JSON text
  (a chunk reader's cursor, stored in the bootstrap store) and back into
  query parameters. Values JSON lacks are tagged one-key objects
  (``{"b64": ...}`` bytes, ``{"dec": ...}`` decimals, ``{"dt": ...}``
  datetimes, ``{"date": ...}``, ``{"td": microseconds}`` times), so binary,
  decimal and temporal keys come back exactly as PyMySQL returned them.
  The same tags are accepted in the key lists of ``keys`` snapshots.

Thread-safety: converters and :class:`RowConverter` hold immutable state
once bound; one seeder thread uses them.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from changebus.fetchers import ColumnPolicy, ColumnRule
from changebus.schemas import (
    Column,
    Op,
    RowEncoder,
    SourceConfigError,
    SourceError,
    mysql_avro_type,
    mysql_bit,
    mysql_boolean,
    mysql_json,
    mysql_set,
    mysql_time_micros,
    mysql_unsigned_bigint,
    mysql_uuid,
    mysql_zero_date_key,
)

__all__ = [
    "NOT_SENT",
    "RowConverter",
    "converter",
    "key_json",
    "key_values",
    "policy_converter",
    "untag",
]

_EPOCH_DAY: Final = datetime.date(1970, 1, 1)
_EPOCH: Final = datetime.datetime(1970, 1, 1)
#: a converted value with no Avro value (a zero date): null, listed as not sent
NOT_SENT: Final = object()


def policy_converter(column: Column, rule: ColumnRule | None) -> Callable[[Any], Any]:
    """:func:`converter`, then the column's policy rule (hash, truncate) if any.

    A hashed column's schema type is ``string``: its value is converted as its
    source type (``source_type``) is first, as the fetcher's decoder does.
    """
    if rule is None:
        return converter(column)
    if rule.action == "hash":
        column = Column(column.name, mysql_avro_type(column.source_type), True, column.source_type)
    convert, apply = converter(column), rule.apply

    def policed(value: Any) -> Any:
        value = convert(value)
        return value if value is NOT_SENT else apply(value)

    return policed


def converter(column: Column) -> Callable[[Any], Any]:
    """From a PyMySQL value of ``column`` to the value the fetcher encodes (not None)."""
    t = column.type
    spec: Mapping[str, Any] = t if isinstance(t, dict) else {"type": t}
    base, logical, kind = spec.get("type"), spec.get("logicalType"), spec.get("changebus.type")
    if base == "boolean":
        return mysql_boolean
    if logical == "decimal":
        return lambda v: v if isinstance(v, decimal.Decimal) else mysql_unsigned_bigint(int(v))
    if logical == "uuid":
        return mysql_uuid
    if logical == "date":
        return lambda v: (v - _EPOCH_DAY).days if isinstance(v, datetime.date) else NOT_SENT
    if logical in ("timestamp-micros", "local-timestamp-micros"):
        return _micros
    if kind == "time-micros-signed":
        return mysql_time_micros
    if kind == "bit":
        return mysql_bit
    if kind == "set":
        return mysql_set
    if kind == "json":
        return mysql_json
    if base == "string":
        return lambda v: v.decode("utf-8") if isinstance(v, bytes) else str(v)
    if base == "bytes":
        return lambda v: v.encode("utf-8") if isinstance(v, str) else bytes(v)
    if base in ("int", "long"):
        return int
    if base in ("float", "double"):
        return float
    return lambda v: v


def _micros(value: Any) -> Any:
    """A naive datetime (UTC for timestamps: the seed's session is UTC) in microseconds."""
    if not isinstance(value, datetime.datetime):
        return NOT_SENT  # a zero date comes back as text
    d = value.replace(tzinfo=None) - _EPOCH
    return (d.days * 86400 + d.seconds) * 1_000_000 + d.microseconds


class RowConverter:
    """Rows of one table (``SELECT *`` tuples) to INSERT events of ``encoder``'s schema version.

    :meth:`bind` takes the column names of a result (its order) and checks
    them against the schema: the same columns, less those the policy
    excludes; anything else means the table changed since the relay's
    newest version (a DDL the relay has not streamed yet: retriable).
    Columns the policy hashes or truncates go through its rules after the
    conversion the fetcher's decoder makes.
    """

    def __init__(self, encoder: RowEncoder, policy: ColumnPolicy) -> None:
        self.encoder = encoder
        schema = encoder.table
        rules = policy.rules_for(schema.name)
        columns = {c.name: c for c in schema.columns}
        self._convert = [(c.name, policy_converter(c, rules.get(c.name))) for c in schema.columns]
        self._wanted = {c.name for c in schema.columns}
        self._excluded = {c for c, r in rules.items() if r.action == "exclude"}
        #: key columns holding dates (true: with a time): a zero date there has the key
        #: value the live stream gives it (:func:`mysql_zero_date_key`), not null
        self._date_keys = {
            name: logical != "date"
            for name in schema.key
            for logical in (_logical(columns[name].type),)
            if logical in ("date", "timestamp-micros", "local-timestamp-micros")
        }
        self._names: tuple[str, ...] = ()
        self._plan: list[tuple[str, int, Callable[[Any], Any]]] = []
        #: positions of the key columns in the bound result
        self.key_at: tuple[int, ...] = ()

    def bind(self, names: Sequence[str]) -> None:
        """Use results with columns ``names`` (in that order) from now on."""
        names = tuple(names)
        if names == self._names:
            return
        schema = self.encoder.table
        if set(names) - self._excluded != self._wanted:
            raise SourceConfigError(
                f"table {schema.name} changed since the relay's newest schema version "
                f"{schema.version}: seed it after the relay has seen the change "
                "(or give the seed the fetcher's column_policy)",
                # mostly a DDL the relay has not streamed yet: it will, so try again
                retriable=True,
            )
        at = {n: i for i, n in enumerate(names)}
        self._plan = [(col, at[col], fn) for col, fn in self._convert]
        self.key_at = tuple(at[k] for k in schema.key)
        self._names = names

    def row(self, source: Sequence[Any]) -> tuple[dict[str, Any], list[str], dict[str, Any] | None]:
        """The Avro row of a bound result's tuple, its columns not sent, and the row to
        take the event key from when that differs (a zero date in a key column)."""
        row: dict[str, Any] = {}
        not_sent: list[str] = []
        key_row: dict[str, Any] | None = None
        for col, i, fn in self._plan:
            value = source[i]
            if value is not None:
                value = fn(value)
                if value is NOT_SENT:
                    value = None
                    not_sent.append(col)
                    if col in self._date_keys:
                        if key_row is None:
                            key_row = {}
                        key_row[col] = _zero_date_key(source[i], self._date_keys[col])
            row[col] = value
        if key_row is not None:
            key_row = {**row, **key_row}
        return row, not_sent, key_row

    def events(
        self, rows: Sequence[Sequence[Any]], scn: int, keys: set[bytes] | None = None
    ) -> list[bytes]:
        """INSERT events of ``rows`` at ``scn`` (sequence numbers from 0); their event keys
        are added to ``keys`` when given."""
        ts = time.time_ns()
        encode, key_bytes = self.encoder.encode, self.encoder.key_bytes
        events: list[bytes] = []
        for seq, source in enumerate(rows):
            row, not_sent, key_row = self.row(source)
            key = None if key_row is None else key_bytes(key_row)
            events.append(encode(Op.INSERT, scn, seq, ts, row, after_not_sent=not_sent, key=key))
            if keys is not None:
                keys.add(key_bytes(row) if key is None else key)
        return events


def _logical(avro: Any) -> Any:
    return avro.get("logicalType") if isinstance(avro, dict) else None


def _zero_date_key(value: Any, with_time: bool) -> int:
    """The key value of a zero date PyMySQL gave as text (or bytes)."""
    text = value.decode("ascii") if isinstance(value, bytes | bytearray) else str(value)
    try:
        return mysql_zero_date_key(text, with_time=with_time)
    except ValueError:
        raise SourceError(f"a key column holds {text!r}, which is not a MySQL date") from None


# ---- key values as JSON ----------------------------------------------------------


def _tagged(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, bytes | bytearray):
        return {"b64": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, decimal.Decimal):
        return {"dec": str(value)}
    if isinstance(value, datetime.datetime):
        return {"dt": value.isoformat()}
    if isinstance(value, datetime.date):
        return {"date": value.isoformat()}
    if isinstance(value, datetime.timedelta):
        return {"td": (value.days * 86400 + value.seconds) * 1_000_000 + value.microseconds}
    return str(value)


_UNTAG: Final[dict[str, Callable[[Any], Any]]] = {
    "b64": lambda v: base64.b64decode(str(v), validate=True),
    "dec": lambda v: decimal.Decimal(str(v)),
    "dt": lambda v: datetime.datetime.fromisoformat(str(v)),
    "date": lambda v: datetime.date.fromisoformat(str(v)),
    "td": lambda v: datetime.timedelta(microseconds=int(v)),
}
#: the tags of a tagged key value (``{"b64": "..."}``, ...), as a request may give them
KEY_TAGS: Final = frozenset(_UNTAG)


def untag(value: Any) -> Any:
    """A query parameter from a JSON key value (plain, or a tagged one-key object)."""
    if isinstance(value, dict):
        if len(value) != 1 or next(iter(value)) not in _UNTAG:
            raise ValueError(f"a key value object must be one of {sorted(_UNTAG)}")
        tag, raw = next(iter(value.items()))
        return _UNTAG[tag](raw)
    if isinstance(value, list):
        raise ValueError("a key value cannot be a list")
    return value


def key_json(values: Sequence[Any]) -> str:
    """Key values (as PyMySQL returned them) as JSON text (the module docstring)."""
    return json.dumps([_tagged(v) for v in values], separators=(",", ":"))


def key_values(text: str) -> tuple[Any, ...]:
    """The query parameters of :func:`key_json` text."""
    raw = json.loads(text)
    if not isinstance(raw, list):
        raise ValueError("a key cursor is a JSON array")
    return tuple(untag(v) for v in raw)
