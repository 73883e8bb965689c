"""From pgoutput messages to encoded windows (one per transaction).

:class:`Assembler` consumes parsed pgoutput messages in stream order and
returns a :class:`~changebus.fetchers.Window` at every Commit:

* the SCN is the commit LSN (Begin's ``final_lsn``), the timestamp the commit
  time, the END_OF_WINDOW's ``source_position`` the commit's end LSN (``X/Y``:
  where the slot may be advanced once the relay holds the window);
* a Relation message turns into a :class:`~changebus.schemas.TableSchema`
  (types resolved through the catalog); a new or changed table gets a new
  schema version and a SCHEMA_CHANGE event before its first row (see
  "Announcements" below);
* Insert / Update / Delete become data events with after- and before-images:
  ``REPLICA IDENTITY DEFAULT`` gives a key-only before-image (the other
  columns are listed as not sent), ``FULL`` the whole old row; unchanged
  TOASTed values are listed in ``after_not_sent``, never silently null;
* an update that changes its row's key is followed by a DELETE of the old key
  (its before-image), so that whoever reads by key routes both halves: the
  relay's and a consumer group's key filters send each event by its own key's
  hash, and the old key's reader must see its row go in its own order
  (``docs/protocol.md``, "Key changes"); with ``FULL`` identity the new row's
  unchanged TOASTed values are taken from the old row;
* Truncate becomes one TRUNCATE event per table; transactional logical
  messages become MESSAGE events inside their window; a non-transactional
  one becomes a window of its own at SCN ``L - 1`` (:func:`message_scn`)
  where ``L`` is the LSN pgoutput gives it, the end of its WAL record, which
  is also what ``pg_logical_emit_message`` returns; the fetcher's own idle
  heartbeat message (prefix :data:`HEARTBEAT_PREFIX`) becomes a window
  holding a HEARTBEAT event. Why ``L - 1``: the record that follows the
  message starts at ``L``, and when it is a commit, its transaction's SCN is
  ``L`` too; the message's window must sort strictly before it (the relay
  refuses a second window at one SCN). ``L - 1`` is still past the start of
  the message's record, so strictly after every transaction committed before
  it. The window's position is ``L``: a restart there re-reads that commit
  and skips the message.

Large transactions: with ``max_window_bytes`` set, a transaction whose
encoded events pass the limit stops being kept (:class:`~._txn.OpenTxn`: its
rows are only counted, memory stays bounded). At its Commit, ``on_oversized="fail"``
raises a non-retriable :class:`~changebus.schemas.SourceConfigError` naming
the transaction and the option to raise, and ``"skip"`` returns a window
holding one DATA_LOSS event for the transaction's SCN instead of its rows:
never a silent gap.

Two entries: :meth:`Assembler.feed` takes parsed messages and decodes every
value to Python (:func:`~._rowdecode.decode_row`), then fastavro the row (the general path);
:meth:`Assembler.feed_raw` takes the raw message bytes and sends Insert /
Update / Delete messages of known tables through the table's
:class:`~._transcode.Transcoder` (pgoutput binary straight to Avro, about 3x
less work per row), which hands anything unusual back to the general path.
Both write the same bytes.

Announcements. A table's schema is announced (one SCHEMA_CHANGE event) in
the first window of this assembler that touches the table, unless the schema
is one of the ``known`` schemas: those the relay already holds (the
registry of the :class:`~changebus.fetchers.ResumePoint` it resumed with),
matched by source id, name, version and fingerprint (the columns and key).
So a fetcher restarted on the same relay, or a new leader taking over the
source in a relay cluster, writes a window it re-reads from the slot exactly
as the previous reader did (the same events, the same ``seq`` numbers), while
new tables and changed schemas are announced as always. The check runs once
per Relation message, never per row.

A seed's assembler (``adopt_annotated``): a Relation whose schema differs from
the table's newest registered version only in annotations
(:func:`~changebus.schemas.same_but_annotations`: a relay that registered it
before it began to record ``changebus.kind`` / ``changebus.bound``, or has
not seen a change of the table since) is read under that version, the
relay's: its rows are the same bytes. The fetcher's own registers a new
version (harmless to readers), which records the annotations for good.

The event key is the table's primary key (from ``primary_key``, the catalog)
and falls back to the replica identity columns pgoutput flags; a table
without either has no key.

Not thread-safe: one assembler per fetcher thread.
"""

