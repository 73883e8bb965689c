"""XA transactions in the binlog: prepared halves kept until their XA COMMIT.

How the server logs ``XA START x; ...; XA END x; XA PREPARE x; ... XA COMMIT x``
(MariaDB 10.5+, MySQL 5.7+), checked against MariaDB by the tests:

* at ``XA PREPARE``: an event group of its own (a GTID event, MySQL also an
  ``XA START`` query, the rows, an ``XA END`` query) that ends with an
  XA_PREPARE event (``one_phase`` false), not with an XID event;
* at ``XA COMMIT`` / ``XA ROLLBACK``, possibly much later and after other
  transactions: one more event group, a GTID event and the query
  ``XA COMMIT X'67747269',X'6271',1`` (gtrid, bqual, format id);
* ``XA COMMIT x ONE PHASE``: MariaDB logs a plain transaction (XID event);
  MySQL ends the group with an XA_PREPARE event whose ``one_phase`` is true.

The assembler keeps each prepared half in a :class:`PreparedSet`, keyed by
its :data:`XaKey`, and delivers its rows as one window at the ``XA COMMIT``
(the SCN and position of the commit's event group: commit order) or drops
them at the ``XA ROLLBACK``.

Restarts: rows of a prepared transaction are only in its prepared group, so
a restart must read it again. While any prepared transaction is pending,
every window's ``source_position`` carries ``xa=GTID@FILE:POS``, the start of
the oldest pending prepared group (:func:`._position.format_restart`); the
fetcher (re)starts reading there instead of at the window's end
(:func:`._position.resume_point`). The transactions in between are read again and their
windows dropped (their SCNs are at or below the relay's last one); their
prepared halves are kept again. Another server after a failover holds that
group at other positions: that case is refused (``docs/mysql.md``).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

from ._position import format_restart

__all__ = ["Prepared", "PreparedSet", "XaKey", "parse_xa_end", "xid_text"]

#: an XA transaction's id: ``(format id, gtrid, bqual)``
XaKey = tuple[int, bytes, bytes]

#: ``XA COMMIT|ROLLBACK X'hex'[,X'hex'[,format]]`` as the server logs it (also quoted text)
_XA_END: Final = re.compile(
    r"\s*XA\s+(COMMIT|ROLLBACK)\s+"
    r"(?:X'(?P<g>[0-9A-F]*)'|'(?P<gs>(?:[^']|'')*)')"
    r"(?:\s*,\s*(?:X'(?P<b>[0-9A-F]*)'|'(?P<bs>(?:[^']|'')*)')"
    r"(?:\s*,\s*(?P<f>\d+))?)?\s*;?\s*$",
    re.I,
)


def parse_xa_end(text: str) -> tuple[str, XaKey] | None:
    """``("COMMIT" | "ROLLBACK", key)`` of an ``XA COMMIT`` / ``XA ROLLBACK`` query; None
    for any other text (``ONE PHASE`` is not logged as such a query)."""
    m = _XA_END.match(text)
    if m is None:
        return None

    def part(hex_name: str, text_name: str) -> bytes:
        if m.group(hex_name) is not None:
            return bytes.fromhex(m.group(hex_name))
        quoted = m.group(text_name)
        return b"" if quoted is None else quoted.replace("''", "'").encode()

    fmt = int(m.group("f")) if m.group("f") is not None else 1
    return m.group(1).upper(), (fmt, part("g", "gs"), part("b", "bs"))


def xid_text(key: XaKey) -> str:
    """An XA id for messages, as it would be written in SQL (``'x1'`` or hex)."""
    fmt, gtrid, bqual = key

    def lit(raw: bytes) -> str:
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError:
            return f"X'{raw.hex()}'"
        if text.isprintable() and "'" not in text:
            return f"'{text}'"
        return f"X'{raw.hex()}'"

    out = lit(gtrid)
    if bqual or fmt != 1:
        out += f",{lit(bqual)}"
    if fmt != 1:
        out += f",{fmt}"
    return out


@dataclass(slots=True)
class Prepared:
    """A prepared XA transaction's half: the assembler's open transaction (its rows,
    no schema announcement: those are made again at the commit), the GTID of its
    prepared group and where that group starts (file, position). ``held``: its
    event bytes as :meth:`PreparedSet.add` counted them."""

    txn: Any
    gtid: str
    file: str
    pos: int
    held: int = 0


class PreparedSet:
    """The prepared XA transactions not committed or rolled back yet, in prepare order.

    Invariants: :meth:`restart` names the oldest of them (insertion order; a
    key prepared again, after a re-read, moves to the end only if it was
    removed first -- a re-read starts with :meth:`clear`); :attr:`_held` is the
    sum of their ``held``; :attr:`_draining` holds those whose transaction
    still keeps decode worker futures (oversized ones), the only ones
    :meth:`count_done` visits. So what every transaction and every position
    asks of it costs the same however many are pending: an ``OrderedDict``
    (its first entry is found at once, however many were removed before it),
    a running sum, and a set of the few with futures.

    A transaction added here no longer changes its size or its futures but by
    :meth:`count_done`. Not thread-safe: the assembler's thread only.
    """

    def __init__(self) -> None:
        self._by_key: OrderedDict[XaKey, Prepared] = OrderedDict()
        self._held = 0
        self._draining: dict[XaKey, Prepared] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def add(self, key: XaKey, prepared: Prepared) -> None:
        self.pop(key)
        txn = prepared.txn
        prepared.held = 0 if txn.oversized else txn.size
        self._by_key[key] = prepared
        self._held += prepared.held
        if txn.dropped:
            self._draining[key] = prepared

    def pop(self, key: XaKey) -> Prepared | None:
        prepared = self._by_key.pop(key, None)
        if prepared is not None:
            self._held -= prepared.held
            self._draining.pop(key, None)
        return prepared

    def clear(self) -> None:
        self._by_key.clear()
        self._draining.clear()
        self._held = 0

    def __iter__(self) -> Iterator[Prepared]:
        return iter(self._by_key.values())

    def held_bytes(self) -> int:
        """Event bytes the prepared transactions hold (oversized ones hold none)."""
        return self._held

    def count_done(self) -> int:
        """Count the rows of the finished worker futures the (oversized) prepared
        transactions keep, and let them go (:meth:`OpenTxn.count_done`). The rows counted."""
        counted = 0
        for key, prepared in list(self._draining.items()):
            counted += prepared.txn.count_done()
            if not prepared.txn.dropped:
                del self._draining[key]
        return counted

    def restart(self) -> str:
        """The ``xa`` field of positions now ('' when nothing is pending)."""
        for p in self._by_key.values():
            return format_restart(p.gtid, p.file, p.pos)
        return ""
