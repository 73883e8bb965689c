"""What the text of a logged statement (a binlog QueryEvent) tells the assembler.

Savepoints set and rolled back to (their names), a data change logged as a
statement (its rows are not in the binlog: the stream stops, :func:`statement_logged`),
and what a DDL is worth saying in the log (:func:`log_ddl`: a partition dropped,
truncated or exchanged removes rows with no row events). Pure functions of the
text; the assembler (:mod:`._assembler`) keeps the transaction state.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Collection

from changebus.schemas import SourceConfigError

__all__ = [
    "changes_captured_rows",
    "created_from_select",
    "is_dml",
    "log_ddl",
    "rollback_to_name",
    "savepoint_name",
    "statement_logged",
]

log = logging.getLogger("changebus.fetchers.mysql")

#: a statement that changes rows (statement-based logging of DML), after any comments
#: (``/* */``, ``-- ``, ``#``); a logged statement starting with WITH is a DML one
_DML = re.compile(
    r"(?:\s+|/\*.*?\*/|--[^\n]*(?:\n|$)|#[^\n]*(?:\n|$))*"
    r"(insert|update|delete|replace|load\s+data|with)\b",
    re.I | re.S,
)
#: a CREATE [OR REPLACE] [TEMPORARY] TABLE, after any comments (group 1: TEMPORARY)
_CREATE_TABLE = re.compile(
    r"(?:\s+|/\*.*?\*/|--[^\n]*(?:\n|$)|#[^\n]*(?:\n|$))*"
    r"create\s+(?:or\s+replace\s+)?(temporary\s+)?table\b",
    re.I | re.S,
)
#: quoted names, strings and comments of a statement's text
_QUOTED_PARTS = re.compile(
    r"`(?:[^`]|``)*`|'(?:[^'\\]|\\.|'')*'|\"(?:[^\"\\]|\\.|\"\")*\"|/\*.*?\*/|--\s[^\n]*|#[^\n]*",
    re.S,
)
_SELECT_WORD = re.compile(r"(?<![\w$])select(?![\w$])", re.I)
#: the table a CREATE TABLE names (``[IF NOT EXISTS] [db.]table``): group 2 when qualified
_NAME = r"(`(?:[^`]|``)+`|\"(?:[^\"]|\"\")+\"|[\w$]+)"
_TARGET = re.compile(rf"\s*(?:if\s+not\s+exists\s+)?{_NAME}(?:\s*\.\s*{_NAME})?", re.I)
#: an ALTER TABLE that removes rows without row events
_PARTITION_DROP = re.compile(r"\b(?:drop|truncate|exchange)\s+partition\b", re.I)
#: a savepoint set, and a ROLLBACK to one (the transaction goes on); the name, quoted
#: with backticks or (a session with sql_mode ANSI_QUOTES) double quotes, or bare
_SAVEPOINT = re.compile(r'savepoint\s+(`(?:[^`]|``)+`|"(?:[^"]|"")+"|\w+)', re.I)
_ROLLBACK_TO = re.compile(
    r'rollback\s+(?:work\s+)?to\s+(?:savepoint\s+)?(`(?:[^`]|``)+`|"(?:[^"]|"")+"|\w+)', re.I
)
#: any ROLLBACK TO (one whose name is not read must not pass for a whole ROLLBACK)
_ANY_ROLLBACK_TO = re.compile(r"rollback\s+(?:work\s+)?to\b", re.I)


def _name(quoted: str) -> str:
    mark = quoted[0]
    return quoted[1:-1].replace(mark + mark, mark) if mark in '`"' else quoted


def savepoint_name(text: str) -> str | None:
    """The savepoint a ``SAVEPOINT`` statement sets (None: it is no such statement)."""
    m = _SAVEPOINT.match(text)
    return _name(m[1]) if m else None


def rollback_to_name(text: str) -> str | None:
    """The savepoint a ``ROLLBACK TO`` statement goes back to (None: no such statement).

    Raises :class:`SourceConfigError` for a ``ROLLBACK TO`` whose name it cannot
    read: taken for a whole ROLLBACK, it would drop the transaction's rows.
    """
    m = _ROLLBACK_TO.match(text)
    if m is None and _ANY_ROLLBACK_TO.match(text):
        raise SourceConfigError(
            "a ROLLBACK TO statement names its savepoint in a form the fetcher cannot read;"
            " the transaction's rows would be lost"
        )
    return _name(m[1]) if m else None


def is_dml(text: str) -> bool:
    """Whether the statement changes rows (logged as a statement, its rows are not)."""
    return _DML.match(text) is not None


def created_from_select(text: str, default_db: str) -> str | None:
    """The database of the table a ``CREATE TABLE ... SELECT`` logged as a statement fills
    (None: the text is no such statement).

    ROW format logs that statement as a plain CREATE TABLE and the rows as row
    events; a statement-format session logged the SELECT, taken for DDL, and the
    new table's rows were lost without a word (review). A temporary table is never
    captured: its CREATE ... SELECT is none.
    """
    head = _CREATE_TABLE.match(text)
    if head is None or head.group(1):
        return None
    target = _TARGET.match(text, head.end())
    if target is None:
        return None
    # an unquoted SELECT word after it (quoted names, strings and comments stripped)
    bare = _QUOTED_PARTS.sub(" ", text[head.end() :])
    if _SELECT_WORD.search(bare) is None:
        return None
    first, second = target.group(1), target.group(2)
    return _name(first) if second is not None else default_db


def changes_captured_rows(
    text: str, schema: str, captured: Callable[[str], bool], databases: Collection[str]
) -> bool:
    """Whether a statement logged as text (run in ``schema``) changed rows of a captured
    database: a DML one that may touch one (run there, or naming one: ``databases``,
    lower case, empty for all), or a ``CREATE TABLE ... SELECT`` filling a table of one
    (:func:`created_from_select`). Its rows are not in the binlog (:func:`statement_logged`)."""
    if is_dml(text):
        if not databases or captured(schema):
            return True
        lowered = text.lower()
        return any(db in lowered for db in databases)
    filled = created_from_select(text, schema)
    return filled is not None and captured(filled)


def statement_logged(where: str) -> SourceConfigError:
    """The error of a data change logged as a statement at ``where`` (its text is never
    shown: it may hold data)."""
    return SourceConfigError(
        f"a data change was logged as a statement (at {where}), not as "
        "rows: a client session ran with binlog_format = STATEMENT or MIXED. Its rows "
        "cannot be captured; keep binlog_format = ROW for every session (revoke "
        "SUPER / BINLOG ADMIN from applications), then reseed the tables it changed"
    )


def log_ddl(kind: str, text: str, table: str, where: str) -> None:
    """Log a DDL statement of ``kind`` on captured ``table``: a warning when it removes
    rows without row events (no consumer hears of it), else at INFO."""
    if kind == "alter" and _PARTITION_DROP.search(text) is not None:
        log.warning(
            "DDL at %s removes rows of %s without row events (a partition "
            "dropped, truncated or exchanged): consumers and bootstrap "
            "snapshots keep those rows; snapshot the table again "
            "(docs/bootstrap.md) if they must go",
            where,
            table,
        )
    else:
        log.info("DDL (%s) on %s at %s", kind, table, where)
