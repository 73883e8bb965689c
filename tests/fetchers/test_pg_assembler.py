"""pgoutput -> windows: a random workload rebuilt from the events equals the source."""

from __future__ import annotations

import datetime
import decimal
import json
import random
import uuid
from typing import Any

import psycopg
import pytest

from changebus.fetchers.postgres import Assembler, TypeResolver, message_scn, parse_message
from changebus.schemas import (
    ChangeDecoder,
    Op,
    decode_control,
    event_at,
    lsn_to_scn,
    parse_stream,
    verify_event,
)

pytestmark = pytest.mark.pg

SETUP = [
    "CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy')",
    "CREATE DOMAIN posint AS int4 CHECK (VALUE > 0)",
    """CREATE TABLE items (id int8 PRIMARY KEY, i int4, n numeric(10,2), nu numeric, t text,
        ts timestamptz, d date, u uuid, arr int4[], j jsonb, m mood, p posint, big text)""",
    "ALTER TABLE items ALTER COLUMN big SET STORAGE EXTERNAL",
    "CREATE TABLE pairs (a int4, b text, v text, PRIMARY KEY (a, b))",
    "ALTER TABLE pairs REPLICA IDENTITY FULL",
    "CREATE PUBLICATION pub FOR ALL TABLES",
    "SELECT pg_create_logical_replication_slot('s', 'pgoutput')",
]


def windows_from(conn: psycopg.Connection[Any], asm: Assembler) -> list[Any]:
    rows = conn.execute(
        "SELECT data FROM pg_logical_slot_get_binary_changes('s', NULL, NULL, 'proto_version', '1', "
        "'publication_names', 'pub', 'binary', 'true', 'messages', 'true')"
    ).fetchall()
    out = []
    for (data,) in rows:
        window = asm.feed(parse_message(bytes(data)))
        if window is not None:
            out.append(window)
    return out


def replay(windows: list[Any], asm: Assembler) -> dict[str, dict[tuple[Any, ...], dict[str, Any]]]:
    """Apply the windows' events to an empty replica, checking order and structure."""
    state: dict[str, dict[tuple[Any, ...], dict[str, Any]]] = {}
    last_scn = -1
    decoders: dict[tuple[int, int], ChangeDecoder] = {}
    companion: tuple[str, tuple[Any, ...]] | None = None
    for w in windows:
        assert w.scn > last_scn
        last_scn = w.scn
        offsets, headers = parse_stream(w.data)
        assert int(headers["op"][-1]) == Op.END_OF_WINDOW
        for off in offsets.tolist():
            h = verify_event(w.data, off)
            _, payload = event_at(w.data, off, h)
            if h.op.is_control:
                if h.op == Op.END_OF_WINDOW:
                    eow = decode_control(h.op, bytes(payload))
                    assert eow.source_position.count("/") == 1  # type: ignore[union-attr]
                continue
            name = asm.registry.name_for_id(h.source_id)
            table = asm.registry.get(name, h.schema_version)
            dec = decoders.setdefault((h.source_id, h.schema_version), ChangeDecoder(table))
            rows = state.setdefault(name, {})
            if h.op == Op.TRUNCATE:
                rows.clear()
                continue
            change = dec.decode(payload)
            if h.op == Op.DELETE:
                assert change.before is not None
                gone = tuple(change.before[k] for k in table.key)
                if companion is not None:  # the old key's DELETE after its key change
                    assert companion == (name, gone) and gone not in rows
                    companion = None
                    continue
                del rows[gone]
                continue
            assert companion is None, "a key change without the old key's DELETE after it"
            assert change.after is not None
            if change.before is not None:  # a key change moves the row
                old_key = tuple(change.before[k] for k in table.key)
                prev = rows.pop(old_key, {})
                if old_key != tuple(change.after[k] for k in table.key):
                    companion = (name, old_key)
            else:
                prev = rows.get(tuple(change.after[k] for k in table.key), {})
            row = dict(change.after)
            for col in change.after_not_sent:
                row[col] = prev[col]  # unchanged TOAST: keep what the replica has
            rows[tuple(row[k] for k in table.key)] = row
    assert companion is None, "a key change without the old key's DELETE after it"
    return state


