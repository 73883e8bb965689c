"""The Postgres chunk readers: ``keyset``, ``keys`` and ``single_transaction`` (see :mod:`._seed`).

Each reads one table's chunks through its :class:`~._seed.PostgresChunkSource`
(the connection, the watermark, the encoders); the SQL is
:mod:`._seed_pg_keys`'s. Blocking; one seeder thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import TYPE_CHECKING, Any

from changebus.schemas import HEADER_SIZE, decode_header

from ._chunks import Chunk
from ._seed_pg_keys import PgTable, insert_message

if TYPE_CHECKING:
    from ._seed import PostgresChunkSource

__all__ = ["KeysReader", "KeysetReader", "Reader", "SingleReader"]

log = logging.getLogger("changebus.bootstrap.seed")


class Reader:
    """What every Postgres reader shares: its source, table and the psycopg error mapping."""

    mode = ""

    def __init__(self, source: PostgresChunkSource, name: str, oid: int, table: PgTable) -> None:
        self.source, self.name, self.oid, self.table = source, name, oid, table
        self.estimate_rows = -1
        #: what its cursors mean (:attr:`~._chunks.ChunkReader.key_id`)
        self.key_id = self.mode
        #: the lowest tag a chunk may have, beyond ``request.min_tag`` (a refill's: the
        #: newest SCN its rows were listed at, :func:`~._chunks._refill`)
        self.min_tag = -1

    def read(self, cursor: str | None, limit: int) -> Chunk:
        conn = self.source.conn
        try:
            return self._read(cursor, limit)
        except Exception as exc:
            if conn is not None and not conn.closed:
                with contextlib.suppress(Exception):  # the original error is the one to report
                    conn.execute("ROLLBACK")
            from ._seed import _psycopg_error

            err = _psycopg_error(f"snapshot of {self.name}: reading a chunk failed", exc)
            if err is exc:
                raise
            raise err from None

    def _read(self, cursor: str | None, limit: int) -> Chunk:
        raise NotImplementedError


class KeysetReader(Reader):
    """Key-ordered chunks, each in its own short transaction (``keyset``)."""

    mode = "keyset"

    def __init__(
        self,
        source: PostgresChunkSource,
        name: str,
        oid: int,
        table: PgTable,
        estimate: int,
        where: str,
        order: list[Any],
    ) -> None:
        super().__init__(source, name, oid, table)
        self.estimate_rows = estimate
        self.where = where
        # the cursor holds the key columns' values, in the order of their types and
        # collations (``order``: name, type oid and collation oid of each)
        self.key_id = "keyset:" + json.dumps(order, separators=(",", ":"))

    def _read(self, cursor: str | None, limit: int) -> Chunk:
        after = None if cursor is None else [str(v) for v in json.loads(cursor)]
        src = self.source
        if self.where:
            return self._read_where(after, limit)
        sql, params = self.table.keyset(after, self.where, limit)
        tag = src.begin_chunk(self.name, self.min_tag)
        data = src.copy_data(sql, self.oid, params)
        src.conn.execute("COMMIT")
        ncols = len(self.table.columns)
        events, extra = src.encode_copy(tag, data, self.oid, ncols, len(self.table.key))
        if len(events) < limit or extra is None:
            return Chunk(events, tag, None, rows=len(events))
        last = [None if v is None else v.decode() for v in extra]
        return Chunk(events, tag, json.dumps(last), rows=len(events))

    def _read_where(self, after: list[str] | None, limit: int) -> Chunk:
        """A ``where`` chunk: the rows matching it among the next ``limit`` keys.

        Asking for ``limit`` matching rows instead would walk the key index
        until that many match: with a selective condition, most of the table
        in one transaction (vacuum held back all along). The cursor is the
        bound, so chunks may hold fewer rows, or none.
        """
        src, table = self.source, self.table
        tag = src.begin_chunk(self.name, self.min_tag)
        sql, params = table.bound(after, limit)
        row = src.conn.execute(sql, params).fetchone()
        upto = None if row is None else [str(v) for v in row]  # (key columns: NOT NULL)
        sql, kparams = table.keyset(after, self.where, limit, upto)
        data = src.copy_data(sql, self.oid, kparams)
        src.conn.execute("COMMIT")
        events, _extra = src.encode_copy(tag, data, self.oid, len(table.columns), len(table.key))
        cursor = None if upto is None else json.dumps(upto)
        return Chunk(events, tag, cursor, rows=len(events))


class KeysReader(Reader):
    """A key list in slices of ``limit`` keys (``keys``); the cursor is the next key's index."""

    mode = "keys"

    def __init__(
        self,
        source: PostgresChunkSource,
        name: str,
        oid: int,
        table: PgTable,
        keys: tuple[tuple[Any, ...], ...],
    ) -> None:
        super().__init__(source, name, oid, table)
        self.keys = list(dict.fromkeys(tuple(k) for k in keys))
        self.estimate_rows = len(self.keys)

    def _read(self, cursor: str | None, limit: int) -> Chunk:
        first = 0 if cursor is None else int(json.loads(cursor))
        part = self.keys[first : first + limit]
        src, table = self.source, self.table
        tag = src.begin_chunk(self.name, self.min_tag)
        rows = []
        if part:
            sql, params = table.by_keys(part, first)
            rows = src.copy(sql, self.oid, len(table.columns), params)
        src.conn.execute("COMMIT")
        at = {c: i for i, c in enumerate(table.columns)}
        found = [m for m, x in rows if x[0] == b"\x01"]
        lacking = []
        for _m, x in rows:
            values = x[2:]
            if x[0] != b"\x01" and all(v is not None for v in values):
                cells: list[bytes | None] = [None] * len(table.columns)
                for k, v in zip(table.key, values, strict=True):
                    cells[at[k]] = v
                lacking.append(insert_message(self.oid, cells))
        events = src.events(tag, found)
        absent = tuple(_key_of(ev) for ev in src.events(tag, lacking))
        done = first + len(part) >= len(self.keys)
        return Chunk(
            events, tag, None if done else json.dumps(first + len(part)), absent, len(found)
        )


