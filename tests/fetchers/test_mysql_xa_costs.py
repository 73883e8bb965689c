"""XA bookkeeping costs the same however many prepared transactions are pending.

Found by review: every transaction (its GTID event) visited every pending
prepared transaction for worker futures to let go, and every ``XA PREPARE``
summed the bytes of all of them. Counted (reads of the pending transactions'
state), not timed.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from changebus.fetchers.mysql import BinlogAssembler, DeclaredTypes
from changebus.fetchers.mysql._txn import OpenTxn
from changebus.fetchers.mysql._xa import Prepared, PreparedSet
from changebus.schemas import SchemaRegistry


class _Watched(OpenTxn):
    """An open transaction counting the reads of what the bookkeeping looks at."""

    reads = 0

    def __getattribute__(self, name: str) -> Any:
        if name in ("dropped", "size", "oversized", "count_done"):
            _Watched.reads += 1
        return super().__getattribute__(name)


def _pending(assembler: BinlogAssembler, n: int) -> None:
    for i in range(n):
        txn = _Watched(f"0-1-{i}", 0, False)
        txn.size = 100
        assembler.prepared.add((1, b"x%d" % i, b""), Prepared(txn, txn.gtid, "b.000001", 4 + i))


def test_transactions_and_prepares_do_not_visit_every_pending_prepare() -> None:
    assembler = BinlogAssembler(1, SchemaRegistry(), DeclaredTypes(), max_window_bytes=10**9)
    assembler.rotate("b.000001")
    _pending(assembler, 2000)
    _Watched.reads = 0
    for i in range(10):  # ordinary transactions: GTID event, commit position
        assembler.begin(f"0-1-{3000 + i}", 1, 0, 100)
        assembler.position_at(f"0-1-{3000 + i}", 200)
    assembler._txn = OpenTxn("0-1-4000", 0, False)
    assembler.xa_prepare((1, b"new", b""), False, 300)  # checks the bytes held together
    assert _Watched.reads == 0
    assert assembler.prepared.held_bytes() == 2000 * 100
    assert assembler.prepared.restart() == "0-1-0@b.000001:4"


def test_an_oversized_prepare_is_visited_until_its_workers_are_done() -> None:
    prepared = PreparedSet()
    future: Future[list[Any]] = Future()
    big = OpenTxn("0-1-1", 0, False, oversized=True, dropped=[future])
    prepared.add((1, b"big", b""), Prepared(big, big.gtid, "b.000001", 4))
    small = OpenTxn("0-1-2", 0, False, size=300)
    prepared.add((1, b"small", b""), Prepared(small, small.gtid, "b.000001", 90))
    assert prepared.held_bytes() == 300 and prepared.count_done() == 0
    future.set_result([object()] * 3)
    assert prepared.count_done() == 3 and big.dropped == [] and big.data_events == 3
    assert not prepared._draining  # not visited any more
    assert prepared.pop((1, b"big", b"")) is not None
    assert prepared.restart() == "0-1-2@b.000001:90" and prepared.held_bytes() == 300
    prepared.clear()
    assert prepared.held_bytes() == 0 and prepared.restart() == ""
