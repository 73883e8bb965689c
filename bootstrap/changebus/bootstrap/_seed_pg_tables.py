"""Checking a table before a Postgres seed reads it, and choosing its reader.

:func:`open_reader` is :meth:`~._seed.PostgresChunkSource.reader`'s work for
one :class:`~._chunks.SnapshotScope`: it finds the table in the catalog by
its stream name (schema and table names may hold dots), refuses what a seed
cannot copy faithfully -- a table the relay has no schema of yet, one whose
columns differ from the relay's newest version (a DDL not streamed yet:
retriable), one without a key in the relay's schema, a row filter of the
relay's publication, a snapshot condition the server rejects -- and feeds
the table's Relation message to the source's Assembler, so that its rows are
encoded under the relay's schema version. It records in the source what each
chunk checks later: the table's columns (a DDL during the snapshot), its name
and its ``LOCK TABLE`` statement (:meth:`~._seed.PostgresChunkSource.begin_chunk`).

The reader (:mod:`._seed_pg_readers`): ``single_transaction`` for a
``REPLICA IDENTITY FULL`` table without a primary key (whole tables only),
``keys`` for a scope of keys, else ``keyset`` (with the scope's condition).

Blocking (psycopg), on the source's connection: the seeder's worker thread.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from changebus.schemas import ChangebusError, SourceConfigError

from ._chunks import SnapshotScope
from ._seed_pg_keys import PgTable, quote
from ._seed_pg_readers import KeysetReader, KeysReader, Reader, SingleReader
from ._seedtypes import SeedRequest

if TYPE_CHECKING:
    from ._seed import PostgresChunkSource

__all__ = ["open_reader"]

log = logging.getLogger("changebus.bootstrap.seed")


def open_reader(source: PostgresChunkSource, scope: SnapshotScope) -> Reader:
    """Check ``scope``'s table against the relay's schema and make its reader (module
    docstring); records the table's shape, name and lock statement in ``source``."""
    from changebus.fetchers.postgres import Begin, Relation, RelationColumn

    name, conn, registry = scope.table, source.conn, source.registry
    try:
        known = registry.versions(name)
    except ChangebusError:
        raise SourceConfigError(
            f"table {name} is not in the relay's stream yet (no schema): it cannot be "
            "seeded before the relay has seen a change of it"
        ) from None
    source.policy.check_schema(known[-1])  # the rows follow the fetcher's column policy
    # the stream names a table "schema.table" unescaped: a dot in either part makes
    # the split ambiguous (its first dot read "a.b"."t" as "a"."b.t", found nothing and
    # took the table for dropped, found by review), so the catalog is asked for the name
    tails = [name[i + 1 :] for i, ch in enumerate(name) if ch == "."]  # (relname, if)
    found = conn.execute(
        "SELECT c.oid, c.relreplident::text, c.reltuples::bigint, n.nspname::text, "
        "c.relname::text, c.relkind::text FROM pg_class c JOIN pg_namespace n "
        "ON n.oid = c.relnamespace WHERE c.relname = ANY(%s) AND c.relkind IN ('r', 'p') "
        "AND n.nspname || '.' || c.relname = %s",
        (tails, name),
    ).fetchall()
    if not found:
        raise SourceConfigError(f"table {name} does not exist in the source", gone=True)
    if len(found) > 1:
        raise SourceConfigError(
            f"table name {name} is ambiguous in the source: "
            + " and ".join(f'"{r[3]}"."{r[4]}"' for r in found)
            + " (schema and table names with dots): rename one of them to seed it"
        )
    info = found[0]
    oid, identity, reltuples = int(info[0]), str(info[1]), int(info[2])
    nsp, rel, kind = str(info[3]), str(info[4]), str(info[5])
    _refuse_row_filter(source.request, conn, name, oid)
    cols = conn.execute(
        "SELECT attname::text, atttypid::int, atttypmod::int, "
        "format_type(atttypid, atttypmod), attcollation::int FROM pg_attribute "
        # (not generated columns: pgoutput never sends them, so the relay's schema
        # lacks them, and with them the table was refused as changed, on every try)
        "WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped AND attgenerated = '' "
        "ORDER BY attnum",
        (oid,),
    ).fetchall()
    source.shapes[oid] = [(str(c), int(t), int(m)) for c, t, m, _f, _o in cols]
    source.names[oid] = name
    from psycopg import sql

    source.locks[name] = sql.SQL("LOCK TABLE {} IN ACCESS SHARE MODE").format(
        sql.Identifier(nsp, rel)
    )
    ident = _identity_columns(conn, oid, identity, source.resolver)
    relation = Relation(
        oid,
        nsp,
        rel,
        identity,
        tuple(RelationColumn(c, t, m, c in ident) for c, t, m, _f, _o in cols),
    )
    source.assembler.feed(Begin(0, time.time_ns(), 0))
    source.assembler.feed(relation)
    if len(registry.versions(name)) != len(known):
        raise SourceConfigError(
            f"table {name} changed since the relay's newest schema version "
            f"{known[-1].version}: seed it after the relay has seen the change "
            "(or give the seed the fetcher's column_policy)",
            # mostly a DDL the relay has not streamed yet: it will, so try again
            retriable=True,
        )
    key = known[-1].key
    if not key:
        raise SourceConfigError(
            f"table {name} has no key in the relay's schema, so it cannot be snapshotted "
            "in chunks: add a primary key (ALTER TABLE ... ADD PRIMARY KEY), or set "
            "REPLICA IDENTITY FULL (then it is read in one long transaction)"
        )
    types = {str(c): str(f) for c, _t, _m, f, _o in cols}
    missing = [k for k in key if k not in types]
    if missing:
        raise SourceConfigError(
            f"table {name} lacks key column(s) {', '.join(missing)} of the relay's schema",
            retriable=True,
        )
    table = PgTable(
        # ONLY: a table with inheritance children (old-style partitioning, archive
        # tables) must not read theirs, which the stream carries under their own names
        # (found by review); a partitioned table is read whole, as the stream names it
        # with publish_via_partition_root
        f"{'' if kind == 'p' else 'ONLY '}{quote(nsp)}.{quote(rel)}",
        tuple(str(c) for c, *_ in cols),
        tuple(key),
        tuple(types[k] for k in key),
    )
    estimate = max(reltuples, -1)
    if identity == "f" and source.resolver.primary_key(oid) is None:
        if scope.keys or scope.where:
            raise SourceConfigError(
                f"table {name} has no primary key (REPLICA IDENTITY FULL): only the whole "
                "table can be snapshotted (in one transaction), not keys or a condition"
            )
        log.warning(
            "%s has no primary key (REPLICA IDENTITY FULL): it is read in ONE long "
            "transaction (mode single_transaction, not resumable); add a primary key "
            "to snapshot it in short chunks",
            name,
        )
        return SingleReader(source, name, oid, table, estimate)
    if scope.keys:
        if any(isinstance(v, dict) for k in scope.keys for v in k):
            raise SourceConfigError(
                f'keys of {name}: tagged values ({{"b64": ...}}) are for MariaDB key '
                "columns; give Postgres key values as their text (bytea as '\\x...')"
            )
        return KeysReader(source, name, oid, table, scope.keys)
    if scope.where:
        _check_where(conn, name, table, scope.where)
        estimate = -1
    # what orders the keyset's cursor: the key columns' types and collations (not
    # their typmods nor how format_type spells them, which change nothing of it)
    order = {str(c): [str(c), int(t), int(o)] for c, t, _m, _f, o in cols}
    return KeysetReader(source, name, oid, table, estimate, scope.where, [order[k] for k in key])


