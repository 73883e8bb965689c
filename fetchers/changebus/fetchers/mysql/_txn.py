"""The state of the assembler (:mod:`._assembler`): mapped tables, open transactions,
committed ones waiting for their decode workers."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from changebus.schemas import ControlPayload, EndOfWindow, RowEncoder, encode_control

from .._base import Window
from ._layout import RowsTranscoder, TableLayout

if TYPE_CHECKING:
    from ._assembler import BinlogAssembler

__all__ = ["MappedTable", "OpenTxn", "Part", "PendingWindow", "control_window", "encode_window"]


@dataclass
class MappedTable:
    """A captured table as mapped by a TABLE_MAP event: its layout, encoder, compiled
    transcoder and column count (whether its schema version was announced, the
    assembler keeps by fingerprint)."""

    layout: TableLayout
    encoder: RowEncoder
    transcode: RowsTranscoder
    ncols: int
    #: what the assembler's layout cache knows it by (TABLE_MAP bytes and declared types)
    key: tuple[Any, ...] = ()
    #: what decode workers know the layout by (:func:`._workers.layout_id`; b"": none)
    layout_id: bytes = b""


#: one event of an open transaction (see :attr:`OpenTxn.events`)
Part = tuple[RowEncoder, "list[Any] | Future[list[Any]]"] | tuple[Callable[[int, int], bytes], bool]


@dataclass
class OpenTxn:
    """A transaction being assembled, from its GTID event to its commit (or, for
    an XA transaction, kept prepared until its XA COMMIT: :mod:`._xa`)."""

    gtid: str
    ts_ns: int
    standalone: bool
    #: the window's events, encoded at the commit (SCN and seq known then): row
    #: changes ``(encoder, changes or a future of them)`` or a control/TRUNCATE event
    #: ``(fn(scn, seq) -> bytes, is a data event)``
    events: list[Part] = field(default_factory=list)
    #: worker futures of row changes of an oversized transaction, counted (and let go)
    #: as they finish; none is added once it is oversized (the assembler counts in its
    #: own thread then): at most those submitted before it passed the limit
    dropped: list[Future[list[Any]]] = field(default_factory=list)
    data_events: int = 0
    size: int = 0
    oversized: bool = False
    #: tables whose SCHEMA_CHANGE is in :attr:`events`
    announced: list[MappedTable] = field(default_factory=list)
    #: every table with events in this transaction, in first-touch order (an XA
    #: transaction's announcements are made again at its commit)
    touched: list[MappedTable] = field(default_factory=list)
    #: ``id()`` of each table in :attr:`touched` (a rows event checks it)
    touched_ids: set[int] = field(default_factory=set)
    #: binlog file and position where the transaction's event group starts
    start: tuple[str, int] = ("", 0)
    #: savepoint name -> how many of :attr:`events` were there when it was set
    savepoints: dict[str, int] = field(default_factory=dict)

    def rollback_to(self, name: str) -> bool:
        """``ROLLBACK TO name``: the row changes after the savepoint were undone. (The
        binlog keeps them when that part changed a non-transactional table too, whose
        changes persisted: those are logged apart.) False: no such savepoint here."""
        mark = self.savepoints.get(name)
        if mark is None or self.oversized:
            return mark is not None
        kept = self.events[:mark]
        # (schema announcements stay: harmless, and the tables count as announced)
        kept += [p for p in self.events[mark:] if not isinstance(p[0], RowEncoder) and not p[1]]
        self.events = kept
        self.savepoints = {n: m for n, m in self.savepoints.items() if m <= mark}
        return True

    def let_go(self) -> int:
        """Make it oversized: its rows are only counted from now on (its events go;
        their finished worker futures are counted). The rows counted now."""
        self.oversized = True
        counted = 0
        for kept in self.events:
            if isinstance(kept[0], RowEncoder):
                changes = kept[1]
                if isinstance(changes, Future):
                    self.dropped.append(changes)
                else:
                    self.data_events += len(changes)
                    counted += len(changes)
            elif kept[1]:
                self.data_events += 1
        self.events.clear()
        return counted + self.count_done()

    def count_done(self) -> int:
        """Count the rows of an oversized transaction's finished worker futures and let
        them go: only those submitted before it passed the limit (a bounded number) are
        kept, until they finish. The rows counted."""
        pending: list[Future[list[Any]]] = []
        counted = 0
        for future in self.dropped:
            if future.done():
                counted += len(future.result())
            else:
                pending.append(future)
        self.data_events += counted
        self.dropped = pending
        return counted


class PendingWindow:
    """A committed transaction whose rows decode workers are still transcoding.

    :meth:`ready` does not block; :meth:`resolve` waits for the workers and
    encodes the window (call it in commit order, from the assembler's thread).
    """

    def __init__(self, assembler: BinlogAssembler, txn: OpenTxn, scn: int, position: str) -> None:
        self._assembler = assembler
        self._txn = txn
        self.scn = scn
        self.source_position = position

    def ready(self) -> bool:
        futures = [p[1] for p in self._txn.events if isinstance(p[1], Future)]
        return all(f.done() for f in (*futures, *self._txn.dropped))

    def resolve(self) -> Window:
        return self._assembler._close(self._txn, self.scn, self.source_position)


def encode_window(txn: OpenTxn, scn: int, position: str, partition: int) -> tuple[Window, int]:
    """The window of a committed transaction ``txn`` (worker futures are waited for),
    and the number of row changes in it. Its events are framed here, so the relay may
    trust ``Window.event_sizes``."""
    ts = txn.ts_ns
    parts: list[bytes] = []
    sizes: list[int] = []  # framed here: the relay may trust them (Window.event_sizes)
    seq = data = rows = 0
    for part in txn.events:
        if isinstance(part[0], RowEncoder):
            changes = part[1]
            if isinstance(changes, Future):
                changes = changes.result()
            assert isinstance(changes, list)
            parts.append(part[0].encode_many_encoded(changes, scn, ts, first_seq=seq, sizes=sizes))
            seq += len(changes)
            data += len(changes)
            rows += len(changes)
        else:
            encode, is_data = part
            event = encode(scn, seq)
            parts.append(event)
            sizes.append(len(event))
            seq += 1
            data += is_data
    end = encode_control(EndOfWindow(data, position), scn, seq, ts, partition=partition)
    parts.append(end)
    sizes.append(len(end))
    return Window(scn, ts, b"".join(parts), seq + 1, position, tuple(sizes)), rows


def control_window(
    payload: ControlPayload, scn: int, position: str, partition: int, timestamp_ns: int = 0
) -> Window:
    """A window of one control event at ``scn`` (a heartbeat, a data loss)."""
    ts = timestamp_ns or time.time_ns()
    event = encode_control(payload, scn, 0, ts, partition=partition)
    end = encode_control(EndOfWindow(0, position), scn, 1, ts, partition=partition)
    return Window(scn, ts, event + end, 2, position, (len(event), len(end)))
