"""Changing the declared type (the affinity) of a SQLite replica's columns in place.

One job: SQLite has no ``ALTER COLUMN ... TYPE``, and converts what it
stores by a column's declared affinity (``'007'`` in an ``INTEGER`` column
becomes ``7``). When a source column's new type needs another affinity, the
replica (:meth:`~._apply_sqlite.SqliteReplica._widen_columns`) calls
:func:`retype` inside its write transaction:

* the table's stored ``CREATE TABLE`` text gets the column's type token
  replaced (``"code" INTEGER`` -> ``"code" TEXT``). The token must appear
  exactly once after the quoted name, as the replica writes it (when it
  created the table or added the column); an operator's rewrite of the
  table that hides it is refused with a :class:`ConfigError` naming the
  column, never guessed at;
* usually the new text replaces the old one in ``sqlite_schema``
  (``writable_schema``, ``schema_version`` + 1: SQLite's documented way for
  a change that leaves the stored records valid), and the column's values
  are converted to the new affinity with one ``UPDATE``. Views, triggers,
  indexes, constraints and generated columns stay as they are;
* a column that is the table's rowid (a lone ``INTEGER`` primary key) is
  stored in the b-tree's key, not in the records, so the table is copied
  instead (so it is too where SQLite is built to refuse writes to its
  schema table, ``SQLITE_DBCONFIG_DEFENSIVE``): a new table from the rewritten text, the rows copied (converted
  by the new affinity), the old one dropped and the new one renamed (with
  ``legacy_alter_table``, so views over it are not checked while it is
  briefly gone), its indexes and triggers made again.

The change is never a narrowing (:func:`affinity_join`). Thread-safety: the
caller's connection and transaction; nothing shared.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable, Mapping
from typing import Final

from changebus.schemas import ConfigError

__all__ = ["AFFINITIES", "affinity_join", "retype"]

#: the declared types the replica makes (each one affinity)
AFFINITIES: Final = frozenset({"INTEGER", "REAL", "TEXT", "BLOB"})

#: what an ``UPDATE`` converts to the new affinity (other storage classes stay)
_CONVERT: Final = {"TEXT": ("integer", "real"), "REAL": ("integer",)}

_CREATE_NAME: Final = re.compile(
    r'^(\s*CREATE\s+TABLE\s+)("(?:[^"]|"")*"|`[^`]*`|\[[^\]]*\]|\S+?)(\s*\()', re.I
)


def affinity_join(have: str, want: str) -> str:
    """The narrowest of the replica's column types that holds values of both."""
    if have == want:
        return have
    if "BLOB" in (have, want):
        return "BLOB"  # (no conversion at all: every value as it is given)
    if {have, want} == {"INTEGER", "REAL"}:
        return "REAL"
    return "TEXT"


def retype(
    conn: sqlite3.Connection,
    table: str,
    types: Mapping[str, str],
    quote: Callable[[str], str],
) -> None:
    """Give the columns of ``table`` that ``types`` names those declared types (module
    docstring), inside the caller's transaction."""
    found = conn.execute(
        "SELECT name, sql FROM sqlite_master WHERE type = 'table' AND name = ? COLLATE NOCASE",
        (table,),
    ).fetchone()
    if found is None:
        raise ConfigError(f"replica table {table}: not found")
    name, sql = str(found[0]), str(found[1])
    text = _with_types(table, sql, types, quote)
    if _rowid_column(conn, name) in types:
        _copy(conn, name, text, quote)
        return
    version = int(conn.execute("PRAGMA schema_version").fetchone()[0])
    conn.execute("PRAGMA writable_schema = ON")
    try:
        conn.execute(
            "UPDATE sqlite_master SET sql = ? WHERE type = 'table' AND name = ?", (text, name)
        )
        conn.execute(f"PRAGMA schema_version = {version + 1}")
    except sqlite3.OperationalError:
        # (a SQLite built "defensive" refuses writes to its schema table: copied instead)
        _copy(conn, name, text, quote)
        return
    finally:
        conn.execute("PRAGMA writable_schema = OFF")
    for column, declared in types.items():
        classes = _CONVERT.get(declared)
        if classes:
            c = quote(column)
            marks = ", ".join(f"'{k}'" for k in classes)
            conn.execute(
                f"UPDATE {quote(name)} SET {c} = CAST({c} AS {declared})"
                f" WHERE typeof({c}) IN ({marks})"
            )


def _with_types(table: str, sql: str, types: Mapping[str, str], quote: Callable[[str], str]) -> str:
    """``sql`` (a ``CREATE TABLE``) with each column's type token replaced."""
    for column, declared in types.items():
        token = re.compile(
            re.escape(quote(column)) + r"(\s+)(INTEGER|REAL|TEXT|BLOB)\b", re.IGNORECASE
        )
        if len(token.findall(sql)) != 1:
            raise ConfigError(
                f"replica table {table}: column {column!r} needs type {declared} for the"
                " source's new values, and its definition is not the one the replica wrote:"
                " change its type yourself (or drop the table and replicate it again)"
            )
        at = token.search(sql)
        assert at is not None
        sql = f"{sql[: at.start()]}{quote(column)}{at.group(1)}{declared}{sql[at.end() :]}"
    return sql


def _rowid_column(conn: sqlite3.Connection, table: str) -> str | None:
    """The column that is ``table``'s rowid (a lone ``INTEGER`` primary key), if any."""
    info = conn.execute(f"PRAGMA table_info({_q(table)})").fetchall()
    key = [r for r in info if r[5]]
    if len(key) != 1 or str(key[0][2]).upper() != "INTEGER":
        return None
    without = conn.execute(
        "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
    ).fetchone()
    if without is not None and re.search(r"WITHOUT\s+ROWID", str(without[0]), re.I):
        return None
    return str(key[0][1])


def _copy(conn: sqlite3.Connection, table: str, text: str, quote: Callable[[str], str]) -> None:
    """``table`` copied into a new one made by ``text`` (module docstring)."""
    temp = f"{table}__changebus_retype"
    made = _CREATE_NAME.sub(lambda m: f"{m.group(1)}{quote(temp)}{m.group(3)}", text, count=1)
    if made == text:
        raise ConfigError(f"replica table {table}: its CREATE TABLE text cannot be read")
    plain = [str(r[1]) for r in conn.execute(f"PRAGMA table_xinfo({_q(table)})") if r[6] == 0]
    names = ", ".join(quote(n) for n in plain)
    extras = [
        str(sql)
        for (sql,) in conn.execute(
            "SELECT sql FROM sqlite_master WHERE tbl_name = ? COLLATE NOCASE"
            " AND type IN ('index', 'trigger') AND sql IS NOT NULL",
            (table,),
        )
    ]
    conn.execute("PRAGMA legacy_alter_table = ON")
    try:
        conn.execute(f"DROP TABLE IF EXISTS {quote(temp)}")
        conn.execute(made)
        conn.execute(f"INSERT INTO {quote(temp)} ({names}) SELECT {names} FROM {quote(table)}")
        conn.execute(f"DROP TABLE {quote(table)}")
        conn.execute(f"ALTER TABLE {quote(temp)} RENAME TO {quote(table)}")
    finally:
        conn.execute("PRAGMA legacy_alter_table = OFF")
    for sql in extras:
        conn.execute(sql)


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'
