"""Seeding the snapshot store from MySQL/MariaDB: online, in short chunks, aligned with SCNs.

The MariaDB :class:`~._chunks.ChunkSource` of :func:`._chunks.run_chunked`
(which owns the chunk loop, resume, throttle and progress), and
:func:`seed_mysql`, the public seeder over it:

1. One PyMySQL connection per seed run (``program_name`` ``changebus-seed``,
   session time zone UTC, ``REPEATABLE READ``, autocommit between chunks),
   opened like the fetcher's (:func:`changebus.fetchers.mysql.open_connection`:
   ``seed.dsn``'s ``password_file`` and TLS options; a certificate that does
   not verify is a non-retriable error).
   Its ``@@server_id`` must be the server the relay's fetcher reads (binlog
   positions, hence SCNs, are a server's own), and the relay's fetcher
   status gives the SCN base (0 unless the relay failed over to this
   server; docs/protocol.md 5).
2. Every chunk is one short transaction: ``START TRANSACTION WITH
   CONSISTENT SNAPSHOT, READ ONLY``; ``SHOW STATUS LIKE
   'binlog_snapshot_%'`` gives the binlog position of exactly that snapshot
   (every transaction before it is visible to the chunk's reads, no later
   one is); the chunk's tag is that position as an SCN (SCN base +
   ``binlog_to_scn``), so every change with an SCN <= tag is in what the
   chunk reads (the tag rule of :mod:`._chunks`); then one keyset
   ``SELECT``; ``COMMIT``. No lock is taken; writers go on; no transaction
   outlives its chunk. Rows are turned into INSERT events (the fetcher's
   Avro values, :mod:`._seed_mysql_values`) after the commit.
3. Keyset pagination on the relay schema's key (the primary key): ``WHERE
   key > last ORDER BY key LIMIT n``. A composite key uses the row
   constructor ``(k1, k2) > (a, b)`` when ``EXPLAIN`` shows a range scan for
   it, else the expanded ``k1 > a OR (k1 = a AND k2 > b)`` (MariaDB 10.x
   does not range-scan row constructors). The cursor is the last row's key
   values as JSON (:func:`~._seed_mysql_values.key_json`: binary, decimal
   and temporal keys round-trip exactly).
4. A ``keys`` scope reads its keys in slices of ``chunk_rows`` (``key IN
   (...)``, with ``in_predicate_conversion_threshold = 0`` so a long list
   stays index lookups); keys not found are reported in
   :attr:`~._chunks.Chunk.absent` as store keys (the Avro key encoding) when
   every key column is an int, long, string or uuid column; other keys are
   not tombstoned. A ``where`` scope is validated once (``EXPLAIN`` in a
   read-only transaction; ``;`` is refused; a bad condition is a
   non-retriable :class:`~changebus.schemas.SourceConfigError` quoting the
   server); each chunk first finds the key ``chunk_rows`` rows on (an index
   walk), then reads the rows up to it that match: a chunk reads at most
   ``2 * chunk_rows`` rows however selective the condition, so its
   transaction stays short.

A table the relay has not seen (no schema), whose columns changed since the
relay's newest version (retriable: the relay will stream the DDL), or that
has no primary key (refused, naming the fix) is not read. The fetcher's
column policy (``request.column_policy``) applies to the rows as in the
fetcher.

Blocking (PyMySQL): runs in the seeder's worker thread; a source and its
readers are that thread's. The DSN's password never reaches a log or an
error message.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

from changebus.fetchers import ColumnPolicy
from changebus.fetchers.mysql import open_connection
from changebus.schemas import (
    ChangebusError,
    RowEncoder,
    SchemaRegistry,
    SourceConfigError,
    SourceError,
    binlog_file_number,
    binlog_to_scn,
)

from ._chunks import Chunk, SnapshotScope, SnapshotSink, WriterSink, run_chunked
from ._seed_mysql_conn import (
    check_readable,
    column_names,
    mysql_config_from_dsn,
    q,
    relay_origin,
    server_message,
    source_errors,
    where_sql,
)
from ._seed_mysql_keys import compare_sql, enum_keys, plain_key_type
from ._seed_mysql_values import RowConverter, key_json, key_values, policy_converter, untag
from ._seedtypes import SeedProgress, SeedRequest, SeedWriter

__all__ = ["MySQLChunkReader", "MySQLChunkSource", "seed_mysql"]

log = logging.getLogger("changebus.bootstrap.seed")

T = TypeVar("T")

#: the connection's program name (``program_name`` connection attribute)
PROGRAM_NAME: Final = "changebus-seed"
_START: Final = "START TRANSACTION WITH CONSISTENT SNAPSHOT"


class MySQLChunkSource:
    """The MariaDB source of one seed run: one connection, a reader per table (module docstring).

    Built from the :class:`~._seedtypes.SeedRequest` (refused at once when
    the relay's fetcher gives no server id); ``with`` connects and checks
    the server. Thread-safety: one seeder thread.
    """

    #: a full row image sends every column (one without an Avro value, a zero date, is
    #: left out of a seed's copy too): nothing to refill
    omits_columns = False

    def key_values(self, table: str, values: tuple[Any, ...]) -> tuple[Any, ...] | None:
        return None  # (never asked: omits_columns)

    def marker(self, table: str) -> int | None:
        return None  # (never asked: omits_columns)

    def __init__(self, request: SeedRequest, *, stop: threading.Event | None = None) -> None:
        self.request = request
        #: set: a wait for the minimum tag ends at once (the run is stopping)
        self.stop = stop or threading.Event()
        self.server_id, self.scn_base = relay_origin(request.relay_fetcher)
        self.registry = SchemaRegistry()
        self.registry.import_entries(list(request.schemas))
        self.policy = request.column_policy or ColumnPolicy()
        self.conn: Any = None
        #: the connection id (``CONNECTION_ID()``: information_schema's thread id)
        self.connection_id = -1
        #: seconds the last :meth:`snapshot` transaction was open (BEGIN to COMMIT)
        self.last_txn_s = -1.0
        self._start = _START + ", READ ONLY"

    def __enter__(self) -> MySQLChunkSource:
        import pymysql

        # (the password file is read now, at the seed's start; TLS as the fetcher's)
        cfg = mysql_config_from_dsn(self.request.dsn).resolved()
        try:
            self.conn = open_connection(
                cfg,
                connect_timeout=cfg.connect_timeout_s,
                autocommit=True,
                charset="utf8mb4",
                program_name=PROGRAM_NAME,
            )
        except pymysql.err.MySQLError as exc:
            code, message = server_message(exc)
            raise SourceConfigError(
                f"cannot connect to MySQL for a snapshot: {message}",
                retriable=code not in (1044, 1045),  # access denied: not by waiting
            ) from None
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def _setup(self) -> None:
        import pymysql

        with source_errors("setting up the seed connection"), self.conn.cursor() as cur:
            cur.execute("SET SESSION time_zone = '+00:00'")
            # values as the binlog holds them whatever the server's default mode: no CHAR
            # padding (PAD_CHAR_TO_FULL_LENGTH), '' not NULL (EMPTY_STRING_IS_NULL, a
            # cursor at '' became "k > NULL"), backslash escapes for the driver's literals
            # (NO_BACKSLASH_ESCAPES): found by review
            cur.execute("SET SESSION sql_mode = ''")
            cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            with contextlib.suppress(pymysql.err.MySQLError):  # MySQL, MariaDB < 10.3.18
                cur.execute("SET SESSION in_predicate_conversion_threshold = 0")
            cur.execute("SELECT @@server_id, CONNECTION_ID()")
            row = cur.fetchone()
            server, self.connection_id = (int(row[0]), int(row[1])) if row else (0, -1)
            if server != self.server_id:
                raise SourceConfigError(
                    f"the seed source is server id {server}, the relay reads server id "
                    f"{self.server_id}: seed from the server the relay reads (binlog positions, "
                    "hence SCNs, are the server's own)"
                )
            try:
                cur.execute(self._start)
            except pymysql.err.ProgrammingError:  # no READ ONLY snapshot transactions
                self._start = _START
                cur.execute(self._start)
            try:
                self._tag(cur)  # binlog on, and the status variables there
            finally:
                self.conn.rollback()
        log.info(
            "seeding %d table(s) from MariaDB server id %d (SCN base %d) in chunks of %d rows",
            len(self.request.todo),
            server,
            self.scn_base,
            self.request.chunk_rows,
        )

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()
            self.conn = None

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _tag(self, cur: Any) -> int:
        """The SCN of the open snapshot transaction's binlog position."""
        cur.execute("SHOW STATUS LIKE 'binlog_snapshot_%'")
        status = {str(k).lower(): str(v) for k, v in cur.fetchall()}
        file = status.get("binlog_snapshot_file", "")
        if not file:
            raise SourceConfigError(
                "the server reports no binlog snapshot position (binlog_snapshot_file): "
                "consistent seeding needs MariaDB with log_bin on"
            )
        pos = int(status["binlog_snapshot_position"])
        return self.scn_base + binlog_to_scn(binlog_file_number(file), pos)

    def snapshot(self, read: Callable[[Any], T], what: str, min_tag: int = -1) -> tuple[int, T]:
        """``read(cursor)`` in one consistent-snapshot transaction; returns ``(tag, result)``.

        :attr:`last_txn_s` is then how long that transaction was open, from
        before ``START TRANSACTION`` to after ``COMMIT`` returned (what the
        server's ``information_schema.innodb_trx`` would show, plus one round
        trip at most).

        A tag below ``request.min_tag`` (the end of a gap to repair: the read
        must be newer) or ``min_tag`` is not used: the transaction ends unread and a new
        one is tried (0.05 s doubling to 1 s), for at most
        ``request.watermark_wait_s`` (then a retriable error).
        """
        deadline = time.monotonic() + self.request.watermark_wait_s
        floor = max(self.request.min_tag, min_tag)
        pause = 0.05
        while True:
            with source_errors(what), self.conn.cursor() as cur:
                began = time.monotonic()
                cur.execute(self._start)
                try:
                    tag = self._tag(cur)
                    if tag >= floor:
                        result = read(cur)
                        self.conn.commit()
                        self.last_txn_s = time.monotonic() - began
                        return tag, result
                except BaseException:
                    with contextlib.suppress(Exception):
                        self.conn.rollback()
                    raise
                self.conn.rollback()
            if time.monotonic() >= deadline:
                raise SourceError(
                    f"the source's binlog position (SCN {tag}) stayed behind SCN "
                    f"{floor} (the end of the gap to repair) for "
                    f"{self.request.watermark_wait_s:g}s: is the seed reading the relay's server?",
                    retriable=True,
                )
            if self.stop.wait(pause):
                raise ChangebusError("seeding stopped", retriable=True)
            pause = min(pause * 2, 1.0)

    def reader(self, scope: SnapshotScope, *, min_tag: int = -1) -> MySQLChunkReader:
        """A reader of ``scope`` after checking the table (see :class:`~._chunks.ChunkSource`:
        its chunks' tags are at least ``min_tag`` too)."""
        name = scope.table
        try:
            schema = self.registry.latest(name)
        except ChangebusError:
            raise SourceConfigError(
                f"table {name} is not in the relay's stream yet (no schema): it cannot be "
                "seeded before the relay has seen a change of it"
            ) from None
        self.policy.check_schema(schema)  # the rows follow the fetcher's column policy
        check_readable(self.conn, name)
        if not schema.key:
            raise SourceConfigError(
                f"table {name} has no primary key: a snapshot reads a table in key order, in "
                "short transactions, and cannot read one without a key; add a primary key "
                f"(ALTER TABLE {name} ADD PRIMARY KEY (...)), then snapshot it"
            )
        encoder = RowEncoder(
            schema, source_id=self.registry.source_id(name), partition=self.request.partition_id
        )
        reader = MySQLChunkReader(self, scope, RowConverter(encoder, self.policy))
        reader.min_tag = min_tag
        return reader


class MySQLChunkReader:
    """Reads one :class:`~._chunks.SnapshotScope` of a table in chunks (module docstring).

    ``mode``: ``keyset`` (whole table or ``where``) or ``keys``. Cursors:
    keyset -- :func:`~._seed_mysql_values.key_json` of the last key read
    (``where``: of the chunk's upper bound); keys -- the index of the next
    key in the list, as text. Thread-safety: the seeder's thread.
    """

    def __init__(self, source: MySQLChunkSource, scope: SnapshotScope, rows: RowConverter) -> None:
        self._source = source
        self._rows = rows
        self.name = scope.table
        #: the lowest tag a chunk may have, beyond ``request.min_tag``
        self.min_tag = -1
        schema = rows.encoder.table
        db, _, table = self.name.partition(".")
        self._table = f"{q(db)}.{q(table)}"
        self._cols = [q(k) for k in schema.key]
        self._key_list = ", ".join(self._cols)
        self._enums = enum_keys(schema)
        self._row_form: bool | None = None if len(self._cols) > 1 else False
        self._where = ""
        self._keys: list[tuple[Any, ...]] = []
        self._absent_keys: list[bytes | None] = []
        with source_errors(f"reading {self.name}"), source.conn.cursor() as cur:
            cur.execute(f"SELECT * FROM {self._table} LIMIT 0", ())
            names = column_names(cur)
            rows.bind(names)  # the columns are the relay's (else: retriable)
            # what orders a keyset cursor: the key columns' types and collations
            cur.execute(
                "SELECT COLUMN_NAME, DATA_TYPE, COLLATION_NAME FROM information_schema.COLUMNS"
                " WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s",
                (db, table),
            )
            found = {str(r[0]): [str(r[0]), str(r[1]), str(r[2] or "")] for r in cur.fetchall()}
        #: the select list: FLOAT columns as DOUBLE (the text protocol prints a FLOAT with
        #: 6 significant digits, the binlog holds its 4 bytes; a DOUBLE prints exactly, and
        #: a keyset cursor on a FLOAT key compares exactly too: found by review)
        floats = {n for n, (_, dtype, _) in found.items() if dtype.lower() == "float"}
        self._select = (
            ", ".join(f"CAST({q(n)} AS DOUBLE) AS {q(n)}" if n in floats else q(n) for n in names)
            if floats
            else "*"
        )
        #: the key columns as a where chunk's bound reads them (a FLOAT key printed with
        #: 6 digits gave a bound equal to the cursor again and again, and the chunk
        #: "ended where it started": found by review)
        self._key_select = ", ".join(
            f"CAST({q(k)} AS DOUBLE)" if k in floats else q(k) for k in schema.key
        )
        self.mode = "keys" if scope.keys else "keyset"
        #: what its cursors mean (:attr:`~._chunks.ChunkReader.key_id`)
        self.key_id = (
            "keys"
            if scope.keys
            else "keyset:"
            + json.dumps([found.get(k, [k]) for k in schema.key], separators=(",", ":"))
        )
        if scope.keys:
            self._init_keys(scope.keys)
            self.estimate_rows = len(self._keys)
        elif scope.where:
            if ";" in scope.where:
                raise SourceConfigError(
                    "a snapshot's where condition is one SQL condition (no ';')"
                )
            self._where = "(" + scope.where.replace("%", "%%") + ")"
            self.estimate_rows = self._check_where()
        else:
            self.estimate_rows = self._table_rows()

    def _ordinal(self, i: int, value: Any) -> Any:
        """Key value ``i`` as an ordering comparison needs it. An ENUM sorts by its
        label's position (``ORDER BY`` and the key index), but compares with a string
        by text: ``k > 'b'`` would skip labels after 'b' in the list but before it in
        the alphabet. Compared with its number instead, it sorts and compares alike."""
        labels = self._enums.get(i)
        if labels is None:
            return value
        try:
            return labels.index(value) + 1
        except ValueError:
            if value == "":  # (MariaDB's "invalid value" label: number 0)
                return 0
            raise SourceConfigError(
                f"snapshot of {self.name}: key value {value!r} is not one of its ENUM's "
                "labels in the relay's schema; snapshot it again once the relay has seen "
                "the table's new definition",
                retriable=True,
            ) from None

    # ---- set-up --------------------------------------------------------------

    def _table_rows(self) -> int:
        db, _, table = self.name.partition(".")
        with source_errors(f"estimating {self.name}"), self._source.conn.cursor() as cur:
            cur.execute(
                "SELECT TABLE_ROWS FROM information_schema.TABLES "
                "WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s",
                (db, table),
            )
            row = cur.fetchone()
        return -1 if row is None or row[0] is None else int(row[0])

    def _check_where(self) -> int:
        """Refuse a bad ``where`` (server's message); returns the rows it selects, about."""
        import pymysql

        conn = self._source.conn
        with conn.cursor() as cur:
            try:
                cur.execute("START TRANSACTION READ ONLY")
                try:
                    cur.execute(f"EXPLAIN SELECT 1 FROM {self._table} WHERE {self._where}", ())
                    plan = cur.fetchall()
                    names = column_names(cur)
                finally:
                    conn.rollback()
            except pymysql.err.MySQLError as exc:
                code, message = server_message(exc)
                if code >= 2000 or code == 0:  # the client's (connection lost...): not the text
                    raise SourceError(f"MariaDB error {code}: {message}", retriable=True) from None
                raise SourceConfigError(
                    f"the where condition cannot be used on {self.name}: {message}"
                ) from None
        rows = names.index("rows") if "rows" in names else -1
        if rows < 0 or not plan or plan[0][rows] is None:
            return -1
        return int(plan[0][rows])

    def _init_keys(self, keys: Sequence[Sequence[Any]]) -> None:
        """Check the key list; keep its store keys when they can be encoded (for ``absent``)."""
        schema = self._rows.encoder.table
        columns = {c.name: c for c in schema.columns}
        rules = self._source.policy.rules_for(self.name)
        plain = all(plain_key_type(columns[k].type) for k in schema.key)
        convert = [policy_converter(columns[k], rules.get(k)) for k in schema.key]
        # the JSON type each key column's values must have to name one row for sure: the
        # server compares a number with a text column (or 1.5 with an int) by its own
        # rules, and Python's int(1.5) or str(True) named another row, which was then
        # deleted as absent while the source still held it (review)
        kinds = [int if columns[k].type in ("int", "long") else str for k in schema.key]
        for raw in keys:
            if len(raw) != len(schema.key):
                raise SourceConfigError(
                    f"key {list(raw)!r} of {self.name} has {len(raw)} value(s); its key is "
                    f"({', '.join(schema.key)})"
                )
            try:
                values = tuple(untag(v) for v in raw)
            except (ValueError, TypeError, ArithmeticError) as exc:
                raise SourceConfigError(f"bad key value {list(raw)!r}: {exc}") from None
            self._keys.append(values)
            exact = plain and all(type(v) is kind for v, kind in zip(values, kinds, strict=True))
            self._absent_keys.append(self._store_key(values, convert) if exact else None)

    def _store_key(
        self, values: tuple[Any, ...], convert: list[Callable[[Any], Any]]
    ) -> bytes | None:
        """The store key of a requested key (None: cannot say, not tombstoned)."""
        if any(v is None for v in values):
            return None
        try:
            key = self._rows.encoder.table.key
            row = {k: fn(v) for k, fn, v in zip(key, convert, values, strict=True)}
            return self._rows.encoder.key_bytes(row)
        except Exception:  # noqa: BLE001 - a value the column cannot hold: never a row
            return None

    # ---- chunks --------------------------------------------------------------

    def read(self, cursor: str | None, limit: int) -> Chunk:
        if self.mode == "keys":
            return self._read_keys(int(cursor or 0), limit)
        after = None if cursor is None else key_values(cursor)
        tag, (rows, nxt) = self._source.snapshot(
            lambda cur: self._read_range(cur, after, limit), f"reading {self.name}", self.min_tag
        )
        txn_s = self._source.last_txn_s
        return Chunk(self._rows.events(rows, tag), tag, nxt, txn_s=txn_s)

    def _read_range(
        self, cur: Any, after: tuple[Any, ...] | None, limit: int
    ) -> tuple[list[Any], str | None]:
        """Rows after ``after`` in key order (in the snapshot transaction) and the next cursor."""
        conds: list[str] = []
        args: list[Any] = []
        if after is not None:
            if self._row_form is None:
                self._row_form = self._row_form_ranges(cur, after, limit)
            sql, at = compare_sql(self._cols, ">", self._row_form)
            conds.append(sql)
            args.extend(self._ordinal(i, after[i]) for i in at)
        head = f"FROM {self._table}"
        if self._where:
            cur.execute(
                f"SELECT {self._key_select} {head}{where_sql(conds)} ORDER BY {self._key_list} "
                f"LIMIT 1 OFFSET {limit - 1}",
                tuple(args),
            )
            bound = cur.fetchone()
            if bound is not None:
                sql, at = compare_sql(self._cols, "<=", bool(self._row_form))
                conds.append(sql)
                args.extend(self._ordinal(i, bound[i]) for i in at)
            cur.execute(
                f"SELECT {self._select} {head}{where_sql([*conds, self._where])} ORDER BY {self._key_list}",
                tuple(args),
            )
            rows = list(cur.fetchall())
            self._rows.bind(column_names(cur))
            return rows, None if bound is None else key_json(bound)
        cur.execute(
            f"SELECT {self._select} {head}{where_sql(conds)} ORDER BY {self._key_list} LIMIT {limit}",
            tuple(args),
        )
        rows = list(cur.fetchall())
        self._rows.bind(column_names(cur))
        if len(rows) < limit:
            return rows, None
        return rows, key_json([rows[-1][i] for i in self._rows.key_at])

    def _row_form_ranges(self, cur: Any, after: tuple[Any, ...], limit: int) -> bool:
        """Whether the server range-scans ``(k1, k2) > (a, b)`` (``EXPLAIN`` says ``range``)."""
        sql, at = compare_sql(self._cols, ">", True)
        cur.execute(
            f"EXPLAIN SELECT {self._key_list} FROM {self._table} WHERE {sql} "
            f"ORDER BY {self._key_list} LIMIT {limit}",
            tuple(after[i] for i in at),
        )
        plan = cur.fetchall()
        names = column_names(cur)
        ranges = bool(plan) and "type" in names and plan[0][names.index("type")] == "range"
        log.debug(
            "%s: composite key pages with %s",
            self.name,
            "a row constructor" if ranges else "the expanded OR form",
        )
        return ranges

    def _read_keys(self, start: int, limit: int) -> Chunk:
        keys = self._keys[start : start + limit]
        n = len(self._cols)
        if n == 1:
            cond = f"{self._cols[0]} IN ({', '.join(['%s'] * len(keys))})"
        else:
            one = "(" + ", ".join(["%s"] * n) + ")"
            cond = f"({self._key_list}) IN ({', '.join([one] * len(keys))})"
        args = tuple(v for k in keys for v in k)

        def read(cur: Any) -> list[Any]:
            cur.execute(
                f"SELECT {self._select} FROM {self._table} WHERE {cond} ORDER BY {self._key_list}",
                args,
            )
            rows = list(cur.fetchall())
            self._rows.bind(column_names(cur))
            return rows

        tag, rows = self._source.snapshot(read, f"reading keys of {self.name}", self.min_tag)
        txn_s = self._source.last_txn_s
        found: set[bytes] = set()
        events = self._rows.events(rows, tag, found)
        wanted = self._absent_keys[start : start + limit]
        absent = tuple(dict.fromkeys(k for k in wanted if k is not None and k not in found))
        nxt = start + len(keys)
        return Chunk(events, tag, str(nxt) if nxt < len(self._keys) else None, absent, txn_s=txn_s)


def seed_mysql(
    request: SeedRequest,
    write: SeedWriter,
    progress: SeedProgress,
    *,
    stop: threading.Event | None = None,
    sink: SnapshotSink | None = None,
) -> int:
    """Snapshot ``request.tables`` (``database.table`` names) chunk by chunk; returns the newest tag.

    Arguments as for :func:`._seed.seed_postgres`; ``request.relay_fetcher``
    is the relay's fetcher status of the partition (its ``mysql_server_id``
    and ``scn_base``). Chunks go to ``sink`` (the bootstrap store: resumable)
    or, without one, to ``write``.
    """
    opener = functools.partial(MySQLChunkSource, stop=stop)
    return run_chunked(request, opener, sink or WriterSink(write), progress, stop=stop)