def normalise(value: Any) -> Any:
    if isinstance(value, datetime.datetime) and value.tzinfo is not None:
        return value.astimezone(datetime.UTC)
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True)
    return value


def source_rows(
    conn: psycopg.Connection[Any], table: str, key: tuple[str, ...]
) -> dict[tuple[Any, ...], dict[str, Any]]:
    cur = conn.execute(f"SELECT * FROM {table}")
    names = [d.name for d in cur.description or ()]
    out = {}
    for rec in cur.fetchall():
        row = dict(zip(names, rec, strict=True))
        out[tuple(row[k] for k in key)] = row
    return out


def same_row(replica: dict[str, Any], source: dict[str, Any]) -> bool:
    for name, want in source.items():
        got = replica[name]
        if name == "j" and got is not None:
            got = json.dumps(json.loads(got), sort_keys=True)
        if name == "nu" and got is not None:
            got = decimal.Decimal(got)
            if got.is_nan() and isinstance(want, decimal.Decimal) and want.is_nan():
                continue
        if normalise(got) != normalise(want):
            return False
    return True


def test_random_workload_is_rebuilt_exactly(pg_dsn: str) -> None:
    rnd = random.Random(7)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for stmt in SETUP:
            conn.execute(stmt)
        resolver = TypeResolver(conn)
        asm = Assembler(1, resolver.resolve, primary_key=resolver.primary_key)
        for txn in range(60):
            with conn.transaction():
                for step in range(rnd.randint(1, 6)):
                    op = rnd.random()
                    k = rnd.randint(1, 25)
                    if op < 0.45:
                        conn.execute(
                            "INSERT INTO items VALUES (%s, %s, %s, %s, %s, now(), %s, %s, %s, %s, %s, %s, %s) "
                            "ON CONFLICT (id) DO UPDATE SET i = EXCLUDED.i, t = EXCLUDED.t",
                            (
                                k,
                                rnd.randint(-9, 9),
                                decimal.Decimal(rnd.randint(-99999, 99999)) / 100,
                                decimal.Decimal("NaN")
                                if rnd.random() < 0.1
                                else decimal.Decimal(rnd.random()),
                                rnd.choice(["a", "é", "", None]),
                                datetime.date(2020, 1, rnd.randint(1, 28)),
                                uuid.uuid4(),
                                [rnd.randint(0, 9), None],
                                json.dumps({"k": k}),
                                rnd.choice(["sad", "ok", "happy"]),
                                rnd.randint(1, 99),
                                "".join(rnd.choices("abcdef", k=3000)),
                            ),
                        )
                    elif op < 0.65:
                        conn.execute(
                            "UPDATE items SET i = i + 1, t = 'upd' WHERE id = %s", (k,)
                        )  # big unchanged
                    elif op < 0.72:
                        new_id = 1000 + txn * 10 + step  # a key change, to a fresh key
                        conn.execute("UPDATE items SET id = %s WHERE id = %s", (new_id, k))
                    elif op < 0.8:
                        conn.execute("DELETE FROM items WHERE id = %s", (k,))
                    elif op < 0.95:
                        conn.execute(
                            "INSERT INTO pairs VALUES (%s, %s, %s) ON CONFLICT (a, b) DO UPDATE SET v = EXCLUDED.v",
                            (k % 5, f"b{k % 3}", f"v{txn}"),
                        )
                    else:
                        conn.execute("DELETE FROM pairs WHERE a = %s", (k % 5,))
            if txn == 30:
                conn.execute("TRUNCATE pairs")
                conn.execute("SELECT pg_logical_emit_message(false, 'marker', 'half way')")
        windows = windows_from(conn, asm)
        state = replay(windows, asm)
        for table, key in (("items", ("id",)), ("pairs", ("a", "b"))):
            source = source_rows(conn, table, key)
            replica = state.get(f"public.{table}", {})
            assert set(replica) == set(source), table
            for pk, row in source.items():
                assert same_row(replica[pk], row), (table, pk, replica[pk], row)
    ops = [int(h["op"]) for w in windows for h in parse_stream(w.data)[1]]
    assert Op.TRUNCATE in ops
    message_windows = [
        w
        for w in windows
        if w.events == 2 and Op.MESSAGE in [int(h["op"]) for h in parse_stream(w.data)[1]]
    ]
    assert len(message_windows) == 1  # the non-transactional message is a window of its own


