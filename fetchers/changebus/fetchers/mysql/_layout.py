"""Table layouts from TABLE_MAP events (and where the layout API is imported from).

With ``binlog_row_metadata=FULL`` every TABLE_MAP event describes the table
as it was when the rows that follow were written (:mod:`._columns`).
:func:`layout_from_table_map` turns one into a :class:`TableLayout`; the
binlog cannot tell a few declared types apart (``uuid``/``inet6`` from
``binary(16)``, ``json`` from ``longtext``, ``tinyint(1)`` from
``tinyint``), so declared type texts tracked from DDL (:mod:`._ddl`) refine a
column when they agree with its binlog type, and are ignored when they do
not.

The layout records, their compiled row decoders (:mod:`._decoder`) and
binlog-to-Avro transcoders (:mod:`._transcoder`) are re-exported here: this
module is where the package and the assembler take them from.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Mapping
from typing import Any, Final

from changebus.schemas import SourceConfigError, mysql_avro_type

from ._columns import (
    T_BIT,
    T_BLOB,
    T_DATE,
    T_DATETIME2,
    T_DOUBLE,
    T_ENUM,
    T_FLOAT,
    T_GEOMETRY,
    T_INT24,
    T_JSON,
    T_LONG,
    T_LONGLONG,
    T_NEWDECIMAL,
    T_SET,
    T_SHORT,
    T_STRING,
    T_TIME2,
    T_TIMESTAMP2,
    T_TINY,
    T_VAR_STRING,
    T_VARCHAR,
    T_YEAR,
    ColumnLayout,
    TableLayout,
    base_type,
)
from ._decoder import RowsDecoder, compile_decoder
from ._transcoder import RowsTranscoder, compile_transcoder

__all__ = [
    "ColumnLayout",
    "RowsDecoder",
    "RowsTranscoder",
    "TableLayout",
    "compile_decoder",
    "compile_transcoder",
    "layout_from_table_map",
]

_INT_NAMES: Final = {
    T_TINY: "tinyint",
    T_SHORT: "smallint",
    T_INT24: "mediumint",
    T_LONG: "int",
    T_LONGLONG: "bigint",
}
_CODECS: Final = {
    "utf8": "utf-8",
    "utf8mb4": "utf-8",
    "utf8mb3": "utf-8",
    "latin1": "changebus-latin1",
    "cp1252": "changebus-latin1",  # (the replication library's name for latin1)
    "ascii": "ascii",
    "ucs2": "utf-16-be",
    "utf16": "utf-16-be",
    "utf16le": "utf-16-le",
    "utf32": "utf-32-be",
    "koi8r": "koi8_r",
    "koi8u": "koi8_u",
}

#: MySQL's latin1 is Windows-1252 with its five unassigned bytes (0x81, 0x8D, 0x8F,
#: 0x90, 0x9D) as the C1 controls of the same number; Python's cp1252 refuses those
_LATIN1_TABLE: Final = "".join(
    bytes([b]).decode("cp1252", errors="ignore") or chr(b) for b in range(256)
)


def _latin1_search(name: str) -> codecs.CodecInfo | None:
    if name != "changebus_latin1":
        return None

    def decode(data: Any, errors: str = "strict", /) -> tuple[str, int]:
        return codecs.charmap_decode(data, errors, _LATIN1_TABLE)

    def encode(text: str, errors: str = "strict", /) -> tuple[bytes, int]:
        return codecs.charmap_encode(text, errors, codecs.charmap_build(_LATIN1_TABLE))

    return codecs.CodecInfo(encode, decode, name="changebus-latin1")


codecs.register(_latin1_search)


def _codec(column: Any) -> str:
    charset = (getattr(column, "character_set_name", None) or "").lower()
    if charset == "binary":
        return ""
    codec = _CODECS.get(charset, charset or "utf-8")
    try:
        codecs.lookup(codec)
    except LookupError:
        # (refused once, here, not as an error on every row that the relay retries)
        raise SourceConfigError(
            f"column {getattr(column, 'name', '?')}: character set {charset} has no Python "
            "codec; convert the column to utf8mb4 (or binary) to capture it"
        ) from None
    return codec


def _agrees(declared: str, binlog_type: int, codec: str, meta: dict[str, int]) -> bool:
    """Whether a declared type text can be the type a binlog column was written with."""
    base = base_type(declared)
    if binlog_type == T_TINY:
        return base in ("tinyint", "bool", "boolean")
    if binlog_type in (T_STRING, T_VAR_STRING) and not codec:
        return (base == "uuid" and meta.get("length") == 16) or (
            base in ("inet6", "inet4", "binary")
            and meta.get("length") == {"inet6": 16, "inet4": 4}.get(base, meta.get("length"))
        )
    if binlog_type == T_BLOB and codec:
        return base in ("json", "longtext", "text", "mediumtext", "tinytext")
    return False


#: a quoted label of a declared ENUM / SET type (``''`` is a quote inside one)
_LABEL = re.compile(r"'((?:[^'\\]|''|\\.)*)'")
_LABEL_UNESCAPE: Final = re.compile(r"\\\\|''|\\'")
_LABEL_ESCAPES: Final = {"\\\\": "\\", "''": "'", "\\'": "'"}


def _labels(col: Any, labels: tuple[str, ...], declared: str | None) -> tuple[str, ...]:
    """The labels of an ENUM or SET column as the server holds them.

    mysql-replication reads the table map's labels as UTF-8, whatever the
    column's character set: a latin1 ``é`` became ``''`` and a ucs2 ``b``
    ``'\\x00b'`` (review). In another character set the declared type's labels
    (information_schema, kept by the DDL the stream reads) are taken when they
    are as many; else the binlog's bytes are decoded again with the column's
    character set, unless some of them were lost (refused: the values would
    name the wrong labels).
    """
    charset = (getattr(col, "character_set_name", None) or "").lower()
    codec = _CODECS.get(charset, charset or "utf-8")
    if codec in ("utf-8", "ascii"):
        return labels
    if declared is not None:
        kind = base_type(declared)
        if kind in ("enum", "set"):
            found = tuple(
                _LABEL_UNESCAPE.sub(lambda m: _LABEL_ESCAPES[m.group(0)], s)
                for s in _LABEL.findall(declared[declared.index("(") :])
            )
            if len(found) == len(labels):
                return found
    if "" not in labels:  # (a label that was not UTF-8 became "")
        try:
            return tuple(v.encode("utf-8").decode(codec) for v in labels)
        except (LookupError, UnicodeError):
            pass
    raise SourceConfigError(
        f"column {getattr(col, 'name', '?')}: the binlog's {charset} labels of this ENUM/SET "
        "cannot be read (mysql-replication reads them as UTF-8), and information_schema "
        "does not tell them either: restart the relay to read them from there"
    )


def _width(col: Any) -> int:
    """Bytes per character of a text column's character set (for the declared length)."""
    collation = (getattr(col, "collation_name", None) or "").lower()
    for prefix, width in (("utf8mb4", 4), ("utf8", 3), ("ucs2", 2), ("utf16", 4), ("utf32", 4)):
        if collation.startswith(prefix):
            return width
    return 1


