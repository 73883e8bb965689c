"""Schema history from the DDL statements in the binlog.

The binlog's TABLE_MAP events (``binlog_row_metadata=FULL``) are the
authority for *decoding*: they describe each table as it was when its rows
were written. What they cannot say is a handful of declared types that share
a binlog representation with others (``uuid`` / ``inet6`` are ``binary(16)``,
``json`` is ``longtext``, ``tinyint(1)`` is ``tinyint``). :class:`DeclaredTypes`
keeps, per table, the declared type text of each column and follows the DDL
in the binlog as the stream passes it, so the declared type used for an
event is the one valid at that event's position, never the present one.

Seeds: the relay's schema registry (the source types of the newest version
of each table, valid at the relay's last window, where the stream resumes)
and, for tables the registry does not know, ``information_schema.COLUMNS``
read at the start: valid at the binlog's end as it was then, which may be
well after the resume point (DDL written while the relay was down). Such a
table's types are marked ``valid_at`` that SCN: the statements the stream
reads up to it are in them already and leave them as they are; later ones
apply.

The parser understands ``CREATE TABLE`` (column list, ``LIKE``), ``ALTER
TABLE`` (``ADD``/``MODIFY``/``CHANGE``/``DROP``/``RENAME COLUMN``, ``RENAME
TO``), ``RENAME TABLE``, ``DROP TABLE`` and ``TRUNCATE``. A statement it cannot
follow for a table it tracks makes it forget that table's declared types:
the table then decodes with the types the binlog gives (``binary(16)``
instead of ``uuid``), which is safe, and a warning says so. Statement text
is never logged or forwarded (it can hold passwords).

A statement costs what it touches, not the number of tables known: its
changes to tables it must leave as they are (``valid_at``, or a statement
read again: ``apply(..., keep=True)``) are undone from a log of the tables
it wrote, and the ``valid_at`` marks the stream passed leave a heap in SCN
order.

Not thread-safe: one instance per fetcher thread.
"""

from __future__ import annotations

import heapq
import logging
import re
from dataclasses import dataclass
from typing import Final

__all__ = ["MODE_ANSI_QUOTES", "DdlEffect", "DeclaredTypes"]

log = logging.getLogger("changebus.fetchers.mysql")

_TOKEN: Final = re.compile(
    r"""\s+|/\*.*?\*/|--[^\n]*|\#[^\n]*
    |(?P<q>`(?:[^`]|``)*`)
    |(?P<s>'(?:[^'\\]|\\.|'')*'|"(?:[^"\\]|\\.|"")*")
    |(?P<w>[A-Za-z0-9_$@]+)
    |(?P<p>.)""",
    re.S | re.X,
)
#: the same under the session's ``sql_mode`` ANSI_QUOTES: ``"name"`` quotes a name
_TOKEN_ANSI: Final = re.compile(
    r"""\s+|/\*.*?\*/|--[^\n]*|\#[^\n]*
    |(?P<q>`(?:[^`]|``)*`|"(?:[^"]|"")*")
    |(?P<s>'(?:[^'\\]|\\.|'')*')
    |(?P<w>[A-Za-z0-9_$@]+)
    |(?P<p>.)""",
    re.S | re.X,
)
#: the ANSI_QUOTES bit of a binlog query event's ``sql_mode`` (MySQL and MariaDB)
MODE_ANSI_QUOTES: Final = 4
_NOT_COLUMNS: Final = frozenset(
    [
        "index",
        "key",
        "primary",
        "unique",
        "constraint",
        "fulltext",
        "spatial",
        "foreign",
        "check",
        "period",
        "system",
    ]
)
_TYPE_FLAGS: Final = frozenset(("unsigned", "signed", "zerofill"))

TableName = tuple[str, str]


@dataclass(frozen=True, slots=True)
class DdlEffect:
    """What a statement did: ``kind`` and the tables it touched (``(db, table)``, lower case)."""

    kind: str  # create, alter, drop, rename, truncate, other
    tables: tuple[TableName, ...] = ()
    #: a truncate's table as the statement wrote it (its case: with
    #: lower_case_table_names = 0, ``Orders`` and ``orders`` are two tables)
    written: TableName | None = None


