"""Seeding the snapshot store from MySQL/MariaDB, aligned with an SCN, without stopping writes.

The MySQL counterpart of :func:`._seed.seed_postgres`, with the same
arguments (a :class:`~._seedtypes.SeedRequest`) and the same guarantees:

1. :func:`changebus.fetchers.mysql.consistent_snapshot` opens ``START
   TRANSACTION WITH CONSISTENT SNAPSHOT`` and reads the binlog position of
   that snapshot (``binlog_snapshot_file`` / ``binlog_snapshot_position``):
   every transaction that ends at or before it is in the snapshot, every
   later one is not. No lock is taken; writers go on.
2. The seed's SCN is that position in the fetcher's SCN scheme: ``file
   number << 32 | position``, plus the SCN base of the relay's fetcher (0
   unless the relay failed over to this server; docs/protocol.md 5). The
   relay's fetcher status gives the base and the ``@@server_id`` it reads; a
   seed from another server is refused (its positions mean nothing to the
   relay's SCNs).
3. Each table is read through a server-side cursor in batches of
   ``chunk_rows`` rows; every row becomes an INSERT event encoded with the
   relay's newest schema version of the table and its source id (the same
   Avro values the fetcher writes for the same row: :func:`_converter`), and
   each batch is merged into the snapshot in one store transaction. Zero
   dates (no Avro value) are sent as null and listed as not sent, as the
   fetcher does. The fetcher's column policy (``request.column_policy``)
   applies to the rows as in the fetcher.

Resumable per table: finished tables are recorded by the store and skipped;
an interrupted table is copied again from a new snapshot (merges are
idempotent). A table the relay has not seen (no schema), or whose columns
changed since the relay's newest version, is refused with a clear message.

Blocking (PyMySQL): runs in a worker thread. The DSN's password never reaches
a log or an error message.
"""

from __future__ import annotations

import datetime
import decimal
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any, Final

from changebus.fetchers import ColumnPolicy, ColumnRule
from changebus.schemas import (
    ChangebusError,
    Column,
    ConfigError,
    Op,
    RowEncoder,
    SchemaRegistry,
    SourceConfigError,
    SourceError,
    mysql_avro_type,
    mysql_bit,
    mysql_boolean,
    mysql_json,
    mysql_set,
    mysql_time_micros,
    mysql_unsigned_bigint,
    mysql_uuid,
)

from ._chunks import SnapshotSink
from ._seedtypes import SeedProgress, SeedRequest, SeedWriter

__all__ = ["mysql_config_from_dsn", "seed_mysql"]

log = logging.getLogger("changebus.bootstrap.seed")

_EPOCH_DAY: Final = datetime.date(1970, 1, 1)
_EPOCH: Final = datetime.datetime(1970, 1, 1)
_NOT_SENT: Final = object()


def mysql_config_from_dsn(dsn: str) -> Any:
    """A :class:`~changebus.fetchers.mysql.MySQLConfig` from ``mysql://user:password@host:port``.

    ``mariadb://`` is accepted too; user and password are percent-decoded.
    Errors never quote the DSN (it holds the password).
    """
    from changebus.fetchers.mysql import MySQLConfig

    parts = urllib.parse.urlsplit(dsn)
    if parts.scheme not in ("mysql", "mariadb") or not parts.hostname:
        raise ConfigError("seed.dsn must be a mysql://user:password@host:port URL for kind mysql")
    try:
        port = parts.port or 3306
    except ValueError:
        raise ConfigError("seed.dsn has a bad port") from None
    return MySQLConfig(
        host=parts.hostname,
        port=port,
        user=urllib.parse.unquote(parts.username or "changebus"),
        password=urllib.parse.unquote(parts.password or ""),
    )


def _policy_converter(column: Column, rule: ColumnRule | None) -> Callable[[Any], Any]:
    """:func:`_converter`, then the column's policy rule (hash, truncate) if any.

    A hashed column's schema type is ``string``: its value is converted as its
    source type (``source_type``) is first, as the fetcher's decoder does.
    """
    if rule is None:
        return _converter(column)
    if rule.action == "hash":
        column = Column(column.name, mysql_avro_type(column.source_type), True, column.source_type)
    convert, apply = _converter(column), rule.apply

    def policed(value: Any) -> Any:
        value = convert(value)
        return value if value is _NOT_SENT else apply(value)

    return policed


def _converter(column: Column) -> Callable[[Any], Any]:
    """From a PyMySQL value of ``column`` to the value the fetcher encodes (not None)."""
    t = column.type
    spec: Mapping[str, Any] = t if isinstance(t, dict) else {"type": t}
    base, logical, kind = spec.get("type"), spec.get("logicalType"), spec.get("changebus.type")
    if base == "boolean":
        return mysql_boolean
    if logical == "decimal":
        return lambda v: v if isinstance(v, decimal.Decimal) else mysql_unsigned_bigint(int(v))
    if logical == "uuid":
        return mysql_uuid
    if logical == "date":
        return lambda v: (v - _EPOCH_DAY).days if isinstance(v, datetime.date) else _NOT_SENT
    if logical in ("timestamp-micros", "local-timestamp-micros"):
        return _micros
    if kind == "time-micros-signed":
        return mysql_time_micros
    if kind == "bit":
        return mysql_bit
    if kind == "set":
        return mysql_set
    if kind == "json":
        return mysql_json
    if base == "string":
        return lambda v: v.decode("utf-8") if isinstance(v, bytes) else str(v)
    if base == "bytes":
        return lambda v: v.encode("utf-8") if isinstance(v, str) else bytes(v)
    if base in ("int", "long"):
        return int
    if base in ("float", "double"):
        return float
    return lambda v: v


