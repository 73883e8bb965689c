"""A DDL statement on one table costs what it touches, not the number of tables known.

Found by review: each statement walked every table seeded with a ``valid_at``
mark (twice: a snapshot, then the expired marks), a statement read again
after a rewind copied every table's declared types, and the assembler found
the table a DDL or TRUNCATE names by walking every table mapped. Counted
(walks of the whole tables), not timed.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from test_mysql_fetcher import execute
from test_mysql_oversized import binlog_events, feed

from changebus.fetchers.mysql import BinlogAssembler, DeclaredTypes, EmbeddedMariaDB
from changebus.schemas import Op, SchemaRegistry, parse_stream


class _Walked(dict[Any, Any]):
    """A dict counting the walks over it (iteration, keys, values, items)."""

    walks = 0

    def __iter__(self) -> Iterator[Any]:
        self.walks += 1
        return super().__iter__()

    def keys(self) -> Any:
        self.walks += 1
        return super().keys()

    def values(self) -> Any:
        self.walks += 1
        return super().values()

    def items(self) -> Any:
        self.walks += 1
        return super().items()


def _watched(declared: DeclaredTypes) -> tuple[_Walked, _Walked]:
    tables: _Walked = _Walked(declared._tables)
    valid_at: _Walked = _Walked(declared._valid_at)
    declared._tables, declared._valid_at = tables, valid_at
    return tables, valid_at


def test_a_statement_while_catching_up_walks_no_table_list() -> None:
    declared = DeclaredTypes()
    for i in range(500):  # read from information_schema at SCN 1000
        declared.set("d", f"t{i}", {"id": "int", "u": "uuid"}, valid_at=1000)
    declared.set("d", "known", {"id": "int"})  # from the registry: valid at the resume point
    tables, valid_at = _watched(declared)
    declared.apply("ALTER TABLE t7 MODIFY u int", "d", at=5)
    declared.apply("ALTER TABLE known ADD COLUMN j json", "d", at=6)
    declared.apply("RENAME TABLE t8 TO t9, t9 TO t8", "d", at=7)
    assert tables.walks == valid_at.walks == 0
    assert declared.get("d", "t7") == {"id": "int", "u": "uuid"}  # already in it
    assert declared.get("d", "known") == {"id": "int", "j": "json"}
    # past SCN 1000 every statement applies again (and the marks are gone)
    declared.apply("ALTER TABLE t7 MODIFY u int", "d", at=1001)
    assert declared.get("d", "t7") == {"id": "int", "u": "int"}
    assert not declared._valid_at and not declared._expiry
    assert tables.walks == valid_at.walks == 0


def test_a_statement_read_again_changes_nothing_and_walks_nothing() -> None:
    declared = DeclaredTypes()
    for i in range(500):
        declared.set("d", f"t{i}", {"id": "int", "u": "uuid"})
    before = {n: dict(c) for n, c in declared._tables.items()}
    tables, _ = _watched(declared)
    for sql in (
        "ALTER TABLE t1 DROP COLUMN u",
        "DROP TABLE t2",
        "RENAME TABLE t3 TO t3x, t4 TO t3",
        "CREATE TABLE t5 (id bigint)",
        "CREATE TABLE t6 LIKE t7",
        "ALTER TABLE t8 RENAME TO t9",
        "RENAME TABLE t10 TO",  # not understood, after a change
    ):
        effect = declared.apply(sql, "d", at=10, keep=True)
        assert effect.kind in ("alter", "drop", "rename", "create", "other")
    assert declared.apply("DROP TABLE t2", "d", at=10, keep=True).tables == (("d", "t2"),)
    assert tables.walks == 0
    assert dict(declared._tables) == before


def test_a_statement_without_an_scn_applies_to_tables_without_a_mark() -> None:
    """``apply`` without ``at`` (-1) took every table for one marked valid at -1 and
    undid the statement on all of them (found by review): a table without a mark
    follows every statement, one with a mark keeps its types up to that SCN."""
    declared = DeclaredTypes()
    declared.set("d", "t", {"id": "int"})
    declared.set("d", "m", {"id": "int"}, valid_at=10)
    declared.apply("ALTER TABLE t ADD COLUMN u uuid", "d")
    declared.apply("CREATE TABLE n (id bigint)", "d")
    declared.apply("ALTER TABLE m ADD COLUMN u uuid", "d")
    assert declared.get("d", "t") == {"id": "int", "u": "uuid"}
    assert declared.get("d", "n") == {"id": "bigint"}
    assert declared.get("d", "m") == {"id": "int"}  # (valid at SCN 10: already in it)


@pytest.mark.mysql
def test_the_assembler_finds_a_ddl_s_table_without_walking_every_table(
    mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    names = [f"t{i}" for i in range(20)]
    execute(mysql_server, mysql_db, *(f"CREATE TABLE {n} (id int PRIMARY KEY)" for n in names))
    conn = mysql_server.connect(mysql_db)
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW MASTER STATUS")
            file, pos = cur.fetchone()[:2]
            for n in names:
                cur.execute(f"INSERT INTO {n} VALUES (1)")
            conn.commit()
            cur.execute("TRUNCATE TABLE t3")
            cur.execute("ALTER TABLE t4 ADD COLUMN v int")
    finally:
        conn.close()
    events = list(binlog_events(mysql_server, file, int(pos)))
    declared = DeclaredTypes()
    assembler = BinlogAssembler(1, SchemaRegistry(), declared, databases=(mysql_db,))
    tables_walked = None
    windows = []
    for event in events:
        if type(event).__name__ == "QueryEvent" and "TRUNCATE" in str(event.query):
            tables_walked = assembler._tables.latest = _Walked(assembler._tables.latest)
            _, _ = _watched(declared)
        window = feed(assembler, event)
        if window is not None:
            windows.append(window)
    assert tables_walked is not None and tables_walked.walks == 0
    assert declared._tables.walks == 0  # type: ignore[attr-defined]
    _, headers = parse_stream(windows[-2].data)
    assert Op.TRUNCATE in [Op(int(o)) for o in headers["op"].tolist()]
    # a DDL read again (the relay has it): the declared types stay, nothing is walked
    assembler.replay_until = assembler.scn_at(10**9)
    event = SimpleNamespace(query="ALTER TABLE t5 ADD COLUMN w uuid", schema=mysql_db, timestamp=1)
    assembler.query(event, 4)
    assert declared.get(mysql_db, "t5") is None
    assert declared._tables.walks == 0  # type: ignore[attr-defined]


def test_columns_swapped_in_one_statement_keep_their_types() -> None:
    """Every clause of an ALTER names the columns as they were before it: applied one after
    the other, swapping two by RENAME (or CHANGE) left one column with the other's type
    and lost the other (review)."""
    declared = DeclaredTypes()
    declared.set("d", "t", {"id": "int", "a": "uuid", "b": "binary(16)"})
    declared.apply("ALTER TABLE t RENAME COLUMN a TO b, RENAME COLUMN b TO a", "d", at=10)
    assert declared.get("d", "t") == {"id": "int", "a": "binary(16)", "b": "uuid"}
    declared.apply("ALTER TABLE t CHANGE a b binary(16), CHANGE b a uuid", "d", at=20)
    assert declared.get("d", "t") == {"id": "int", "a": "uuid", "b": "binary(16)"}
    declared.apply(
        "ALTER TABLE t DROP COLUMN a, ADD COLUMN a int, MODIFY b varchar(3), ADD (c uuid)",
        "d",
        at=30,
    )
    assert declared.get("d", "t") == {"id": "int", "a": "int", "b": "varchar(3)", "c": "uuid"}
