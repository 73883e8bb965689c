"""Seeding the snapshot store from a Postgres source, aligned with an SCN, without stopping writes.

The change stream only holds what changed after capture began; rows nobody
touched since are not in it. The seeder copies them from the source:

1. On a replication connection, ``CREATE_REPLICATION_SLOT <tmp> TEMPORARY
   LOGICAL pgoutput (SNAPSHOT 'export')`` gives ``consistent_point`` ``C``
   and an exported snapshot that is exactly the database at ``C`` (see
   /work/shared/reference/sources-feasibility.md 1.7: verified under
   concurrent writers). The temporary slot vanishes with the connection.
2. A second connection runs ``BEGIN ISOLATION LEVEL REPEATABLE READ, READ
   ONLY; SET TRANSACTION SNAPSHOT`` and reads each table with ``COPY ...
   (FORMAT binary)`` -- the same binary values pgoutput sends -- in chunks of
   ``chunk_rows`` rows, turned into events by the postgres fetcher's own
   :class:`~changebus.fetchers.postgres.Assembler` (same types, same Avro
   encoding, the relay's source ids and schema versions, mirrored from the
   store), under the fetcher's column policy (``request.column_policy``:
   excluded columns are not copied out, hashed and truncated ones are
   written as the fetcher writes them; a relay schema showing another
   policy is refused, so masked data never leaks through a snapshot).
3. Each chunk is merged into the snapshot at SCN ``C`` in one store
   transaction (:meth:`~._store.Store.seed_rows`): a row is written unless
   the snapshot already holds a *newer* state of its key (the applier's
   upserts likewise never replace a newer row with an older one), so the
   merge is right whether the applier is before or after ``C``.

Why it is consistent: the seed is the source at ``C``; the relay's stream,
hence the log, holds every change after ``C`` (the relay's slot is older);
snapshot rows always end at the newest state of their key. A table whose
copy is interrupted is copied again (a new snapshot, idempotent merges);
tables finished are recorded (``cb_seed``) and skipped: the seed resumes per
table. A table the relay has not seen yet (no schema in the store) cannot be
seeded: its source id is the relay's to give; the seeder says so.

Blocking (psycopg): runs in a worker thread; store writes go through the
callback it is given (the daemon's writer thread).
"""

from __future__ import annotations

import logging
import struct
import threading
import time
import uuid
from typing import Any

from changebus.fetchers import ColumnPolicy
from changebus.schemas import (
    ChangebusError,
    Op,
    SchemaRegistry,
    SourceConfigError,
    lsn_to_scn,
    parse_stream,
)

from ._chunks import SnapshotSink
from ._seedtypes import SeedProgress, SeedRequest, SeedWriter

__all__ = ["seed_postgres"]

log = logging.getLogger("changebus.bootstrap.seed")

_COPY_SIGNATURE = b"PGCOPY\n\xff\r\n\x00"


