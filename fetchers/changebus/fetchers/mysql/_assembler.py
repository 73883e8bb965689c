"""From binlog events to encoded windows (one per transaction).

:class:`BinlogAssembler` is fed the events of mysql-replication's
``BinLogStreamReader`` in stream order and returns a
:class:`~changebus.fetchers.Window` when a transaction ends:

* a transaction opens at its GTID event (MariaDB; MySQL also sends
  ``BEGIN``) and ends at its ``XID`` event, at ``COMMIT`` (non-transactional
  engines), or right after its one statement (DDL: standalone GTID);
* an XA transaction's rows are logged at its ``XA PREPARE`` (a group ending
  with an XA_PREPARE event): they are kept (:mod:`._xa`, :mod:`._xa_events`)
  and become a window at its ``XA COMMIT`` (that event group's SCN, GTID and
  position: commit order), or are dropped at its ``XA ROLLBACK``. While one is pending, every
  position names the start of the oldest pending prepared group (``xa=``),
  where a restart must read from; an ``XA COMMIT`` whose prepared half this
  assembler never read (prepared before the fetcher's first start) becomes a
  DATA_LOSS window;
* the SCN is ``binlog file number << 32 | end position of the commit event``
  plus :attr:`BinlogAssembler.scn_base` (0 on the first server a relay
  reads; set after a failover so that SCNs go on increasing: docs/protocol.md
  5); the END_OF_WINDOW's ``source_position`` is
  ``gtid=D-S-N;file=NAME;pos=P;server=ID[;base=B]`` (docs/protocol.md 1.4,
  5): where to resume, on which server, with which SCN base;
* row images are decoded by the layout's compiled decoder
  (:mod:`._layout`) straight from the event bytes: TABLE_MAP gives the layout
  valid at that position (the tables, compiled and cached:
  :mod:`._tablemap`); a new or changed layout is a new schema version,
  announced by a SCHEMA_CHANGE event before its first row. A table is
  announced in the first window of this assembler touching it unless its
  schema is one of the ``known`` ones (those the relay holds: the registry of
  the :class:`~changebus.fetchers.ResumePoint`, matched by source id, name,
  version and fingerprint), so a restarted fetcher or a new leader in a
  relay cluster re-reads a window exactly as the previous reader wrote it;
* WRITE / UPDATE / DELETE rows become INSERT / UPDATE (before and after
  images; one changing the key is followed by the old key's DELETE, as in the
  Postgres fetcher) / DELETE (full before image) events; ``TRUNCATE`` becomes a
  TRUNCATE event; other DDL updates the declared-type history
  (:class:`._ddl.DeclaredTypes`) and its window holds no text of the
  statement (it can hold passwords); what a statement's text means
  (savepoints, a data change logged as a statement) is :mod:`._statements`.

Large transactions: with ``max_window_bytes`` set, a transaction past it is
no longer kept (its rows are only counted; of its decode worker futures only
those submitted before are kept, until they finish), so it holds about
``max_window_bytes``; at its end ``on_oversized="fail"`` raises a
:class:`~changebus.schemas.SourceConfigError`, ``"skip"`` makes it a DATA_LOSS
window. A transaction thrown away (read again after a reconnect, replaced by
the next GTID, or read again while the relay holds it) takes back the
SCHEMA_CHANGE events it held: the next window sent announces them.

Not thread-safe: one assembler per fetcher thread.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import Executor, Future
from typing import Any

from changebus.schemas import (
    ControlPayload,
    DataLoss,
    Heartbeat,
    Op,
    SchemaChange,
    SchemaRegistry,
    SourceConfigError,
    TableSchema,
    binlog_file_number,
    binlog_to_scn,
    encode_control,
)

from .._base import Window
from .._policy import ColumnPolicy
from ._config import SYSTEM_DATABASES
from ._ddl import MODE_ANSI_QUOTES, DeclaredTypes
from ._position import format_position
from ._statements import (
    changes_captured_rows,
    log_ddl,
    rollback_to_name,
    savepoint_name,
    statement_logged,
)
from ._tablemap import TableCatalog
from ._txn import (
    MappedTable as _Table,
    OpenTxn as _Txn,
    Part as _Part,
    PendingWindow,
    control_window,
    encode_window,
)
from ._workers import WorkerDispatch, transcode_changes
from ._xa import PreparedSet, XaKey
from ._xa_events import xa_end, xa_prepare

__all__ = ["BinlogAssembler", "PendingWindow"]

log = logging.getLogger("changebus.fetchers.mysql")
#: header, CRC, union branches and empty not-sent arrays of one row event (a bound)
_EVENT_OVERHEAD = 72

#: MariaDB GTID event flag: a standalone event group (DDL, no XID follows)
_FL_STANDALONE = 1


class BinlogAssembler:
    """Builds windows from binlog events (see the module docstring)."""

    def __init__(
        self,
        partition_id: int,
        registry: SchemaRegistry,
        declared: DeclaredTypes,
        *,
        databases: tuple[str, ...] = (),
        checksum_bytes: int = 4,
        tinyint1_as_boolean: bool = False,
        max_window_bytes: int = 0,
        on_oversized: str = "fail",
        pool: Executor | None = None,
        known: Iterable[TableSchema] = (),
        policy: ColumnPolicy | None = None,
    ) -> None:
        self.partition_id = partition_id
        self.registry = registry
        #: ``(source id, name, version, fingerprint)`` of the schemas the relay holds
        self._known = frozenset(
            (registry.source_id(t.name), t.name, t.version, t.fingerprint) for t in known
        )
        self.declared = declared
        self._databases = frozenset(d.lower() for d in databases)
        self._checksum = checksum_bytes
        self.max_window_bytes = max_window_bytes
        self.on_oversized = on_oversized
        #: data-loss windows made here, by cause (the fetcher shares its own counter)
        self.losses: Counter[str] = Counter()
        #: decode workers (processes) that transcode rows events; None: this thread
        self._pool = pool
        self._dispatch = WorkerDispatch.of(pool) if pool is not None else None
        self.file = ""
        self._file_number = 0
        #: added to ``file_number << 32 | pos``: 0 unless the relay failed over to
        #: this server from another one (set by the fetcher before the stream starts)
        self.scn_base = 0
        #: the server's ``@@server_id`` (0: unknown), recorded in every position
        self.server = 0
        #: the mapped tables: by table id, by name, compiled layouts (column policies
        #: applied to each table's layout when it is first mapped)
        self._tables = TableCatalog(
            registry,
            declared,
            partition_id,
            checksum_bytes=checksum_bytes,
            tinyint1_as_boolean=tinyint1_as_boolean,
            policy=policy if policy else None,
            workers=pool is not None,
        )
        #: fingerprints of the schema versions announced (SCHEMA_CHANGE sent, or known
        #: by the relay): shared by every layout of a version
        self._announced: set[int] = set()
        self._txn: _Txn | None = None
        #: prepared XA transactions waiting for their XA COMMIT / XA ROLLBACK
        self.prepared = PreparedSet()
        self.row_count = 0
        #: the last window :meth:`commit` returned holds no change (see there)
        self.last_empty = False
        #: the relay's last SCN (-1: none): events up to it are read again (a restart
        #: rewound to a pending XA prepare), their table layouts are versions the
        #: relay knows, found by content rather than registered anew
        self.replay_until = -1
        #: the SCN of the newest statement the declared types followed: none is applied
        #: twice when a reconnect reads again from a pending XA prepare (review)
        self.ddl_applied = -1

    # ---- positions ----------------------------------------------------------

    def rotate(self, next_file: str) -> None:
        """The stream moved to ``next_file`` (a RotateEvent; also at connect)."""
        self.file = next_file
        self._file_number = binlog_file_number(next_file)
        self._tables.by_id.clear()  # table ids are only valid within one binlog file

    def scn_at(self, end_pos: int) -> int:
        return binlog_to_scn(self._file_number, end_pos) + self.scn_base

    def position_at(self, gtid: str, end_pos: int) -> str:
        """The ``source_position`` of a transaction ending at ``end_pos`` of :attr:`file`
        (with the restart point of the oldest pending prepared XA transaction)."""
        return format_position(
            gtid, self.file, end_pos, self.server, self.scn_base, self.prepared.restart()
        )

    def reset(self) -> None:
        """The stream (re)starts at a transaction boundary where nothing is prepared yet
        (a restart point: prepared XA halves after it are read again)."""
        if self._txn is not None:  # read again (module docstring)
            self._unannounce(self._txn)
        self._txn = None
        self.prepared.clear()

    def captured(self, database: str) -> bool:
        db = database.lower()
        if db in SYSTEM_DATABASES:
            return False
        return not self._databases or db in self._databases

    @property
    def in_transaction(self) -> bool:
        return self._txn is not None

    # ---- events -----------------------------------------------------------

    def begin(self, gtid: str, timestamp_s: int, flags: int, start_pos: int = 0) -> None:
        """A MariaDB GTID event starting at ``start_pos``: a transaction (or, with
        the standalone flag, one statement: DDL, TRUNCATE) starts."""
        if self._txn is not None:  # (an open group the binlog never ended: not sent)
            self._unannounce(self._txn)
        self._txn = _Txn(gtid, timestamp_s * 1_000_000_000, bool(flags & _FL_STANDALONE))
        self._txn.start = (self.file, start_pos)
        self.row_count += self.prepared.count_done()  # (what their finished workers hold)

    def begin_mysql(self, gtid: str, timestamp_s: int, start_pos: int = 0) -> None:
        """A MySQL GTID event (or anonymous GTID event) starting at ``start_pos``.

        MySQL's event carries no standalone flag: a transaction's group goes on
        with a ``BEGIN`` query (which makes it a transaction, ended by its XID
        or COMMIT), a DDL or ``TRUNCATE`` statement's group is that one query.
        So the group counts as standalone until a ``BEGIN`` comes.
        """
        self.begin(gtid, timestamp_s, _FL_STANDALONE, start_pos)

    def table_map(self, event: Any) -> None:
        """A TABLE_MAP event: the layout of ``event.table_id`` from here on (:mod:`._tablemap`)."""
        if not self.captured(event.schema):
            self._tables.by_id[event.table_id] = None
            return
        table, compiled = self._tables.map(
            event, lambda: self.scn_at(int(event.packet.log_pos)) <= self.replay_until
        )
        schema = table.encoder.table
        if compiled and (
            (table.encoder.source_id, schema.name, schema.version, schema.fingerprint)
            in self._known
        ):
            self._announced.add(schema.fingerprint)

    def rows(self, event: Any, op: Op) -> None:
        txn = self._txn
        if txn is None:
            raise SourceConfigError("a rows event outside a transaction")
        table = self._tables.by_id.get(event.table_id)
        if table is None:
            return  # not captured
        packet = event.packet.packet
        raw = packet._data
        start, end = packet._position, len(raw) - self._checksum
        full = (1 << table.ncols) - 1
        if (
            event.number_of_columns != table.ncols
            or int.from_bytes(event.columns_present_bitmap, "little") != full
        ):
            raise SourceConfigError(
                f"a rows event of {table.layout.name} lacks columns: set binlog_row_image = FULL "
                "on the server"
            )
        if int(op) == 2 and int.from_bytes(event.columns_present_bitmap2, "little") != full:
            raise SourceConfigError(
                f"an update of {table.layout.name} lacks columns: set binlog_row_image = "
                "FULL on the server"
            )
        if txn.oversized:
            # only counted from now on, here: nothing of it is kept (a worker's future
            # would hold its rows until the commit)
            n = len(transcode_changes(table.transcode, raw, int(op), start, end))
            txn.data_events += n
            self.row_count += n
            self.row_count += txn.count_done()
            return
        changes: list[Any] | Future[list[Any]]
        if self._dispatch is not None:  # (the layout goes along only when needed)
            changes = self._dispatch.submit(
                table.layout_id, table.layout, table.transcode, raw[start:end], int(op)
            )
            size = (end - start) * 2  # an estimate until the worker is done
        else:
            changes = transcode_changes(table.transcode, raw, int(op), start, end)
            size = len(changes) * _EVENT_OVERHEAD + sum(
                len(c[1]) + len(c[2] or b"") + len(c[3] or b"") for c in changes
            )
        self._announce(txn, table)
        self._add(txn, (table.encoder, changes), size)

    def _add(self, txn: _Txn, part: _Part, size: int) -> None:
        txn.events.append(part)
        txn.size += size
        if self.max_window_bytes and txn.size > self.max_window_bytes:
            self._let_go(txn)

    def _let_go(self, txn: _Txn) -> None:
        """Make ``txn`` oversized: its rows are only counted from now on."""
        self.row_count += txn.let_go()
        self._unannounce(txn)

    @property
    def held_parts(self) -> int:
        """Events and worker futures the open transaction holds (a memory bound's gauge)."""
        txn = self._txn
        return 0 if txn is None else len(txn.events) + len(txn.dropped)

    def _unannounce(self, txn: _Txn) -> None:
        """``txn``'s SCHEMA_CHANGE events will not be sent (yet): the next window
        touching those tables announces them."""
        for table in txn.announced:
            self._announced.discard(table.encoder.table.fingerprint)
        txn.announced.clear()

    def _announce(self, txn: _Txn, table: _Table) -> None:
        if id(table) not in txn.touched_ids:
            txn.touched_ids.add(id(table))
            txn.touched.append(table)
        if table.encoder.table.fingerprint in self._announced:
            return
        schema = table.encoder.table
        change = SchemaChange(
            table.encoder.source_id,
            schema.name,
            schema.version,
            schema.fingerprint,
            json.dumps(schema.to_json(), separators=(",", ":")),
        )
        ts, partition = txn.ts_ns, self.partition_id
        self._add(
            txn,
            (lambda scn, seq: encode_control(change, scn, seq, ts, partition=partition), False),
            len(change.schema) + 200,
        )
        self._announced.add(schema.fingerprint)
        txn.announced.append(table)

    def query(self, event: Any, end_pos: int) -> Window | PendingWindow | None:
        """A QueryEvent: BEGIN, COMMIT, DDL or TRUNCATE."""
        text = event.query.strip()
        head = text[:8].upper()
        if head.startswith("BEGIN"):
            if self._txn is None:
                self._txn = _Txn("", event.timestamp * 1_000_000_000, False)
            else:  # (after MySQL's GTID event: a transaction, not one statement)
                self._txn.standalone = False
            return None
        if head.startswith("COMMIT"):
            return self.commit(end_pos)
        if head.startswith("XA "):
            return xa_end(self, text, end_pos)
        if (saved := savepoint_name(text)) is not None and self._txn is not None:
            self._txn.savepoints[saved] = len(self._txn.events)
            return None
        if (back := rollback_to_name(text)) is not None and self._txn is not None:
            if not self._txn.rollback_to(back):
                raise SourceConfigError(
                    f"ROLLBACK TO an unknown savepoint at {self.file}:{end_pos}"
                )
            return None
        if head.startswith("ROLLBACK"):
            # (ROW format logs changes of non-transactional tables as groups of their own:
            # what a group ending here holds was undone)
            txn, self._txn = self._txn, None
            if txn is not None:
                self._unannounce(txn)
            return None
        schema = event.schema.decode() if isinstance(event.schema, bytes) else event.schema
        if changes_captured_rows(text, schema or "", self.captured, self._databases):
            # a session ran with binlog_format = STATEMENT or MIXED: the rows it
            # changed are not in the binlog, only its text (never forwarded)
            raise statement_logged(f"{self.file}:{end_pos}")
        # (read again after a rewind: declared types are at the relay's last window)
        at = self.scn_at(end_pos)
        ansi = bool(getattr(event, "sql_mode", 0) & MODE_ANSI_QUOTES)
        keep = at <= max(self.replay_until, self.ddl_applied)
        effect = self.declared.apply(text, schema or "", at, keep=keep, ansi_quotes=ansi)
        if not keep:
            self.ddl_applied = at
        txn = self._txn
        if txn is None:  # a statement without a GTID event (old servers)
            txn = self._txn = _Txn("", event.timestamp * 1_000_000_000, True)
        if effect.kind == "truncate":
            db, name = effect.tables[0]
            # the table as written, else the one table of that name in any case (by the
            # lower-case name alone, TRUNCATE orders emptied app.Orders where both
            # exist, a server with lower_case_table_names = 0 keeping them apart: review)
            target = self._tables.truncated(effect.written or (db, name))
            table = self._tables.latest.get(target) if target is not None else None
            encoder = None
            if table is not None:
                if not txn.oversized:
                    self._announce(txn, table)
                encoder = table.encoder
            elif target is not None and self.captured(db):
                # not mapped in this run yet (a TRUNCATE before any row change since the
                # start): the relay's registry knows the table if it ever sent its rows
                encoder = self._tables.registered_encoder(target)
            if encoder is not None and not txn.oversized:
                ts = txn.ts_ns
                make = lambda scn, seq, e=encoder: e.encode(Op.TRUNCATE, scn, seq, ts, None)  # noqa: E731
                self._add(txn, (make, True), 100)
        elif effect.kind in ("alter", "drop", "rename", "create"):
            for db, name in effect.tables:
                table = self._tables.find(db, name)
                if table is not None:
                    log_ddl(effect.kind, text, table.layout.name, f"{self.file}:{end_pos}")
        if txn.standalone:
            return self.commit(end_pos)
        return None

    # ---- XA transactions (._xa) ------------------------------------------------

    def xa_prepare(
        self, key: XaKey, one_phase: bool, end_pos: int
    ) -> Window | PendingWindow | None:
        """An XA_PREPARE event ending at ``end_pos``: the open transaction is prepared
        (kept until its XA COMMIT), or, ``one_phase`` (MySQL's ``XA COMMIT ..
        ONE PHASE``), committed (:func:`._xa_events.xa_prepare`)."""
        return xa_prepare(self, key, one_phase, end_pos)

    def commit(self, end_pos: int) -> Window | PendingWindow | None:
        """The transaction ends with the event ending at ``end_pos`` (XID or COMMIT).

        Returns its window; with decode workers a :class:`PendingWindow` (its
        rows are still being transcoded) that the caller resolves in order.
        After it, :attr:`last_empty` says whether the window holds no change (a
        HEARTBEAT window for a transaction that touched nothing captured).
        """
        self.last_empty = False
        txn = self._txn
        self._txn = None
        if txn is None:
            return None
        scn = self.scn_at(end_pos)
        position = self.position_at(txn.gtid, end_pos)
        if scn <= self.replay_until:  # the relay has it: what it announces is not sent
            self._unannounce(txn)
        if not txn.events and not txn.dropped and not txn.oversized:
            # nothing captured (other databases, DDL): a HEARTBEAT window, which the
            # fetcher writes only now and then, to keep the resume position current
            self.last_empty = True
            return self.control_window(Heartbeat(position), scn, position, txn.ts_ns)
        pending = PendingWindow(self, txn, scn, position)
        return pending if self._pool is not None else pending.resolve()

    def control_window(
        self, payload: ControlPayload, scn: int, position: str, timestamp_ns: int = 0
    ) -> Window:
        """A window of one control event at ``scn`` (data loss)."""
        return control_window(payload, scn, position, self.partition_id, timestamp_ns)

    def _close(self, txn: _Txn, scn: int, position: str) -> Window:
        """Encode a committed transaction's events (futures are waited for)."""
        for future in txn.dropped:
            n = len(future.result())
            txn.data_events += n
            self.row_count += n
        txn.dropped.clear()
        if txn.oversized:
            what = (
                f"transaction {txn.gtid or position} has {txn.data_events} changes and more "
                f"than {self.max_window_bytes} bytes of events (max_transaction_bytes; for "
                "a prepared XA transaction, with the others prepared at the time)"
            )
            if self.on_oversized == "fail":
                raise SourceConfigError(
                    f"{what}; raise max_transaction_bytes (and the relay's buffer) or set "
                    "on_oversized_transaction = 'skip' to replace it by a data-loss event"
                )
            if scn > self.replay_until:  # (read again after a rewind: the relay has it)
                log.error("%s: replaced by a data-loss event", what)
                self.losses["transaction_too_large"] += 1
            return self.control_window(DataLoss(scn, scn, what), scn, position, txn.ts_ns)
        window, rows = encode_window(txn, scn, position, self.partition_id)
        self.row_count += rows
        return window
