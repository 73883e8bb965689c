"""SQL of the Postgres chunk readers: keyset, key-list and ctid-range COPY statements.

One job: build the ``COPY (SELECT ...) TO STDOUT (FORMAT binary)``
statements of :mod:`._seed` and parse their output. Values travel as query
parameters (client-side merged by psycopg), never spliced into the text;
identifiers are quoted; type names come from the server's ``format_type``.

Keyset cursor: the JSON list of the last row's key values as Postgres text
(``key::text``, appended to the select list after the table's columns),
cast back with ``%s::<format_type>`` in the next chunk's ``WHERE (k1, k2)
> (...)``. Text round-trips every ordered key type exactly (integers,
numeric, text, uuid, timestamps in the session's own TimeZone and
DateStyle, floats with ``extra_float_digits``).
"""

from __future__ import annotations

import datetime
import decimal
import json
import struct
import uuid
from dataclasses import dataclass
from typing import Any

from changebus.schemas import ChangebusError, SourceConfigError

__all__ = [
    "PgTable",
    "copy_data_start",
    "copy_rows",
    "insert_message",
    "key_param",
    "key_text",
    "quote",
    "row_fields",
]

_COPY_SIGNATURE = b"PGCOPY\n\xff\r\n\x00"
_INT4 = struct.Struct("!i").unpack_from
_INT2 = struct.Struct("!h").unpack_from


def copy_rows(data: bytes, oid: int, ncols: int) -> list[tuple[bytes, list[bytes | None]]]:
    """Rows of a ``COPY ... (FORMAT binary)`` output as pgoutput messages.

    Each row: an ``Insert`` message of relation ``oid`` holding its first
    ``ncols`` fields in pgoutput's binary tuple format (``b`` + length +
    bytes, ``n`` for NULL: the very bytes a binary pgoutput stream carries,
    so the fetcher's transcoder encodes them), and the fields after those
    (raw bytes, None = NULL).
    """
    pos = copy_data_start(data)
    head = b"I" + oid.to_bytes(4, "big") + b"N" + ncols.to_bytes(2, "big")
    rows: list[tuple[bytes, list[bytes | None]]] = []
    add = rows.append
    fields = range(ncols)
    while True:  # per row and field: the fewest Python steps (this is the seed's hot loop)
        (n,) = _INT2(data, pos)
        pos += 2
        if n == -1:
            return rows
        parts = [head]
        put = parts.append
        for _ in fields:
            (size,) = _INT4(data, pos)
            if size < 0:
                put(b"n")
                pos += 4
            else:
                end = pos + 4 + size
                put(b"b" + data[pos:end])
                pos = end
        extra: list[bytes | None] = []
        for _ in range(n - ncols):
            (size,) = _INT4(data, pos)
            pos += 4
            if size < 0:
                extra.append(None)
            else:
                extra.append(data[pos : pos + size])
                pos += size
        add((b"".join(parts), extra))


def copy_data_start(data: bytes) -> int:
    """Where the first row of a ``COPY ... (FORMAT binary)`` output starts (after its header)."""
    if not data.startswith(_COPY_SIGNATURE):
        raise ChangebusError("COPY output lacks the binary signature")
    pos = len(_COPY_SIGNATURE) + 4
    (ext,) = _INT4(data, pos)
    return pos + 4 + int(ext)


def row_fields(data: bytes, pos: int) -> list[bytes | None]:
    """The fields of the binary COPY row starting at ``pos`` (None = NULL)."""
    (n,) = _INT2(data, pos)
    pos += 2
    out: list[bytes | None] = []
    for _ in range(n):
        (size,) = _INT4(data, pos)
        pos += 4
        if size < 0:
            out.append(None)
        else:
            out.append(data[pos : pos + size])
            pos += size
    return out


def insert_message(oid: int, cells: list[bytes | None]) -> bytes:
    """A pgoutput binary ``Insert`` message of ``cells`` (None = NULL)."""
    head = b"I" + oid.to_bytes(4, "big") + b"N" + len(cells).to_bytes(2, "big")
    return head + b"".join(
        b"n" if v is None else b"b" + len(v).to_bytes(4, "big") + v for v in cells
    )


def quote(name: str) -> str:
    """An SQL identifier, double-quoted, ``%`` doubled: the generated queries run with
    parameters (an empty list at least), and a COPY without any is un-doubled first
    (:meth:`~._seed.PostgresChunkSource.copy_data`). A table named ``t%x`` failed the
    seed from its second chunk on (found by review)."""
    return '"' + name.replace('"', '""').replace("%", "%%") + '"'


