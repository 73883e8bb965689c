"""What a consumer receives: :class:`Window` (one source transaction) of :class:`ChangeEvent`.

A window is the unit of delivery, of atomicity and of checkpointing: it holds
the decoded data events of one source transaction that passed the consumer's
subscription (sources, partition filter), in ``seq`` order, plus the control
signals the transaction carried. With a filter, ``seq`` numbers have gaps (the
relay leaves out other consumers' events but keeps their numbering), so
``(scn, seq)`` identifies an event the same way for every consumer and across
replays: use :attr:`ChangeEvent.dedupe_key` to drop duplicates of
at-least-once delivery.

Everything here is immutable (frozen dataclasses, tuples) and safe to share
between threads. Row dicts (``key``/``before``/``after``) are plain dicts
made for each event: an application may keep them, and must not expect
mutations to be seen by anyone else.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from changebus.schemas import (
    ChangeDecoder,
    CheckpointError,
    DataLoss,
    LogicalMessage,
    Mode,
    Op,
    PartitionCheckpoint,
    SchemaChange,
    TableSchema,
)

__all__ = ["ChangeEvent", "ChangeOp", "RawEvents", "Window"]


class ChangeOp(enum.Enum):
    """The kind of a row change (the data ops of the envelope, by name)."""

    INSERT = "insert"
    UPDATE = "update"
    DELETE = "delete"
    TRUNCATE = "truncate"

    @classmethod
    def from_op(cls, op: Op | int) -> ChangeOp:
        """The change op of an envelope data op (``ValueError`` for control ops)."""
        return _FROM_OP[int(op)]


_FROM_OP: dict[int, ChangeOp] = {
    int(Op.INSERT): ChangeOp.INSERT,
    int(Op.UPDATE): ChangeOp.UPDATE,
    int(Op.DELETE): ChangeOp.DELETE,
    int(Op.TRUNCATE): ChangeOp.TRUNCATE,
}


@dataclass(frozen=True, slots=True)
class ChangeEvent:
    """One row change, decoded.

    * ``table`` -- the logical source name (``schema.table`` / ``db.table``);
    * ``key`` -- the key columns (``{}`` for TRUNCATE);
    * ``after`` / ``before`` -- the row images, ``None`` when the source gave
      none (an insert has no before-image, a delete no after-image; an update
      has a before-image only when the source sends one);
    * ``not_sent`` -- columns with no value in ``after`` (their value there is
      ``None`` and means nothing: Postgres' unchanged TOAST values), and
      ``before_not_sent`` likewise for ``before``;
    * ``schema_version`` -- the writer's schema version; ``schema`` the table
      schema the rows are shaped by (the reader schema when the consumer
      resolves to one, else the writer's), shared between events.
    """

    scn: int
    seq: int
    op: ChangeOp
    table: str
    key: dict[str, Any]
    after: dict[str, Any] | None
    before: dict[str, Any] | None
    not_sent: tuple[str, ...] = ()
    before_not_sent: tuple[str, ...] = ()
    timestamp_ns: int = 0
    source_id: int = 0
    schema_version: int = 0
    schema: TableSchema | None = field(default=None, repr=False, compare=False)

    @property
    def dedupe_key(self) -> tuple[int, int]:
        """``(scn, seq)``: the same for this event in every delivery and every consumer."""
        return (self.scn, self.seq)


_EventTwin: Any = make_dataclass(
    "_EventTwin",
    [
        (f.name, f.type, field(default=f.default, repr=f.repr, compare=f.compare))
        for f in fields(ChangeEvent)
    ],
    slots=True,
)
_EventTwin.__doc__ = """:class:`ChangeEvent`'s mutable twin: the same fields, so the same slot layout.

A frozen dataclass sets each field through ``object.__setattr__`` in its
``__init__`` (~1.5 us for these 13 fields, more than a row's worth of
varints); the decoder builds a twin with plain slot stores (~0.2 us) and
retypes it (see :func:`_new_event`). The retyped object *is* a
``ChangeEvent`` (frozen, equal to one built normally) and is never changed
afterwards. ``tests/client/test_client_model.py`` checks the classes stay alike.
"""


def _new_event(
    scn: int,
    seq: int,
    op: ChangeOp,
    table: str,
    key: dict[str, Any],
    after: dict[str, Any] | None,
    before: dict[str, Any] | None,
    not_sent: tuple[str, ...],
    before_not_sent: tuple[str, ...],
    timestamp_ns: int,
    source_id: int,
    schema_version: int,
    schema: TableSchema | None,
) -> ChangeEvent:
    """A :class:`ChangeEvent`, built the fast way (see :class:`_EventTwin`)."""
    event: Any = _EventTwin(
        scn,
        seq,
        op,
        table,
        key,
        after,
        before,
        not_sent,
        before_not_sent,
        timestamp_ns,
        source_id,
        schema_version,
        schema,
    )
    event.__class__ = ChangeEvent
    return event  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class RawEvents:
    """The data events of a window left undecoded, for a columnar decoder.

    A consumer configured with ``columnar=True`` delivers windows whose data
    events are not :class:`ChangeEvent` objects but these bytes:
    ``offsets`` (into ``body``) and ``headers``
    (:data:`~changebus.schemas.HEADER_DTYPE` records) of the data events
    only, in ``seq`` order, and ``decoders`` the decoder of each writer
    schema they name, by ``(source_id, schema_version)`` (resolving to the
    consumer's reader schemas like its row decoding does).
    :class:`changebus.client.spark.ArrowDecoder` turns them into Arrow
    record batches. Immutable; the arrays must not be written to.
    """

    body: bytes
    offsets: npt.NDArray[np.int64]
    headers: npt.NDArray[Any]
    decoders: Mapping[tuple[int, int], ChangeDecoder]

    def __len__(self) -> int:
        return len(self.offsets)


@dataclass(frozen=True, slots=True)
class Window:
    """One source transaction as delivered (see the module docstring).

    ``events`` are in ``seq`` order. ``schema_changes`` and ``messages`` are
    the SCHEMA_CHANGE and MESSAGE control events of the window. ``data_loss``
    is set only when the stream said that SCNs were lost *and* the consumer
    was configured to deliver that as a signal instead of raising
    :class:`~changebus.client.DataLossDetectedError`. ``source_position`` is
    the source's own position at commit (Postgres LSN, MySQL GTID/file/pos).
    ``nbytes`` is the wire size of the window's events (flow control).

    Bootstrapping: ``phase`` is ``"online"`` for windows from a relay,
    ``"snapshot"`` for a page of a bootstrap server's snapshot (rows at their
    latest version, each event with the SCN that last changed the row; the
    window's ``scn`` is the snapshot's SCN) and ``"catchup"`` for a log window
    replayed by a bootstrap server. Such windows carry the ``checkpoint``
    entry that holds after them (bootstrap progress); see
    :meth:`position_after`.

    Columnar consumers (``ConsumerConfig.columnar``): ``events`` is empty and
    ``raw_events`` holds the data events undecoded (:class:`RawEvents`);
    windows of a bootstrap server (snapshot pages, catch-up) still come as
    ``events``.

    Consumer groups: ``unit`` names the work unit (``<partition>.<bucket>``)
    whose events the window holds; a group member delivers each unit's
    windows in SCN order and makes no order promise across units. Empty
    outside groups.
    """

    scn: int
    timestamp_ns: int
    partition: str
    events: tuple[ChangeEvent, ...] = ()
    source_position: str = ""
    schema_changes: tuple[SchemaChange, ...] = ()
    messages: tuple[LogicalMessage, ...] = ()
    data_loss: DataLoss | None = None
    nbytes: int = field(default=0, compare=False)
    phase: str = "online"
    checkpoint: PartitionCheckpoint | None = field(default=None, compare=False)
    unit: str = ""
    raw_events: RawEvents | None = field(default=None, compare=False, repr=False)

    @property
    def bootstrapping(self) -> bool:
        """Whether this window comes from a bootstrap server (snapshot or catch-up)."""
        return self.phase != "online"

    def position_after(self, before: PartitionCheckpoint) -> PartitionCheckpoint:
        """The partition's checkpoint once this window is processed (``before`` it).

        A relay window after a bootstrap is online whatever ``before`` says:
        ``before`` may still be a snapshot or catch-up position when the
        application commits only now and then (the catch-up's last window,
        which carries the online checkpoint, was passed over uncommitted).
        """
        if self.checkpoint is not None:
            return self.checkpoint
        if self.phase == "online" and before.mode is not Mode.ONLINE:
            if self.scn < before.window_scn:
                raise CheckpointError(
                    f"window SCN {self.scn} goes back before checkpoint {before.window_scn}"
                )
            return PartitionCheckpoint(
                window_scn=self.scn, prev_scn=self.scn, timestamp_ns=self.timestamp_ns
            )
        return before.on_end_of_window(self.scn, self.timestamp_ns)

    @property
    def is_empty(self) -> bool:
        """No data events and no control signal (an empty or fully filtered transaction)."""
        return not (
            self.events or self.raw_events or self.schema_changes or self.messages or self.data_loss
        )

    def tables(self) -> list[str]:
        """The tables with events in this window, in order of first appearance."""
        return list(dict.fromkeys(e.table for e in self.events))
