"""Chunked snapshots in the store: chunks, the job row that makes them resumable, the sweep.

One job: the ``cb_snapjob`` table and the writes of a chunked snapshot
(:mod:`._chunks`). A row per table being snapshotted: the scope (what is
read, :meth:`~._chunks.SnapshotScope.as_json`), the reader's cursor after
the last stored chunk (``resume_at``), chunk and row counts, and the first
and newest chunk tags. :meth:`SnapshotJobs.snapshot_chunk` writes a chunk's
rows and the job row in **one transaction**, so after a crash the job row
names exactly the chunks whose rows are stored: the snapshot resumes after
them. A gap (:meth:`~._gaps.SeedLedger.mark_gap`) or a re-seed
(:meth:`~._gaps.SeedLedger.forget_seed`) deletes the job rows: those
snapshots start again.

Merging: chunk rows are INSERT events at the chunk's tag, written unless the
snapshot holds a newer state of the key (:data:`~._db.UPSERT_SNAP`); keys a
``keys`` snapshot asked for and the source lacks become tombstones at the
tag when the snapshot holds them live and older. A chunk's rows of a table
the applier saw truncated at or after the tag are not written (they were
read before the TRUNCATE). When the newer state is an UPDATE without some
columns (Postgres' unchanged TOAST values, for a row the applier had no
image of), the chunk's older, whole copy fills them in. The end of a whole-table
snapshot sweeps in steps (:meth:`SnapshotJobs.sweep_step`, one short
transaction each, so the applier goes on in between): rows of the table
older than the first tag that no chunk rewrote are gone from the source,
they become tombstones at the first tag.

Not thread-safe (a part of :class:`~._store.Store`: the writer thread's).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from changebus.schemas import HEADER_SIZE, MAGIC, VERSION, CorruptEventError, Op, decode_header

from ._chunks import JobState, SnapshotScope
from ._db import UPSERT_SNAP
from ._fold import merge_unsent
from ._gaps import SeedLedger, _check_tables

__all__ = ["SnapshotJobs"]

#: magic, version, scn, source_id and key_length of an event header (changebus.schemas._envelope
#: layout: offsets 0, 2, 8, 52, 58): a chunk's events were encoded by this process a moment
#: ago, so they are not verified again (the CRCs) -- only recognised
_ROW_FIELDS = struct.Struct("<HB5xQ36xH4xH")

#: keys per ``IN (...)`` lookup of chunk rows the snapshot holds newer
_IN_BATCH = 500


class SnapshotJobs(SeedLedger):
    """Chunked snapshot writes and their job rows (a part of :class:`~._store.Store`)."""

    def snapshot_job(self, part: str, scope: SnapshotScope) -> JobState | None:
        """The stored job of ``scope.table`` when it was for the same scope (else None)."""
        row = self._one(
            "SELECT scope, resume_at, chunks, nrows, first_tag, last_tag FROM cb_snapjob "
            "WHERE part = {p} AND name = {p}",
            (part, scope.table),
        )
        if row is None or str(row[0]) != scope.as_json():
            return None
        return JobState(
            scope.table,
            str(row[0]),
            None if row[1] is None else str(row[1]),
            int(row[2]),
            int(row[3]),
            int(row[4]),
            int(row[5]),
        )

    def snapshot_jobs(self, part: str) -> list[JobState]:
        """Every stored job of the partition (for status)."""
        return [
            JobState(str(n), str(s), None if c is None else str(c), int(k), int(r), int(f), int(t))
            for n, s, c, k, r, f, t in self._all(
                "SELECT name, scope, resume_at, chunks, nrows, first_tag, last_tag FROM cb_snapjob "
                "WHERE part = {p} ORDER BY name",
                (part,),
            )
        ]

    def snapshot_chunk(
        self,
        part: str,
        job: JobState,
        events: Sequence[bytes],
        tag: int,
        absent: Sequence[bytes] = (),
    ) -> None:
        """Merge a chunk's rows (INSERTs at ``tag``), tombstone ``absent`` keys, store ``job``.

        One transaction. ``job`` is the state after this chunk.
        """
        _check_tables([job.table])
        with self._txn():
            self._merge_chunk(part, job.table, events, tag, absent)
            self._conn.execute(
                self._sql(
                    "INSERT INTO cb_snapjob (part, name, scope, resume_at, chunks, nrows, "
                    "first_tag, last_tag) VALUES ({p}, {p}, {p}, {p}, {p}, {p}, {p}, {p}) "
                    "ON CONFLICT (part, name) DO UPDATE SET scope = excluded.scope, "
                    "resume_at = excluded.resume_at, chunks = excluded.chunks, "
                    "nrows = excluded.nrows, first_tag = excluded.first_tag, "
                    "last_tag = excluded.last_tag"
                ),
                (
                    part,
                    job.table,
                    job.scope,
                    job.cursor,
                    job.chunks,
                    job.rows,
                    job.first_tag,
                    job.last_tag,
                ),
            )

    def _merge_chunk(
        self, part: str, table: str, events: Sequence[bytes], tag: int, absent: Sequence[bytes]
    ) -> list[tuple[int, bytes, bytes]]:
        """Merge a chunk's rows of ``table`` (INSERTs at ``tag``) and tombstone its ``absent``
        keys (inside the caller's transaction); returns its rows (source id, key, event)."""
        rows = []
        unpack = _ROW_FIELDS.unpack_from
        for ev in events:
            magic, version, scn, sid, klen = unpack(ev)
            if magic != MAGIC or version != VERSION or scn != tag:
                raise CorruptEventError(
                    f"a snapshot chunk of {table} holds a non-event or one off its tag"
                )
            rows.append((sid, ev[HEADER_SIZE : HEADER_SIZE + klen], ev))
        # in key order: the writes to the key index (the largest) stay close together
        rows.sort(key=lambda r: r[1])
        rows = self._not_truncated(part, tag, rows)
        if self._upsert_seeded(part, tag, rows) < len(rows):
            self._complete_newer(part, tag, rows)
        if absent:
            sid = self._source_id(part, table)
            if sid is not None:
                live = []
                for key in absent:
                    row = self._one(
                        "SELECT key, event FROM cb_snap WHERE part = {p} AND source_id = {p} "
                        "AND key = {p} AND deleted = 0 AND scn < {p}",
                        (part, sid, key, tag),
                    )
                    if row is not None:
                        live.append(row)
                self._many(UPSERT_SNAP, self._tombstones(part, live, tag))
        return rows

    def _not_truncated(
        self, part: str, tag: int, rows: list[tuple[int, bytes, bytes]]
    ) -> list[tuple[int, bytes, bytes]]:
        """``rows`` without those of a table truncated at or after ``tag``: the applier
        folded the TRUNCATE (deleting the rows it had) before this chunk, read earlier,
        arrived; written now, they would live on though the source has none of them."""
        cut = set()
        for sid in {r[0] for r in rows}:
            row = self._one(
                "SELECT scn FROM cb_trunc WHERE part = {p} AND source_id = {p}", (part, sid)
            )
            if row is not None and int(row[0]) >= tag:
                cut.add(sid)
        return [r for r in rows if r[0] not in cut] if cut else rows

    def _complete_newer(self, part: str, tag: int, rows: list[tuple[int, bytes, bytes]]) -> None:
        """Chunk rows the snapshot holds newer: an UPDATE stored there that lacks columns
        (Postgres' unchanged TOAST values; the applier had no earlier image of the row)
        gets them from the chunk's copy, which is older and whole. Else the row would
        stay without them for good: no later change need send them."""
        by_key = {(sid, key): ev for sid, key, ev in rows}
        for sid in {r[0] for r in rows}:
            keys = [key for s, key, _ev in rows if s == sid]
            for start in range(0, len(keys), _IN_BATCH):
                batch = keys[start : start + _IN_BATCH]
                marks = ", ".join(["{p}"] * len(batch))
                newer = self._all(
                    "SELECT key, scn, event FROM cb_snap WHERE part = {p} AND source_id = {p} "
                    f"AND deleted = 0 AND scn > {{p}} AND key IN ({marks})",
                    (part, sid, tag, *batch),
                )
                if not newer:
                    continue
                # rows that moved to their key after the chunk was read: the chunk's copy
                # is of the row the key held then (deleted since), not of this one
                moved = {
                    bytes(r[0])
                    for r in self._all(
                        "SELECT key FROM cb_moved WHERE part = {p} AND source_id = {p} "
                        f"AND scn > {{p}} AND key IN ({marks})",
                        (part, sid, tag, *batch),
                    )
                }
                fixed = []
                for key, scn, event in newer:
                    if bytes(key) in moved:
                        continue
                    merged = self._merge_from(part, bytes(event), by_key[(sid, bytes(key))])
                    if merged is not None:
                        fixed.append((part, sid, bytes(key), int(scn), 0, merged))
                self._many(UPSERT_SNAP, fixed)

    def _merge_from(self, part: str, event: bytes, image: bytes) -> bytes | None:
        """``event`` with its unsent columns from ``image`` (None: nothing to fill)."""
        h = decode_header(event)
        if h.op != int(Op.UPDATE):
            return None
        codec, icodec = self._codec(part, h), self._codec(part, decode_header(image))
        if codec is None or icodec is None:
            return None
        change = codec[0].decode(memoryview(event)[HEADER_SIZE + h.key_length :])
        if not change.after_not_sent or change.after is None:
            return None
        ih = decode_header(image)
        key = event[HEADER_SIZE : HEADER_SIZE + h.key_length]
        image_change = icodec[0].decode(memoryview(image)[HEADER_SIZE + ih.key_length :])
        merged = merge_unsent(h, key, change, codec[1], image_change)
        return None if merged is None else merged[0]

    def sweep_step(
        self, part: str, table: str, below: int, after_id: int, batch: int = 20_000
    ) -> int | None:
        """Tombstone (at ``below``) live rows of ``table`` older than ``below``, ``batch`` rows
        at a time in row id order after ``after_id``; returns the id to go on after (None: done)."""
        sid = self._source_id(part, table)
        if sid is None or below < 0:
            return None
        if after_id == 0 and self._sweep_by_scn(part, sid, below, batch):
            return None
        with self._txn():
            # positions first (no event bytes: most rows were just rewritten, few are old)
            ids = self._all(
                "SELECT id, scn, deleted FROM cb_snap WHERE part = {p} "
                "AND source_id = {p} AND id > {p} ORDER BY id LIMIT {p}",
                (part, sid, after_id, batch),
            )
            stale = [int(i) for i, scn, d in ids if not d and int(scn) < below]
            old: list[tuple[bytes, bytes]] = []
            for start in range(0, len(stale), 500):
                some = stale[start : start + 500]
                old += self._all(
                    "SELECT key, event FROM cb_snap WHERE id IN ("
                    + ", ".join(["{p}"] * len(some))
                    + ") ORDER BY id",
                    some,
                )
            self._many(UPSERT_SNAP, self._tombstones(part, old, below))
        return int(ids[-1][0]) if len(ids) == batch else None

    def _sweep_by_scn(self, part: str, sid: int, below: int, batch: int) -> bool:
        """The whole sweep in one step when few rows of the partition are older than ``below``
        (at most ``batch``; False: more, sweep in id order).

        A chunk writes its rows at its tag, and every tag is at least the
        first one (``below``): the rows to tombstone are exactly the live rows
        of the table with an SCN below it. After a first seed of a table (or
        of a fresh store) few rows are that old, and the ``(part, scn)``
        index finds them without reading every row of the table.
        """
        old = self._one(
            "SELECT count(*) FROM (SELECT 1 FROM cb_snap WHERE part = {p} AND scn < {p} "
            "LIMIT {p}) AS o",
            (part, below, batch + 1),
        )
        if int(old[0]) > batch:
            return False
        with self._txn():
            rows = self._all(
                "SELECT key, event FROM cb_snap WHERE part = {p} AND scn < {p} "
                "AND source_id = {p} AND deleted = 0 ORDER BY id",
                (part, below, sid),
            )
            self._many(UPSERT_SNAP, self._tombstones(part, rows, below))
        return True

    def finish_snapshot(self, part: str, job: JobState, *, seeded: bool) -> None:
        """Drop ``job``'s row; ``seeded`` (a whole table): record the table seeded at its
        first tag, and forget the table's rows listed as lacking columns up to its newest
        tag (the refill read them, or no read can complete them: a MariaDB zero date;
        listed, every later update of such a row would be listed again)."""
        _check_tables([job.table])
        with self._txn():
            if seeded:
                self._conn.execute(
                    self._sql(
                        "INSERT INTO cb_seed (part, name, scn) VALUES ({p}, {p}, {p}) "
                        "ON CONFLICT (part, name) DO UPDATE SET scn = excluded.scn"
                    ),
                    (part, job.table, max(job.first_tag, 0)),
                )
                sid = self._source_id(part, job.table)
                if sid is not None:
                    self._conn.execute(
                        self._sql(
                            "DELETE FROM cb_unfilled WHERE part = {p} AND source_id = {p} "
                            "AND scn <= {p}"
                        ),
                        (part, sid, job.last_tag),
                    )
                    self._conn.execute(
                        self._sql(
                            "DELETE FROM cb_moved WHERE part = {p} AND source_id = {p} "
                            "AND scn <= {p}"
                        ),
                        (part, sid, job.last_tag),
                    )
            else:
                self.mark_copied(part)  # (rows the log lacks, though no table is seeded)
            self._conn.execute(
                self._sql("DELETE FROM cb_snapjob WHERE part = {p} AND name = {p}"),
                (part, job.table),
            )

    def _source_id(self, part: str, table: str) -> int | None:
        return self.source_names(part).get(table)