class _Tokens:
    def __init__(self, sql: str, ansi_quotes: bool = False) -> None:
        self.items: list[
            tuple[str, str]
        ] = []  # (kind, text): w word, q quoted name, s string, p punct
        for m in (_TOKEN_ANSI if ansi_quotes else _TOKEN).finditer(sql):
            kind = m.lastgroup
            if kind is None:
                continue
            text = m.group(kind)
            if kind == "q":
                mark = text[0]
                text = text[1:-1].replace(mark + mark, mark)
            self.items.append((kind, text))
        self.i = 0

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        if j >= len(self.items):
            return ""
        kind, text = self.items[j]
        return text.lower() if kind == "w" else ("\0" + text if kind == "q" else text)

    def take(self) -> tuple[str, str]:
        item = self.items[self.i] if self.i < len(self.items) else ("", "")
        self.i += 1
        return item

    def accept(self, *words: str) -> bool:
        if self.peek() in words:
            self.i += 1
            return True
        return False

    def name(self) -> str:
        kind, text = self.take()
        if kind not in ("w", "q"):
            raise ValueError("expected a name")
        return text

    def table(self, default_db: str) -> TableName:
        db, name = self.table_as_written(default_db)
        return db.lower(), name.lower()

    def table_as_written(self, default_db: str) -> TableName:
        first = self.name()
        if self.peek() == ".":
            self.i += 1
            return first, self.name()
        return default_db, first

    def skip_group(self) -> None:
        """Skip a parenthesised group (at ``(``)."""
        depth = 0
        while self.i < len(self.items):
            kind, text = self.take()
            if kind == "p" and text == "(":
                depth += 1
            elif kind == "p" and text == ")":
                depth -= 1
            if depth == 0:
                return

    def until_comma(self) -> None:
        """Skip to the next top-level comma (consumed) or the end of a group."""
        depth = 0
        while self.i < len(self.items):
            kind, text = self.items[self.i]
            if kind == "p" and text == "(":
                depth += 1
            elif kind == "p" and text == ")":
                if depth == 0:
                    return
                depth -= 1
            elif kind == "p" and text == "," and depth == 0:
                self.i += 1
                return
            self.i += 1

    def column_type(self) -> str:
        """A column's declared type text: ``name[(args)] [unsigned|signed|zerofill]...``."""
        base = self.name().lower()
        if base in ("double", "national", "long") and self.peek() in (
            "precision",
            "char",
            "varchar",
            "varbinary",
        ):
            base += " " + self.name().lower()
        args = ""
        if self.peek() == "(":
            start = self.i
            self.skip_group()
            args = (
                "("
                + ",".join(
                    t for k, t in self.items[start + 1 : self.i - 1] if not (k == "p" and t == ",")
                )
                + ")"
            )
        flags = []
        while self.peek() in _TYPE_FLAGS:
            flags.append(self.name().lower())
        return " ".join([base + args, *flags])


#: a quoted ENUM/SET label in a COLUMN_TYPE text ('' is a quote inside one)
_QUOTED = re.compile(r"'(?:[^']|'')*'")


def _lower_keeping_labels(type_text: str) -> str:
    """``type_text`` in lower case but its quoted labels: ``enum('Active','Done')`` kept
    its labels' case (they were lowercased, and a latin1 ENUM's values with them, since
    the labels of a non-UTF-8 column come from here: review)."""
    out, at = [], 0
    for m in _QUOTED.finditer(type_text):
        out.append(type_text[at : m.start()].lower())
        out.append(m.group(0))
        at = m.end()
    out.append(type_text[at:].lower())
    return "".join(out)


