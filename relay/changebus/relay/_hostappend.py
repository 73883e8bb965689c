"""The partition host's group commit: a batch of a fetcher's windows into the buffer.

One job: :class:`GroupAppend`, mixed into :class:`~._host.PartitionHost`,
appends a batch of windows as one group commit (the writer splits it into
parts of at most half the ring). Before any work and again just before each
part is published, the leader's fence is asked (:class:`~._acks.IngestFence`);
new table schemas announced in the windows are registered before readers see
them; a window over the buffer's limit, or one the ring or the event table
cannot hold, becomes a DATA_LOSS window at its SCN, never a silent gap.

Thread-safety: the writer thread (or the event loop when it runs a small
group inline, the writer thread idle); never both at once.
"""

from __future__ import annotations

import functools
import json
import logging
from collections import Counter
from typing import Any

import numpy.typing as npt

from changebus.fetchers import Window
from changebus.schemas import EventTooLargeError, SchemaRegistry, TableSchema

from ._acks import IngestFence
from ._buffer import EventBuffer
from ._config import PartitionConfig
from ._lossmarker import loss_marker, schema_changes
from ._syncer import GroupSyncer

__all__ = ["GroupAppend"]

log = logging.getLogger("changebus.relay.ingest")


class _LeaseLapsed(Exception):
    """The fence refused a group's part just before it was published (writer thread)."""


class GroupAppend:
    """The group commit of :class:`~._host.PartitionHost` (module docstring); the
    attributes below are the host's."""

    name: str
    config: PartitionConfig
    buffer: EventBuffer
    registry: SchemaRegistry
    fence: IngestFence | None
    syncer: GroupSyncer | None
    stats: dict[str, int]
    losses: Counter[str]

    def _publish_fenced(
        self, fence: IngestFence, data: bytes | memoryview, ev: npt.NDArray[Any]
    ) -> None:
        """Writer thread, the last step before a part of a group is published: the lease
        once more (raises :class:`_LeaseLapsed`), then :meth:`_register_schemas`."""
        if not fence.admit():
            raise _LeaseLapsed
        self._register_schemas(data, ev)

    def _register_schemas(self, data: bytes | memoryview, ev: npt.NDArray[Any]) -> None:
        """Writer thread, before readers see the windows: record new table schemas.

        ``ev``: the group's validated event table (``PARSED_DTYPE``).
        """
        for change in schema_changes(data, ev["off"], ev["op"], ev["length"]):
            table = TableSchema.from_json(json.loads(change.schema))
            self.registry.register_as(table, change.source_id)

    def _loss_marker(self, window: Window, reason: str) -> bytes:
        """A window that says SCN ``window.scn`` was lost (never a silent gap)."""
        return loss_marker(window, reason, self.config.id)

    def _append(self, batch: list[Window]) -> bool:
        """Writer thread: append a group of windows (one group commit).

        False (not appended) when the fence refuses the group: before any work,
        and again just before each part is published. A leader paused between
        the two (its lease lapsed, a new leader elected meanwhile) published the
        group when it woke, and followers whose routing table still named it
        took it (found by review). A part refused there is not published (its
        bytes lie past the tail); parts published before it stay.
        """
        fence = self.fence
        if fence is not None and not fence.admit():
            return False
        try:
            return self._append_admitted(batch, fence)
        except _LeaseLapsed:
            return False

    def _append_admitted(self, batch: list[Window], fence: IngestFence | None) -> bool:
        hook = self._register_schemas
        if fence is not None:
            hook = functools.partial(self._publish_fenced, fence)
        limit = self.buffer.config.window_limit
        datas: list[bytes] = []
        sizes: list[tuple[int, ...]] = []
        for window in batch:
            if window.schemas:  # a mirrored registry: known before the window is published
                self.registry.import_entries(window.schemas)
            if len(window.data) > limit:
                self.stats["windows_data_loss"] += 1
                self.losses["window_too_large"] += 1
                reason = (
                    f"window of {len(window.data)} bytes exceeds the buffer limit of {limit} bytes"
                )
                log.error(
                    "partition %s: %s; recorded as data loss at SCN %d",
                    self.name,
                    reason,
                    window.scn,
                )
                datas.append(self._loss_marker(window, reason))
                sizes.append(())
            else:
                datas.append(window.data)
                sizes.append(window.event_sizes)
        try:
            self.buffer.append_windows(datas, before_publish=hook, sizes=sizes)
        except EventTooLargeError:
            # one window has more events than the event table, or too many bytes for the
            # ring with its largest event: find it, one by one. Groups of the batch before
            # the failing one are in already: appended again, the first of them failed the
            # SCN order, and the partition for good (found by review)
            done = self.buffer.meta.last_scn
            for window, data, size in zip(batch, datas, sizes, strict=True):
                if window.scn <= done:
                    continue
                try:
                    self.buffer.append_windows([data], before_publish=hook, sizes=[size])
                except EventTooLargeError as exc:
                    self.stats["windows_data_loss"] += 1
                    # (the ring's check names the window's size; the event table's does not)
                    sized = "size" in exc.details
                    self.losses["window_too_large" if sized else "window_too_many_events"] += 1
                    log.error(
                        "partition %s: %s; recorded as data loss at SCN %d",
                        self.name,
                        exc.message,
                        window.scn,
                    )
                    marker = self._loss_marker(window, exc.message)
                    self.buffer.append_windows([marker], before_publish=hook)
        if self.syncer is not None:
            self.syncer.request()
        return True
