"""The preflight of a Postgres source for the ``postgres`` fetcher (``changebus check-source``).

:func:`check_postgres` connects as the fetcher would (its ``dsn``), reads
the catalog only (it creates, alters and drops nothing) and returns the
findings in :mod:`.._check`'s model, one per requirement of
:mod:`._setup` and the stream: server version (13+: ``wal_status``,
``max_slot_wal_keep_size``), not a standby, ``wal_level = logical``, free
replication slots and WAL senders, a role with REPLICATION (or superuser),
the slot (plugin pgoutput, this database, not held by another process, not
lost), the publication (exists and covers the tables, or can be created by
the role), tables in scope with a key for updates and deletes (a primary
key, or REPLICA IDENTITY FULL / USING INDEX), SELECT on them (the bootstrap
server's seeding reads them) and ``max_slot_wal_keep_size`` against the
slot's retained WAL. Blocking; runs in a worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from changebus.schemas import SourceError

from .._check import Finding
from ._config import PostgresConfig
from ._setup import connect, reason

__all__ = ["check_postgres"]

#: the oldest server the fetcher supports: pgoutput's ``binary`` and ``messages``
#: options, which every START_REPLICATION of the fetcher asks for, came in 14
_MIN_VERSION = 140000
_RESTART = "then restart the server (this setting needs a restart)"
_SETTINGS = ("wal_level", "max_replication_slots", "max_wal_senders", "max_slot_wal_keep_size")


@dataclass(frozen=True, slots=True)
class _Table:
    schema: str
    name: str
    has_pk: bool
    identity: str  # pg_class.relreplident: d(efault) f(ull) i(ndex) n(othing)
    can_select: bool
    owned: bool

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"

    @property
    def sql(self) -> str:
        return f"{_ident(self.schema)}.{_ident(self.name)}"


def _ident(name: str) -> str:
    """A quoted SQL identifier when it needs quotes (for the fix statements)."""
    if name and name.replace("_", "").isalnum() and name.islower() and not name[0].isdigit():
        return name
    return '"' + name.replace('"', '""') + '"'


def _lit(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover - the loop returns


def check_postgres(cfg: PostgresConfig) -> tuple[str, str, list[Finding]]:
    """``(target, server version, findings)`` for ``cfg`` (see the module docstring).

    Raises :class:`~changebus.schemas.SourceError` when the server cannot
    be reached (the check cannot run).
    """
    import psycopg

    conn = connect(cfg.dsn, "cannot connect to Postgres", timeout_s=cfg.io_timeout_s or 15.0)
    try:
        info = conn.info
        target = f"{info.host}:{info.port}/{info.dbname} as {info.user}"
        try:
            return target, *_checks(conn, cfg)
        except psycopg.OperationalError as exc:
            raise SourceError(f"lost the Postgres connection: {reason(exc, cfg.dsn)}") from None
        except psycopg.Error as exc:
            raise SourceError(
                f"a catalog query of the check failed: {reason(exc, cfg.dsn)}"
            ) from None
    finally:
        conn.close()


def _checks(conn: Any, cfg: PostgresConfig) -> tuple[str, list[Finding]]:
    def one(query: str, params: tuple[Any, ...] = ()) -> Any:
        return conn.execute(query, params).fetchone()

    conn.execute("SET statement_timeout = '30s'")
    version_num = int(conn.info.server_version)
    version = str(one("SHOW server_version")[0]).split(" ")[0]
    out: list[Finding] = []
    if version_num < _MIN_VERSION:
        out.append(
            Finding.fail(
                "server_version",
                f"PostgreSQL {version}; the postgres fetcher needs 14 or newer (pgoutput's"
                " binary and messages options)",
                "upgrade the server to PostgreSQL 14 or newer",
            )
        )
        return f"PostgreSQL {version}", out  # (the catalog queries below need 13)
    out.append(Finding.ok("server_version", f"PostgreSQL {version}"))
    if one("SELECT pg_is_in_recovery()")[0]:
        out.append(
            Finding.fail(
                "primary",
                "this server is a standby (in recovery): the fetcher reads a primary",
                "point the DSN at the primary server",
            )
        )
        return f"PostgreSQL {version}", out  # the slot's WAL position needs a primary
    settings = {
        str(name): (str(setting), str(unit or ""))
        for name, setting, unit in conn.execute(
            "SELECT name, setting, unit FROM pg_settings WHERE name = ANY(%s)", (list(_SETTINGS),)
        ).fetchall()
    }
    user, superuser, replication = one(
        "SELECT current_user, rolsuper, rolreplication FROM pg_roles WHERE rolname = current_user"
    )
    database, can_create = one(
        "SELECT current_database(), has_database_privilege(current_database(), 'CREATE')"
    )
    slot = one(
        "SELECT plugin, slot_type, database, active, active_pid, wal_status, "
        "pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint "
        "FROM pg_replication_slots WHERE slot_name = %s",
        (cfg.slot,),
    )
    level = settings.get("wal_level", ("?", ""))[0]
    if level == "logical":
        out.append(Finding.ok("wal_level", "wal_level = logical"))
    else:
        out.append(
            Finding.fail(
                "wal_level",
                f"wal_level = {level}: logical decoding needs logical",
                "postgresql.conf: wal_level = logical (or ALTER SYSTEM SET wal_level = "
                f"logical;), {_RESTART}",
            )
        )
    out += _capacity(conn, cfg, settings, slot)
    out.append(_role(user, superuser, replication))
    out.append(_slot(cfg, slot, database))
    tables = _tables(conn)
    publication = one(
        "SELECT p.puballtables, r.rolname FROM pg_publication p "
        "JOIN pg_roles r ON r.oid = p.pubowner WHERE p.pubname = %s",
        (cfg.publication,),
    )
    published = {
        f"{s}.{t}"
        for s, t in conn.execute(
            "SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s",
            (cfg.publication,),
        ).fetchall()
    }
    scope, missing = _scope(cfg, tables, publication, published)
    if missing:
        out.append(
            Finding.fail(
                "tables",
                f"configured tables not found: {', '.join(missing)}",
                "create them, or fix the fetcher option tables (schema.table names)",
            )
        )
    out.append(_publication(cfg, publication, published, scope, user, superuser, can_create))
    out += _keys_and_reads(scope, user)
    out.append(_wal_keep(settings, cfg.slot, slot))
    return f"PostgreSQL {version}", out


def _capacity(
    conn: Any, cfg: PostgresConfig, settings: dict[str, tuple[str, str]], slot: Any
) -> list[Finding]:
    """Free replication slots (one more when the slot is still to be created) and senders."""
    out: list[Finding] = []
    slots_max = int(settings.get("max_replication_slots", ("0", ""))[0])
    slots_used = int(conn.execute("SELECT count(*) FROM pg_replication_slots").fetchone()[0])
    need = 0 if slot is not None else 1
    found = f"{slots_used} of max_replication_slots = {slots_max} in use"
    if slots_max - slots_used < need:
        out.append(
            Finding.fail(
                "replication_slots",
                f"{found}: no free slot for {cfg.slot!r}",
                f"postgresql.conf: max_replication_slots = {max(slots_used + 4, 10)} (or drop "
                f"an unused slot: SELECT pg_drop_replication_slot('name');), {_RESTART}",
            )
        )
    else:
        extra = "" if need else f" (slot {cfg.slot!r} exists)"
        out.append(Finding.ok("replication_slots", f"{found}{extra}"))
    senders_max = int(settings.get("max_wal_senders", ("0", ""))[0])
    senders_used = int(conn.execute("SELECT count(*) FROM pg_stat_replication").fetchone()[0])
    found = f"{senders_used} of max_wal_senders = {senders_max} in use"
    if cfg.mode == "stream" and senders_max - senders_used < 1:
        out.append(
            Finding.fail(
                "wal_senders",
                f"{found}: no free WAL sender for the replication stream",
                f"postgresql.conf: max_wal_senders = {max(senders_used + 4, 10)}, {_RESTART}",
            )
        )
    else:
        why = " (mode = sql needs none)" if cfg.mode == "sql" else ""
        out.append(Finding.ok("wal_senders", f"{found}{why}"))
    return out


def _role(user: str, superuser: bool, replication: bool) -> Finding:
    if superuser or replication:
        what = "superuser" if superuser else "REPLICATION"
        return Finding.ok("replication_role", f"role {user} has {what}")
    return Finding.fail(
        "replication_role",
        f"role {user} has neither REPLICATION nor SUPERUSER: it cannot create or read a "
        "replication slot",
        f"as a superuser: ALTER ROLE {_ident(user)} REPLICATION;",
    )


def _slot(cfg: PostgresConfig, slot: Any, database: str) -> Finding:
    name = cfg.slot
    if slot is None:
        if not cfg.create_slot:
            return Finding.fail(
                "slot",
                f"slot {name!r} does not exist and create_slot = false",
                f"SELECT pg_create_logical_replication_slot({_lit(name)}, 'pgoutput'); "
                "(or set create_slot = true)",
            )
        return Finding.ok("slot", f"slot {name!r} does not exist yet: the fetcher creates it")
    plugin, kind, slot_db, active, pid, wal_status, retained = slot
    drop = f"SELECT pg_drop_replication_slot({_lit(name)}); or use another slot name"
    if kind != "logical" or plugin != "pgoutput":
        what = "a physical slot" if kind != "logical" else f"plugin {plugin}"
        return Finding.fail("slot", f"slot {name!r} is {what}, not pgoutput", drop)
    if slot_db != database:
        return Finding.fail(
            "slot",
            f"slot {name!r} belongs to database {slot_db}, not {database}",
            f"connect to database {slot_db}, or {drop}",
        )
    if wal_status == "lost":
        found = f"slot {name!r} was invalidated (wal_status = lost): changes are gone"
        if cfg.on_slot_lost == "fail":
            return Finding.fail(
                "slot",
                found,
                f"{drop} (the relay then records a data-loss event), or set on_slot_lost = "
                "'recreate'",
            )
        return Finding.warn(
            "slot",
            f"{found}; the fetcher recreates it after a data-loss event (on_slot_lost)",
            "re-seed consumers from the bootstrap server after the data-loss event",
        )
    held = f"; {_size(int(retained or 0))} of WAL retained, wal_status = {wal_status}"
    if active:
        return Finding.warn(
            "slot",
            f"slot {name!r} is in use by another process (pid {pid}){held}",
            f"stop the other reader (SELECT pg_terminate_backend({pid}); as a superuser) "
            "unless it is the relay this is meant for",
        )
    return Finding.ok("slot", f"slot {name!r} (pgoutput, database {database}){held}")


def _tables(conn: Any) -> dict[str, _Table]:
    rows = conn.execute(
        "SELECT n.nspname, c.relname, "
        "EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary), "
        "c.relreplident, has_table_privilege(c.oid, 'SELECT'), "
        "pg_has_role(c.relowner, 'USAGE') "
        "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition "
        "AND n.nspname NOT IN ('pg_catalog', 'information_schema') "
        "AND n.nspname !~ '^pg_(toast|temp)' ORDER BY 1, 2"
    ).fetchall()
    out = {}
    for schema, name, pk, identity, can_select, owned in rows:
        t = _Table(str(schema), str(name), bool(pk), str(identity), bool(can_select), bool(owned))
        out[t.qualified] = t
    return out


def _scope(
    cfg: PostgresConfig, tables: dict[str, _Table], publication: Any, published: set[str]
) -> tuple[list[_Table], list[str]]:
    """The tables the fetcher captures, and configured ones that do not exist."""
    if cfg.tables:
        names = [t if "." in t else f"public.{t}" for t in cfg.tables]
        return [tables[n] for n in names if n in tables], [n for n in names if n not in tables]
    if publication is not None and not publication[0]:
        return [t for n, t in tables.items() if n in published], []
    return list(tables.values()), []


def _publication(
    cfg: PostgresConfig,
    publication: Any,
    published: set[str],
    scope: list[_Table],
    user: str,
    superuser: bool,
    can_create: bool,
) -> Finding:
    name = cfg.publication
    if publication is not None:
        all_tables, owner = publication
        uncovered = [] if all_tables else [t for t in scope if t.qualified not in published]
        if uncovered:
            return Finding.fail(
                "publication",
                f"publication {name!r} does not cover "
                f"{', '.join(t.qualified for t in uncovered)}: their changes are not sent",
                f"ALTER PUBLICATION {_ident(name)} ADD TABLE "
                f"{', '.join(t.sql for t in uncovered)};",
            )
        what = "all tables" if all_tables else f"{len(published)} tables"
        if owner != user and not superuser:
            return Finding.warn(
                "publication",
                f"publication {name!r} ({what}) is owned by {owner}, not {user}: the role "
                "cannot change which tables it covers",
                f"as a superuser: ALTER PUBLICATION {_ident(name)} OWNER TO {_ident(user)};",
            )
        return Finding.ok("publication", f"publication {name!r} covers {what}")
    statement = f"CREATE PUBLICATION {_ident(name)} " + (
        f"FOR TABLE {', '.join(t.sql for t in scope)};" if cfg.tables else "FOR ALL TABLES;"
    )
    if not cfg.create_publication:
        return Finding.fail(
            "publication",
            f"publication {name!r} does not exist and create_publication = false",
            statement,
        )
    if superuser:
        return Finding.ok("publication", f"publication {name!r} does not exist yet: created")
    not_owned = [t.qualified for t in scope if not t.owned]
    if not can_create or not cfg.tables or not_owned:
        why = (
            "has no CREATE on the database"
            if not can_create
            else "is no superuser (FOR ALL TABLES needs one)"
            if not cfg.tables
            else f"does not own {', '.join(not_owned)}"
        )
        return Finding.fail(
            "publication",
            f"publication {name!r} does not exist, and role {user} cannot create it: it {why}",
            f"as a superuser: {statement} ALTER PUBLICATION {_ident(name)} OWNER TO "
            f"{_ident(user)};",
        )
    return Finding.ok("publication", f"publication {name!r} does not exist yet: created")


def _keys_and_reads(scope: list[_Table], user: str) -> list[Finding]:
    keyless = [t for t in scope if t.identity == "n" or (t.identity == "d" and not t.has_pk)]
    out: list[Finding] = []
    if keyless:
        out.append(
            Finding.fail(
                "keys",
                f"{len(keyless)} table(s) without a primary key or replica identity: "
                f"{', '.join(t.qualified for t in keyless)}; their updates and deletes "
                "cannot be keyed (Postgres even refuses them once published)",
                "add a primary key (ALTER TABLE t ADD PRIMARY KEY (...);) or: "
                + " ".join(f"ALTER TABLE {t.sql} REPLICA IDENTITY FULL;" for t in keyless),
            )
        )
    else:
        out.append(Finding.ok("keys", f"{len(scope)} table(s) in scope, each with a key"))
    unreadable = [t for t in scope if not t.can_select]
    if unreadable:
        out.append(
            Finding.warn(
                "select",
                f"role {user} cannot SELECT {', '.join(t.qualified for t in unreadable)}: "
                "the bootstrap server cannot seed them",
                f"GRANT SELECT ON {', '.join(t.sql for t in unreadable)} TO {_ident(user)};",
            )
        )
    else:
        out.append(Finding.ok("select", f"role {user} can SELECT every table in scope"))
    return out


def _wal_keep(settings: dict[str, tuple[str, str]], name: str, slot: Any) -> Finding:
    value, unit = settings.get("max_slot_wal_keep_size", ("-1", "MB"))
    retained = f"slot {name!r} retains {_size(int(slot[6] or 0))}" if slot else "no slot yet"
    if int(value) < 0:
        return Finding.warn(
            "max_slot_wal_keep_size",
            f"max_slot_wal_keep_size = -1 (unlimited; {retained}): a stalled or abandoned "
            "slot keeps WAL until the disk is full",
            "ALTER SYSTEM SET max_slot_wal_keep_size = '16GB'; SELECT pg_reload_conf(); "
            "(as a superuser; no restart; size it to the WAL written during the longest "
            "relay outage to survive)",
        )
    return Finding.ok(
        "max_slot_wal_keep_size", f"max_slot_wal_keep_size = {value}{unit} ({retained})"
    )