def _key_of(event: bytes) -> bytes:
    """The store key (encoded key bytes) of an event."""
    h = decode_header(event)
    return event[HEADER_SIZE : HEADER_SIZE + h.key_length]


class SingleReader(Reader):
    """The whole table in ONE repeatable-read transaction, in heap-page ranges (fallback).

    Not resumable: a stored cursor of another run (the transaction is gone)
    starts the table again (rows already written are merged again, harmlessly).
    """

    mode = "single_transaction"

    def __init__(
        self, source: PostgresChunkSource, name: str, oid: int, table: PgTable, estimate: int
    ) -> None:
        super().__init__(source, name, oid, table)
        self.estimate_rows = estimate
        self.tag = -1
        self.pages = 0
        self.leaves = 1  # (the leaf partitions a ctid range covers)
        self.rows_per_page = 100.0

    def _read(self, cursor: str | None, limit: int) -> Chunk:
        src = self.source
        if self.tag < 0 or cursor is None:
            if cursor is not None:
                log.warning(
                    "%s: single_transaction snapshots do not resume: starting again", self.name
                )
            self.tag = src.begin_chunk(self.name, self.min_tag)
            # a partitioned table has no pages of its own: its ctid ranges apply to each
            # leaf (the largest sets the end), so a chunk spans every leaf and is sized by
            # their count. Read as the table's size (0) it went in ONE whole COPY,
            # however big (found by review)
            row = src.conn.execute(
                "SELECT coalesce(max(pg_relation_size(c.oid)), 0)"
                " / current_setting('block_size')::int, sum(greatest(c.reltuples, 0)),"
                " sum(c.relpages), count(*) FILTER (WHERE c.relkind <> 'p')"
                " FROM pg_class c WHERE c.oid = %s OR c.oid IN"
                " (SELECT relid FROM pg_partition_tree(%s) WHERE isleaf)",
                (self.oid, self.oid),
            ).fetchone()
            self.pages = int(row[0])
            self.leaves = max(int(row[3]), 1)
            if float(row[1]) > 0 and int(row[2]) > 0:
                self.rows_per_page = max(float(row[1]) / int(row[2]), 1.0)
            first = 0
        else:
            first = int(json.loads(cursor))
        step = max(1, int(limit / self.rows_per_page / self.leaves))
        end: int | None = first + step
        if end is not None and end >= self.pages:
            end = None  # the last range has no end: nothing visible lies beyond
        data = src.copy_data(self.table.pages(first, end), self.oid)
        tag = self.tag
        if end is None:
            src.conn.execute("COMMIT")
            self.tag = -1
        events, _x = src.encode_copy(tag, data, self.oid, len(self.table.columns), 0)
        return Chunk(events, tag, None if end is None else json.dumps(end), rows=len(events))
