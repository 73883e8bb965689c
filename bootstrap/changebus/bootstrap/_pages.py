"""Pages: what the bootstrap server reads from the store for a consumer.

One job: the read side. A bootstrap is a snapshot (:meth:`Pages.snapshot_page`:
rows changed after the consumer's SCN, at their latest version, by source
then row id) followed by a catch-up (:meth:`Pages.catchup_page`: whole log
windows up to a target SCN, oldest first); plus the counts the server uses
to choose between them. Pages resume from a position the previous page
returned, so a consumer's bootstrap keeps no state on the server.

Nothing here writes; the scans are stable while the applier writes (a
snapshot upsert keeps its row ``id``, the log only grows at its end).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from changebus.schemas import FIRST_CONTROL_OP, Op, PartitionFilter, decode_header

from ._db import StoreDb

__all__ = ["CatchupPage", "Pages", "SnapshotPage"]

_EOW = int(Op.END_OF_WINDOW)
_MAX_ID = 2**62


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


class Pages(StoreDb):
    """Snapshot and catch-up pages (a part of :class:`~._store.Store`)."""

    def changed_since(self, part: str, since_scn: int, upto_scn: int, limit: int) -> int:
        """Log data events in ``(since_scn, upto_scn]`` (what a catch-up-only bootstrap
        costs), counted up to ``limit`` (a plan needs no more: a count of the whole log
        read every row of it, per request)."""
        row = self._one(
            "SELECT count(*) FROM (SELECT 1 FROM cb_log WHERE part = {p} AND scn > {p} AND "
            "scn <= {p} AND op < {p} LIMIT {p}) AS x",
            (part, since_scn, upto_scn, FIRST_CONTROL_OP, limit),
        )
        return int(row[0])

    def first_log_scn(self, part: str) -> int:
        """SCN of the oldest window in the log (-1: empty)."""
        row = self._one("SELECT min(scn) FROM cb_log WHERE part = {p}", (part,))
        return int(row[0]) if row is not None and row[0] is not None else -1

    def snapshot_changed(self, part: str, since_scn: int, upto_scn: int, limit: int) -> int:
        """Snapshot rows (tombstones too) last changed in ``(since_scn, upto_scn]``, counted
        up to ``limit``."""
        row = self._one(
            "SELECT count(*) FROM (SELECT 1 FROM cb_snap WHERE part = {p} AND scn > {p} AND "
            "scn <= {p} LIMIT {p}) AS x",
            (part, since_scn, upto_scn, limit),
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
        (``since_scn >= 0``); a source's TRUNCATE after it comes first, for a
        consumer with a key filter also from nothing (writers of other keys
        share its tables: :mod:`changebus.client._apply_shared`).
        At least one event is returned when any is left (even over
        ``max_bytes``), unless the page stopped after reading
        :data:`SCAN_PAGES` times ``max_bytes`` (at least :data:`MIN_SCAN_BYTES`)
        of rows it did not send (a key filter matching few, rows older than
        ``since_scn``, tombstones for a consumer from nothing; the last two
        count :data:`SKIPPED_ROW_BYTES` each): a request never reads the whole
        store at once, and the page ends at its position, not complete,
        possibly empty.
        """
        scan_limit = max(SCAN_PAGES * max_bytes, MIN_SCAN_BYTES)
        sources = sorted(source_ids)
        src, after = position
        chunks: list[bytes] = []
        size = events = 0
        seen = (0, 0)  # rows read and their bytes (kept or not: the reads' sizes)
        for sid in sources:
            if sid < src:
                continue
            if sid > src:
                if seen[1] >= scan_limit:
                    # (checked after full reads only, tables of few rows each were read to
                    # the end of the store in one request: review) the next page starts it
                    return SnapshotPage(b"".join(chunks), events, (src, after), False)
                after = 0
            reads = 0  # (this table's: its rows' size is not known from another's)
            if after == 0:
                trunc = self._one(
                    "SELECT scn, event FROM cb_trunc WHERE part = {p} AND source_id = {p}",
                    (part, sid),
                )
                # (a filtered consumer from nothing gets it too: it shares its tables with
                # other filters' writers, and must not apply the TRUNCATE again later)
                shared = since_scn >= 0 or key_filter is not None
                if trunc is not None and shared and since_scn < int(trunc[0]):
                    chunks.append(bytes(trunc[1]))
                    size += len(trunc[1])
                    events += 1
            while True:
                want = self._held_rows(_rows_to_fetch(batch_rows, max_bytes, size, seen), reads)
                reads += 1
                # rows the page does not send (older than ``since_scn``; tombstones for a
                # consumer from nothing) are read, not filtered in SQL, so that they count
                # in the scan budget: filtered there (neither column is in the index), one
                # LIMIT query read the whole source to find a few changed rows. Their
                # events are not read (CASE), and each counts :data:`SKIPPED_ROW_BYTES`.
                # (taken row by row, and left as soon as the page is full: a read sized
                # by the rows before (a table of small rows, rows unchanged since
                # ``since_scn``) held 2,000 of the next table's 1 MB rows at once; review)
                # (at least 1: a TRUNCATE taken above may fill the page, and a budget of 0
                # read no row, which ended the table with its rows unsent: review)
                budget = max(max_bytes - size, 1)
                rows = self._page_rows(
                    _SNAP_SQLITE,
                    _SNAP_PG,
                    (since_scn, since_scn >= 0, part, sid, after, want),
                    budget,
                )
                got = cut = 0
                try:
                    for rid, event, upto in rows:
                        got += 1
                        cut = int(upto) >= budget  # (Postgres: the rows after it were not sent)
                        after = int(rid)
                        n = SKIPPED_ROW_BYTES if event is None else len(event)
                        seen = (seen[0] + 1, seen[1] + n)
                        if event is None:
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
                finally:
                    rows.close()
                if got < want and not cut:
                    break
                if seen[1] >= scan_limit:  # (rows were left: the next page goes on here)
                    return SnapshotPage(b"".join(chunks), events, (sid, after), False)
            src = sid
        last = sources[-1] if sources else 0
        return SnapshotPage(b"".join(chunks), events, (last, after), True)

    def _page_rows(
        self, sqlite: str, postgres: str, params: tuple[object, ...], budget: int
    ) -> Any:
        """A page read's rows (close them): on Postgres cut after ``budget`` bytes."""
        if self.dialect == "sqlite":
            return self._each(sqlite, params)
        return self._each(postgres, (*params, budget))

    def _held_rows(self, want: int, reads: int) -> int:
        """Rows a page's ``reads``-th read of one table may ask for: ``want``. Postgres'
        client-side cursor holds all it reads, sized by the rows read before (of another
        table, or skipped): there reads start at 16 rows and at most double."""
        return want if self.dialect == "sqlite" else min(want, 16 << min(reads, 16))

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
        want = reads = 0
        while True:
            if size < max_bytes:
                want = _rows_to_fetch(batch_rows, max_bytes, size, (events, size))
            else:
                # past max_bytes inside a window, which goes out whole: reads that double
                # (one row a read, as the estimate gives, took a query per row of a big
                # window: any reader could ask for that with max_bytes=1; review)
                want = min(batch_rows, max(2 * want, 16))
            want = self._held_rows(want, reads)
            reads += 1
            # (a window goes out whole: past max_bytes, reads of a few MiB until its end)
            budget = max_bytes - size if size < max_bytes else _WINDOW_READ_BYTES
            rows = self._page_rows(
                _LOG_SQLITE,
                _LOG_PG,
                (part, cursor_scn, cursor_scn, cursor_scn, cursor_id, target_scn, want),
                budget,
            )
            got = cut = 0
            try:
                for rid, scn, op, event, upto in rows:
                    got += 1
                    cut = int(upto) >= budget
                    cursor_scn, cursor_id = int(scn), int(rid)
                    chunks.append(bytes(event))
                    size += len(event)
                    events += 1
                    if op == _EOW:
                        last_scn, last_id = int(scn), int(rid)
                        if size >= max_bytes:
                            data = b"".join(chunks)
                            done = last_scn >= target_scn
                            return CatchupPage(data, events, last_scn, last_id, done)
            finally:
                rows.close()
            if got < want and not cut:
                break
        # drop a trailing partial window (cannot happen with whole-window appends)
        return CatchupPage(b"".join(chunks), events, last_scn, last_id, True)


