"""The bootstrap store's SQL layer: dialects, tables, the state row and the schema table.

One job: everything the parts of the store (:mod:`._store`) share about the
database itself.

* **Dialects**: SQLite (the default: one file, no server) and Postgres
  (``psycopg``) run the same statements. They are written with ``{p}`` for a
  parameter (``?`` or ``%s``), and ``{serial}`` / ``{blob}`` in the DDL;
  both connections run in autocommit mode and a transaction is an explicit
  ``BEGIN`` ... ``COMMIT`` (:meth:`StoreDb._txn`). Transactions nest: an
  inner block joins the outer one (only the outermost commits, and an
  exception leaving the outermost block rolls all of it back), so two parts'
  writes can be made one transaction (:meth:`~._store.Store.append`).
* **Tables**: all of them are created here (:data:`_DDL`); each is described
  with the part that writes it: ``cb_log`` in :mod:`._logstore`, ``cb_snap``
  and ``cb_trunc`` in :mod:`._fold`, ``cb_seed`` and ``cb_lost`` in :mod:`._gaps`,
  ``cb_snapjob`` in :mod:`._snapjobs`, ``cb_unfilled`` and ``cb_moved`` in
  :mod:`._fold` and :mod:`._refill`, ``cb_purge`` in :mod:`._purge`.
* ``cb_state`` -- per partition: ``producer_scn`` (newest window in the log),
  ``applier_scn`` / ``applier_id`` (the snapshot reflects every window up to
  it), ``log_min_scn`` (windows after it are all in the log), ``base_scn``
  (the snapshot holds every change after it; -1: the whole history). One
  row, read and written whole (:class:`PartitionState`).
* ``cb_schema`` -- table schemas by (partition, source id, version), from the
  SCHEMA_CHANGE events the producer saw; decoders and encoders built from
  them are cached per connection (:meth:`StoreDb._codec`).

Not thread-safe: a connection and its cache belong to one thread.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from changebus.schemas import ChangeDecoder, EventHeader, RowEncoder, TableSchema

__all__ = ["UPSERT_SNAP", "PartitionState", "StoreDb"]

_DDL = [
    """CREATE TABLE IF NOT EXISTS cb_log (
        id {serial} PRIMARY KEY, part TEXT NOT NULL, scn BIGINT NOT NULL,
        source_id INTEGER NOT NULL, op INTEGER NOT NULL, event {blob} NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS cb_log_part_scn ON cb_log (part, scn, id)",
    """CREATE TABLE IF NOT EXISTS cb_snap (
        id {serial} PRIMARY KEY, part TEXT NOT NULL, source_id INTEGER NOT NULL,
        key {blob} NOT NULL, scn BIGINT NOT NULL, deleted INTEGER NOT NULL,
        event {blob} NOT NULL, UNIQUE (part, source_id, key))""",
    "CREATE INDEX IF NOT EXISTS cb_snap_scan ON cb_snap (part, source_id, id)",
    "CREATE INDEX IF NOT EXISTS cb_snap_scn ON cb_snap (part, scn)",
    """CREATE TABLE IF NOT EXISTS cb_trunc (
        part TEXT NOT NULL, source_id INTEGER NOT NULL, scn BIGINT NOT NULL,
        event {blob} NOT NULL, PRIMARY KEY (part, source_id))""",
    """CREATE TABLE IF NOT EXISTS cb_state (
        part TEXT PRIMARY KEY, producer_scn BIGINT NOT NULL, applier_scn BIGINT NOT NULL,
        applier_id BIGINT NOT NULL, log_min_scn BIGINT NOT NULL, base_scn BIGINT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS cb_seed (
        part TEXT NOT NULL, name TEXT NOT NULL, scn BIGINT NOT NULL, PRIMARY KEY (part, name))""",
    """CREATE TABLE IF NOT EXISTS cb_lost (
        part TEXT NOT NULL, after_scn BIGINT NOT NULL, upto_scn BIGINT NOT NULL,
        PRIMARY KEY (part, upto_scn))""",
    """CREATE TABLE IF NOT EXISTS cb_snapjob (
        part TEXT NOT NULL, name TEXT NOT NULL, scope TEXT NOT NULL, resume_at TEXT,
        chunks BIGINT NOT NULL, nrows BIGINT NOT NULL, first_tag BIGINT NOT NULL,
        last_tag BIGINT NOT NULL, PRIMARY KEY (part, name))""",
    """CREATE TABLE IF NOT EXISTS cb_unfilled (
        part TEXT NOT NULL, source_id INTEGER NOT NULL, key {blob} NOT NULL,
        scn BIGINT NOT NULL, PRIMARY KEY (part, source_id, key))""",
    # keys whose row lacking columns moved there from another key, and when (a chunk read
    # before that held another row at the key: it must not complete this one)
    """CREATE TABLE IF NOT EXISTS cb_moved (
        part TEXT NOT NULL, source_id INTEGER NOT NULL, key {blob} NOT NULL,
        scn BIGINT NOT NULL, PRIMARY KEY (part, source_id, key))""",
    """CREATE TABLE IF NOT EXISTS cb_purge (
        part TEXT PRIMARY KEY, tomb_scn BIGINT NOT NULL, scanned_scn BIGINT NOT NULL)""",
    # the store's identity: a random id made once, named in snapshot positions
    "CREATE TABLE IF NOT EXISTS cb_ident (id TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS cb_schema (
        part TEXT NOT NULL, source_id INTEGER NOT NULL, version INTEGER NOT NULL,
        name TEXT NOT NULL, schema TEXT NOT NULL, PRIMARY KEY (part, source_id, version))""",
]

#: ``VALUES ({p}, ...)`` of an INSERT (:meth:`StoreDb._many` batches its rows on SQLite)
_VALUES = re.compile(r"\bVALUES\s*(\((?:\{p\},\s*)*\{p\}\))")
#: rows per multi-row INSERT on SQLite (at most: a statement binds at most the connection's
#: SQLITE_LIMIT_VARIABLE_NUMBER parameters, 999 before SQLite 3.32, 32766 since)
_VALUES_ROWS = 500

#: write a snapshot row; never replaces a newer state of a key (seeded rows
#: may be ahead of the applier)
UPSERT_SNAP = (
    "INSERT INTO cb_snap (part, source_id, key, scn, deleted, event) VALUES ({p}, {p}, {p}, {p}, {p}, {p}) "
    "ON CONFLICT (part, source_id, key) DO UPDATE SET scn = excluded.scn, "
    "deleted = excluded.deleted, event = excluded.event WHERE excluded.scn >= cb_snap.scn"
)

_SEEDED_HEAD, _SEEDED_TAIL = (
    "INSERT INTO cb_snap (part, source_id, key, scn, deleted, event) VALUES ",
    UPSERT_SNAP[UPSERT_SNAP.index(" ON CONFLICT") :],
)


@dataclass(frozen=True)
class PartitionState:
    """Where the producer and the applier are in one partition (SCNs; -1 = none)."""

    producer_scn: int = -1
    applier_scn: int = -1
    applier_id: int = 0
    log_min_scn: int = -1
    base_scn: int = -1


class StoreDb:
    """A store's connection, dialect and shared tables (see the module docstring)."""

    def __init__(self, conn: Any, dialect: str) -> None:
        self._conn = conn
        self.dialect = dialect
        self._codecs: dict[tuple[str, int, int, int], tuple[ChangeDecoder, RowEncoder]] = {}
        self._p = "?" if dialect == "sqlite" else "%s"
        #: parameters one SQLite statement may bind (multi-row INSERTs: :meth:`_many`)
        self._max_params = (
            int(conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)) if dialect == "sqlite" else 0
        )
        #: :meth:`_upsert_seeded` statements by their row count
        self._seeded_sql: dict[int, str] = {}
        #: how many :meth:`_txn` blocks are open (only the outermost one commits)
        self._txn_depth = 0
        serial = "INTEGER" if dialect == "sqlite" else "BIGINT GENERATED BY DEFAULT AS IDENTITY"
        blob = "BLOB" if dialect == "sqlite" else "BYTEA"
        with self._txn():
            for ddl in _DDL:
                self._conn.execute(ddl.format(serial=serial, blob=blob))
            if self._one("SELECT min(id) FROM cb_ident")[0] is None:
                self._conn.execute(
                    self._sql("INSERT INTO cb_ident (id) VALUES ({p})"), (secrets.token_hex(8),)
                )
            #: this store's identity (a snapshot position of another store is refused);
            #: the smallest id, should two connections have made one at once
            self.store_id: str = str(self._one("SELECT min(id) FROM cb_ident")[0])

    def close(self) -> None:
        self._conn.close()

    def socket(self) -> int | None:
        """A Postgres store's connection socket (None: SQLite, or closed)."""
        if self.dialect != "postgres" or self._conn.closed:
            return None
        try:
            return int(self._conn.pgconn.socket)
        except Exception:  # noqa: BLE001 - a connection gone: no socket
            return None

    def interrupt(self) -> None:
        """Cut the call in progress on this store from another thread (a stop's last resort).

        SQLite: ``sqlite3.Connection.interrupt`` (the statement fails with
        "interrupted" at its next step; a thread stuck inside one disk
        syscall still finishes that syscall first). Postgres: the
        connection's socket is shut down, so the call fails as a lost
        connection. Safe to call from any thread, also when no call runs.
        """
        if self.dialect == "sqlite":
            with contextlib.suppress(sqlite3.ProgrammingError):  # (closed meanwhile)
                self._conn.interrupt()
            return
        fd = self.socket()
        if fd is not None:
            from changebus.fetchers.postgres import pg_cut_socket

            pg_cut_socket(fd)

    def connection_lost(self) -> bool:
        """Whether the connection is gone (Postgres closed it, or the network did)."""
        return self.dialect == "postgres" and bool(self._conn.closed or self._conn.broken)

    # ---- plumbing -------------------------------------------------------

    def _sql(self, text: str) -> str:
        return text.replace("{p}", self._p)

    def _txn(self) -> Any:
        """A transaction block; inside another one it joins it (module docstring)."""
        store = self

        class _Txn:
            def __enter__(self) -> None:
                if store._txn_depth == 0:
                    store._conn.execute("BEGIN")
                store._txn_depth += 1

            def __exit__(self, kind: object, exc: object, tb: object) -> None:
                store._txn_depth -= 1
                if store._txn_depth == 0:
                    store._conn.execute("COMMIT" if kind is None else "ROLLBACK")

        return _Txn()

    def _one(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self._conn.execute(self._sql(sql), params).fetchone()

    def _all(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        return list(self._conn.execute(self._sql(sql), params).fetchall())

    def _each(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """The rows of ``sql`` as an iterator (close it when done). SQLite steps the query
        as the rows are taken, so a reader that stops early never holds the rest; a
        client-side Postgres cursor holds them all (its reads are sized to match)."""
        return self._conn.execute(self._sql(sql), params)

    def _many(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        """Run ``sql`` (an ``INSERT ... VALUES ({p}, ...)``, or any statement) for each row.

        SQLite: an ``INSERT`` runs as multi-row ``VALUES (...), (...)``
        statements of up to :data:`_VALUES_ROWS` rows -- the same effect (rows
        are inserted in order, an upsert's conflict sees the rows before it),
        but one statement step per batch instead of one per row: far less
        Python work, and the GIL is released and taken again once per batch,
        not per row (per row, another busy Python thread of the process -- a
        seeder encoding its next chunk while the applier writes -- makes
        each re-take wait for the interpreter's switch interval).
        """
        rows = list(rows)
        if not rows:
            return
        if self.dialect == "sqlite":
            values = _VALUES.search(sql)
            if values is None:
                self._conn.executemany(self._sql(sql), rows)
                return
            width = values.group(1).count("{p}")
            head = self._sql(sql[: values.start(1)])
            tail = self._sql(sql[values.end(1) :])
            one = "(" + ", ".join(["?"] * width) + ")"
            per = max(1, min(_VALUES_ROWS, self._max_params // width))
            full = ""
            for start in range(0, len(rows), per):
                batch = rows[start : start + per]
                if len(batch) == per and full:
                    text = full
                else:
                    text = head + ", ".join([one] * len(batch)) + tail
                    if len(batch) == per:
                        full = text
                self._conn.execute(text, [v for row in batch for v in row])
        else:
            with self._conn.cursor() as cur:
                cur.executemany(self._sql(sql), rows)

    def _upsert_seeded(self, part: str, scn: int, rows: Sequence[tuple[int, bytes, bytes]]) -> int:
        """:data:`UPSERT_SNAP` of live rows ``(source_id, key, event)`` all at ``scn``;
        returns how many were written (the others' keys hold a newer state).

        SQLite: multi-row statements that bind the partition and the SCN once
        (numbered parameters) and each row's source id, key and event: the
        same rows as :meth:`_many` of ``UPSERT_SNAP``, with a third of the
        parameters to convert, so the writer thread holds the GIL far less
        (the statement's steps run without it). Postgres: :meth:`_many`.
        """
        if not rows:
            return 0
        if self.dialect != "sqlite":
            with self._conn.cursor() as cur:  # (rowcount: the sum over the rows)
                cur.executemany(
                    self._sql(UPSERT_SNAP), [(part, sid, key, scn, 0, ev) for sid, key, ev in rows]
                )
                return int(cur.rowcount)
        written = 0
        per = max(1, min(_VALUES_ROWS, (self._max_params - 2) // 3))
        texts = self._seeded_sql
        for start in range(0, len(rows), per):
            batch = rows[start : start + per]
            text = texts.get(len(batch))
            if text is None:
                values = ", ".join(
                    f"(?1, ?{3 * j + 3}, ?{3 * j + 4}, ?2, 0, ?{3 * j + 5})"
                    for j in range(len(batch))
                )
                text = texts[len(batch)] = _SEEDED_HEAD + values + _SEEDED_TAIL
                if len(texts) > 8:  # only full batches repeat: keep those
                    texts.clear()
                    texts[len(batch)] = text
            params: list[Any] = [part, scn]
            for row in batch:
                params += row
            written += self._conn.execute(text, params).rowcount
        return written

    # ---- state ------------------------------------------------------------

    def state(self, part: str) -> PartitionState:
        row = self._one(
            "SELECT producer_scn, applier_scn, applier_id, log_min_scn, base_scn FROM cb_state "
            "WHERE part = {p}",
            (part,),
        )
        return PartitionState(*(int(v) for v in row)) if row else PartitionState()

    def _put_state(self, part: str, st: PartitionState) -> None:
        self._conn.execute(
            self._sql(
                "INSERT INTO cb_state (part, producer_scn, applier_scn, applier_id, log_min_scn, "
                "base_scn) VALUES ({p}, {p}, {p}, {p}, {p}, {p}) ON CONFLICT (part) DO UPDATE SET "
                "producer_scn = excluded.producer_scn, applier_scn = excluded.applier_scn, "
                "applier_id = excluded.applier_id, log_min_scn = excluded.log_min_scn, "
                "base_scn = excluded.base_scn"
            ),
            (part, st.producer_scn, st.applier_scn, st.applier_id, st.log_min_scn, st.base_scn),
        )

    def partitions(self) -> list[str]:
        return [str(r[0]) for r in self._all("SELECT part FROM cb_state ORDER BY part")]

    # ---- table schemas ------------------------------------------------------

    def put_schemas(self, part: str, entries: Iterable[tuple[int, int, str, str]]) -> None:
        """Record (source_id, version, name, schema JSON); known ones are kept."""
        sql = (
            "INSERT INTO cb_schema (part, source_id, version, name, schema) "
            "VALUES ({p}, {p}, {p}, {p}, {p}) ON CONFLICT DO NOTHING"
        )
        with self._txn():
            self._many(sql, [(part, *e) for e in entries])

    def source_names(self, part: str) -> dict[str, int]:
        """The partition's source names and ids (not their schemas' JSON, which a page
        request or a sweep step would otherwise read whole)."""
        return {
            str(n): int(s)
            for s, n in self._all(
                "SELECT DISTINCT source_id, name FROM cb_schema WHERE part = {p}", (part,)
            )
        }

    def schemas(self, part: str) -> list[tuple[int, int, str, str]]:
        return [
            (int(s), int(v), str(n), str(j))
            for s, v, n, j in self._all(
                "SELECT source_id, version, name, schema FROM cb_schema WHERE part = {p} "
                "ORDER BY source_id, version",
                (part,),
            )
        ]

    def _codec(self, part: str, h: EventHeader) -> tuple[ChangeDecoder, RowEncoder] | None:
        """Decoder and encoder of an event's writer schema (None: schema unknown here)."""
        ck = (part, h.source_id, h.schema_version, h.partition)
        codec = self._codecs.get(ck)
        if codec is None:
            row = self._one(
                "SELECT schema FROM cb_schema WHERE part = {p} AND source_id = {p} AND version = {p}",
                (part, h.source_id, h.schema_version),
            )
            if row is None:
                return None
            table = TableSchema.from_json(json.loads(str(row[0])))
            codec = self._codecs[ck] = (
                ChangeDecoder(table),
                RowEncoder(table, source_id=h.source_id, partition=h.partition),
            )
        return codec