def _synthesised(col: Any, codec: str) -> str:
    """A COLUMN_TYPE-like text for a binlog column (when no declared type applies)."""
    t = col.type
    sign = " unsigned" if col.unsigned else ""
    if t in _INT_NAMES:
        return _INT_NAMES[t] + sign
    if t == T_NEWDECIMAL:
        return f"decimal({col.precision},{col.decimals})"
    if t == T_FLOAT:
        return "float"
    if t == T_DOUBLE:
        return "double"
    if t == T_BIT:
        return f"bit({col.bits})"
    if t == T_YEAR:
        return "year"
    if t == T_DATE:
        return "date"
    if t == T_TIME2:
        return f"time({col.fsp})" if col.fsp else "time"
    if t == T_DATETIME2:
        return f"datetime({col.fsp})" if col.fsp else "datetime"
    if t == T_TIMESTAMP2:
        return f"timestamp({col.fsp})" if col.fsp else "timestamp"
    if t in (T_ENUM, T_SET):
        labels = col.enum_values[1:] if t == T_ENUM else col.set_values
        quoted = ",".join("'" + v.replace("'", "''") + "'" for v in labels or ())
        return f"{'enum' if t == T_ENUM else 'set'}({quoted})"
    if t == T_VARCHAR:
        return (
            f"varchar({col.max_length // _width(col)})" if codec else f"varbinary({col.max_length})"
        )
    if t in (T_STRING, T_VAR_STRING):
        return f"char({col.max_length // _width(col)})" if codec else f"binary({col.max_length})"
    if t == T_BLOB:
        kind = {1: "tiny", 2: "", 3: "medium", 4: "long"}.get(col.length_size, "long")
        return f"{kind}text" if codec else f"{kind}blob"
    if t == T_GEOMETRY:
        return "geometry"
    return f"binlog_type_{t}"


