"""Seeding and gaps: which tables were copied from the source whole, and what is missing.

One job: the ``cb_seed`` table. A row per table copied from the source in
full (see :mod:`._seed`), with the SCN of the copy; seed rows are merged
into the snapshot like applied changes (never over a newer state of a key).

A *gap*: windows up to ``gap_end`` may be missing from the log, because the
producer fell off the relay (the relay evicted windows it never read) or
because the relay sent a DATA_LOSS window (SCNs it knows are lost: a chained
relay that fell off its upstream, an oversized window, a damaged ring at
restart; recorded with that window, :meth:`~._store.Store.append`). The
snapshot then lacks whatever changed in the lost range. It is recorded as a ``cb_seed`` row under a name no
table has (``*gap*``) and, while it is there, every table must be seeded
again and positions before ``gap_end`` cannot be served. No table can
take that name: :meth:`seed_rows` and :meth:`forget_seed` refuse names
:func:`~._seedtypes.table_name_problem` rejects (the HTTP seed request is
checked before it gets here). When a table's
seed ends after a gap, its snapshot rows the seed did not rewrite that are
older than the gap were deleted during it: they become tombstones. The gap
is forgotten once every known table has been seeded since.

A gap also leaves a *lost range* for good (``cb_lost``): ``(after, upto)``,
``after`` being the newest window the server had when the windows up to
``upto`` went missing. The re-seed and the sweep repair the snapshot for a
consumer whose position is at most ``after`` (the server saw every row it
holds) or at least ``upto``. A consumer whose position lies strictly inside
the range got changes from there elsewhere (a relay, another server): it
may hold a row inserted and deleted within the range, which this server
never saw and can send no delete for. Such positions are refused for good
(:meth:`SeedLedger.lost_range`): another server, or a reset of the
consumer's state, serves it. Ranges that end at or before ``base_scn`` are
dropped (those positions are refused anyway).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from changebus.schemas import HEADER_SIZE, BadRequestError, Op, decode_header

from ._db import UPSERT_SNAP, PartitionState, StoreDb
from ._seedtypes import table_name_problem

__all__ = ["SeedLedger"]


def _check_tables(tables: Sequence[str]) -> None:
    """Refuse a name that is no table (the gap marker above all)."""
    for table in tables:
        problem = table_name_problem(table)
        if problem is not None:
            raise BadRequestError(problem)


class SeedLedger(StoreDb):
    """Seeded tables and gaps in the log (a part of :class:`~._store.Store`)."""

    #: the ``cb_seed`` name of a gap: reserved, never a table (no dot)
    _GAP = "*gap*"
    #: the ``cb_seed`` name that says rows were copied from the source by a snapshot of
    #: keys or a range, which records no table as seeded (:meth:`copied`)
    _COPIED = "*copied*"

    #: lost ranges :meth:`lost_ranges` lists at most (the newest)
    LOST_RANGES_SHOWN = 100

    def mark_gap(self, part: str, gap_end: int, *, after: int | None = None) -> PartitionState:
        """Windows up to ``gap_end`` may be missing (fall-off or DATA_LOSS, module docstring).

        The log continues after ``gap_end`` (catch-ups from before it are
        refused), every table must be seeded again, and until that is done
        positions before ``gap_end`` cannot be served (:meth:`gap`).
        Positions strictly between ``after`` (default: the newest window in
        the log) and ``gap_end`` are refused for good (:meth:`lost_range`).
        """
        with self._txn():
            st = self.state(part)
            # (positions up to base_scn are refused anyway: the range starts there at the least)
            lost_after = max(st.producer_scn if after is None else after, st.base_scn)
            if lost_after < gap_end:
                least = "min" if self.dialect == "sqlite" else "least"
                self._conn.execute(
                    self._sql(
                        "INSERT INTO cb_lost (part, after_scn, upto_scn) VALUES ({p}, {p}, {p}) "
                        f"ON CONFLICT (part, upto_scn) DO UPDATE SET after_scn = "
                        f"{least}(cb_lost.after_scn, excluded.after_scn)"
                    ),
                    (part, lost_after, gap_end),
                )
            self._conn.execute(
                self._sql("DELETE FROM cb_lost WHERE part = {p} AND upto_scn <= {p}"),
                (part, st.base_scn),
            )
            new = PartitionState(
                max(st.producer_scn, gap_end),
                st.applier_scn,
                st.applier_id,
                max(st.log_min_scn, gap_end),
                st.base_scn,
            )
            self._put_state(part, new)
            self._conn.execute(self._sql("DELETE FROM cb_seed WHERE part = {p}"), (part,))
            # snapshots in progress read rows before the gap: they start again
            self._conn.execute(self._sql("DELETE FROM cb_snapjob WHERE part = {p}"), (part,))
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

    def lost_range(self, part: str, position: int) -> tuple[int, int] | None:
        """A lost range ``(after, upto)`` with ``after < position < upto`` (module
        docstring): such a position cannot be served here; None: it can."""
        if position < 0:
            return None
        row = self._one(
            "SELECT after_scn, upto_scn FROM cb_lost WHERE part = {p} AND after_scn < {p} "
            "AND upto_scn > {p} AND upto_scn > (SELECT coalesce(max(base_scn), -1) FROM "
            "cb_state WHERE part = {p}) ORDER BY upto_scn LIMIT 1",
            (part, position, position, part),
        )
        return (int(row[0]), int(row[1])) if row is not None else None

    def lost_ranges(self, part: str) -> list[tuple[int, int]]:
        """The newest lost ranges ``(after, upto)`` (at most :attr:`LOST_RANGES_SHOWN`),
        oldest first, of those ending after ``base_scn``."""
        rows = self._all(
            "SELECT after_scn, upto_scn FROM cb_lost WHERE part = {p} AND upto_scn > (SELECT "
            "coalesce(max(base_scn), -1) FROM cb_state WHERE part = {p}) "
            f"ORDER BY upto_scn DESC LIMIT {self.LOST_RANGES_SHOWN}",
            (part, part),
        )
        return [(int(a), int(u)) for a, u in reversed(rows)]

    def gap_applied(self, part: str) -> bool:
        """Whether the applier has folded every window the log holds from before the open
        gap (True without one). A table's sweep before that misses a row a window from
        before the gap inserts later: the fold brings it back after the sweep, though the
        source deleted it in the gap. So a re-seed waits for this, and :meth:`clear_gap`
        refuses until it holds."""
        gap_end = self.gap(part)
        if gap_end is None:
            return True
        row = self._one(
            "SELECT after_scn FROM cb_lost WHERE part = {p} AND upto_scn = {p}", (part, gap_end)
        )
        start = min(int(row[0]), gap_end) if row is not None else gap_end
        return self.state(part).applier_scn >= start

    def clear_gap(self, part: str) -> bool:
        """Forget the gap when every known table has been seeded since (and after the
        applier passed the gap's start: :meth:`gap_applied`); True when it was."""
        gap_end = self.gap(part)
        if gap_end is None or not self.gap_applied(part):
            return False
        with self._txn():
            names = set(self.source_names(part))
            seeded = self.seeded(part)
            # (a seed stored as the gap came, from chunks read before it, does not count)
            if not all(seeded.get(n, -1) >= gap_end for n in names):
                return False
            self._conn.execute(
                self._sql("DELETE FROM cb_seed WHERE part = {p} AND name = {p}"),
                (part, self._GAP),
            )
        return True

    def _sweep(self, part: str, table: str, gap_end: int, seed_scn: int) -> None:
        """After a table's seed at ``seed_scn``: rows it did not rewrite that are older
        than the gap were deleted during the gap; they become tombstones at ``seed_scn``."""
        sid = self.source_names(part).get(table)
        if sid is None:
            return
        rows = self._all(
            "SELECT key, event FROM cb_snap WHERE part = {p} AND source_id = {p} "
            "AND deleted = 0 AND scn <= {p} AND scn < {p}",
            (part, sid, gap_end, seed_scn),
        )
        self._many(UPSERT_SNAP, self._tombstones(part, rows, seed_scn))

    def _tombstones(self, part: str, rows: Sequence[Any], scn: int) -> list[tuple[Any, ...]]:
        """``cb_snap`` rows (tombstones at ``scn``) for ``(key, event)`` rows of live keys.

        A tombstone is stamped with the time it is made (or the row's own time, if
        later): when the delete happened is unknown, and the row's last write,
        perhaps months old, made the purge (:mod:`._purge`) take a sweep's fresh
        tombstones for old ones and refuse consumers at once (found by review).
        """
        now = time.time_ns()
        tombs = []
        for key, event in rows:
            ev = bytes(event)
            h = decode_header(ev)
            codec = self._codec(part, h)
            if codec is None:
                continue
            change = codec[0].decode(memoryview(ev)[HEADER_SIZE + h.key_length :])
            image = change.after if change.after is not None else change.before
            when = max(h.timestamp_ns, now)
            tomb = codec[1].encode(Op.DELETE, scn, 0, when, None, image, key=bytes(key))
            tombs.append((part, h.source_id, bytes(key), scn, 1, tomb))
        return tombs

    def seed_rows(self, part: str, table: str, events: Sequence[bytes], scn: int) -> None:
        """Merge seed rows (INSERT events at ``scn``), or record ``table`` as seeded when empty.

        A row is written unless the snapshot holds a newer state of its key.
        After a gap (:meth:`mark_gap`) the end of a table also turns the rows
        deleted during the gap into tombstones.
        """
        _check_tables([table])
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
            self._many(UPSERT_SNAP, rows)

    def seeded(self, part: str) -> dict[str, int]:
        """Tables seeded in full, with the SCN of their seed (not those being seeded again)."""
        return {
            str(n): int(s)
            for n, s in self._all(
                "SELECT name, scn FROM cb_seed WHERE part = {p} AND name <> {p} AND name <> {p} "
                "AND scn >= 0",
                (part, self._GAP, self._COPIED),
            )
        }

    def copied(self, part: str) -> bool:
        """Whether the snapshot holds rows copied from the source since the last gap: a
        table seeded, being seeded again (:meth:`forget_seed`), or a snapshot of keys or a
        range, finished or in progress. Such rows are not in the log: a consumer from
        nothing needs the snapshot, whatever :meth:`seeded` says now (review)."""
        return (
            self._one(
                "SELECT 1 FROM cb_seed WHERE part = {p} AND name <> {p} LIMIT 1",
                (part, self._GAP),
            )
            is not None
            or self._one("SELECT 1 FROM cb_snapjob WHERE part = {p} LIMIT 1", (part,)) is not None
        )

    def mark_copied(self, part: str) -> None:
        """Record that a snapshot of keys or a range copied rows (:meth:`copied`)."""
        self._conn.execute(
            self._sql(
                "INSERT INTO cb_seed (part, name, scn) VALUES ({p}, {p}, 0) "
                "ON CONFLICT (part, name) DO NOTHING"
            ),
            (part, self._COPIED),
        )

    def never_seeded(self, part: str) -> list[str]:
        """Known tables never seeded in full since the last gap (their snapshot may lack
        rows nobody changed since the log began); a table being seeded again counts as
        seeded: its earlier copy is still in the snapshot."""
        seeds = {str(n) for (n,) in self._all("SELECT name FROM cb_seed WHERE part = {p}", (part,))}
        return sorted(set(self.source_names(part)) - seeds)

    def forget_seed(self, part: str, tables: Sequence[str]) -> None:
        """Mark ``tables`` as not seeded (a re-seed copies them again).

        Their rows stay, at SCN -1 ("seeded once, being seeded again"):
        :meth:`seeded` leaves them out, :meth:`never_seeded` too. A chunked
        snapshot of one of them in progress (``cb_snapjob``) is kept: the
        re-seed resumes it (its chunks are newer than the seed being
        forgotten)."""
        _check_tables(tables)
        with self._txn():
            self._many(
                "UPDATE cb_seed SET scn = -1 WHERE part = {p} AND name = {p}",
                [(part, t) for t in tables],
            )
