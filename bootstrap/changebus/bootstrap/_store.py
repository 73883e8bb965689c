"""The bootstrap server's storage: a log store and a snapshot store in one SQL database.

Tables (one database holds every physical partition, ``part`` = its name):

``cb_log`` -- the **log store**: every event the producer took from the relay,
  raw (exactly the relay's bytes, validated), one row per event, whole windows
  per database transaction, in stream order (``id`` ascending = SCN order).
  Control events are kept too, so a catch-up page is a valid stream of
  windows.
``cb_snap`` -- the **snapshot store**: per (partition, source id, key) the
  latest data event: ``scn`` of the change that wrote it, ``deleted`` for a
  delete (a *tombstone*: a consumer that saw the row earlier must learn it is
  gone). An upsert keeps the row's ``id``, so a scan in ``id`` order is stable
  while the applier keeps writing.
``cb_trunc`` -- the newest TRUNCATE per (partition, source): the snapshot rows
  of that source before it are removed; the event itself is served first in a
  snapshot to consumers that saw the table before it.
``cb_state`` -- per partition: ``producer_scn`` (newest window in the log),
  ``applier_scn`` / ``applier_id`` (the snapshot reflects every window up to
  it), ``log_min_scn`` (windows after it are all in the log), ``base_scn``
  (the snapshot holds every change after it; -1: the whole history).
``cb_seed`` -- tables copied from the source in full (see :mod:`._seed`),
  with the SCN of the copy.
``cb_schema`` -- table schemas by (partition, source id, version), from the
  SCHEMA_CHANGE events the producer saw.

Invariants: ``applier_scn <= producer_scn``; ``cb_snap`` = the fold of the log
windows up to ``applier_scn`` (plus what was seeded); the log holds every
window in ``(log_min_scn, producer_scn]``; ``base_scn <= log_min_scn`` (pruning
the log moves only ``log_min_scn``).

Two dialects with the same statements: SQLite (the default: one file, no
server) and Postgres (``psycopg``). A :class:`Store` is **not thread-safe**:
the daemon owns each one from a single thread (see :mod:`._service`).
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from changebus.schemas import (
    FIRST_CONTROL_OP,
    HEADER_SIZE,
    ChangeDecoder,
    DecodedChange,
    EventHeader,
    Op,
    PartitionFilter,
    ProtocolError,
    RowEncoder,
    TableSchema,
    decode_header,
    parse_stream,
)

__all__ = ["CatchupPage", "PartitionState", "SnapshotPage", "Store"]

log = logging.getLogger("changebus.bootstrap.store")

_EOW = int(Op.END_OF_WINDOW)
_DELETE = int(Op.DELETE)
_UPDATE = int(Op.UPDATE)
_TRUNCATE = int(Op.TRUNCATE)
_SCHEMA_CHANGE = int(Op.SCHEMA_CHANGE)
_MAX_ID = 2**62


@dataclass(frozen=True)
class PartitionState:
    """Where the producer and the applier are in one partition (SCNs; -1 = none)."""

    producer_scn: int = -1
    applier_scn: int = -1
    applier_id: int = 0
    log_min_scn: int = -1
    base_scn: int = -1


@dataclass(frozen=True)
class SnapshotPage:
    """Events of one snapshot page and where the next page starts.

    ``position`` is ``(source_id, row id)`` of the last row considered;
    ``complete`` says the snapshot of every asked source is done.
    """

    data: bytes
    events: int
    position: tuple[int, int]
    complete: bool


@dataclass(frozen=True)
class CatchupPage:
    """Whole windows of the log in ``(after, target]`` and the last log row sent."""

    data: bytes
    events: int
    last_scn: int
    last_id: int
    complete: bool


class _Conn(Protocol):
    def execute(self, sql: str, params: Sequence[Any] = ...) -> Any: ...


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
    """CREATE TABLE IF NOT EXISTS cb_schema (
        part TEXT NOT NULL, source_id INTEGER NOT NULL, version INTEGER NOT NULL,
        name TEXT NOT NULL, schema TEXT NOT NULL, PRIMARY KEY (part, source_id, version))""",
]

# never replaces a newer state of a key (seeded rows may be ahead of the applier)
_UPSERT = (
    "INSERT INTO cb_snap (part, source_id, key, scn, deleted, event) VALUES ({p}, {p}, {p}, {p}, {p}, {p}) "
    "ON CONFLICT (part, source_id, key) DO UPDATE SET scn = excluded.scn, "
    "deleted = excluded.deleted, event = excluded.event WHERE excluded.scn >= cb_snap.scn"
)


class Store:
    """One bootstrap database (see the module docstring). Not thread-safe."""

    def __init__(self, conn: Any, dialect: str) -> None:
        self._conn = conn
        self.dialect = dialect
        #: log events folded into the snapshot through this connection
        self.applied_events = 0
        self._codecs: dict[tuple[str, int, int, int], tuple[ChangeDecoder, RowEncoder]] = {}
        self._p = "?" if dialect == "sqlite" else "%s"
        serial = "INTEGER" if dialect == "sqlite" else "BIGINT GENERATED BY DEFAULT AS IDENTITY"
        blob = "BLOB" if dialect == "sqlite" else "BYTEA"
        with self._txn():
            for ddl in _DDL:
                self._conn.execute(ddl.format(serial=serial, blob=blob))

    @classmethod
    def sqlite(cls, path: Path) -> Store:
        """Open (create) a SQLite store file; WAL journal, synchronous=NORMAL."""
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA cache_size=-65536")
        return cls(conn, "sqlite")

    @classmethod
    def postgres(cls, dsn: str) -> Store:
        """Open a Postgres store (the tables are created when missing)."""
        import psycopg

        conn = psycopg.connect(dsn, autocommit=True)
        return cls(conn, "postgres")

    def close(self) -> None:
        self._conn.close()

    # ---- plumbing -------------------------------------------------------

    def _sql(self, text: str) -> str:
        return text.replace("{p}", self._p)

    def _txn(self) -> Any:
        store = self

        class _Txn:
            def __enter__(self) -> None:
                store._conn.execute("BEGIN")

            def __exit__(self, kind: object, exc: object, tb: object) -> None:
                store._conn.execute("COMMIT" if kind is None else "ROLLBACK")

        return _Txn()

    def _one(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self._conn.execute(self._sql(sql), params).fetchone()

    def _all(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        return list(self._conn.execute(self._sql(sql), params).fetchall())

    def _many(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        rows = list(rows)
        if not rows:
            return
        if self.dialect == "sqlite":
            self._conn.executemany(self._sql(sql), rows)
        else:
            with self._conn.cursor() as cur:
                cur.executemany(self._sql(sql), rows)

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

    def counts(self, part: str) -> dict[str, int]:
        """Rows in the log and the snapshot (live and tombstones) of a partition."""
        logn = self._one("SELECT count(*) FROM cb_log WHERE part = {p}", (part,))
        snap = self._all(
            "SELECT deleted, count(*) FROM cb_snap WHERE part = {p} GROUP BY deleted", (part,)
        )
        by = {int(d): int(n) for d, n in snap}
        return {"log_events": int(logn[0]), "rows": by.get(0, 0), "tombstones": by.get(1, 0)}

    # ---- producer -------------------------------------------------------

    def append(self, part: str, data: bytes, *, start_scn: int = -1) -> int:
        """Append whole windows (events back to back, validated); returns the new producer SCN.

        Windows at or below the producer SCN are skipped (a replay after a
        restart). ``start_scn`` is where the stream began when the store
        has nothing yet: the log is complete after it.
        """
        st = self.state(part)
        offsets, headers = parse_stream(data)
        if not offsets.size:
            return st.producer_scn
        scns = headers["scn"].astype(np.int64)
        keep = scns > st.producer_scn
        if not keep.any():
            return st.producer_scn
        ops = headers["op"]
        eow = np.flatnonzero(ops == _EOW)
        if not eow.size or int(eow[-1]) != offsets.size - 1:
            raise ProtocolError("append needs whole windows (the data must end with END_OF_WINDOW)")
        mv = memoryview(data)
        rows = [
            (part, int(scns[i]), int(headers["source_id"][i]), int(ops[i]), bytes(mv[o : o + n]))
            for i, (o, n) in enumerate(
                zip(offsets.tolist(), headers["total_length"].tolist(), strict=True)
            )
            if keep[i]
        ]
        new_scn = int(scns[-1])
        fresh = st.producer_scn < 0 and st.applier_scn < 0
        log_min = start_scn if fresh else st.log_min_scn
        base = start_scn if fresh else st.base_scn
        with self._txn():
            self._many(
                "INSERT INTO cb_log (part, scn, source_id, op, event) VALUES ({p}, {p}, {p}, {p}, {p})",
                rows,
            )
            self._put_state(
                part,
                PartitionState(new_scn, st.applier_scn, st.applier_id, log_min, base),
            )
        return new_scn

    def unapplied_events(self, part: str) -> int:
        """Log events the applier has not folded in yet (the applier's lag)."""
        st = self.state(part)
        row = self._one(
            "SELECT count(*) FROM cb_log WHERE part = {p} AND id > {p}", (part, st.applier_id)
        )
        return int(row[0])

    def put_schemas(self, part: str, entries: Iterable[tuple[int, int, str, str]]) -> None:
        """Record (source_id, version, name, schema JSON); known ones are kept."""
        sql = (
            "INSERT INTO cb_schema (part, source_id, version, name, schema) "
            "VALUES ({p}, {p}, {p}, {p}, {p}) ON CONFLICT DO NOTHING"
        )
        with self._txn():
            self._many(sql, [(part, *e) for e in entries])

    def schemas(self, part: str) -> list[tuple[int, int, str, str]]:
        return [
            (int(s), int(v), str(n), str(j))
            for s, v, n, j in self._all(
                "SELECT source_id, version, name, schema FROM cb_schema WHERE part = {p} "
                "ORDER BY source_id, version",
                (part,),
            )
        ]

    # ---- applier ----------------------------------------------------------

    def apply(self, part: str, max_events: int = 10_000) -> PartitionState:
        """Fold the next whole windows of the log (about ``max_events``) into the snapshot.

        One transaction: the snapshot rows and the applier position move
        together, so a crash never applies a window twice or half.
        """
        st = self.state(part)
        if st.applier_scn >= st.producer_scn:
            return st
        # the SCN up to which to apply: the window holding the max_events-th row
        row = self._one(
            "SELECT scn FROM cb_log WHERE part = {p} AND id > {p} ORDER BY id LIMIT 1 OFFSET {p}",
            (part, st.applier_id, max_events - 1),
        )
        upto = st.producer_scn if row is None else min(int(row[0]), st.producer_scn)
        rows = self._all(
            "SELECT id, source_id, op, scn, event FROM cb_log WHERE part = {p} AND id > {p} "
            "AND scn <= {p} ORDER BY id",
            (part, st.applier_id, upto),
        )
        if not rows:
            return st
        upserts: dict[tuple[int, bytes], tuple[Any, ...]] = {}
        with self._txn():
            for _id, source_id, op, scn, event in rows:
                if op == _TRUNCATE:
                    self._flush_upserts(upserts)
                    self._truncate(part, int(source_id), int(scn), bytes(event))
                elif op < FIRST_CONTROL_OP:
                    event = bytes(event)
                    h = decode_header(event)
                    key = event[HEADER_SIZE : HEADER_SIZE + h.key_length]
                    if op == _UPDATE:
                        event = self._fold_update(part, h, key, event, upserts)
                    upserts[(int(source_id), key)] = (
                        part,
                        int(source_id),
                        key,
                        int(scn),
                        1 if op == _DELETE else 0,
                        event,
                    )
            self._flush_upserts(upserts)
            cur = self.state(part)
            new = PartitionState(
                cur.producer_scn, upto, int(rows[-1][0]), cur.log_min_scn, cur.base_scn
            )
            self._put_state(part, new)
        self.applied_events += len(rows)
        return new

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

    def _fold_update(
        self,
        part: str,
        h: EventHeader,
        key: bytes,
        event: bytes,
        upserts: dict[tuple[int, bytes], tuple[Any, ...]],
    ) -> bytes:
        """What an UPDATE leaves in the snapshot; returns the event to store for its key.

        * A key change (the before-image has another key) leaves a tombstone
          for the old key, so no stale row survives under it.
        * Columns the source did not send (Postgres' unchanged TOAST values)
          are taken from the row's previous image, so a snapshot row is whole.
        """
        codec = self._codec(part, h)
        if codec is None:
            return event
        dec, enc = codec
        change = dec.decode(memoryview(event)[HEADER_SIZE + h.key_length :])
        source_key = key  # where the row's previous image is
        if change.before is not None and h.key_length:
            tomb = enc.encode(
                Op.DELETE,
                h.scn,
                h.seq,
                h.timestamp_ns,
                None,
                change.before,
                before_not_sent=change.before_not_sent,
            )
            old = tomb[HEADER_SIZE : HEADER_SIZE + decode_header(tomb).key_length]
            if old != key:
                source_key = old
        if change.after_not_sent and change.after is not None:
            event = self._fill_unsent(part, h, source_key, change, enc, upserts) or event
        if source_key != key:
            upserts[(h.source_id, source_key)] = (part, h.source_id, source_key, h.scn, 1, tomb)
        return event

    def _fill_unsent(
        self,
        part: str,
        h: EventHeader,
        source_key: bytes,
        change: DecodedChange,
        enc: RowEncoder,
        upserts: dict[tuple[int, bytes], tuple[Any, ...]],
    ) -> bytes | None:
        """The UPDATE re-encoded with its unsent columns from the row's previous image."""
        assert change.after is not None
        pending = upserts.get((h.source_id, source_key))
        if pending is not None:
            prev: bytes | None = None if pending[4] else pending[5]
        else:
            row = self._one(
                "SELECT event, deleted FROM cb_snap WHERE part = {p} AND source_id = {p} "
                "AND key = {p}",
                (part, h.source_id, source_key),
            )
            prev = bytes(row[0]) if row is not None and not row[1] else None
        if prev is None:
            return None
        ph = decode_header(prev)
        pcodec = self._codec(part, ph)
        if pcodec is None:
            return None
        old_change = pcodec[0].decode(memoryview(prev)[HEADER_SIZE + ph.key_length :])
        image = old_change.after
        if image is None:
            return None
        merged = dict(change.after)
        still: list[str] = []
        for col in change.after_not_sent:
            if col in image and col not in old_change.after_not_sent:
                merged[col] = image[col]
            else:
                still.append(col)
        return enc.encode(
            Op.UPDATE,
            h.scn,
            h.seq,
            h.timestamp_ns,
            merged,
            change.before,
            after_not_sent=still,
            before_not_sent=change.before_not_sent,
        )

    def _flush_upserts(self, upserts: dict[tuple[int, bytes], tuple[Any, ...]]) -> None:
        self._many(_UPSERT, upserts.values())
        upserts.clear()

    def _truncate(self, part: str, source_id: int, scn: int, event: bytes) -> None:
        self._conn.execute(
            self._sql("DELETE FROM cb_snap WHERE part = {p} AND source_id = {p} AND scn <= {p}"),
            (part, source_id, scn),
        )
        self._conn.execute(
            self._sql(
                "INSERT INTO cb_trunc (part, source_id, scn, event) VALUES ({p}, {p}, {p}, {p}) "
                "ON CONFLICT (part, source_id) DO UPDATE SET scn = excluded.scn, event = excluded.event"
            ),
            (part, source_id, scn, event),
        )

    # ---- seeding --------------------------------------------------------------

    _GAP = "*gap*"

    def mark_gap(self, part: str, gap_end: int) -> PartitionState:
        """The producer fell off the relay: windows up to ``gap_end`` may be missing.

        The log continues after ``gap_end`` (catch-ups from before it are
        refused), every table must be seeded again, and until that is done
        positions before ``gap_end`` cannot be served (:meth:`gap`).
        """
        with self._txn():
            st = self.state(part)
            new = PartitionState(
                max(st.producer_scn, gap_end),
                st.applier_scn,
                st.applier_id,
                max(st.log_min_scn, gap_end),
                st.base_scn,
            )
            self._put_state(part, new)
            self._conn.execute(self._sql("DELETE FROM cb_seed WHERE part = {p}"), (part,))
            self._conn.execute(
                self._sql("INSERT INTO cb_seed (part, name, scn) VALUES ({p}, {p}, {p})"),
                (part, self._GAP, gap_end),
            )
        return new

    def gap(self, part: str) -> int | None:
        """The end of a gap in the log not yet repaired by a seed (None: no gap)."""
        row = self._one(
            "SELECT scn FROM cb_seed WHERE part = {p} AND name = {p}", (part, self._GAP)
        )
        return int(row[0]) if row is not None else None

    def clear_gap(self, part: str) -> bool:
        """Forget the gap when every known table has been seeded since; True when it was."""
        if self.gap(part) is None:
            return False
        with self._txn():
            names = {n for _s, _v, n, _j in self.schemas(part)}
            if not names <= set(self.seeded(part)):
                return False
            self._conn.execute(
                self._sql("DELETE FROM cb_seed WHERE part = {p} AND name = {p}"),
                (part, self._GAP),
            )
        return True

    def _sweep(self, part: str, table: str, gap_end: int, seed_scn: int) -> None:
        """After a table's seed at ``seed_scn``: rows it did not rewrite that are older
        than the gap were deleted during the gap; they become tombstones at ``seed_scn``."""
        sids = [s for s, _v, n, _j in self.schemas(part) if n == table]
        if not sids:
            return
        rows = self._all(
            "SELECT key, event FROM cb_snap WHERE part = {p} AND source_id = {p} "
            "AND deleted = 0 AND scn <= {p} AND scn < {p}",
            (part, sids[0], gap_end, seed_scn),
        )
        tombs = []
        for key, event in rows:
            ev = bytes(event)
            h = decode_header(ev)
            codec = self._codec(part, h)
            if codec is None:
                continue
            change = codec[0].decode(memoryview(ev)[HEADER_SIZE + h.key_length :])
            image = change.after if change.after is not None else change.before
            tomb = codec[1].encode(Op.DELETE, seed_scn, 0, h.timestamp_ns, None, image)
            tombs.append((part, h.source_id, bytes(key), seed_scn, 1, tomb))
        self._many(_UPSERT, tombs)

    def seed_rows(self, part: str, table: str, events: Sequence[bytes], scn: int) -> None:
        """Merge seed rows (INSERT events at ``scn``), or record ``table`` as seeded when empty.

        A row is written unless the snapshot holds a newer state of its key.
        After a gap (:meth:`mark_gap`) the end of a table also turns the rows
        deleted during the gap into tombstones.
        """
        with self._txn():
            if not events:
                gap_end = self.gap(part)
                if gap_end is not None:
                    self._sweep(part, table, gap_end, scn)
                self._conn.execute(
                    self._sql(
                        "INSERT INTO cb_seed (part, name, scn) VALUES ({p}, {p}, {p}) "
                        "ON CONFLICT (part, name) DO UPDATE SET scn = excluded.scn"
                    ),
                    (part, table, scn),
                )
                return
            rows = []
            for ev in events:
                h = decode_header(ev)
                key = ev[HEADER_SIZE : HEADER_SIZE + h.key_length]
                rows.append((part, h.source_id, key, h.scn, 0, ev))
            self._many(_UPSERT, rows)

    def seeded(self, part: str) -> dict[str, int]:
        """Tables seeded in full, with the SCN of their seed."""
        return {
            str(n): int(s)
            for n, s in self._all(
                "SELECT name, scn FROM cb_seed WHERE part = {p} AND name <> {p}",
                (part, self._GAP),
            )
        }

    def forget_seed(self, part: str, tables: Sequence[str]) -> None:
        """Mark ``tables`` as not seeded (a re-seed copies them again)."""
        with self._txn():
            self._many(
                "DELETE FROM cb_seed WHERE part = {p} AND name = {p}", [(part, t) for t in tables]
            )

    # ---- serving ------------------------------------------------------------

    def changed_since(self, part: str, since_scn: int, upto_scn: int) -> int:
        """Log data events in ``(since_scn, upto_scn]`` (what a catch-up-only bootstrap costs)."""
        row = self._one(
            "SELECT count(*) FROM cb_log WHERE part = {p} AND scn > {p} AND scn <= {p} AND op < {p}",
            (part, since_scn, upto_scn, FIRST_CONTROL_OP),
        )
        return int(row[0])

    def first_log_scn(self, part: str) -> int:
        """SCN of the oldest window in the log (-1: empty)."""
        row = self._one("SELECT min(scn) FROM cb_log WHERE part = {p}", (part,))
        return int(row[0]) if row is not None and row[0] is not None else -1

    def snapshot_changed(self, part: str, since_scn: int, upto_scn: int) -> int:
        """Snapshot rows (tombstones too) last changed in ``(since_scn, upto_scn]``."""
        row = self._one(
            "SELECT count(*) FROM cb_snap WHERE part = {p} AND scn > {p} AND scn <= {p}",
            (part, since_scn, upto_scn),
        )
        return int(row[0])

    def source_ids(self, part: str) -> list[int]:
        """Source ids of the partition (those with a known schema or a snapshot row)."""
        rows = self._all(
            "SELECT DISTINCT source_id FROM cb_schema WHERE part = {p} UNION "
            "SELECT DISTINCT source_id FROM cb_trunc WHERE part = {p}",
            (part, part),
        )
        return sorted(int(r[0]) for r in rows)

    def snapshot_page(
        self,
        part: str,
        source_ids: Sequence[int],
        *,
        since_scn: int,
        start_scn: int,
        position: tuple[int, int],
        max_bytes: int,
        key_filter: PartitionFilter | None = None,
        batch_rows: int = 2000,
    ) -> SnapshotPage:
        """Rows changed after ``since_scn``, at their latest version, by source then row id.

        ``start_scn`` is the snapshot's SCN (the catch-up starts there). Rows
        the applier changed after it are sent too, at their newer version:
        the catch-up replays their older changes and ends at a target past
        them, so the end state is the same, and a row is always sent whole
        (a catch-up UPDATE may carry only some columns: Postgres' unchanged
        TOAST values). Pages resume after ``position`` (source id, row id).
        Tombstones are sent only to a consumer that has a position
        (``since_scn >= 0``); a source's TRUNCATE after it comes first.
        At least one event is returned when any is left (even over
        ``max_bytes``).
        """
        sources = sorted(source_ids)
        src, after = position
        chunks: list[bytes] = []
        size = events = 0
        for sid in sources:
            if sid < src:
                continue
            if sid > src:
                after = 0
            if after == 0:
                trunc = self._one(
                    "SELECT scn, event FROM cb_trunc WHERE part = {p} AND source_id = {p}",
                    (part, sid),
                )
                if trunc is not None and 0 <= since_scn < int(trunc[0]):
                    chunks.append(bytes(trunc[1]))
                    size += len(trunc[1])
                    events += 1
            while True:
                rows = self._all(
                    "SELECT id, scn, deleted, event FROM cb_snap WHERE part = {p} AND source_id = {p} "
                    "AND id > {p} AND scn > {p}"
                    + (" AND deleted = 0" if since_scn < 0 else "")
                    + " ORDER BY id LIMIT {p}",
                    (part, sid, after, since_scn, batch_rows),
                )
                for rid, scn, deleted, event in rows:
                    after = int(rid)
                    if int(scn) <= since_scn:
                        continue
                    if deleted and since_scn < 0:
                        continue
                    ev = bytes(event)
                    if key_filter is not None and not key_filter.matches(
                        decode_header(ev).key_hash
                    ):
                        continue
                    chunks.append(ev)
                    size += len(ev)
                    events += 1
                    if size >= max_bytes:
                        return SnapshotPage(b"".join(chunks), events, (sid, after), False)
                if len(rows) < batch_rows:
                    break
            src = sid
        last = sources[-1] if sources else 0
        return SnapshotPage(b"".join(chunks), events, (last, after), True)

    def catchup_page(
        self,
        part: str,
        *,
        after_scn: int,
        target_scn: int,
        max_bytes: int,
        batch_rows: int = 5000,
    ) -> CatchupPage:
        """Whole log windows with ``after_scn < scn <= target_scn``, oldest first.

        Stops after the window that passes ``max_bytes`` (at least one
        window). Filtering by source and key is the caller's (the relay's
        selection rules apply to the returned stream).
        """
        chunks: list[bytes] = []
        size = events = 0
        last_scn, last_id = after_scn, 0
        # (scn, id) of the last row read; windows have one SCN each and
        # ``after_scn``'s window was sent already: start past all of it
        cursor_scn, cursor_id = after_scn, _MAX_ID
        while True:
            rows = self._all(
                "SELECT id, scn, op, event FROM cb_log WHERE part = {p} AND "
                "(scn > {p} OR (scn = {p} AND id > {p})) AND scn <= {p} ORDER BY scn, id LIMIT {p}",
                (part, cursor_scn, cursor_scn, cursor_id, target_scn, batch_rows),
            )
            for rid, scn, op, event in rows:
                cursor_scn, cursor_id = int(scn), int(rid)
                chunks.append(bytes(event))
                size += len(event)
                events += 1
                if op == _EOW:
                    last_scn, last_id = int(scn), int(rid)
                    if size >= max_bytes:
                        data = b"".join(chunks)
                        return CatchupPage(data, events, last_scn, last_id, last_scn >= target_scn)
            if len(rows) < batch_rows:
                break
        # drop a trailing partial window (cannot happen with whole-window appends)
        return CatchupPage(b"".join(chunks), events, last_scn, last_id, True)

    def prune_to(self, part: str, keep_events: int) -> int:
        """Prune applied windows so that about ``keep_events`` log events remain."""
        row = self._one(
            "SELECT scn FROM cb_log WHERE part = {p} ORDER BY id DESC LIMIT 1 OFFSET {p}",
            (part, keep_events),
        )
        if row is None:
            return 0
        return self.prune_log(part, int(row[0]))

    def prune_log(self, part: str, keep_after_scn: int) -> int:
        """Delete applied log windows at or below ``keep_after_scn``; returns rows deleted."""
        st = self.state(part)
        upto = min(keep_after_scn, st.applier_scn)
        if upto <= st.log_min_scn:
            return 0
        with self._txn():
            cur = self._conn.execute(
                self._sql("DELETE FROM cb_log WHERE part = {p} AND scn <= {p}"), (part, upto)
            )
            self._put_state(
                part,
                PartitionState(st.producer_scn, st.applier_scn, st.applier_id, upto, st.base_scn),
            )
        return int(cur.rowcount or 0)
