"""The snapshot fold: the applier turns the log into the latest row per key.

One job: the ``cb_snap`` and ``cb_trunc`` tables, written by folding log
windows in (:meth:`SnapshotFold.apply`).

``cb_snap`` -- the **snapshot store**: per (partition, source id, key) the
  latest data event: ``scn`` of the change that wrote it, ``deleted`` for a
  delete (a *tombstone*: a consumer that saw the row earlier must learn it is
  gone). An upsert keeps the row's ``id``, so a scan in ``id`` order is stable
  while the applier keeps writing; it never replaces a newer state of a key
  (:data:`~._db.UPSERT_SNAP`: seeded rows may be ahead of the applier).
``cb_trunc`` -- the newest TRUNCATE per (partition, source): the snapshot rows
  of that source before it are removed; the event itself is served first in a
  snapshot to consumers that saw the table before it (:mod:`._pages`).

Invariants: ``applier_scn <= producer_scn``; ``cb_snap`` = the fold of the log
windows up to ``applier_scn`` (plus what was seeded, :mod:`._gaps`). A fold
step is one transaction: the snapshot rows and the applier position move
together, so a crash never applies a window twice or half. An UPDATE is
stored whole: a key change leaves a tombstone under the old key, and columns
the source did not send (Postgres' unchanged TOAST values) are filled in
from the row's previous image.

``cb_unfilled`` -- keys whose stored UPDATE still lacks columns (the fold
had no whole earlier image of the row: a seed had not copied it yet, or the
row came under a new key the seed had passed), with the UPDATE's SCN. A
seed re-reads them from the source before it ends (:mod:`._refill`).
"""

from __future__ import annotations

from typing import Any

from changebus.schemas import (
    FIRST_CONTROL_OP,
    HEADER_SIZE,
    DecodedChange,
    EventHeader,
    Op,
    RowEncoder,
    SchemaError,
    decode_header,
)

from ._db import UPSERT_SNAP, PartitionState, StoreDb

__all__ = ["SnapshotFold", "merge_unsent"]

_DELETE = int(Op.DELETE)
_UPDATE = int(Op.UPDATE)
_TRUNCATE = int(Op.TRUNCATE)