def layout_from_table_map(
    event: Any,
    declared: Mapping[str, str] | None = None,
    *,
    tinyint1_as_boolean: bool = False,
) -> TableLayout:
    """The layout a TableMapEvent describes (``declared``: column name -> declared type)."""
    names = [c.name for c in event.columns]
    if any(n is None or n.startswith("UNKNOWN_COL") for n in names):
        raise SourceConfigError(
            f"the binlog has no column names for {event.schema}.{event.table}: "
            "set binlog_row_metadata = FULL on the server (SET GLOBAL binlog_row_metadata = FULL)"
        )
    nullmask = int.from_bytes(bytes(event.null_bitmask), "little")
    declared = {k.lower(): v for k, v in (declared or {}).items()}
    pk = list(getattr(event.optional_metadata, "simple_primary_key_list", []) or [])
    if not pk and getattr(event.optional_metadata, "primary_keys_with_prefix", None):
        pk = list(event.optional_metadata.primary_keys_with_prefix)
    columns = []
    for i, col in enumerate(event.columns):
        t = col.type
        if t == T_JSON:
            # (MariaDB's json is a longtext, logged as a blob: this type is MySQL's; its
            # bytes were sent as text, garbage to every reader: found by review)
            raise SourceConfigError(
                f"column {col.name!r} of {event.schema}.{event.table} is a MySQL json column,"
                " which the binlog holds in MySQL's binary JSON form; the mysql fetcher does"
                " not decode that form yet and stops rather than send its bytes as text."
                " Capture the table from MariaDB, or store the column as text"
            )
        codec = _codec(col) if t in (T_VARCHAR, T_STRING, T_VAR_STRING, T_BLOB) else ""
        meta: dict[str, int] = {}
        if t in (T_VARCHAR, T_STRING, T_VAR_STRING):
            meta["length"] = col.max_length
        elif t in (T_BLOB, T_GEOMETRY):
            meta["length"] = col.length_size
        elif t in (T_TIME2, T_DATETIME2, T_TIMESTAMP2):
            meta["fsp"] = col.fsp
        elif t == T_NEWDECIMAL:
            meta["precision"], meta["scale"] = col.precision, col.decimals
        elif t == T_BIT:
            meta["bits"] = col.bits
        elif t in (T_ENUM, T_SET):
            meta["size"] = col.size
        labels: tuple[str, ...] = ()
        hint = declared.get(col.name.lower())
        if t == T_ENUM:
            labels = tuple(col.enum_values or ())[1:]
        elif t == T_SET:
            labels = tuple(col.set_values or ())
        if t in (T_ENUM, T_SET):
            labels = _labels(col, labels, hint)
            if t == T_ENUM:  # (the synthesised type names them)
                col.enum_values = ["", *labels]
            else:
                col.set_values = list(labels)
        source_type = _synthesised(col, codec)
        if hint is not None and _agrees(hint, t, codec, meta):
            base = base_type(hint)
            if t == T_TINY:
                source_type = (
                    hint.lower()
                    .replace("bool", "tinyint(1)")
                    .replace("tinyint(1)ean", "tinyint(1)")
                )
            elif base in ("uuid", "inet6", "inet4", "json"):
                source_type = base
        avro = mysql_avro_type(source_type, tinyint1_as_boolean=tinyint1_as_boolean)
        columns.append(
            ColumnLayout(
                col.name,
                t,
                bool(nullmask >> i & 1) and i not in pk,
                bool(col.unsigned),
                codec,
                labels,
                tuple(sorted(meta.items())),
                source_type,
                avro,
            )
        )
    return TableLayout(
        event.schema, event.table, tuple(columns), tuple(names[i] for i in pk if i < len(names))
    )