# The reads of a page. Postgres' client-side cursor holds a whole result: its queries
# stop after the row that passes ``budget`` bytes of events sent (a running sum of
# their sizes, which ``octet_length`` reads without fetching a TOASTed value), and the
# rows after it are read by the next query. Before, a read sized by rows seen (a
# table's skipped rows count 256 bytes each) held 2,000 rows of 1 MiB for a 1 MiB page
# (review). SQLite steps its query as rows are taken: a reader that stops early holds
# nothing more. Columns: the rows', then that running sum (0 on SQLite).
_SENT = "CASE WHEN scn > {p} AND (deleted = 0 OR {p}) THEN event END"
_SNAP_FROM = "FROM cb_snap WHERE part = {p} AND source_id = {p} AND id > {p} ORDER BY id LIMIT {p}"
_SNAP_SQLITE = f"SELECT id, {_SENT}, 0 {_SNAP_FROM}"
_SNAP_PG = (
    "SELECT id, ev, upto FROM (SELECT id, ev, sum(coalesce(octet_length(ev), 0)) OVER "
    f"(ORDER BY id ROWS UNBOUNDED PRECEDING) AS upto FROM (SELECT id, {_SENT} AS ev "
    f"{_SNAP_FROM}) l) q WHERE upto - coalesce(octet_length(ev), 0) < {{p}} ORDER BY id"
)
_LOG_FROM = (
    "FROM cb_log WHERE part = {p} AND "
    # (``scn >= cursor``, implied by the OR, is what lets the index start at the
    # cursor: without it every page read the log from its beginning)
    "scn >= {p} AND (scn > {p} OR (scn = {p} AND id > {p})) AND scn <= {p} "
    "ORDER BY scn, id LIMIT {p}"
)
_LOG_SQLITE = f"SELECT id, scn, op, event, 0 {_LOG_FROM}"
_LOG_PG = (
    "SELECT id, scn, op, event, upto FROM (SELECT id, scn, op, event, "
    "sum(octet_length(event)) OVER (ORDER BY scn, id ROWS UNBOUNDED PRECEDING) AS upto "
    f"FROM (SELECT id, scn, op, event {_LOG_FROM}) l) q "
    "WHERE upto - octet_length(event) < {p} ORDER BY scn, id"
)
#: a catch-up read's budget past ``max_bytes``, inside a window that goes out whole
_WINDOW_READ_BYTES = 4 << 20

#: a snapshot page reads at most this many times its ``max_bytes`` of rows...
SCAN_PAGES = 16
#: ...and at least this many bytes (then it ends, not complete: see ``snapshot_page``)
MIN_SCAN_BYTES = 32 << 20
#: what a row a page reads and does not send counts in that budget (its event unread)
SKIPPED_ROW_BYTES = 256


def _rows_to_fetch(batch_rows: int, max_bytes: int, size: int, seen: tuple[int, int]) -> int:
    """How many rows a page's next read fetches: about what is left of ``max_bytes``
    (``size`` is kept so far) at the average size of the rows read so far (``seen``:
    rows, bytes; 16 first), at most ``batch_rows``. A page of big rows then holds
    about ``max_bytes`` and one read more, not ``batch_rows`` of them."""
    rows, nbytes = seen
    if rows == 0:
        return min(batch_rows, 16)
    average = max(1, nbytes // rows)
    return max(1, min(batch_rows, max(0, max_bytes - size) // average + 1))