class SnapshotFold(StoreDb):
    """The applier's fold of the log into the snapshot (a part of :class:`~._store.Store`)."""

    #: log events folded into the snapshot through this connection
    applied_events: int = 0

    def apply(
        self, part: str, max_events: int = 10_000, max_bytes: int = 64 << 20
    ) -> PartitionState:
        """Fold the next whole windows of the log (about ``max_events``, or ``max_bytes`` of
        events, whichever comes first: they are held at once) into the snapshot.

        One transaction: the snapshot rows and the applier position move
        together, so a crash never applies a window twice or half.
        """
        st = self.state(part)
        if st.applier_scn >= st.producer_scn:
            return st
        # the SCN up to which to apply: the window holding the max_events-th row. Whole
        # windows are applied, so the SCN alone says what is left; row ids only order a
        # window's rows (SQLite reuses them once a prune emptied the log: a filter on
        # ``id > applier_id`` then left new windows out, found by review)
        # (the events' lengths, not the events: 20,000 events of 1 MB were 20 GB held at
        # once; found by review)
        sizes = self._each(
            "SELECT scn, length(event) FROM cb_log WHERE part = {p} AND scn > {p} "
            "ORDER BY scn, id LIMIT {p}",
            (part, st.applier_scn, max_events),
        )
        upto, taken, total = st.producer_scn, 0, 0
        try:
            for scn, length in sizes:
                taken += 1
                total += int(length)
                if taken == max_events or total >= max_bytes:
                    upto = min(int(scn), st.producer_scn)
                    break
        finally:
            sizes.close()
        rows = self._all(
            "SELECT id, source_id, op, scn, event FROM cb_log WHERE part = {p} AND scn > {p} "
            "AND scn <= {p} ORDER BY scn, id",
            (part, st.applier_scn, upto),
        )
        if not rows:
            # nothing in the log up to the producer: the snapshot is the fold up to it
            # (a gap's end, where the log starts again, with no window after it yet: an
            # applier left before it planned snapshots no catch-up could follow)
            with self._txn():
                cur = self.state(part)
                new = PartitionState(
                    cur.producer_scn, upto, st.applier_id, cur.log_min_scn, cur.base_scn
                )
                self._put_state(part, new)
            return new
        upserts: dict[tuple[int, bytes], tuple[Any, ...]] = {}
        lacking: dict[tuple[int, bytes], int] = {}  # (source id, key) -> SCN
        moved: dict[tuple[int, bytes], int] = {}  # of those, moved there (cb_moved)
        # UPDATEs that moved a row and were filled in: (event, log row id)
        refilled: list[tuple[bytes, int]] = []
        with self._txn():
            for row_id, source_id, op, scn, event in rows:
                if op == _TRUNCATE:
                    self._flush_upserts(upserts)
                    self._truncate(part, int(source_id), int(scn), bytes(event))
                elif op < FIRST_CONTROL_OP:
                    event = bytes(event)
                    h = decode_header(event)
                    key = event[HEADER_SIZE : HEADER_SIZE + h.key_length]
                    if op == _UPDATE:
                        event = self._fold_update(
                            part, h, key, event, (upserts, lacking, moved), refilled, row_id
                        )
                    upserts[(int(source_id), key)] = (
                        part,
                        int(source_id),
                        key,
                        int(scn),
                        1 if op == _DELETE else 0,
                        event,
                    )
            self._flush_upserts(upserts)
            # the log serves catch-ups the UPDATEs that moved a row as filled in: a
            # consumer may lack the row's previous image (it moved from a key the consumer
            # never held: a snapshot sent it at its newest version, deleted) and stored
            # the row without the columns Postgres left out, or moved a newer row onto it
            # (review). Only those: others a consumer completes from the row it holds,
            # and filled in, a bulk UPDATE of TOASTed rows would grow many times over
            self._many("UPDATE cb_log SET event = {p} WHERE id = {p}", refilled)
            self._many(
                "INSERT INTO cb_unfilled (part, source_id, key, scn) VALUES ({p}, {p}, {p}, {p}) "
                "ON CONFLICT (part, source_id, key) DO UPDATE SET scn = excluded.scn",
                [(part, sid, key, scn) for (sid, key), scn in lacking.items()],
            )
            self._many(
                "INSERT INTO cb_moved (part, source_id, key, scn) VALUES ({p}, {p}, {p}, {p}) "
                "ON CONFLICT (part, source_id, key) DO UPDATE SET scn = excluded.scn",
                [(part, sid, key, scn) for (sid, key), scn in moved.items()],
            )
            cur = self.state(part)
            new = PartitionState(
                cur.producer_scn, upto, int(rows[-1][0]), cur.log_min_scn, cur.base_scn
            )
            self._put_state(part, new)
        self.applied_events += len(rows)
        return new

    def _fold_update(
        self,
        part: str,
        h: EventHeader,
        key: bytes,
        event: bytes,
        batch: tuple[
            dict[tuple[int, bytes], tuple[Any, ...]],
            dict[tuple[int, bytes], int],
            dict[tuple[int, bytes], int],
        ],
        refilled: list[tuple[bytes, int]],
        row_id: int,
    ) -> bytes:
        """What an UPDATE leaves in the snapshot; returns the event to store for its key.

        ``batch``: the snapshot rows of the fold step so far, the keys whose
        rows still lack columns (``cb_unfilled``), and those of them whose row moved
        there from another key (``cb_moved``), all written at its end. A moved row's
        UPDATE, filled in, goes to ``refilled`` with its log ``row_id`` (the log's copy
        is replaced by it).

        * A key change (the before-image has another key) leaves a tombstone
          for the old key, so no stale row survives under it, and stores the
          row under its new key as a new row (a new id: a snapshot in progress
          reaches it).
        * Columns the source did not send (Postgres' unchanged TOAST values)
          are taken from the row's previous image, so a snapshot row is whole.
        """
        upserts, lacking, moved = batch
        codec = self._codec(part, h)
        if codec is None:
            return event
        dec, enc = codec
        change = dec.decode(memoryview(event)[HEADER_SIZE + h.key_length :])
        source_key = key  # where the row's previous image is
        if change.before is not None and h.key_length:
            try:
                tomb = enc.encode(
                    Op.DELETE,
                    h.scn,
                    h.seq,
                    h.timestamp_ns,
                    None,
                    change.before,
                    before_not_sent=change.before_not_sent,
                )
            except SchemaError:
                if all(change.before.get(k) is not None for k in enc.table.key):
                    raise
                # a key column without a value in the before-image (a MySQL zero date:
                # its key value is the stream's own, which the image cannot give):
                # taken as the same key (docs/mysql.md, Types)
                tomb = None
            old = (
                key
                if tomb is None
                else tomb[HEADER_SIZE : HEADER_SIZE + decode_header(tomb).key_length]
            )
            if old != key:
                source_key = old
        if change.after_not_sent and change.after is not None:
            filled = self._fill_unsent(part, h, (key, source_key), change, enc, upserts)
            whole = filled is not None and filled[1]
            if filled is not None:
                event = filled[0]
                if source_key != key:  # (the log's copy too: see fold)
                    refilled.append((event, int(row_id)))
            if (
                not whole
                and h.key_length
                and (filled is None or self._lacked(part, h, source_key, lacking))
            ):
                lacking[(h.source_id, key)] = h.scn
                if source_key != key:
                    # (a chunk read before this moved here holds another row at this key:
                    # it must not lend it the columns it lacks; review)
                    moved[(h.source_id, key)] = h.scn
        if source_key != key:
            upserts[(h.source_id, source_key)] = (part, h.source_id, source_key, h.scn, 1, tomb)
            # the moved row is stored anew, after every row: kept in the new key's old row
            # (a tombstone of an earlier delete), it sat behind a snapshot in progress, which
            # never sent it, and the catch-up's UPDATE (without Postgres' unchanged TOAST
            # columns) could not make it whole (review). Not over a newer (seeded) version
            self._conn.execute(
                self._sql(
                    "DELETE FROM cb_snap WHERE part = {p} AND source_id = {p} AND key = {p}"
                    " AND scn <= {p}"
                ),
                (part, h.source_id, key, h.scn),
            )
        return event

    def _lacked(
        self, part: str, h: EventHeader, key: bytes, lacking: dict[tuple[int, bytes], int]
    ) -> bool:
        """Whether the row's previous image (under ``key``) was listed as lacking columns:
        then the UPDATE, filled from it, lacks them for the same reason (a chain of key
        changes). An image that lacks a column for good (a MariaDB zero date has no Avro
        value; the seed's copy leaves it out too) is not listed, nor are its updates."""
        if (h.source_id, key) in lacking:
            return True
        return (
            self._one(
                "SELECT 1 FROM cb_unfilled WHERE part = {p} AND source_id = {p} AND key = {p}",
                (part, h.source_id, key),
            )
            is not None
        )

    def _fill_unsent(
        self,
        part: str,
        h: EventHeader,
        keys: tuple[bytes, bytes],
        change: DecodedChange,
        enc: RowEncoder,
        upserts: dict[tuple[int, bytes], tuple[Any, ...]],
    ) -> tuple[bytes, bool] | None:
        """The UPDATE (event key ``keys[0]``) re-encoded with its unsent columns from the
        row's previous image (at ``keys[1]``), and whether it is whole now (None: no
        such image)."""
        key, source_key = keys
        assert change.after is not None
        pending = upserts.get((h.source_id, source_key))
        if pending is not None:
            prev: bytes | None = None if pending[4] else pending[5]
            at = int(pending[3])
        else:
            row = self._one(
                "SELECT event, deleted, scn FROM cb_snap WHERE part = {p} AND source_id = {p} "
                "AND key = {p}",
                (part, h.source_id, source_key),
            )
            prev = bytes(row[0]) if row is not None and not row[1] else None
            at = int(row[2]) if row is not None else -1
        if prev is None or at > h.scn:
            # (an image newer than the UPDATE, seeded ahead of the applier, is of a later
            # state of the key: of another row when this one moved away from it since)
            return None
        ph = decode_header(prev)
        pcodec = self._codec(part, ph)
        if pcodec is None:
            return None
        old_change = pcodec[0].decode(memoryview(prev)[HEADER_SIZE + ph.key_length :])
        return merge_unsent(h, key, change, enc, old_change)

    def _flush_upserts(self, upserts: dict[tuple[int, bytes], tuple[Any, ...]]) -> None:
        self._many(UPSERT_SNAP, upserts.values())
        upserts.clear()

    def _truncate(self, part: str, source_id: int, scn: int, event: bytes) -> None:
        self._conn.execute(
            # (``+scn``: not by the (part, scn) index, which made SQLite visit every
            # row of the partition older than the TRUNCATE, but by (part, source_id, id))
            self._sql("DELETE FROM cb_snap WHERE part = {p} AND source_id = {p} AND +scn <= {p}"),
            (part, source_id, scn),
        )
        self._conn.execute(
            self._sql(
                "INSERT INTO cb_trunc (part, source_id, scn, event) VALUES ({p}, {p}, {p}, {p}) "
                "ON CONFLICT (part, source_id) DO UPDATE SET scn = excluded.scn, event = excluded.event"
            ),
            (part, source_id, scn, event),
        )