class DeclaredTypes:
    """Declared column types per table, following the DDL (see the module docstring)."""

    def __init__(self) -> None:
        self._tables: dict[TableName, dict[str, str]] = {}
        #: tables whose types are those at a later SCN (information_schema read at the
        #: start, while the stream resumes before it): statements up to it are in them
        self._valid_at: dict[TableName, int] = {}
        #: ``(valid_at, table)`` of :attr:`_valid_at`, smallest first (entries whose
        #: table has another mark since, or none, are stale: skipped when popped)
        self._expiry: list[tuple[int, TableName]] = []
        #: during :meth:`apply`: what the tables it wrote held before, for those it
        #: must leave as they are (restored at its end); None otherwise
        self._undo: dict[TableName, dict[str, str] | None] | None = None
        self._at = -1
        self._keep = False

    def get(self, database: str, table: str) -> dict[str, str] | None:
        return self._tables.get((database.lower(), table.lower()))

    def set(
        self, database: str, table: str, columns: dict[str, str], *, valid_at: int = -1
    ) -> None:
        """The table's declared types; ``valid_at``: as they are at that SCN, so the
        statements :meth:`apply` is given up to it (read again) leave them as they are."""
        name = (database.lower(), table.lower())
        self._tables[name] = {k.lower(): _lower_keeping_labels(v) for k, v in columns.items()}
        if valid_at >= 0:
            self._valid_at[name] = valid_at
            heapq.heappush(self._expiry, (valid_at, name))
        else:
            self._valid_at.pop(name, None)

    def copy(self) -> DeclaredTypes:
        """An independent copy (a statement applied to it leaves this one as it is)."""
        other = DeclaredTypes()
        other._tables = {name: dict(columns) for name, columns in self._tables.items()}
        other._valid_at = dict(self._valid_at)
        other._expiry = list(self._expiry)
        return other

    def known(self, database: str, table: str) -> bool:
        return (database.lower(), table.lower()) in self._tables

    def apply(
        self,
        sql: str,
        default_db: str,
        at: int = -1,
        *,
        keep: bool = False,
        ansi_quotes: bool = False,
    ) -> DdlEffect:
        """Follow one statement (at SCN ``at``); never raises (an unparsable one is 'other').

        Tables whose types are valid at ``at`` or later (``set(valid_at=...)``)
        keep them: the statement is already in them. With ``keep`` every table
        does (a statement read again: only its effect is wanted). ``ansi_quotes``:
        the statement ran under ``sql_mode`` ANSI_QUOTES (``"name"`` is a name).
        """
        self._undo, self._at, self._keep = {}, at, keep
        tokens = _Tokens(sql, ansi_quotes)
        try:
            return self._apply(tokens, default_db)
        except (ValueError, IndexError):
            return DdlEffect("other")
        finally:
            undo, self._undo = self._undo, None
            for name, columns in undo.items():
                if columns is None:
                    self._tables.pop(name, None)
                else:
                    self._tables[name] = columns
            expiry = self._expiry
            while expiry and expiry[0][0] < at:  # the stream is past it: statements apply
                valid_at, name = heapq.heappop(expiry)
                if self._valid_at.get(name) == valid_at:
                    del self._valid_at[name]

    def _put(self, name: TableName, columns: dict[str, str] | None) -> None:
        """Set (None: forget) a table's types during :meth:`apply` (logged in
        :attr:`_undo` first when the statement must leave the table as it is)."""
        undo = self._undo
        valid_at = self._valid_at.get(name)  # (None: no mark; a table without one follows)
        if (
            undo is not None
            and name not in undo
            and (self._keep or (valid_at is not None and valid_at >= self._at))
        ):
            undo[name] = self._tables.get(name)
        if columns is None:
            self._tables.pop(name, None)
        else:
            self._tables[name] = columns

    def _apply(self, t: _Tokens, db: str) -> DdlEffect:
        head = t.peek()
        if head == "truncate":
            t.i += 1
            t.accept("table")
            written = t.table_as_written(db)
            return DdlEffect(
                "truncate", ((written[0].lower(), written[1].lower()),), written=written
            )
        if head == "drop":
            t.i += 1
            t.accept("temporary")
            if not t.accept("table", "tables"):
                return DdlEffect("other")
            t.accept("if") and t.accept("exists")
            names = [t.table(db)]
            while t.accept(","):
                names.append(t.table(db))
            for n in names:
                self._put(n, None)
            return DdlEffect("drop", tuple(names))
        if head == "rename":
            t.i += 1
            if not t.accept("table", "tables"):
                return DdlEffect("other")
            touched = []
            while True:
                old, new = t.table(db), None
                if not t.accept("to"):
                    raise ValueError("RENAME TABLE without TO")
                new = t.table(db)
                self._move(old, new)
                touched += [old, new]
                if not t.accept(","):
                    break
            return DdlEffect("rename", tuple(touched))
        if head == "create":
            t.i += 1
            if t.accept("or"):
                t.accept("replace")
            t.accept("temporary")
            if not t.accept("table"):
                return DdlEffect("other")
            if_missing = False
            if t.accept("if"):
                t.accept("not")
                t.accept("exists")
                if_missing = True
            name = t.table(db)
            if if_missing and name in self._tables:
                # logged even when the table was there (and so left as it was): an
                # idempotent schema script's column list may be out of date (review)
                return DdlEffect("other")
            if t.accept("like"):
                src = t.table(db)
                src_columns = self._tables.get(src)
                self._put(name, None if src_columns is None else dict(src_columns))
                return DdlEffect("create", (name,))
            if t.peek() == "(" and t.peek(1) != "select":
                t.i += 1
                self._put(name, self._definitions(t))
            else:
                self._put(name, None)  # CREATE ... SELECT: types unknown
            return DdlEffect("create", (name,))
        if head == "alter":
            t.i += 1
            t.accept("online")
            t.accept("ignore")
            if not t.accept("table"):
                return DdlEffect("other")
            t.accept("if") and t.accept("exists")
            name = t.table(db)
            target = self._alter(t, name, db)
            if target is not None:
                return DdlEffect("alter", (name,) if target == name else (name, target))
            if name in self._tables:
                log.warning(
                    "an ALTER TABLE of %s.%s was not understood: its columns decode with "
                    "binlog types from here on (uuid as binary(16), json as text)",
                    *name,
                )
            self._put(name, None)
            return DdlEffect("alter", (name,))
        return DdlEffect("other")

    def _move(self, old: TableName, new: TableName) -> None:
        cols = self._tables.get(old)
        self._put(old, None)
        self._put(new, cols)

    @staticmethod
    def _definitions(t: _Tokens) -> dict[str, str]:
        """Column definitions up to the closing parenthesis (consumed)."""
        cols: dict[str, str] = {}
        while t.peek() not in (")", ""):
            if t.peek() in _NOT_COLUMNS or t.peek() == "(":
                t.until_comma()
                continue
            name = t.name().lower()
            cols[name] = t.column_type()
            t.until_comma()
        t.accept(")")
        return cols

    def _alter(self, t: _Tokens, name: TableName, db: str) -> TableName | None:
        """Apply ALTER TABLE specifications; the table's (new) name, None if not understood.

        Every clause names the columns as they were before the statement, as the
        server reads them: ``RENAME COLUMN a TO b, RENAME COLUMN b TO a`` swaps
        them (applied one after the other, the second found the first's result:
        review)."""
        before = dict(self._tables.get(name, {}))
        moved: dict[str, tuple[str, str | None]] = {}  # old name -> (new name, new type)
        dropped: set[str] = set()
        added: dict[str, str] = {}
        target = name
        while t.peek() != "":
            op = t.peek()
            t.i += 1
            if op == "rename" and t.peek() not in ("column", "index", "key"):
                t.accept("to", "as")
                target = t.table(db)
            elif op == "convert":
                return None  # CONVERT TO CHARACTER SET changes every text column
            elif op in ("add", "modify", "change", "drop", "rename"):
                if t.peek() in _NOT_COLUMNS or t.peek() in ("partition", "index", "key"):
                    t.until_comma()
                    continue
                t.accept("column")
                if t.accept("if"):
                    t.accept("not")
                    t.accept("exists")
                if op == "add" and t.accept("("):
                    added.update(self._definitions(t))
                elif op == "add":
                    col = t.name().lower()
                    added[col] = t.column_type()
                elif op == "modify":
                    col = t.name().lower()
                    moved[col] = (col, t.column_type())
                elif op == "change":
                    old = t.name().lower()
                    new_col = t.name().lower()
                    moved[old] = (new_col, t.column_type())
                elif op == "drop":
                    dropped.add(t.name().lower())
                else:  # rename column
                    old = t.name().lower()
                    t.accept("to")
                    new_col = t.name().lower()
                    if old in before:
                        moved[old] = (new_col, None)
            t.until_comma()
        cols: dict[str, str] = {}
        for col, kind in before.items():
            if col in dropped:
                continue
            new_col, new_kind = moved.pop(col, (col, None))
            cols[new_col] = kind if new_kind is None else new_kind
        # (a column changed that this tracker did not know)
        cols.update({c: k for c, k in moved.values() if k is not None})
        cols.update(added)
        known = name in self._tables
        self._put(name, None)
        if known:
            self._put(target, cols)
        return target
