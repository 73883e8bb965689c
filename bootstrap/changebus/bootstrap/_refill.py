"""Rows the snapshot holds without some columns, and their re-read from the source.

One job: the store side of the *refill* step that ends a whole-table
snapshot (:func:`~._chunks.run_chunked`).

Why: Postgres leaves unchanged TOASTed values out of an UPDATE (REPLICA
IDENTITY DEFAULT), and the fold fills them in from the row's previous
image (:mod:`._fold`). During a first seed that image may not exist yet: a
row moved to a new key before the seed copied it, and the new key lies in a
range the seed had already read. Neither a chunk nor a later change would
ever bring the missing values: the row would stay without them for good.
The fold records such keys in ``cb_unfilled`` (with the UPDATE's SCN).

The refill: once the applier has folded the stream up to a marker the
seed wrote into the source's log after its last chunk (so every change
committed before it), :meth:`Refills.unfilled_keys` lists the keys of the table whose
stored row still lacks columns (dropping entries whose rows are whole or
gone by now), the seeder reads those keys from the source as a ``keys``
chunk (at a tag at or above the SCNs they were listed at), and :meth:`Refills.refill_chunk` merges it like any chunk (a newer
stored UPDATE is completed from it) and drops the entries it covered.

Not thread-safe (a part of :class:`~._store.Store`: the writer thread's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from changebus.schemas import HEADER_SIZE, Op, decode_header

from ._gaps import _check_tables
from ._snapjobs import SnapshotJobs

__all__ = ["Refills"]

#: keys listed per :meth:`Refills.unfilled_keys` call at most
UNFILLED_BATCH = 10_000


class Refills(SnapshotJobs):
    """``cb_unfilled``: rows lacking columns, listed and refilled (a part of the store)."""

    def unfilled_keys(
        self, part: str, table: str, limit: int = UNFILLED_BATCH
    ) -> list[tuple[bytes, tuple[Any, ...], int]]:
        """Up to ``limit`` rows of ``table`` whose snapshot row is an UPDATE still lacking
        columns: (store key, key values as the store decodes them, in key column order,
        the entry's SCN: the newest of its ``cb_unfilled`` and ``cb_moved`` ones).

        A re-read completes such a row only when its tag is at or above that
        SCN: :meth:`refill_chunk` keeps the entries of a read tagged lower
        (a Postgres tag is only a lower bound of what its read saw).

        Entries whose rows are whole, deleted or gone are dropped on the way,
        ``limit`` at a time in key order (one store transaction each), until
        some rows lack columns or none are left: a batch of such entries is
        no sign that none follow.
        """
        _check_tables([table])
        sid = self._source_id(part, table)
        if sid is None:
            return []
        out: list[tuple[bytes, tuple[Any, ...], int]] = []
        after = b""
        while not out:
            settled: list[tuple[str, int, bytes]] = []
            with self._txn():
                rows = self._all(
                    "SELECT u.key, s.deleted, s.event, u.scn, m.scn FROM cb_unfilled u "
                    "LEFT JOIN cb_snap s "
                    "ON s.part = u.part AND s.source_id = u.source_id AND s.key = u.key "
                    "LEFT JOIN cb_moved m "
                    "ON m.part = u.part AND m.source_id = u.source_id AND m.key = u.key "
                    "WHERE u.part = {p} AND u.source_id = {p} AND u.key > {p} "
                    "ORDER BY u.key LIMIT {p}",
                    (part, sid, after, limit),
                )
                for key, deleted, event, scn, moved_scn in rows:
                    values = None if event is None or deleted else self._lacking_key(part, event)
                    if values is None:
                        settled.append((part, sid, bytes(key)))
                    else:
                        at = max(int(scn), -1 if moved_scn is None else int(moved_scn))
                        out.append((bytes(key), values, at))
                for table_of in ("cb_unfilled", "cb_moved"):
                    self._many(
                        f"DELETE FROM {table_of} WHERE part = {{p}} AND source_id = {{p}} "
                        "AND key = {p}",
                        settled,
                    )
            if len(rows) < limit:
                break
            after = bytes(rows[-1][0])
        return out

    def _lacking_key(self, part: str, event: Any) -> tuple[Any, ...] | None:
        """The key values of a stored UPDATE that lacks columns (None: it is whole)."""
        ev = bytes(event)
        h = decode_header(ev)
        if h.op != int(Op.UPDATE):
            return None
        codec = self._codec(part, h)
        if codec is None:
            return None
        change = codec[0].decode(memoryview(ev)[HEADER_SIZE + h.key_length :])
        after = change.after
        key = codec[0].writer.key
        if not change.after_not_sent or after is None or not all(k in after for k in key):
            return None
        return tuple(after[k] for k in key)

    def refill_chunk(
        self,
        part: str,
        table: str,
        events: Sequence[bytes],
        tag: int,
        absent: Sequence[bytes],
        skipped: Sequence[bytes] = (),
    ) -> None:
        """Merge a re-read of unfilled keys (INSERTs at ``tag``, ``absent`` keys the source
        lacks), drop the entries of the keys it read that are not newer than ``tag``,
        and those of the ``skipped`` keys (which cannot be read again by key).

        One transaction. An entry newer than ``tag`` stays: its UPDATE was folded
        after the listing (the refill reads at a tag at or above the SCNs it
        listed), and the next listing checks whether the merge completed it.
        """
        _check_tables([table])
        with self._txn():
            rows = self._merge_chunk(part, table, events, tag, absent)
            sid = self._source_id(part, table)
            if sid is None:
                return
            keys = [k for _s, k, _ev in rows] + list(absent)
            for table_of in ("cb_unfilled", "cb_moved"):
                self._many(
                    f"DELETE FROM {table_of} WHERE part = {{p}} AND source_id = {{p}} "
                    "AND key = {p} AND scn <= {p}",
                    [(part, sid, k, tag) for k in keys],
                )
                self._many(
                    f"DELETE FROM {table_of} WHERE part = {{p}} AND source_id = {{p}} "
                    "AND key = {p}",
                    [(part, sid, k) for k in skipped],
                )