def merge_unsent(
    h: EventHeader, key: bytes, change: DecodedChange, enc: RowEncoder, image: DecodedChange
) -> tuple[bytes, bool] | None:
    """The UPDATE ``change`` (header ``h``, event key ``key``: kept as it is, since
    an image cannot give a MySQL zero date's key value) re-encoded at its own SCN with the columns
    the source did not send taken from ``image``'s after-image (an earlier state of
    the row: its previous snapshot row, or a snapshot chunk's copy of it), and whether
    every column is sent now; None when ``image`` has no after-image, or values
    its schema version gave that the UPDATE's no longer takes (a column's type
    changed). Columns ``image`` lacks stay unsent."""
    assert change.after is not None
    if image.after is None:
        return None
    merged = dict(change.after)
    still: list[str] = []
    for col in change.after_not_sent:
        if col in image.after and col not in image.after_not_sent:
            merged[col] = image.after[col]
        else:
            still.append(col)
    try:
        event = enc.encode(
            Op.UPDATE,
            h.scn,
            h.seq,
            h.timestamp_ns,
            merged,
            change.before,
            after_not_sent=still,
            before_not_sent=change.before_not_sent,
            key=key,
        )
    except SchemaError:
        # a value of the image's schema version that the UPDATE's no longer takes (the
        # column's type changed since: text to bytea, say): nothing is filled, the
        # columns are filled from the source like any the image lacks. Raised, it
        # stopped the applier on this UPDATE for good, and the log grew without a bound
        # (found by review)
        return None
    return event, not still