from __future__ import annotations

import functools
import logging
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from changebus.schemas import (
    Column,
    ControlPayload,
    DataLoss,
    Heartbeat,
    LogicalMessage as MessagePayload,
    Op,
    RowEncoder,
    SchemaRegistry,
    SourceConfigError,
    TableSchema,
    UnknownSchemaError,
    encode_control,
    lsn_to_scn,
    same_but_annotations,
    scn_to_lsn,
)

from .._base import Window
from .._policy import ColumnPolicy
from ._cellwalk import nullable_key
from ._copyenc import CopyEncoder
from ._pgoutput import (
    Begin,
    Cell,
    Commit,
    Delete,
    Insert,
    LogicalMessage,
    Message,
    Relation,
    Truncate,
    Update,
    parse_message,
)
from ._rowdecode import decode_row
from ._tables import (
    Table,
    Transcoders,
    adapter,
    choose_key,
    column_types,
    old_key,
    refuse_unsupported,
)
from ._transcode import Fallback, Transcoder
from ._txn import OpenTxn
from ._types import ColumnType

__all__ = ["HEARTBEAT_PREFIX", "Assembler", "message_scn"]

#: prefix of the non-transactional logical message the fetcher emits when idle
HEARTBEAT_PREFIX = "changebus.heartbeat"


def message_scn(lsn: str) -> int:
    """The SCN of the window a non-transactional logical message becomes.

    ``lsn`` is what ``pg_logical_emit_message(false, ...)`` returned (the end
    of the message's WAL record); the window's SCN is one less (see the module
    docstring). A consumer that emits such a message as a marker has read
    everything committed before it once its checkpoint reaches this SCN.
    """
    return lsn_to_scn(lsn) - 1


log = logging.getLogger("changebus.fetchers.postgres")


