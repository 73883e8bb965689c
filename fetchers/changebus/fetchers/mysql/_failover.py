"""Finding a transaction by its GTID in a MariaDB server's binlog (failover).

A MariaDB replica with ``log_slave_updates`` writes the transactions it
applies to its own binlog under their original GTIDs, at positions of its
own. After a failover to such a replica, the relay's last window is known by
its GTID only: :func:`locate_gtid` finds where that transaction ends in this
server's binlog, so the fetcher can go on from exactly there.

How: every MariaDB binlog file starts with a ``Gtid_list`` event, the GTID
state before the file. The newest file whose state for the GTID's domain is
below the GTID's sequence number is the only one that can hold it (sequence
numbers grow within a domain). In that file, the fetcher first gallops
towards the transaction: ``SHOW BINLOG EVENTS ... FROM p LIMIT k, n`` makes
the server skip ``k`` events (in C, millions per second) and returns the few
after them; the next ``Gtid`` event there tells whether the transaction is
still ahead (jump there, double ``k``) or not (halve ``k``). From the last
``Gtid`` event known to be before it, a scan in pages of ``_PAGE`` events
finds the transaction's ``Gtid`` event; the transaction ends at its ``Xid``
event or ``COMMIT`` query, or, for a standalone event group (DDL), right
after its one statement. If sequence numbers were out of order and the
gallop went past it, the whole file is scanned. The result is checked with
``BINLOG_GTID_POS``, whose state at that point must list the GTID.

Cost: once per failover, a few round trips plus the server's skip through
one binlog file; measured with ``bench/mysql_failover_scan.py``
(docs/benchmarks.md). Blocking (PyMySQL cursor of the caller); MySQL is not
supported (no ``Gtid_list`` / ``BINLOG_GTID_POS``).
"""

from __future__ import annotations

import re
from typing import Any, Final

__all__ = ["gtid_parts", "locate_gtid"]

_GTID: Final = re.compile(r"(\d+)-(\d+)-(\d+)")
#: the Info of a MariaDB Gtid event: ``BEGIN GTID 0-1-5`` (or ``GTID 0-1-2`` for DDL)
_GTID_INFO: Final = re.compile(r"(BEGIN )?GTID (\d+-\d+-\d+)\b")
_PAGE: Final = 5000
#: events looked at after each gallop step, for the next Gtid event
_PROBE: Final = 64


def gtid_parts(gtid: str) -> tuple[int, int, int] | None:
    """``(domain, server_id, seq)`` of a MariaDB GTID ``D-S-N``; None for anything else."""
    m = _GTID.fullmatch(gtid.strip())
    return None if m is None else (int(m.group(1)), int(m.group(2)), int(m.group(3)))


def _start_seq(cur: Any, file: str, domain: int) -> int:
    """The highest sequence number of ``domain`` before ``file`` (-1: none)."""
    cur.execute(f"SHOW BINLOG EVENTS IN {_quote(file)} LIMIT 3")
    for row in cur.fetchall():
        if str(row[2]) == "Gtid_list":
            seqs = [
                int(n)
                for d, _s, n in (m.groups() for m in _GTID.finditer(str(row[5])))
                if int(d) == domain
            ]
            return max(seqs, default=-1)
    return -1


def _quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "''") + "'"


def locate_gtid(cur: Any, logs: list[str], gtid: str) -> tuple[str, int] | None:
    """``(file, end position)`` of the transaction ``gtid`` in this server's binlog.

    ``logs`` are the server's binlog files, oldest first (``SHOW BINARY
    LOGS``). None when the server's binlog does not hold it (never had it, or
    purged it).
    """
    parts = gtid_parts(gtid)
    if parts is None:
        return None
    domain, _server, seq = parts
    file = next((f for f in reversed(logs) if _start_seq(cur, f, domain) < seq), None)
    if file is None:
        return None
    start = _gallop(cur, file, domain, seq)
    found = _scan(cur, file, gtid, start)
    if found is None and start > 4:
        found = _scan(cur, file, gtid, 4)  # out-of-order sequence numbers: all of it
    if found is None:
        return None
    cur.execute("SELECT BINLOG_GTID_POS(%s, %s)", (file, found))
    row = cur.fetchone()
    state = "" if row is None or row[0] is None else str(row[0])
    if gtid not in {g.strip() for g in state.split(",")}:
        return None
    return file, found


def _gallop(cur: Any, file: str, domain: int, seq: int) -> int:
    """The start of a Gtid event of ``domain`` before ``seq`` in ``file`` (4: none known)."""
    pos, step = 4, 8 * _PAGE
    while step >= _PAGE:  # below a page, the scan is as cheap
        cur.execute(f"SHOW BINLOG EVENTS IN {_quote(file)} FROM {int(pos)} LIMIT {step}, {_PROBE}")
        ahead = None
        for _log, start, kind, _sid, _end, info in cur.fetchall():
            m = _GTID_INFO.match(str(info)) if str(kind) == "Gtid" else None
            parts = gtid_parts(m.group(2)) if m else None
            if parts is not None and parts[0] == domain:
                ahead = (int(start), parts[2])
                break
        if ahead is not None and ahead[1] <= seq:
            pos = ahead[0]  # still before the transaction (or at it)
            if ahead[1] == seq:
                return pos
            step *= 2
        else:
            step //= 2  # past it, past the end, or no Gtid event nearby
    return pos


def _scan(cur: Any, file: str, gtid: str, pos: int) -> int | None:
    """End position of ``gtid``'s transaction in ``file``, scanning from ``pos`` (None: not there)."""
    inside = False  # after the transaction's Gtid event
    standalone = False
    while True:
        cur.execute(f"SHOW BINLOG EVENTS IN {_quote(file)} FROM {int(pos)} LIMIT {_PAGE}")
        rows = cur.fetchall()
        for _log, start, kind, _sid, end, info in rows:
            kind, text = str(kind), str(info)
            if not inside:
                if kind == "Gtid":
                    m = _GTID_INFO.match(text)
                    if m and m.group(2) == gtid:
                        inside, standalone = True, m.group(1) is None
                continue
            if standalone and kind == "Query":
                return int(end)
            if kind == "Xid" or (kind == "Query" and text.strip().upper().startswith("COMMIT")):
                return int(end)
            if kind == "Gtid":  # the next transaction: no commit seen (not expected)
                return int(start)
        if len(rows) < _PAGE:
            return None
        pos = int(rows[-1][4])
