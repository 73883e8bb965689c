"""Purging old tombstones from the snapshot store.

One job: the ``cb_purge`` table and the deletes it records. A tombstone (a
``cb_snap`` row with ``deleted = 1``) exists only to tell a consumer that
bootstraps from an older position that a row it may hold was deleted. Kept
for ever, a store with churn (rows inserted and deleted again) grows for
ever. :meth:`TombstonePurge.purge_tombstones` deletes the tombstones whose
delete is older than a cutoff, in SCN order, and records how far it went.

Per partition, ``tomb_scn`` is the newest SCN of a purged tombstone (-1:
none was purged) and ``scanned_scn`` how far the purge has read (every row
at or below it was looked at). Invariant: every tombstone above
``tomb_scn`` is kept, so the server holds every delete after
``max(base_scn, tomb_scn)``, and exactly the consumers at older positions
lack one: :func:`~._plan.check_position` refuses them (410: start from
nothing). ``tomb_scn <= scanned_scn <= log_min_scn`` always: a purge never
goes past the log's start, so a consumer the log can serve (a catch-up) is
never refused for it. The age of a tombstone is its DELETE event's timestamp; a purge stops
at the first tombstone younger than the cutoff (SCNs and source commit
times grow together), and deletes only tombstones at SCNs it passed whole.

Work: each purge reads at most about ``limit`` ``cb_snap`` rows (more only
to finish the rows of the last SCN it reached: one transaction's), in the
``(part, scn)`` index from ``scanned_scn`` on, and reads the event header of
tombstones only. Every row version is passed once; a purge that stops at a
young tombstone reads again only the rows of that one SCN next time.
"""

from __future__ import annotations

from typing import Any

from changebus.schemas import HEADER_SIZE, decode_header

from ._db import StoreDb

__all__ = ["TombstonePurge"]


class TombstonePurge(StoreDb):
    """Old tombstones deleted (a part of :class:`~._store.Store`)."""

    def tomb_scn(self, part: str) -> int:
        """The newest SCN of a purged tombstone (-1: none was): a position before it
        lacks that delete."""
        return self._purge_state(part)[0]

    def _purge_state(self, part: str) -> tuple[int, int]:
        """``(tomb_scn, scanned_scn)`` of the partition (module docstring)."""
        row = self._one("SELECT tomb_scn, scanned_scn FROM cb_purge WHERE part = {p}", (part,))
        return (int(row[0]), int(row[1])) if row is not None else (-1, -1)

    def purge_tombstones(
        self, part: str, older_than_ns: int, limit: int = 2_000
    ) -> tuple[int, bool]:
        """Delete tombstones whose delete happened before ``older_than_ns`` (the epoch's
        nanoseconds) and whose SCN is at most the log's start.

        One bounded step (module docstring). Returns how many went, and
        whether another step now would find more to do.
        """
        st = self.state(part)
        # not past what is applied: a gap's repair moves the log's start past windows the
        # applier has yet to apply, whose tombstones a scan could not see yet
        cap = min(st.log_min_scn, st.applier_scn)
        purged, start = self._purge_state(part)
        if cap <= start:
            return 0, False
        rows = self._rows(
            part, "scn > {p} AND scn <= {p} ORDER BY scn, id LIMIT {p}", start, cap, limit
        )
        more = len(rows) >= limit
        upto = cap
        if more:  # finish the last SCN: a purge ends between two SCNs
            upto, last_id = int(rows[-1][1]), int(rows[-1][0])
            rows += self._rows(part, "scn = {p} AND id > {p}", upto, last_id)
        doomed: list[tuple[int, int]] = []
        for row_id, scn, deleted, head in rows:
            if not deleted:
                continue
            if decode_header(bytes(head)).timestamp_ns >= older_than_ns:
                upto = min(upto, int(scn) - 1)  # young: it and everything after it stay
                more = False
                break
            doomed.append((int(scn), int(row_id)))
        if upto <= start:
            return 0, False
        doomed = [(scn, row_id) for scn, row_id in doomed if scn <= upto]
        ids = [row_id for _scn, row_id in doomed]
        purged = max([purged, *(scn for scn, _id in doomed)])
        with self._txn():
            for i in range(0, len(ids), 500):
                some = ids[i : i + 500]
                marks = ", ".join([self._p] * len(some))
                self._conn.execute(f"DELETE FROM cb_snap WHERE id IN ({marks})", some)
            self._conn.execute(
                self._sql(
                    "INSERT INTO cb_purge (part, tomb_scn, scanned_scn) VALUES ({p}, {p}, {p}) "
                    "ON CONFLICT (part) DO UPDATE SET tomb_scn = excluded.tomb_scn, "
                    "scanned_scn = excluded.scanned_scn"
                ),
                (part, purged, upto),
            )
        return len(ids), more

    def _rows(self, part: str, where: str, *params: int) -> list[Any]:
        """``(id, scn, deleted, header or None)`` of the partition's ``cb_snap`` rows
        ``where`` (the event header of tombstones only)."""
        return self._all(
            "SELECT id, scn, deleted, CASE WHEN deleted = 1 THEN substr(event, 1, {p}) END "
            "FROM cb_snap WHERE part = {p} AND " + where,
            (HEADER_SIZE, part, *params),
        )