def _check_where(conn: Any, name: str, table: PgTable, where: str) -> None:
    """``EXPLAIN`` the condition once, read-only: a bad one is refused with the server's words."""
    import psycopg

    from changebus.fetchers.postgres import pg_error_reason as reason

    if ";" in where:
        raise SourceConfigError(f"the snapshot condition of {name} may not hold ';'")
    conn.execute("BEGIN READ ONLY")
    try:
        where_sql = where.replace("%", "%%")  # (run with parameters: see quote())
        conn.execute(f"EXPLAIN SELECT 1 FROM {table.name} WHERE ({where_sql})", [])
    except psycopg.OperationalError:
        raise
    except psycopg.Error as exc:
        raise SourceConfigError(
            f"the snapshot condition of {name} is not valid: {reason(exc)}"
        ) from None
    finally:
        conn.execute("ROLLBACK")


def _refuse_row_filter(request: SeedRequest, conn: Any, name: str, oid: int) -> None:
    """A row filter of the relay's publication on the table (Postgres 15): the stream
    leaves out rows the seed would copy, and those stayed in the snapshot for good
    (found by review). Refused until the seed applies the filter itself."""
    publication = str((request.relay_fetcher or {}).get("publication") or "")
    if not publication:
        return  # (a relay of an older version: it does not say)
    row = conn.execute(
        "SELECT pg_get_expr(pr.prqual, pr.prrelid) FROM pg_publication_rel pr"
        " JOIN pg_publication p ON p.oid = pr.prpubid"
        " WHERE p.pubname = %s AND pr.prrelid = %s AND pr.prqual IS NOT NULL",
        (publication, oid),
    ).fetchone()
    if row is not None:
        raise SourceConfigError(
            f"table {name} has a row filter in publication {publication!r}"
            f" (WHERE {str(row[0])[:200]}): the stream leaves out rows a seed would"
            " copy, and the snapshot would keep them; seeding such a table is not"
            " supported yet (drop the filter, or leave the table out of the seed)"
        )


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
