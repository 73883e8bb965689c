"""The log store: every event the producer took from the relay, whole windows in stream order.

One job: the ``cb_log`` table. A row per event, raw (exactly the relay's
bytes, validated), with its partition, SCN, source id and op; whole windows
per database transaction, in stream order (``id`` ascending = SCN order).
Control events are kept too, so a catch-up page (:mod:`._pages`) is a valid
stream of windows.

Invariants: the log holds every window in ``(log_min_scn, producer_scn]``
(:class:`~._db.PartitionState`); appending moves ``producer_scn`` in the
same transaction as the rows; pruning deletes only windows the applier has
folded in (``<= applier_scn``) and moves only ``log_min_scn``, so
``base_scn <= log_min_scn`` still holds.
"""

from __future__ import annotations

import numpy as np

from changebus.schemas import Op, ProtocolError, parse_stream

from ._db import PartitionState, StoreDb

__all__ = ["LAG_COUNT_MAX", "LogStore"]

_EOW = int(Op.END_OF_WINDOW)
#: :meth:`LogStore.unapplied_events` counts at most this many events, and one more
LAG_COUNT_MAX = 1_000_000


class LogStore(StoreDb):
    """Appending to and pruning the log (a part of :class:`~._store.Store`)."""

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
        """Log events the applier has not folded in yet (the applier's lag).

        Counted up to :data:`LAG_COUNT_MAX` + 1 (a larger lag reads as that):
        the applier counts after every step, and counting costs as much as
        the lag is long.
        """
        st = self.state(part)
        row = self._one(
            "SELECT count(*) FROM (SELECT 1 FROM cb_log WHERE part = {p} AND scn > {p} "
            "LIMIT {p}) AS lag",
            (part, st.applier_scn, LAG_COUNT_MAX + 1),
        )
        return int(row[0])

    def prune_to(self, part: str, keep_events: int) -> int:
        """Prune applied windows so that about ``keep_events`` log events remain."""
        row = self._one(
            "SELECT scn FROM cb_log WHERE part = {p} ORDER BY scn DESC, id DESC LIMIT 1 OFFSET {p}",
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
