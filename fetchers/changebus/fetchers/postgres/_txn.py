"""The events of one transaction while the assembler builds its window.

:class:`OpenTxn` holds what :class:`~._assembler.Assembler` has encoded
between a Begin and its Commit: the framed events in order (their ``seq`` is
their index), how many are data events, their size, and the tables whose
SCHEMA_CHANGE it carries. With a ``limit`` (``max_window_bytes``), a
transaction whose events pass it stops being kept (:meth:`OpenTxn.add`):
its events are dropped, only data events are counted from then on (memory
stays bounded by the limit), and the tables it announced are marked
unannounced again, so the next window that uses them repeats their
SCHEMA_CHANGE. :meth:`OpenTxn.close` ends the events with the
END_OF_WINDOW and frames them as a :class:`~changebus.fetchers.Window`.

Not thread-safe: owned by one assembler.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from changebus.schemas import EndOfWindow, SchemaChange, encode_control

from .._base import Window

if TYPE_CHECKING:
    from ._tables import Table

__all__ = ["OpenTxn"]


@dataclass
class OpenTxn:
    """One transaction's window under construction (module docstring).

    ``scn`` and ``ts_ns`` are the window's (the commit LSN and time);
    ``events`` the framed events so far (empty once ``oversized``);
    ``data_events`` counts the row and truncate events (kept or not);
    ``size`` the bytes added; ``announced`` the tables whose SCHEMA_CHANGE
    ``events`` holds.
    """

    scn: int
    ts_ns: int
    events: list[bytes] = field(default_factory=list)
    data_events: int = 0
    size: int = 0
    oversized: bool = False
    announced: list[Table] = field(default_factory=list)

    def announce(self, table: Table, partition: int) -> None:
        """Add the table's SCHEMA_CHANGE unless this assembler's windows carried it."""
        if table.announced:
            return
        schema = table.schema
        change = SchemaChange(
            table.source_id,
            schema.name,
            schema.version,
            schema.fingerprint,
            json.dumps(schema.to_json(), separators=(",", ":")),
        )
        self.events.append(
            encode_control(change, self.scn, len(self.events), self.ts_ns, partition=partition)
        )
        table.announced = True
        self.announced.append(table)

    def add(self, event: bytes, limit: int) -> None:
        """Add one framed event; past ``limit`` bytes (0: none) stop keeping them."""
        self.events.append(event)
        self.size += len(event)
        if limit and self.size > limit:
            # stop keeping the transaction; its schema announcements are
            # repeated in the next window that uses those tables
            self.oversized = True
            self.events.clear()
            for table in self.announced:
                table.announced = False
            self.announced.clear()

    def close(self, position: str, partition: int) -> Window:
        """The window: the events and an END_OF_WINDOW holding ``position``."""
        self.events.append(
            encode_control(
                EndOfWindow(self.data_events, position),
                self.scn,
                len(self.events),
                self.ts_ns,
                partition=partition,
            )
        )
        events = self.events
        # framed here by RowEncoder / encode_control: the relay may trust the sizes
        return Window(
            self.scn, self.ts_ns, b"".join(events), len(events), position, tuple(map(len, events))
        )