def test_schema_change_mid_stream(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for stmt in SETUP:
            conn.execute(stmt)
        resolver = TypeResolver(conn)
        asm = Assembler(1, resolver.resolve, primary_key=resolver.primary_key)
        conn.execute("INSERT INTO pairs VALUES (1, 'x', 'before')")
        conn.execute("ALTER TABLE pairs ADD COLUMN extra int8 DEFAULT 7")
        conn.execute("INSERT INTO pairs VALUES (2, 'y', 'after', 9)")
        conn.execute("ALTER TABLE pairs ALTER COLUMN extra TYPE numeric(20,0)")
        conn.execute("UPDATE pairs SET v = 'changed' WHERE a = 1")
        windows = windows_from(conn, asm)
    versions = [t.version for t in asm.registry.versions("public.pairs")]
    assert versions == [1, 2, 3]
    seen = []
    for w in windows:
        _, headers = parse_stream(w.data)
        for h in headers:
            seen.append((int(h["op"]), int(h["schema_version"])))
    # each new version is announced by a SCHEMA_CHANGE before the first row using it
    data_versions = [v for op, v in seen if op < 16]
    assert data_versions == [1, 2, 3]
    changes = [i for i, (op, _) in enumerate(seen) if op == Op.SCHEMA_CHANGE]
    firsts = [seen.index((op, v)) for op, v in seen if op < 16]
    assert len(changes) == 3 and all(c < f for c, f in zip(changes, firsts, strict=True))
    state = replay(windows, asm)
    rows = state["public.pairs"]
    assert rows[(1, "x")]["v"] == "changed" and rows[(1, "x")]["extra"] == decimal.Decimal(7)
    assert rows[(2, "y")]["extra"] == decimal.Decimal(9)


def test_message_right_before_a_commit_sorts_before_its_transaction(pg_dsn: str) -> None:
    """A non-transactional message ends where the next commit record starts.

    The transaction's SCN is that commit's LSN, the message's end LSN: the
    message window must sort strictly before it (once they shared an SCN and
    the relay refused the transaction), and its position must let a restart
    there re-read the transaction.
    """
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for stmt in SETUP:
            conn.execute(stmt)
        resolver = TypeResolver(conn)
        asm = Assembler(1, resolver.resolve, primary_key=resolver.primary_key)
        conn.execute("INSERT INTO pairs VALUES (0, 'before', 'v')")
        with conn.transaction():
            conn.execute("INSERT INTO pairs VALUES (1, 'x', 'v')")
            row = conn.execute("SELECT pg_logical_emit_message(false, 'app', 'm')::text").fetchone()
        assert row is not None
        windows = windows_from(conn, asm)
    assert [w.events for w in windows] == [
        3,
        2,
        2,
    ]  # schema change + row + end; message + end; row + end
    first, message, txn = windows
    assert first.scn < message.scn < txn.scn
    assert message.scn == message_scn(row[0]) == lsn_to_scn(row[0]) - 1
    assert txn.scn == lsn_to_scn(row[0])  # the commit starts where the message ends
    assert lsn_to_scn(message.source_position) == lsn_to_scn(row[0])
    state = replay(windows, asm)
    assert set(state["public.pairs"]) == {(0, "before"), (1, "x")}


@pytest.mark.parametrize(
    ("identity", "dropped", "first_key"),
    [
        ("DEFAULT", False, ("id",)),
        ("FULL", False, ("id",)),  # the key's place among the columns
        ("FULL", True, ("gone", "id", "v")),  # a dropped column: only the identity is known
    ],
)
def test_older_relation_after_the_key_was_renamed(
    pg_dsn: str, identity: str, dropped: bool, first_key: tuple[str, ...]
) -> None:
    """The catalog's key is today's; a Relation read from older WAL may predate it.

    A key column renamed after the change being decoded is not in that
    change's Relation message: the key comes from what the message itself
    says (its replica identity, or the table's previous version) instead of
    stopping the partition on a key that names no column.
    """
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for stmt in SETUP:
            conn.execute(stmt)
        conn.execute("CREATE TABLE renamed (gone int4, id int8 PRIMARY KEY, v text)")
        conn.execute(f"ALTER TABLE renamed REPLICA IDENTITY {identity}")
        conn.execute("INSERT INTO renamed (id, v) VALUES (1, 'a'), (2, 'b')")
        conn.execute("UPDATE renamed SET v = 'c' WHERE id = 2")
        conn.execute("ALTER TABLE renamed RENAME COLUMN id TO ident")
        if dropped:
            conn.execute("ALTER TABLE renamed DROP COLUMN gone")
        conn.execute("INSERT INTO renamed (ident, v) VALUES (3, 'd')")
        if not dropped:  # (with all columns as the first key, the key changes with the version)
            conn.execute("DELETE FROM renamed WHERE ident = 1")
        resolver = TypeResolver(conn)
        asm = Assembler(
            1,
            resolver.resolve,
            primary_key=resolver.primary_key,
            key_positions=resolver.key_positions,
        )
        windows = windows_from(conn, asm)
    versions = asm.registry.versions("public.renamed")
    assert [t.key for t in versions] == [first_key, ("ident",)]
    state = replay(windows, asm)
    rows = state["public.renamed"]
    if dropped:
        assert {k: r["v"] for k, r in rows.items()} == {
            (None, 1, "a"): "a",
            (None, 2, "c"): "c",
            (3,): "d",
        }
    else:
        assert {k: r["v"] for k, r in rows.items()} == {(2,): "c", (3,): "d"}


def _changes(windows: list[Any], asm: Assembler) -> list[tuple[Op, Any]]:
    """Every data event of ``windows`` as (op, decoded change), in order."""
    out: list[tuple[Op, Any]] = []
    for w in windows:
        offsets, _headers = parse_stream(w.data)
        for off in offsets.tolist():
            h = verify_event(w.data, off)
            if h.op.is_control:
                continue
            table = asm.registry.get(asm.registry.name_for_id(h.source_id), h.schema_version)
            out.append((h.op, ChangeDecoder(table).decode(event_at(w.data, off, h)[1])))
    return out


def test_a_new_replica_identity_of_the_same_schema_changes_the_before_images(
    pg_dsn: str,
) -> None:
    """ALTER TABLE ... REPLICA IDENTITY keeps the columns and the key, so the schema is
    the same, but the Relation message's key flags change: the assembler kept the old
    ones, and after FULL -> DEFAULT its key-only DELETEs said the other columns were
    NULL instead of not sent (review)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for stmt in SETUP:
            conn.execute(stmt)
        conn.execute("CREATE TABLE ident (id int8 PRIMARY KEY, v text, w text UNIQUE NOT NULL)")
        conn.execute("ALTER TABLE ident REPLICA IDENTITY FULL")
        conn.execute("INSERT INTO ident VALUES (1, 'a', 'w1'), (2, 'b', 'w2'), (3, 'c', 'w3')")
        conn.execute("DELETE FROM ident WHERE id = 1")
        conn.execute("ALTER TABLE ident REPLICA IDENTITY DEFAULT")
        conn.execute("DELETE FROM ident WHERE id = 2")
        conn.execute("ALTER TABLE ident REPLICA IDENTITY FULL")
        conn.execute("DELETE FROM ident WHERE id = 3")
        resolver = TypeResolver(conn)
        asm = Assembler(1, resolver.resolve, primary_key=resolver.primary_key)
        windows = windows_from(conn, asm)
    deletes = [c for op, c in _changes(windows, asm) if op == Op.DELETE]
    assert [(c.before, tuple(c.before_not_sent)) for c in deletes] == [
        ({"id": 1, "v": "a", "w": "w1"}, ()),
        ({"id": 2, "v": None, "w": None}, ("v", "w")),
        ({"id": 3, "v": "c", "w": "w3"}, ()),
    ]
    assert [t.version for t in asm.registry.versions("public.ident")] == [1]


def test_an_unchanged_key_stored_out_of_line_comes_from_the_logged_old_key(pg_dsn: str) -> None:
    """An UPDATE that leaves a TOASTed key alone sends it as unchanged ('u'), and
    Postgres logs the old key with it: the key was taken from the new row only, so
    the encoder failed on a NULL key and the partition stopped for good (review)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for stmt in SETUP:
            conn.execute(stmt)
        conn.execute("CREATE TABLE bigkey (k text PRIMARY KEY, v int4)")
        conn.execute("ALTER TABLE bigkey ALTER COLUMN k SET STORAGE EXTERNAL")
        key = "".join(f"{i:04d}" for i in range(600))  # 2,400 bytes: stored out of line
        conn.execute("INSERT INTO bigkey VALUES (%s, 1), ('short', 1)", (key,))
        conn.execute("UPDATE bigkey SET v = 2")
        resolver = TypeResolver(conn)
        asm = Assembler(1, resolver.resolve, primary_key=resolver.primary_key)
        windows = windows_from(conn, asm)
    updates = [c for op, c in _changes(windows, asm) if op == Op.UPDATE]
    assert sorted((c.after["k"], c.after["v"], tuple(c.after_not_sent)) for c in updates) == [
        (key, 2, ()),
        ("short", 2, ()),
    ]
    state = replay(windows, asm)
    assert {k: r["v"] for k, r in state["public.bigkey"].items()} == {(key,): 2, ("short",): 2}


def test_a_replica_identity_on_another_unique_index_keys_the_events(pg_dsn: str) -> None:
    """``REPLICA IDENTITY USING INDEX`` on an index other than the primary key: pgoutput's
    old keys (a DELETE's, a key-changing UPDATE's) hold only that index's columns. Keyed by
    the primary key, the first DELETE failed the partition for good (its key NULL), and an
    UPDATE of only the primary key sent no old key, so replicas kept the old row (review).
    The events are keyed by the identity index now."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for stmt in SETUP:
            conn.execute(stmt)
        conn.execute("CREATE TABLE ui (id int8 PRIMARY KEY, code text NOT NULL, v text)")
        conn.execute("CREATE UNIQUE INDEX ui_code ON ui (code)")
        conn.execute("ALTER TABLE ui REPLICA IDENTITY USING INDEX ui_code")
        conn.execute("INSERT INTO ui SELECT g, 'c' || g, 'v' || g FROM generate_series(1, 6) g")
        conn.execute("UPDATE ui SET id = 100 WHERE id = 1")  # the primary key only
        conn.execute("UPDATE ui SET code = 'moved' WHERE id = 2")  # the identity
        conn.execute("UPDATE ui SET v = 'x' WHERE id = 3")
        conn.execute("DELETE FROM ui WHERE id = 4")
        conn.execute("DELETE FROM ui WHERE code = 'moved'")
        resolver = TypeResolver(conn)
        asm = Assembler(1, resolver.resolve, primary_key=resolver.primary_key)
        windows = windows_from(conn, asm)
        assert asm.registry.latest("public.ui").key == ("code",)
        state = replay(windows, asm)
        source = source_rows(conn, "ui", ("code",))
    assert state["public.ui"] == source
    assert {r["id"] for r in source.values()} == {100, 3, 5, 6}