def _micros(value: Any) -> Any:
    """A naive datetime (UTC for timestamps: the snapshot's session is UTC) in microseconds."""
    if not isinstance(value, datetime.datetime):
        return _NOT_SENT  # a zero date comes back as text
    d = value.replace(tzinfo=None) - _EPOCH
    return (d.days * 86400 + d.seconds) * 1_000_000 + d.microseconds


def _relay_origin(relay_fetcher: Mapping[str, Any] | None) -> tuple[int, int]:
    """``(server id, SCN base)`` of the relay's started mysql fetcher.

    Without them the seed's SCN could not be placed among the relay's (after
    a failover the base is not 0), so their absence is an error (retriable:
    a relay that is starting has no fetcher status yet).
    """
    server = int((relay_fetcher or {}).get("mysql_server_id", 0) or 0)
    if relay_fetcher is None or relay_fetcher.get("kind") != "mysql" or not server:
        raise SourceError(
            "the relay's fetcher of this partition is not a running mysql fetcher (no server "
            "id and SCN base in its /v1/status): cannot align a MySQL seed with its SCNs",
            retriable=True,
        )
    return server, int(relay_fetcher.get("scn_base", 0) or 0)


def seed_mysql(
    request: SeedRequest,
    write: SeedWriter,
    progress: SeedProgress,
    *,
    stop: threading.Event | None = None,
    sink: SnapshotSink | None = None,
) -> int:
    """Copy ``request.tables`` (``database.table`` names) at one consistent snapshot; returns its SCN.

    Arguments as for :func:`._seed.seed_postgres`; ``request.relay_fetcher``
    is the relay's fetcher status of the partition (its ``mysql_server_id``
    and ``scn_base``).
    """
    from changebus.fetchers.mysql import consistent_snapshot

    registry = SchemaRegistry()
    registry.import_entries(list(request.schemas))
    policy = request.column_policy or ColumnPolicy()
    todo = progress.begin(request)
    if not todo:
        progress.state = "copied"
        return progress.scn
    relay_server, base = _relay_origin(request.relay_fetcher)
    with consistent_snapshot(mysql_config_from_dsn(request.dsn)) as snap:
        with snap.connection.cursor() as cur:
            cur.execute("SELECT @@server_id")
            row = cur.fetchone()
        server = int(row[0]) if row else 0
        if server != relay_server:
            raise SourceConfigError(
                f"the seed source is server id {server}, the relay reads server id "
                f"{relay_server}: seed from the server the relay reads (binlog positions, "
                "hence SCNs, are the server's own)"
            )
        scn = base + snap.scn
        progress.scn = scn
        log.info(
            "seeding %d table(s) at SCN %d (%s:%d, consistent snapshot)",
            len(todo),
            scn,
            snap.file,
            snap.pos,
        )
        for name in todo:
            if stop is not None and stop.is_set():
                raise ChangebusError("seeding stopped", retriable=True)
            progress.table = name
            try:
                schema = registry.latest(name)
            except ChangebusError:
                raise SourceConfigError(
                    f"table {name} is not in the relay's stream yet (no schema): it cannot be "
                    "seeded before the relay has seen a change of it"
                ) from None
            policy.check_schema(schema)  # the rows follow the fetcher's column policy
            encoder = RowEncoder(
                schema, source_id=registry.source_id(name), partition=request.partition_id
            )
            _copy_table(snap, name, encoder, scn, write, progress, request.chunk_rows, policy)
            write(name, [], scn)  # the table is done
            progress.tables_done += 1
            log.info("seeded %s: %d rows so far", name, progress.rows)
    progress.state = "copied"
    progress.table = ""
    return scn


def _copy_table(
    snap: Any,
    name: str,
    encoder: RowEncoder,
    scn: int,
    write: SeedWriter,
    progress: SeedProgress,
    chunk_rows: int,
    policy: ColumnPolicy,
) -> None:
    """Copy table ``name`` in batches of ``chunk_rows``, as INSERTs encoded by ``encoder``
    (under ``policy``: the columns it excludes are dropped, hashed and truncated ones go
    through its rules after the conversion the fetcher's decoder makes)."""
    schema = encoder.table
    rules = policy.rules_for(name)
    convert = [(c.name, _policy_converter(c, rules.get(c.name))) for c in schema.columns]
    wanted = {c.name for c in schema.columns}
    excluded = {c for c, r in rules.items() if r.action == "exclude"}
    db, _, table = name.partition(".")
    for batch in snap.rows(db, table, chunk_rows):
        if set(batch[0]) - excluded != wanted:
            raise SourceConfigError(
                f"table {name} changed since the relay's newest schema version "
                f"{schema.version}: seed it after the relay has seen the change "
                "(or give the seed the fetcher's column_policy)",
                # mostly a DDL the relay has not streamed yet: it will, so try again
                retriable=True,
            )
        ts = time.time_ns()
        events = []
        for seq, source in enumerate(batch):
            row: dict[str, Any] = {}
            not_sent: list[str] = []
            for col, fn in convert:
                value = source[col]
                if value is not None:
                    value = fn(value)
                    if value is _NOT_SENT:
                        value = None
                        not_sent.append(col)
                row[col] = value
            events.append(encoder.encode(Op.INSERT, scn, seq, ts, row, after_not_sent=not_sent))
        write(name, events, scn)
        progress.rows += len(batch)