class Assembler:
    """Builds windows from pgoutput messages (see the module docstring)."""

    def __init__(
        self,
        partition_id: int,
        resolve: Callable[[int, int], ColumnType],
        registry: SchemaRegistry | None = None,
        *,
        primary_key: Callable[[int], tuple[str, ...] | None] | None = None,
        key_positions: Callable[[int], tuple[tuple[int, int], ...] | None] | None = None,
        array_dims: Callable[[int], dict[str, int]] | None = None,
        type_named: Callable[[str], ColumnType | None] | None = None,
        max_window_bytes: int = 0,
        on_oversized: str = "fail",
        known: Iterable[TableSchema] = (),
        policy: ColumnPolicy | None = None,
        adopt_annotated: bool = False,
    ) -> None:
        if on_oversized not in ("fail", "skip"):
            raise ValueError(f"on_oversized must be 'fail' or 'skip', not {on_oversized!r}")
        self.partition_id = partition_id
        self.max_window_bytes = max_window_bytes
        self.on_oversized = on_oversized
        #: data-loss windows made here, by cause (the fetcher shares its own counter)
        self.losses: Counter[str] = Counter()
        self._resolve = resolve
        self._primary_key = primary_key
        self._key_positions = key_positions
        self._array_dims = array_dims
        #: a type by its text, for types dropped since (``TypeResolver.named``)
        self._type_named = type_named
        self._policy = policy if policy else None
        #: a schema differing from the newest version only in annotations is that version
        #: (a seed's: module docstring)
        self._adopt_annotated = adopt_annotated
        self.registry = registry or SchemaRegistry()
        #: ``(source id, name, version, fingerprint)`` of the schemas the relay holds
        self._known = frozenset(
            (self.registry.source_id(t.name), t.name, t.version, t.fingerprint) for t in known
        )
        self._tables: dict[int, Table] = {}
        self.transcoders = Transcoders()
        self._txn: OpenTxn | None = None
        #: the relay's last SCN (-1: none): a transaction at or before it is read again
        #: (the SQL mode peeks from the slot's confirmed position); its Relation
        #: messages are versions the relay holds, found by content, not registered anew
        self.replay_until = -1
        #: row messages taken by :meth:`feed_raw` through the transcoder / the general path
        self.rows_transcoded = 0
        self.rows_general = 0

    # ---- relations ----------------------------------------------------

    def _relation(self, rel: Relation) -> None:
        name = f"{rel.namespace}.{rel.name}"
        types = column_types(
            rel, name, self.registry, self._resolve, self._array_dims, self._type_named
        )
        key, not_null = choose_key(rel, name, self.registry, self._primary_key, self._key_positions)
        columns = tuple(
            Column(
                c.name, t.avro, nullable=not not_null or c.name not in key, source_type=t.formatted
            )
            for c, t in zip(rel.columns, types, strict=True)
        )
        plan = self._policy.plan(name, columns, key) if self._policy is not None else None
        if plan is not None:
            columns = plan.columns
        excluded = plan.excluded if plan is not None else frozenset()
        refuse_unsupported(name, rel, types, excluded)
        wanted = TableSchema(name, columns, key, nullable_key=not not_null)
        found = None
        if self._txn is not None and self._txn.scn <= self.replay_until:
            found = self.registry.find(wanted)  # read again: a version the relay holds
        if found is None and self._adopt_annotated:
            found = self._annotated_latest(wanted)
        table = found if found is not None else self.registry.register(wanted)
        old = self._tables.get(rel.oid)
        key_flags = tuple(c.key for c in rel.columns)
        type_ids = tuple((c.type_oid, c.typmod) for c in rel.columns)
        if (
            old is not None
            and old.schema.version == table.version
            and old.schema.name == table.name
            and old.key_flags == key_flags
            and old.type_ids == type_ids  # (a type made again under its old name: review)
        ):
            return  # Postgres re-sends unchanged Relation messages after reconnects
        # (a new replica identity keeps the schema but changes which columns a key-only
        # before-image holds: the table is made again, or its DELETEs said NULL for
        # columns never sent)
        source_id = self.registry.source_id(table.name)
        names = tuple(c.name for c in rel.columns)
        adapters = tuple(adapter(t.avro) for t in types)
        key_places = [names.index(k) for k in key]
        rules = plan.rules if plan is not None else None
        self.transcoders.forget(rel.oid)
        self._tables[rel.oid] = Table(
            table,
            source_id,
            functools.partial(RowEncoder, table, source_id=source_id, partition=self.partition_id),
            types,
            adapters,
            names,
            key_flags,
            functools.partial(
                Transcoder,
                names,
                types,
                adapters,
                key_places,
                key_flags,
                rules,
                nullable_key(key_places, table),
            ),
            announced=(source_id, table.name, table.version, table.fingerprint) in self._known,
            rules=rules,
            key_only_not_sent=tuple(
                n for n, k in zip(names, key_flags, strict=True) if not k and n not in excluded
            ),
            excluded=excluded,
            type_ids=type_ids,
        )

    def _annotated_latest(self, wanted: TableSchema) -> TableSchema | None:
        """The table's newest version when ``wanted`` differs from it only in annotations."""
        try:
            latest = self.registry.latest(wanted.name)
        except UnknownSchemaError:
            return None
        return latest if same_but_annotations(latest, wanted) else None

    # ---- rows ---------------------------------------------------------

    def _data(
        self,
        rel_oid: int,
        op: Op,
        new: tuple[Cell, ...] | None,
        old: tuple[Cell, ...] | None,
        old_kind: str | None,
    ) -> None:
        txn = self._txn
        if txn is None:
            raise ValueError("a row change outside a transaction")
        if txn.oversized:
            txn.data_events += 1
            return
        table = self._tables[rel_oid]
        txn.announce(table, self.partition_id)
        after, after_ns = decode_row(table, new) if new is not None else (None, [])
        before: dict[str, Any] | None = None
        before_ns: list[str] = []
        if old is not None:
            before, before_ns = decode_row(table, old)
            if old_kind == "K":  # only the key columns were sent
                before_ns = list(table.key_only_not_sent)
        if after_ns and before is not None:
            # an unchanged TOASTed value of the new row is the old row's: the whole old
            # row (FULL identity; pgoutput flattens its TOASTed values), or its key
            # (Postgres logs a key stored out of line with the update, ``K``)
            for name in [n for n in after_ns if n not in before_ns]:
                after_ns.remove(name)
                assert after is not None
                after[name] = before.get(name)
        encoder = self.transcoders.encoder(rel_oid, table)
        txn.add(
            encoder.encode(
                op,
                txn.scn,
                len(txn.events),
                txn.ts_ns,
                after,
                before,
                after_not_sent=after_ns,
                before_not_sent=before_ns,
            ),
            self.max_window_bytes,
        )
        txn.data_events += 1
        if (
            after is not None
            and before is not None
            and old_key(table, encoder, before) not in (None, encoder.key_bytes(after))
        ):  # the old key's delete of a key-changing update (module docstring)
            txn.add(
                encoder.encode(
                    Op.DELETE,
                    txn.scn,
                    len(txn.events),
                    txn.ts_ns,
                    None,
                    before,
                    before_not_sent=before_ns,
                ),
                self.max_window_bytes,
            )
            txn.data_events += 1

    # ---- COPY rows (the bootstrap seeder) -------------------------------

    def copy_encoder(self, rel_oid: int, extra: int = 0) -> CopyEncoder:
        """A :class:`~._copyenc.CopyEncoder` of the table's binary COPY rows (its Relation
        fed already), each row followed by ``extra`` fields; the same events as :meth:`feed_raw`
        of the rows as Insert messages."""
        t = self._tables[rel_oid]
        key = [t.names.index(k) for k in t.schema.key]
        encoder = self.transcoders.encoder(rel_oid, t)
        return CopyEncoder(t.names, t.types, t.adapters, key, t.rules, encoder, extra)

    def announced(self, rel_oid: int) -> bool:
        """Whether the table's SCHEMA_CHANGE was written (or marked so) by this assembler."""
        return self._tables[rel_oid].announced

    def announce_quietly(self, rel_oid: int) -> None:
        """Mark the table announced without writing its SCHEMA_CHANGE: the caller wrote its
        rows outside a window and numbered them as if it had been (:mod:`._copyenc`)."""
        self._tables[rel_oid].announced = True

    # ---- the message loop ----------------------------------------------

    def feed_raw(self, buf: bytes | memoryview, offset: int = 0, end: int = -1) -> Window | None:
        """Take one pgoutput message ``buf[offset:end]``; returns a window at a Commit.

        ``end`` < 0: the message runs to the end of ``buf`` (the socket reader
        hands over spans of a larger chunk, the libpq reader whole messages).
        The same as ``feed(parse_message(buf[offset:end]))``, byte for byte, but
        row messages of known tables go through the table's
        :class:`~._transcode.Transcoder` (pgoutput binary straight to Avro)
        unless it hands them back to the general path.
        """
        if isinstance(buf, memoryview):
            # psycopg hands over a memoryview of a whole bytes object: no copy of it then
            whole = buf.obj if buf.contiguous else None
            buf = whole if type(whole) is bytes and len(whole) == buf.nbytes else bytes(buf)
        elif type(buf) is not bytes:
            buf = bytes(buf)
        kind = buf[offset]
        txn = self._txn
        if (kind == 0x49 or kind == 0x55 or kind == 0x44) and txn is not None:
            oid = int.from_bytes(buf[offset + 1 : offset + 5], "big")
            table = self._tables.get(oid)
            if table is not None and not txn.oversized:
                try:
                    transcoder = self.transcoders.of(oid, table)
                    op, key, body, old = transcoder.change(buf, offset, end)
                except Fallback:
                    pass
                except (IndexError, ValueError, TypeError, KeyError, struct.error):
                    pass  # malformed: the general path says what is wrong
                else:
                    if not table.announced:
                        txn.announce(table, self.partition_id)
                    frame = (table.encoder or self.transcoders.encoder(oid, table)).frame
                    txn.add(
                        frame(op, txn.scn, len(txn.events), txn.ts_ns, key, body),
                        self.max_window_bytes,
                    )
                    txn.data_events += 1
                    if old is not None:  # the old key's delete of a key-changing update
                        txn.add(
                            frame(3, txn.scn, len(txn.events), txn.ts_ns, *old),
                            self.max_window_bytes,
                        )
                        txn.data_events += 1
                    self.rows_transcoded += 1
                    return None
            self.rows_general += 1
        view = memoryview(buf)
        return self.feed(parse_message(view[offset:end] if end >= 0 else view[offset:]))

    def feed(self, msg: Message) -> Window | None:
        """Take one message; returns a complete window at a Commit."""
        if isinstance(msg, Begin):
            self._txn = OpenTxn(msg.final_lsn, msg.commit_ts_ns)
        elif isinstance(msg, Relation):
            self._relation(msg)
        elif isinstance(msg, Insert):
            self._data(msg.relation_oid, Op.INSERT, msg.new, None, None)
        elif isinstance(msg, Update):
            self._data(msg.relation_oid, Op.UPDATE, msg.new, msg.old, msg.old_kind)
        elif isinstance(msg, Delete):
            self._data(msg.relation_oid, Op.DELETE, None, msg.old, msg.old_kind)
        elif isinstance(msg, Truncate):
            txn = self._txn
            if txn is None:
                raise ValueError("a truncate outside a transaction")
            for oid in msg.relation_oids:
                txn.data_events += 1
                if txn.oversized:
                    continue
                table = self._tables[oid]
                txn.announce(table, self.partition_id)
                encoder = self.transcoders.encoder(oid, table)
                txn.add(
                    encoder.encode(Op.TRUNCATE, txn.scn, len(txn.events), txn.ts_ns, None),
                    self.max_window_bytes,
                )
        elif isinstance(msg, LogicalMessage):
            if msg.transactional and self._txn is not None:
                txn = self._txn
                if not txn.oversized:
                    payload = MessagePayload(msg.prefix, msg.content, msg.transactional)
                    txn.add(
                        encode_control(
                            payload,
                            txn.scn,
                            len(txn.events),
                            txn.ts_ns,
                            partition=self.partition_id,
                        ),
                        self.max_window_bytes,
                    )
            else:
                payload_: ControlPayload = (
                    Heartbeat(scn_to_lsn(msg.lsn))
                    if msg.prefix == HEARTBEAT_PREFIX
                    else MessagePayload(msg.prefix, msg.content, msg.transactional)
                )
                # a commit may start where the message ends: see the module docstring
                return self.control_window(payload_, msg.lsn - 1, scn_to_lsn(msg.lsn))
        elif isinstance(msg, Commit):
            txn = self._txn
            self._txn = None
            if txn is None:
                raise ValueError("a commit without a begin")
            if txn.oversized:
                return self._oversized(txn, scn_to_lsn(msg.end_lsn))
            return txn.close(scn_to_lsn(msg.end_lsn), self.partition_id)
        return None

    @property
    def in_transaction(self) -> bool:
        """True between a Begin and its Commit."""
        return self._txn is not None

    def control_window(
        self, payload: ControlPayload, scn: int, position: str = "", timestamp_ns: int = 0
    ) -> Window:
        """A window of one control event at ``scn`` (heartbeat, data loss, message).

        ``position`` defaults to ``scn`` as an LSN, the timestamp to now.
        """
        ts = timestamp_ns or time.time_ns()
        txn = OpenTxn(scn, ts)
        txn.events.append(encode_control(payload, scn, 0, ts, partition=self.partition_id))
        return txn.close(position or scn_to_lsn(scn), self.partition_id)

    def _oversized(self, txn: OpenTxn, position: str) -> Window:
        what = (
            f"transaction at LSN {scn_to_lsn(txn.scn)} has {txn.data_events} changes and "
            f"more than {self.max_window_bytes} bytes of events (max_transaction_bytes)"
        )
        if self.on_oversized == "fail":
            raise SourceConfigError(
                f"{what}; raise max_transaction_bytes (and the relay's buffer) or set "
                "on_oversized_transaction = 'skip' to replace it by a data-loss event"
            )
        if txn.scn > self.replay_until:  # (read again in SQL mode: counted the first time)
            log.error("%s: replaced by a data-loss event", what)
            self.losses["transaction_too_large"] += 1
        return self.control_window(DataLoss(txn.scn, txn.scn, what), txn.scn, position, txn.ts_ns)