def key_param(value: Any) -> str | None:
    """A JSON key value as the text Postgres casts to the key column's type (None: NULL)."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value)  # numbers, true/false (lists/objects: the server says no)


def key_text(value: Any, *, temporal: bool = False) -> Any:
    """A key value as the store decodes it (its Avro value) as a ``keys`` value Postgres
    casts back to the column's type (:func:`key_param`); None: no such form.

    Integers and floats stay numbers; text, uuid, numeric, dates and times
    become their text (ISO 8601: a ``timestamptz`` keeps its offset, a
    ``timestamp`` has none), bytea its ``\\x`` hex form, an interval (the
    ``changebus.Interval`` record) its months, days and microseconds. None
    for lists (arrays), and for the values a date or time column's Avro
    form cannot give back exactly: ``temporal`` (the column is a date, time
    or timestamp) with a plain number (``24:00:00``, a BC date), and the
    first and last representable day (``-infinity`` / ``infinity`` decode
    to them).
    """
    if isinstance(value, datetime.datetime):
        naive = value.replace(tzinfo=None)
        if naive.date() in (datetime.date.min, datetime.date.max):
            return None
        return value.isoformat()
    if isinstance(value, datetime.date):
        return None if value in (datetime.date.min, datetime.date.max) else value.isoformat()
    if isinstance(value, datetime.time):
        return value.isoformat()
    if temporal:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        return value
    if isinstance(value, bytes | bytearray):
        return "\\x" + bytes(value).hex()
    if isinstance(value, decimal.Decimal | uuid.UUID):
        return str(value)
    if isinstance(value, dict) and set(value) == {"months", "days", "micros"}:  # an interval
        return f"{value['months']} mons {value['days']} days {value['micros']} microseconds"
    return None  # (also a NULL: a key column never holds one)


def _binary(sql: str) -> str:
    return f"COPY ({sql}) TO STDOUT (FORMAT binary)"


@dataclass(frozen=True, slots=True)
class PgTable:
    """One source table as the readers select it.

    ``name`` -- ``"nsp"."rel"`` (quoted). ``columns`` -- every column in
    table order (what the fetcher's Relation lists). ``key`` -- the relay
    schema's key columns; ``key_types`` -- their ``format_type`` text.
    """

    name: str
    columns: tuple[str, ...]
    key: tuple[str, ...]
    key_types: tuple[str, ...]

    @property
    def select(self) -> str:
        return ", ".join(quote(c) for c in self.columns)

    def keyset(
        self,
        after: list[str] | None,
        where: str,
        limit: int,
        upto: list[str] | None = None,
    ) -> tuple[str, list[Any]]:
        """Up to ``limit`` rows after key ``after`` (texts; None: from the start), key order;
        ``upto``: only keys up to it (a ``where`` chunk's bound, :meth:`bound`).

        Each row: the table's columns, then ``key::text`` of each key column.
        The parameters are a list, empty for the first chunk; every ``%`` is
        doubled, ``where``'s too (see :func:`quote`).
        """
        conds, params = self._cursor(after, upto)
        if where:
            conds.append(f"({where.replace('%', '%%')})")
        cond = f" WHERE {' AND '.join(conds)}" if conds else ""
        sql = (
            f"SELECT {self.select}, {self._key_texts()} FROM {self.name}{cond} "
            f"ORDER BY {self._order} LIMIT {int(limit)}"
        )
        return _binary(sql), params

    def bound(self, after: list[str] | None, limit: int) -> tuple[str, list[Any]]:
        """The ``limit``-th key after ``after`` (``key::text`` each): a ``where`` chunk reads
        up to it, so it walks at most ``limit`` index entries however few rows match."""
        conds, params = self._cursor(after, None)
        cond = f" WHERE {conds[0]}" if conds else ""
        sql = (
            f"SELECT {self._key_texts()} FROM {self.name}{cond} ORDER BY {self._order} "
            f"OFFSET {int(limit) - 1} LIMIT 1"
        )
        return sql, params

    @property
    def _order(self) -> str:
        return ", ".join(quote(k) for k in self.key)

    def _key_texts(self) -> str:
        """``key::text`` of each key column, aliased ``_cb_k<i>`` (ORDER BY "id" would
        otherwise sort an output column named "id": the text)."""
        return ", ".join(f"{quote(k)}::text AS _cb_k{i}" for i, k in enumerate(self.key))

    def _cursor(
        self, after: list[str] | None, upto: list[str] | None
    ) -> tuple[list[str], list[Any]]:
        """The row-comparison conditions of keys after ``after`` and up to ``upto``
        (texts cast to the key types; None: no such bound), and their parameters."""
        conds: list[str] = []
        params: list[Any] = []
        casts = ", ".join(f"%s::{t}" for t in self.key_types)
        for op, at in ((">", after), ("<=", upto)):
            if at is None:
                continue
            if len(at) != len(self.key):
                raise SourceConfigError("a stored snapshot cursor does not fit the table's key")
            conds.append(f"({self._order}) {op} ({casts})")
            params.extend(at)
        return conds, params

    def by_keys(self, keys: list[tuple[Any, ...]], first: int) -> tuple[str, list[Any]]:
        """The rows of ``keys`` (numbered from ``first``), found or not.

        Each row: the table's columns (NULL when the key is absent), whether
        the key was found, the key's number, then the requested key values
        cast to the key types.
        """
        n = len(self.key)
        alias = [f"_cb_k{i}" for i in range(n)]
        casts = ", ".join(f"%s::{t}" for t in self.key_types)
        values: list[str] = []
        params: list[Any] = []
        for i, key in enumerate(keys):
            if len(key) != n:
                raise SourceConfigError(
                    f"key {list(key)!r} has {len(key)} value(s); the key of the table has {n} "
                    f"({', '.join(self.key)})"
                )
            values.append(f"({first + i}, {casts})")
            params.extend(key_param(v) for v in key)
        join = " AND ".join(f"t.{quote(k)} = v.{a}" for k, a in zip(self.key, alias, strict=True))
        cols = ", ".join(f"t.{quote(c)}" for c in self.columns)
        sql = (
            f"SELECT {cols}, t.{quote(self.key[0])} IS NOT NULL, v._cb_i, "
            f"{', '.join('v.' + a for a in alias)} "
            f"FROM (VALUES {', '.join(values)}) AS v(_cb_i, {', '.join(alias)}) "
            f"LEFT JOIN {self.name} AS t ON {join}"
        )
        return _binary(sql), params

    def pages(self, first: int, end: int | None) -> str:
        """Rows in heap pages ``[first, end)`` (None: to the end), a TID range scan."""
        cond = f"ctid >= '({int(first)},0)'::tid"
        if end is not None:
            cond += f" AND ctid < '({int(end)},0)'::tid"
        return _binary(f"SELECT {self.select} FROM {self.name} WHERE {cond}")
