"""The assembler's XA events: ``XA PREPARE`` keeps a transaction, ``XA COMMIT`` sends it.

How the server logs XA transactions and how their prepared halves are kept
is :mod:`._xa`; these functions drive a :class:`~._assembler.BinlogAssembler`
through them:

* :func:`xa_prepare`: the event group ending with an XA_PREPARE event. Its
  open transaction is kept in the assembler's :class:`~._xa.PreparedSet`
  without its SCHEMA_CHANGE events (windows committed before its commit
  announce those tables themselves); all prepared halves together are
  bounded like one transaction (``max_window_bytes``): past it, the new one
  is only counted. MySQL's ``XA COMMIT .. ONE PHASE`` is a plain commit.
* :func:`xa_end`: an ``XA COMMIT`` makes the prepared half the window of its
  own event group (that group's SCN, GTID and position: commit order),
  announcing the tables the windows since its prepare did not; an
  ``XA ROLLBACK`` drops it (an empty window). An ``XA COMMIT`` of a
  transaction prepared before the stream's start becomes a DATA_LOSS window
  (its rows were never read).

Not thread-safe: called by the assembler, on its fetcher thread.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from changebus.schemas import DataLoss, RowEncoder, SourceConfigError

from .._base import Window
from ._txn import OpenTxn, PendingWindow
from ._xa import Prepared, XaKey, parse_xa_end, xid_text

if TYPE_CHECKING:
    from ._assembler import BinlogAssembler

__all__ = ["xa_end", "xa_prepare"]

log = logging.getLogger("changebus.fetchers.mysql")


def xa_prepare(
    assembler: BinlogAssembler, key: XaKey, one_phase: bool, end_pos: int
) -> Window | PendingWindow | None:
    """An XA_PREPARE event ending at ``end_pos``: the open transaction is prepared
    (kept until its XA COMMIT), or, ``one_phase`` (MySQL's ``XA COMMIT ..
    ONE PHASE``), committed."""
    if one_phase:
        return assembler.commit(end_pos)
    txn = assembler._txn
    assembler._txn = None
    if txn is None:
        raise SourceConfigError(
            f"an XA PREPARE of {xid_text(key)} without its transaction (at "
            f"{assembler.file}:{end_pos})"
        )
    # its SCHEMA_CHANGE events go: windows committed before it must announce
    # those tables themselves; the commit announces what is still needed then
    txn.events = [p for p in txn.events if isinstance(p[0], RowEncoder) or p[1]]
    assembler._unannounce(txn)
    held = assembler.prepared.held_bytes() + (0 if txn.oversized else txn.size)
    if assembler.max_window_bytes and held > assembler.max_window_bytes and not txn.oversized:
        # all the prepared halves together are bounded like one transaction: past
        # it, this one is only counted (its commit is a data loss, or an error)
        log.warning(
            "XA transaction %s: prepared transactions hold %d bytes together, more "
            "than max_transaction_bytes (%d); its rows are let go",
            xid_text(key),
            held,
            assembler.max_window_bytes,
        )
        assembler._let_go(txn)
    assembler.prepared.add(key, Prepared(txn, txn.gtid, *txn.start))  # (after: it counts it)
    return None


def xa_end(assembler: BinlogAssembler, text: str, end_pos: int) -> Window | PendingWindow | None:
    """An ``XA`` query ending at ``end_pos``: ``XA COMMIT`` / ``XA ROLLBACK`` end
    their event group (and deliver or drop the prepared half); others
    (``XA START``, ``XA END``) are inside a transaction."""
    parsed = parse_xa_end(text)
    if parsed is None:
        if text[:9].upper().startswith(("XA COMMIT", "XA ROLLBA")):
            raise SourceConfigError(
                f"an XA statement at {assembler.file}:{end_pos} names its transaction in a "
                "form the fetcher cannot read; its rows would be lost"
            )
        return None
    kind, key = parsed
    group = assembler._txn or OpenTxn("", 0, True)
    prepared = assembler.prepared.pop(key)
    if kind == "ROLLBACK":
        assembler._txn = group  # nothing of it is sent: the group is an empty window
        return assembler.commit(end_pos)
    if prepared is None:
        # prepared before the stream's start (the fetcher's first start, a seed
        # position): its rows were never read
        assembler._txn = None
        assembler.last_empty = False
        scn = assembler.scn_at(end_pos)
        position = assembler.position_at(group.gtid, end_pos)
        what = (
            f"XA transaction {xid_text(key)} was committed at {assembler.file}:{end_pos} "
            f"(GTID {group.gtid or 'none'}), but it was prepared before the fetcher's "
            "start position: its changes, if it made any to captured tables, are missing"
        )
        if scn > assembler.replay_until:  # (read again after a rewind: the relay has it)
            log.error("%s", what)
            assembler.losses["xa_prepared_before_start"] += 1
        return assembler.control_window(DataLoss(scn, scn, what), scn, position, group.ts_ns)
    txn = prepared.txn
    txn.gtid, txn.ts_ns = group.gtid, group.ts_ns or txn.ts_ns
    if not txn.oversized:  # announce what windows since the prepare did not
        head = OpenTxn(txn.gtid, txn.ts_ns, False)
        for table in txn.touched:
            assembler._announce(head, table)
        txn.events[:0] = head.events
        txn.announced = head.announced
    assembler._txn = txn
    return assembler.commit(end_pos)