def _copy_tuples(data: bytes) -> list[tuple[bytes | None, ...]]:
    """Rows of a ``COPY ... (FORMAT binary)`` output (fields as raw bytes, None = NULL)."""
    if not data.startswith(_COPY_SIGNATURE):
        raise ChangebusError("COPY output lacks the binary signature")
    pos = len(_COPY_SIGNATURE) + 4
    (ext,) = struct.unpack_from("!i", data, pos)
    pos += 4 + ext
    rows: list[tuple[bytes | None, ...]] = []
    while True:
        (n,) = struct.unpack_from("!h", data, pos)
        pos += 2
        if n == -1:
            return rows
        fields: list[bytes | None] = []
        for _ in range(n):
            (size,) = struct.unpack_from("!i", data, pos)
            pos += 4
            if size < 0:
                fields.append(None)
            else:
                fields.append(data[pos : pos + size])
                pos += size
        rows.append(tuple(fields))


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def seed_postgres(
    request: SeedRequest,
    write: SeedWriter,
    progress: SeedProgress,
    *,
    stop: threading.Event | None = None,
    sink: SnapshotSink | None = None,
) -> int:
    """Copy ``request.tables`` (``schema.table`` names) at one exported snapshot; returns its SCN.

    ``write`` merges each chunk and records a finished table; ``progress``
    is updated as tables are copied; ``stop`` (when set) ends the run between
    tables. ``request.relay_fetcher`` is not needed (commit LSNs are the
    server's own SCNs) and ignored.
    """

    from changebus.fetchers.postgres import (
        Assembler,
        Begin,
        Commit,
        Insert,
        Relation,
        RelationColumn,
        TypeResolver,
        pg_connect,
    )

    registry = SchemaRegistry()
    registry.import_entries(list(request.schemas))
    policy = request.column_policy or ColumnPolicy()
    todo = progress.begin(request)
    if not todo:
        progress.state = "copied"
        return progress.scn
    slot = f"changebus_seed_{uuid.uuid4().hex[:12]}"
    where = "cannot connect to the seed source"
    with (
        pg_connect(request.dsn, where, option="seed.dsn", replication="database") as repl,
        pg_connect(request.dsn, where, option="seed.dsn") as conn,
    ):
        row = repl.execute(
            f"CREATE_REPLICATION_SLOT {slot} TEMPORARY LOGICAL pgoutput (SNAPSHOT 'export')"
        ).fetchone()
        assert row is not None
        _slot, consistent_point, snapshot_name, _plugin = row
        scn = lsn_to_scn(str(consistent_point))
        progress.scn = scn
        log.info("seeding %d table(s) at SCN %s (exported snapshot)", len(todo), consistent_point)
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        conn.execute(f"SET TRANSACTION SNAPSHOT '{snapshot_name}'")
        resolver = TypeResolver(conn)
        assembler = Assembler(
            request.partition_id,
            resolver.resolve,
            registry,
            primary_key=resolver.primary_key,
            array_dims=resolver.array_dims,
            policy=policy,
        )
        chunk_rows = request.chunk_rows
        for name in todo:
            if stop is not None and stop.is_set():
                raise ChangebusError("seeding stopped", retriable=True)
            progress.table = name
            try:
                known = registry.versions(name)
            except ChangebusError:
                raise SourceConfigError(
                    f"table {name} is not in the relay's stream yet (no schema): it cannot be "
                    "seeded before the relay has seen a change of it"
                ) from None
            policy.check_schema(known[-1])  # the rows follow the fetcher's column policy
            nsp, _, rel = name.partition(".")
            info = conn.execute(
                "SELECT c.oid, c.relreplident::text FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s",
                (nsp, rel),
            ).fetchone()
            if info is None:
                raise SourceConfigError(f"table {name} does not exist in the source")
            oid, identity = int(info[0]), str(info[1])
            cols = conn.execute(
                "SELECT attname::text, atttypid::int, atttypmod::int FROM pg_attribute "
                "WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
                (oid,),
            ).fetchall()
            ident = _identity_columns(conn, oid, identity, resolver)
            relation = Relation(
                oid,
                nsp,
                rel,
                identity,
                tuple(RelationColumn(c, t, m, c in ident) for c, t, m in cols),
            )
            assembler.feed(Begin(scn, time.time_ns(), 0))
            assembler.feed(relation)
            if len(registry.versions(name)) != len(known):
                raise SourceConfigError(
                    f"table {name} changed since the relay's newest schema version "
                    f"{known[-1].version}: seed it after the relay has seen the change "
                    "(or give the seed the fetcher's column_policy)",
                    # mostly a DDL the relay has not streamed yet: it will, so try again
                    retriable=True,
                )
            key = known[-1].key
            order = ", ".join(_quote(k) for k in key) if key else "ctid"
            select = ", ".join(_quote(c) for c, _t, _m in cols)
            offset = 0
            while True:
                sql = (
                    f"COPY (SELECT {select} FROM {_quote(nsp)}.{_quote(rel)} ORDER BY {order} "
                    f"LIMIT {int(chunk_rows)} OFFSET {int(offset)}) TO STDOUT (FORMAT binary)"
                )
                buf = bytearray()
                with conn.cursor().copy(sql) as copy:
                    for block in copy:
                        buf += block
                rows = _copy_tuples(bytes(buf))
                if not rows:
                    break
                assembler.feed(Begin(scn, time.time_ns(), 0))
                for cells in rows:
                    assembler.feed(Insert(oid, cells))
                window = assembler.feed(Commit(0, scn, scn, time.time_ns()))
                assert window is not None
                write(name, _data_events(window.data), scn)
                offset += len(rows)
                progress.rows += len(rows)
                if len(rows) < chunk_rows:
                    break
            write(name, [], scn)  # the table is done
            progress.tables_done += 1
            log.info("seeded %s: %d rows so far", name, progress.rows)
        conn.execute("COMMIT")
    progress.state = "copied"
    progress.table = ""
    return scn


def _data_events(data: bytes) -> list[bytes]:
    offsets, headers = parse_stream(data)
    return [
        data[o : o + n]
        for o, n, op in zip(
            offsets.tolist(), headers["total_length"].tolist(), headers["op"].tolist(), strict=True
        )
        if op == int(Op.INSERT)
    ]


def _identity_columns(conn: Any, oid: int, identity: str, resolver: Any) -> set[str]:
    """The columns pgoutput flags as key (the replica identity), as the fetcher sees them."""
    if identity == "f":
        rows = conn.execute(
            "SELECT attname::text FROM pg_attribute WHERE attrelid = %s AND attnum > 0 "
            "AND NOT attisdropped",
            (oid,),
        ).fetchall()
        return {str(r[0]) for r in rows}
    if identity == "i":
        rows = conn.execute(
            "SELECT a.attname::text FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid "
            "AND a.attnum = ANY(i.indkey) WHERE i.indrelid = %s AND i.indisreplident",
            (oid,),
        ).fetchall()
        return {str(r[0]) for r in rows}
    if identity == "d":
        return set(resolver.primary_key(oid) or ())
    return set()
